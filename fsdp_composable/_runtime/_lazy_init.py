"""Lazy init: on the first forward, the root builds the root context its states share, and every
floating-point buffer is cast once for computation ([Note: buffer casting])."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from fsdp_composable._comm import _rank_agreement
from fsdp_composable._common_utils import _FSDPState, _get_fsdp_states
from fsdp_composable._config import UnitConfig
from fsdp_composable._grads import _comm_hooks, _host_flags
from fsdp_composable._runtime._exec_order_utils import _ExecOrderData
from fsdp_composable._runtime._limiter_utils import _AllGatherLimiter
from fsdp_composable._runtime._root_context import RootContext, UnitStep
from fsdp_composable._runtime._state_dict_keys import _clean_module_fqns

__all__: list[str] = []


# ---------------------------------------------------------------------------- lazy init
def _lazy_init(state: _FSDPState, root_module: nn.Module) -> None:
    """On the first forward: the state whose module runs first is the root; build the root context
    every state below it shares ([Note: the root context])."""
    if state.ctx is not None:
        return
    check_not_root(state)  # see [Note: several modules as one unit]
    states = _get_fsdp_states(root_module)
    _check_no_unit_in_no_sync(state, states, root_module)
    _check_comm_hook_on_root(state, states, root_module)
    streams = side_streams(state.device)
    ctx = RootContext(
        root=state,
        states=states,
        exec_order=_ExecOrderData(state.process_group),
        limiter=_AllGatherLimiter(),
        unshard_stream=streams[0],
        reduce_stream=streams[1],
        all_reduce_stream=streams[2],
        # a unit that ran by itself before the root's first forward keeps its counters
        steps={h: s.ctx.steps[h] if s.ctx is not None else UnitStep() for s in states for h in s.handles},
    )
    for s in states:
        s.ctx = ctx
    handles = ctx.handles
    if _host_flags.on_host(state.device):  # [Note: presence flags agreed on the host]
        _host_flags.init_companions([(h.process_group, h.replicate_group) for h in handles])
    fqn_of = _clean_module_fqns(root_module)
    for h in handles:  # a unit sharded by its own call is named from the root now, in messages and logs
        h.unit_fqn = fqn_of.get(h.module, h.unit_fqn)
    names = [h.unit_fqn or "<root>" for h in handles]
    ctx.exec_order.set_units(handles, names)
    for handle, name in zip(handles, names):
        handle.root_fqn = name
        _rank_agreement.name_units(handle.process_group, [name])
    buffers, dtypes = _get_buffers_and_dtypes_for_computation(state)
    _cast_buffers_to_dtype_and_device(buffers, dtypes, state.device)


def side_streams(device: torch.device) -> tuple[Optional[torch.cuda.Stream], ...]:
    """The unshard, reduce and all-reduce streams (see `_collectives.issue`): on CUDA, of ``device``
    (the root's, whichever device is current) and of high priority, as FSDP2's, so that a collective
    ready to run is scheduled ahead of queued compute kernels; none elsewhere."""
    if device.type != "cuda":
        return (None, None, None)
    return tuple(torch.cuda.Stream(device, priority=-1) for _ in range(3))


def _check_no_unit_in_no_sync(state: _FSDPState, states: list[_FSDPState], root_module: nn.Module) -> None:
    """``no_sync`` entered on a unit before the root's first forward made that unit a root of its own,
    and its switch would be dropped with its context here: refuse, as ``no_sync`` does on a unit once
    the root is known, instead of reducing inside ``no_sync``."""
    for s in states:
        if s is not state and s.ctx is not None and s.ctx.root is s and not s.ctx.sync_gradients:
            fqn = next((name for name, m in root_module.named_modules() if m is s.module), "")
            raise ValueError(
                f"no_sync must be called on the fully_shard root ({type(root_module).__name__}), not on its "
                f"unit {fqn!r}: it must skip the reduction of every unit"
            )


def _check_comm_hook_on_root(state: _FSDPState, states: list[_FSDPState], root_module: nn.Module) -> None:
    """A communication hook registered on a unit before the root was known would reduce only that
    unit's gradients: refuse, as `register_comm_hook` does on a unit once the root is known."""
    hooked = [s for s in states if any(_comm_hooks.registered(h) is not None for h in s.handles)]
    if hooked and any(_comm_hooks.registered(h) is None for s in states for h in s.handles):
        unit = next((s for s in hooked if s is not state), hooked[0])
        fqn = next((name for name, m in root_module.named_modules() if m is unit.module), "")
        raise RuntimeError(
            "register_comm_hook: call it on the root (the outermost sharded module), not on the "
            f"{type(unit.module).__name__} {fqn!r} inside it"
        )


def _ctx(state: _FSDPState) -> RootContext:
    assert state.ctx is not None, "used before lazy init"
    return state.ctx


# ---------------------------------------------------------------------------- buffers
# [Note: buffer casting]
# Every floating-point buffer is cast once, at lazy init, to the ``buffer_dtype`` of the unit whose
# module tree holds it (per submodule, whatever the buffer's name), and stays so for computation.
# Checkpoints must not see that: each state records its buffers' original dtypes under clean FQNs at
# construction, and a state-dict hook casts the saved values back (`_buffer_dtype_state_dict_hook`);
# only values still in a dtype lazy init casts to: a buffer the user cast since (``model.double()``,
# [Note: casts after sharding]) is saved as it is, as the plain model would save it.
def _module_to_unit_config(root: _FSDPState) -> dict[nn.Module, UnitConfig]:
    """The settings governing each module: its deepest enclosing unit's (states are outermost first,
    handles root first then pre-order, so deeper assignments come later and win)."""
    config: dict[nn.Module, UnitConfig] = {}
    for s in root.all_states:
        for m in s.module.modules():
            config[m] = s.config
        for handle in s.handles:
            for m in handle.module.modules():
                config[m] = handle.config
        for m in s.ignored_modules:
            config.pop(m, None)
    return config


def _get_buffers_and_dtypes_for_computation(
    root: _FSDPState,
) -> tuple[list[tuple[nn.Module, str]], list[Optional[torch.dtype]]]:
    buffers: list[tuple[nn.Module, str]] = []
    dtypes: list[Optional[torch.dtype]] = []
    for module, config in _module_to_unit_config(root).items():
        mp = config.mixed_precision
        for name, buf in module._buffers.items():
            if buf is None:
                continue
            buffers.append((module, name))
            cast = mp is not None and mp.buffer_dtype is not None and buf.is_floating_point()
            dtypes.append(mp.buffer_dtype if cast and mp is not None else None)
    return buffers, dtypes


def _get_buffers_and_dtypes_for_checkpoint(state: _FSDPState) -> dict[str, torch.dtype]:
    """Clean buffer FQN (relative to ``state.module``) -> the dtype it had before any casting."""
    return state.buffer_name_to_orig_dtype


def _cast_buffers_to_dtype_and_device(
    buffers: list[tuple[nn.Module, str]], dtypes: list[Optional[torch.dtype]], device: torch.device
) -> None:
    """Replace each ``module._buffers[name]`` by its cast (``None`` dtype: keep the dtype)."""
    for (module, name), dtype in zip(buffers, dtypes):
        buf = module._buffers[name]
        assert buf is not None
        module._buffers[name] = buf.to(device=device, dtype=dtype or buf.dtype)


def _buffer_dtype_state_dict_hook(
    state: _FSDPState, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    # only what lazy init cast: a buffer the user cast since (``model.double()``) is saved as it is now
    states = _get_fsdp_states(state.module)
    configs = [c for s in states for c in (s.config, *(h.config for h in s.handles))]
    ours = {c.mixed_precision.buffer_dtype for c in configs if c.mixed_precision is not None}
    for fqn, dtype in _get_buffers_and_dtypes_for_checkpoint(state).items():
        value = state_dict.get(prefix + fqn)
        if isinstance(value, torch.Tensor) and value.dtype != dtype and value.dtype in ours:
            state_dict[prefix + fqn] = value.to(dtype)


def check_not_root(state: _FSDPState) -> None:
    """A unit of several modules runs only under an enclosing ``fully_shard`` (it names their parameters):
    see [Note: several modules as one unit] in `_group_units`."""
    grouped = [h for h in state.handles if len(h.members) > 1]
    if grouped:
        names = ", ".join(type(m).__name__ for m in grouped[0].members)
        raise RuntimeError(
            f"the unit fully_shard made of several modules ({names}) ran forward without an enclosing "
            "fully_shard: apply fully_shard to a module that contains all of them (e.g. the whole model) "
            "before the first forward, and call that module"
        )
