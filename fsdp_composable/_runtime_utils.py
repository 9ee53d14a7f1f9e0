"""The runtime of one step: hooks for root pre-forward, pre/post forward, pre/post backward, and the
final callback. Each hook is a function taking the state (and handle) first.

[Note: one step]
root pre-forward (lazy init once; every state enters FORWARD_BACKWARD; cast root inputs) -> per
unit: pre-forward (unshard, wait, prefetch the next unit, attach the post-backward trigger to the
inputs) -> forward -> post-forward (reshard unless root unit or SHARD_GRAD_OP/NO_SHARD; hook the
outputs for pre-backward) ... backward: pre-backward (unshard, prefetch, point ``.grad`` at the
gradient buffer) -> autograd fills the buffer -> post-backward (start the async reduction, reshard)
-> final callback (finish every reduction, reshard leftovers, every state back to IDLE).

[Note: when post-backward runs]
A unit's gradients are complete once autograd has run the whole module backward, i.e. once the
gradients of the module's *inputs* are computed. Pre-forward passes the inputs that require grad
through `_PostBackwardTrigger`, an identity whose backward runs then. A unit called k times gets k
triggers and reduces after the last. Units whose inputs need no grad (the first unit) or whose
trigger never runs reduce in the final callback.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils import _pytree as pytree

from fsdp_composable import _rank_agreement
from fsdp_composable._common_utils import (
    TrainingState,
    UnitConfig,
    _FSDPState,
    _get_fsdp_state,
    _get_fsdp_states,
    _is_inside_unit,
    _iter_handles,
    _set_training_state,
)
from fsdp_composable._exec_order_utils import _ExecOrderData
from fsdp_composable._flat_param import FlatParamHandle, HandleTrainingState
from fsdp_composable._limiter_utils import _AllGatherLimiter
from fsdp_composable.api import BackwardPrefetch, ShardingStrategy

__all__: list[str] = []

_RESHARD_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
_BACKWARD_STATES = (HandleTrainingState.BACKWARD_PRE, HandleTrainingState.BACKWARD_POST)


# ---------------------------------------------------------------------------- registration
def _eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Hooks run eagerly even inside ``torch.compile(module)``: they issue collectives, wait on work
    and flip state, which dynamo cannot trace; the module's own forward still compiles whole."""
    return torch._dynamo.disable(fn)  # type: ignore[no-any-return]


def _register_hooks(state: _FSDPState) -> None:
    """Attach the root hooks to ``state.module`` and the unit hooks to each unit module."""
    module = state.module
    state.hook_handles.append(
        module.register_forward_pre_hook(
            _eager(functools.partial(_fsdp_root_pre_forward, state)), prepend=True, with_kwargs=True
        )
    )
    for handle in state.handles:
        unit_module = handle.module
        pre = _eager(functools.partial(_pre_forward, state, handle))
        post = _eager(functools.partial(_post_forward, state, handle))
        state.hook_handles.append(
            unit_module.register_forward_pre_hook(pre, prepend=unit_module is not module, with_kwargs=True)
        )
        state.hook_handles.append(unit_module.register_forward_hook(post))
    state.hook_handles.append(
        module.register_forward_hook(_eager(functools.partial(_fsdp_root_post_forward, state)), always_call=True)
    )
    state.hook_handles.append(module._register_state_dict_hook(functools.partial(_buffer_dtype_state_dict_hook, state)))


# ---------------------------------------------------------------------------- lazy init
def _lazy_init(state: _FSDPState, root_module: nn.Module) -> None:
    """On the first forward: the state whose module runs first is the root; share its per-step
    data (exec order, pending reductions) with every state below it."""
    if state.is_root is not None:
        return
    states = _get_fsdp_states(root_module)
    exec_order = _ExecOrderData(state.process_group)
    for s in states:
        s.is_root = s is state
        s.root_state = state
        s.exec_order_data = exec_order
    state.all_states = states
    state.limiter = _AllGatherLimiter()
    if state.device.type == "cuda":  # one pair of side streams for the whole root, see _collectives.issue
        streams = torch.cuda.Stream(state.device), torch.cuda.Stream(state.device)
        for handle in _iter_handles(state):
            handle.unshard_stream, handle.reduce_stream = streams
    state.non_root_handles = [h for h in _iter_handles(state) if h.module is not root_module]
    fqn_of = {m: name for name, m in root_module.named_modules()}
    handles = list(_iter_handles(state))
    exec_order.set_units(handles, [fqn_of.get(h.module, h.unit_fqn) or "<root>" for h in handles])
    buffers, dtypes = _get_buffers_and_dtypes_for_computation(state)
    _cast_buffers_to_dtype_and_device(buffers, dtypes, state.device)


# ---------------------------------------------------------------------------- buffers
# [Note: buffer casting]
# Every floating-point buffer is cast once, at lazy init, to the ``buffer_dtype`` of the unit whose
# module tree holds it (per submodule, whatever the buffer's name), and stays so for computation.
# Checkpoints must not see that: each state records its buffers' original dtypes under clean FQNs at
# construction, and a state-dict hook casts the saved values back (`_buffer_dtype_state_dict_hook`).
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
    for fqn, dtype in _get_buffers_and_dtypes_for_checkpoint(state).items():
        value = state_dict.get(prefix + fqn)
        if isinstance(value, torch.Tensor) and value.dtype != dtype:
            state_dict[prefix + fqn] = value.to(dtype)


def _is_root_unit(state: _FSDPState, handle: FlatParamHandle) -> bool:
    root = state.root_state
    return root is not None and handle.module is root.module


# ---------------------------------------------------------------------------- forward
def _in_backward() -> bool:
    """A forward running while autograd runs a backward is activation-checkpoint recomputation."""
    return bool(torch._C._current_graph_task_id() != -1)


def _fsdp_root_pre_forward(state: _FSDPState, module: nn.Module, args: Any, kwargs: Any) -> Any:
    _lazy_init(state, module)
    if not state.is_root or _in_backward():
        return None
    if any(s.training_state is TrainingState.SUMMON_FULL_PARAMS for s in state.all_states):
        raise RuntimeError(
            f"forward of {type(module).__name__} was called inside unshard_params(); leave the "
            "unshard_params context before running forward"
        )
    if state.final_callback_queued:  # the previous backward raised before its final callback ran
        _reset_after_failure(state)
    for s in state.all_states:
        _set_training_state(s, TrainingState.FORWARD_BACKWARD)
    if state.exec_order_data is not None:
        state.exec_order_data.start_forward()
    _finish_pending_reductions(state)
    for handle in _iter_handles(state):
        handle.release_cleared_grads()
    mp = state.config.mixed_precision
    if mp is not None and mp.param_dtype is not None and mp.cast_root_forward_inputs:
        return _cast_floating(args, mp.param_dtype), _cast_floating(kwargs, mp.param_dtype)
    return None


def _fsdp_root_post_forward(state: _FSDPState, module: nn.Module, args: Any, output: Any) -> Any:
    if not state.is_root or _in_backward():
        return output
    if sys.exc_info()[1] is not None:  # registered with always_call: the forward raised
        # Only a step in progress needs undoing: if pre-forward refused to start one (e.g. forward
        # inside unshard_params), resetting would break the context that owns the states.
        if state.training_state is TrainingState.FORWARD_BACKWARD:
            _reset_after_failure(state)
        return None
    if state.exec_order_data is not None:
        state.exec_order_data.end_forward()
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in _tensors(output)):
        _finish_step(state)  # no backward will follow: leave everything IDLE and resharded now
    return output


def _pre_forward(state: _FSDPState, handle: FlatParamHandle, module: nn.Module, args: Any, kwargs: Any) -> Any:
    # Recomputation by activation checkpointing (possibly before this unit's pre-backward, when a
    # later op of an enclosing checkpointed module needs it): only make the parameters whole.
    if _in_backward() or handle.training_state in _BACKWARD_STATES:
        _unshard(state, handle)
        handle.wait_unshard()
        return None
    handle.set_training_state(HandleTrainingState.FORWARD)
    eo = state.exec_order_data
    assert eo is not None, "pre-forward before lazy init"
    eo.record_pre_forward(handle)
    for sibling in handle.siblings:  # a unit's groups gather together, then each waits for its own
        _unshard(state, sibling)
    if state.forward_prefetch:
        _prefetch(state, eo.forward_prefetch_target(handle), "forward")
    handle.wait_unshard()
    mp = handle.config.mixed_precision
    if mp is not None and mp.param_dtype is not None and mp.cast_forward_inputs:
        args, kwargs = _cast_floating(args, mp.param_dtype), _cast_floating(kwargs, mp.param_dtype)
    if torch.is_grad_enabled():
        args, kwargs = _attach_post_backward_trigger(state, handle, args, kwargs)
    return args, kwargs


def _post_forward(state: _FSDPState, handle: FlatParamHandle, module: nn.Module, args: Any, output: Any) -> Any:
    if _in_backward() or handle.training_state in _BACKWARD_STATES:
        return output
    eo = state.exec_order_data
    assert eo is not None
    eo.record_post_forward(handle)
    if _reshard_after_forward(state, handle):
        handle.reshard()
    handle.set_training_state(HandleTrainingState.IDLE)
    if torch.is_grad_enabled():
        hook = functools.partial(_pre_backward_hook, state, handle)
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(hook)
    return output


def _reshard_after_forward(state: _FSDPState, handle: FlatParamHandle) -> bool:
    if _is_root_unit(state, handle):
        return False  # needed first in backward; the root post-forward reshards it if none follows
    return not torch.is_grad_enabled() or handle.config.strategy in _RESHARD_AFTER_FORWARD


# ---------------------------------------------------------------------------- backward
def _pre_backward_hook(state: _FSDPState, handle: FlatParamHandle, grad: torch.Tensor) -> None:
    if handle.ran_pre_backward:
        return
    root = state.root_state
    assert root is not None
    if not root.final_callback_queued:
        root.final_callback_queued = True
        Variable._execution_engine.queue_callback(functools.partial(_post_backward_final_callback, root))
    handle.ran_pre_backward = True
    handle.set_training_state(HandleTrainingState.BACKWARD_PRE)
    if state.exec_order_data is not None:
        state.exec_order_data.record_pre_backward(handle)
    _unshard(state, handle)
    if state.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
        _prefetch_for_backward(state, handle)
    handle.wait_unshard()
    if handle.requires_grad:
        handle.stash_sharded_grads()
        # Let autograd allocate the gradients as they come, instead of holding a whole buffer from
        # now on, when no trigger will fire (the unit reduces in the final callback) or when the
        # reduction sends them as they are (see [Note: gradients land in the flat buffer]).
        untriggered = handle.pending_triggers == 0 or handle.untriggered_calls > 0
        handle.prepare_gradient_buffer(lazy=untriggered or handle.takes_autograd_grads)


def _post_backward(state: _FSDPState, handle: FlatParamHandle) -> None:
    """Start the unit's gradient reduction and reshard; runs once per backward per unit."""
    if handle.training_state is not HandleTrainingState.BACKWARD_PRE:
        return
    handle.set_training_state(HandleTrainingState.BACKWARD_POST)
    if handle.has_gradient_buffer():
        if state.sync_gradients:
            root = state.root_state
            assert root is not None
            # Keep one reduction in flight: it overlaps the next unit's backward, and finishing the
            # older one frees its unsharded gradient buffer, so gradient memory stays at ~one unit.
            _finish_pending_reductions(root)
            root.pending_reductions.append(handle.start_reduce())
        else:
            handle.keep_gradient_buffer()  # `no_sync`: the next backward accumulates into it
    handle.reshard()
    if state.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
        _prefetch_for_backward(state, handle)


def _post_backward_final_callback(root: _FSDPState) -> None:
    """End of backward: reduce units whose trigger did not run, finish every reduction, go IDLE."""
    state_of = {id(h): s for s in root.all_states for h in s.handles}
    for handle in _iter_handles(root):
        if handle.training_state is HandleTrainingState.BACKWARD_PRE:
            _post_backward(state_of[id(handle)], handle)
    _finish_step(root)


def _finish_step(root: _FSDPState) -> None:
    _finish_pending_reductions(root)
    for handle in _iter_handles(root):
        if handle.is_unsharded or handle.unshard_in_flight:
            handle.reshard()
        if handle.training_state is not HandleTrainingState.IDLE:
            handle.set_training_state(HandleTrainingState.IDLE)
        handle.ran_pre_backward = False
        handle.pending_triggers = 0
        handle.untriggered_calls = 0
    for s in root.all_states:
        if s.training_state is TrainingState.FORWARD_BACKWARD:
            _set_training_state(s, TrainingState.IDLE)
    root.final_callback_queued = False
    if root.exec_order_data is not None:
        root.exec_order_data.next_iter()


def _reset_after_failure(root: _FSDPState) -> None:
    """Forward or backward raised midway: drop partial gradients, reshard, and return every state and
    handle to IDLE so the next step starts clean (the sharded gradients of earlier steps are kept)."""
    _rank_agreement.leave_step(g for h in _iter_handles(root) for g in (h.process_group, h.replicate_group))
    _finish_pending_reductions(root)
    for handle in _iter_handles(root):
        handle.discard_gradient_buffer()
        handle.reshard()
        handle.training_state = HandleTrainingState.IDLE  # a reset, not a transition
        handle.ran_pre_backward = False
        handle.pending_triggers = 0
        handle.untriggered_calls = 0
    for s in root.all_states:
        s.training_state = TrainingState.IDLE
    root.final_callback_queued = False


def _finish_pending_reductions(root: _FSDPState) -> None:
    pending, root.pending_reductions = root.pending_reductions, []
    for reduction in pending:
        reduction.finish()


# ---------------------------------------------------------------------------- unshard / prefetch
def _unshard(state: _FSDPState, handle: FlatParamHandle) -> None:
    handle.unshard()
    root = state.root_state
    if root is not None and root.limiter is not None:
        root.limiter.record(root.non_root_handles)


def _prefetch(state: _FSDPState, handle: Optional[FlatParamHandle], phase: str) -> None:
    """Start ``handle``'s all-gather early, unless it is already under way or the limiter says no."""
    if handle is None or handle.is_unsharded or handle.unshard_in_flight:
        return
    root = state.root_state
    assert root is not None and root.exec_order_data is not None
    if state.limit_all_gathers and root.limiter is not None and not root.limiter.may_prefetch(root.non_root_handles):
        return
    root.exec_order_data.prefetch_log.append((phase, handle.unit_fqn))
    _unshard(state, handle)


def _prefetch_for_backward(state: _FSDPState, handle: FlatParamHandle) -> None:
    eo = state.exec_order_data
    if eo is not None:
        _prefetch(state, eo.backward_prefetch_target(handle), "backward")


# ---------------------------------------------------------------------------- other forward methods
def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` (e.g. ``generate``) unshard and reshard like ``forward`` does.

    Hooks only see ``forward``; this wraps the method on the instance so it runs the same pre/post
    forward steps (as the root when ``module`` is the root)."""
    state = _check_forward_method_args(module, method_name)
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")
    handles = [h for h in state.handles if h.module is module]

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if module is state.module:
            new = _fsdp_root_pre_forward(state, module, args, kwargs)
            args, kwargs = new if new is not None else (args, kwargs)
        for handle in handles:
            new = _pre_forward(state, handle, module, args, kwargs)
            args, kwargs = new if new is not None else (args, kwargs)
        output = method(*args, **kwargs)
        for handle in handles:
            output = _post_forward(state, handle, module, args, output)
        if module is state.module:
            _fsdp_root_post_forward(state, module, args, output)
        return output

    object.__setattr__(module, method_name, wrapped)


def _check_forward_method_args(module: Any, method_name: Any) -> _FSDPState:
    """The state ``register_fsdp_forward_method`` attaches to, after checking its arguments."""
    api = "register_fsdp_forward_method"
    if not isinstance(module, nn.Module):
        raise TypeError(f"{api} argument 'module' must be an nn.Module, got {type(module).__name__}")
    if not isinstance(method_name, str):
        raise TypeError(
            f"{api} argument 'method_name' must be a str, got {type(method_name).__name__}: {method_name!r}"
        )
    if method_name == "forward":  # its hooks would run twice and the states would not know why
        raise ValueError(
            f"{api}: 'forward' already runs fully_shard's hooks; register only other methods (e.g. 'generate')"
        )
    state = _get_fsdp_state(module)
    if state is None and _is_inside_unit(module):
        raise ValueError(
            f"{api}: this {type(module).__name__} is not a fully_shard root or unit; register the method on the "
            "module fully_shard was applied to (or make this module a unit with the policy)"
        )
    if state is None:
        raise ValueError(f"{api}: call fully_shard on this {type(module).__name__} before registering {method_name!r}")
    return state


# ---------------------------------------------------------------------------- post-backward trigger
class _PostBackwardTrigger(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs when the unit's backward is done."""

    @staticmethod
    def forward(ctx: Any, fire: Callable[[], None], *inputs: torch.Tensor) -> Any:
        ctx.fire = fire
        return inputs if len(inputs) != 1 else inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.fire()
        return (None, *grads)


def _attach_post_backward_trigger(
    state: _FSDPState, handle: FlatParamHandle, args: Any, kwargs: Any
) -> tuple[Any, Any]:
    # also for frozen groups: post-backward is where they reshard once the unit's backward is done
    flat, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not positions:
        handle.untriggered_calls += 1  # this call's backward cannot be observed: reduce at the end
        return args, kwargs
    handle.pending_triggers += 1
    outs = _PostBackwardTrigger.apply(functools.partial(_on_trigger, state, handle), *(flat[i] for i in positions))
    outs = (outs,) if isinstance(outs, torch.Tensor) else outs
    for i, out in zip(positions, outs):
        flat[i] = out
    return pytree.tree_unflatten(flat, spec)  # type: ignore[no-any-return]


def _on_trigger(state: _FSDPState, handle: FlatParamHandle) -> None:
    handle.pending_triggers -= 1
    # A call without a trigger (inputs needing no grad) may still have backward to run after the
    # last trigger fires; then only the final callback knows the unit is done.
    if handle.pending_triggers == 0 and handle.untriggered_calls == 0:
        _post_backward(state, handle)


# ---------------------------------------------------------------------------- tensors in structures
def _tensors(structure: Any) -> list[torch.Tensor]:
    """Every tensor in a nested output: containers pytree knows, and dataclass fields (pytree treats
    an unregistered dataclass as a leaf, which would hide its tensors from the pre-backward hooks)."""
    out: list[torch.Tensor] = []
    for leaf in pytree.tree_leaves(structure):
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            out.extend(_tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)]))
    return out


def _cast_floating(structure: Any, dtype: torch.dtype) -> Any:
    """Cast floating-point tensors in ``structure`` to ``dtype``; integers and others pass through."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, structure)
