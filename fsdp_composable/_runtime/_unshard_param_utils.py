"""`unshard_params` (alias `summon_full_params`): full-shape, full-precision parameters in a context."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_composable._comm import _rank_agreement
from fsdp_composable._comm._tensor_parallel import as_param_grad, local_of, point_at
from fsdp_composable._common_utils import (
    TrainingState,
    _FSDPState,
    _get_fsdp_state,
    _get_fsdp_states,
    _is_inside_unit,
    _set_training_state,
)
from fsdp_composable._flat._checkpoint_comm import any_rank, gather_full_flat
from fsdp_composable._flat_param import FlatParamHandle, HandleTrainingState
from fsdp_composable._grads import _exposed_grads
from fsdp_composable._guards._dtype_casts import adopt_casts
from fsdp_composable._guards._model_edit_checks import check_data_writes
from fsdp_composable._runtime._entry_points import _forward_running, _in_backward, _settle_unfinished_step
from fsdp_composable._runtime._flat_mode import _use_flat_params, _use_orig_params
from fsdp_composable._runtime._state_dict_keys import _join
from fsdp_composable.api import _check_bool

__all__ = ["summon_full_params", "unshard_params"]


def _states_for(module: nn.Module, recurse: bool) -> list[_FSDPState]:
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"unshard_params argument 'module' must be the nn.Module fully_shard was applied to, "
            f"got {type(module).__name__}"
        )
    if recurse:
        states = _get_fsdp_states(module)
    else:
        state = _get_fsdp_state(module)
        states = [state] if state is not None else []
    if not states and _is_inside_unit(module):
        raise ValueError(
            f"unshard_params: this {type(module).__name__} is not a fully_shard root or unit (its parameters "
            "belong to an enclosing unit); call it on the module fully_shard was applied to"
        )
    if not states:
        raise ValueError(
            f"unshard_params: no fully_shard state on this {type(module).__name__}"
            f"{' or its submodules' if recurse else ''}; call fully_shard(module) first"
        )
    return states


def _refuse_inside_step(state: _FSDPState) -> None:
    """Between a forward and its backward (two forwards of one step, say) the step's units hold what
    the backward needs; summoning would reshard them under it, so refuse before anything changes.
    The same on every rank: each ran the same forwards."""
    ctx = state.ctx
    if ctx is not None and not _in_backward() and not _forward_running(state) and ctx.backward_may_come():
        raise RuntimeError(
            f"unshard_params cannot be entered between a forward of {type(ctx.root.module).__name__} and its "
            "backward: the backward would run on resharded parameters. Enter it after backward (or before the "
            "forward), or run a forward whose backward will not come under torch.no_grad()"
        )


def _check_idle(states: list[_FSDPState]) -> None:
    for s in states:
        if s.training_state is not TrainingState.IDLE:
            raise RuntimeError(
                f"unshard_params cannot be used while fully_shard({type(s.module).__name__}) is in "
                f"{s.training_state.name}: call it outside forward/backward (and not nested in itself)"
            )


@contextlib.contextmanager
def unshard_params(
    module: nn.Module,
    *,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Inside the context every original parameter of the units in ``module``'s subtree (only
    ``module``'s own units with ``recurse=False``) has its full shape and full-precision values.

    ``writeback``: changes to the parameters persist on exit, whether made in place (``p.copy_(t)``)
    or by assignment (``p.data = t``, same shape). ``rank0_only``: only rank 0 holds full parameters
    (others keep their shard views); it cannot be combined with ``writeback``. ``offload_to_cpu``: the
    full parameters live on the CPU. ``with_grads``: ``.grad`` holds the full gradient too, in the
    parameters' dtype (``None`` while no backward has produced one), and with ``writeback`` edits of
    ``.grad`` persist. A wrapper in flat-parameter mode exposes its original parameters inside.
    Collective: every rank must enter it.
    """
    for name, value in (
        ("recurse", recurse),
        ("writeback", writeback),
        ("rank0_only", rank0_only),
        ("offload_to_cpu", offload_to_cpu),
        ("with_grads", with_grads),
    ):
        _check_bool(f"unshard_params argument {name!r}", value)
    if writeback and rank0_only:
        raise ValueError(
            "unshard_params(writeback=True, rank0_only=True) is not supported: the other ranks would "
            "not see rank 0's writes. Pass writeback=False, or rank0_only=False"
        )
    states = _states_for(module, recurse)
    _refuse_inside_step(states[0])
    _settle_unfinished_step(states[0])  # a step that stopped midway (see _entry_points)
    _check_idle(states)
    adopt_casts(states)  # model.half() since the last step: see [Note: casts after sharding]
    check_data_writes(states)  # `p.data = t` since the last forward: undone and refused
    inside = set(module.modules()) if recurse else {module}
    handles = [h for s in states for h in s.handles if h.module in inside]
    flat_mode = begin_summon(states)
    summoned: list[_Summoned] = []
    try:
        for handle in handles:
            handle.set_training_state(HandleTrainingState.SUMMON_FULL_PARAMS)
            summoned.append(_summon_handle(handle, rank0_only, offload_to_cpu, with_grads))
        yield
    finally:
        problems: list[str] = []
        for entry in summoned:
            problems.extend(_restore_handle(entry, writeback))
        end_summon(states, handles, flat_mode)
    if problems:
        raise RuntimeError("unshard_params(writeback=True) could not write back: " + "; ".join(problems))


summon_full_params = unshard_params


def begin_summon(states: list[_FSDPState]) -> list[_FSDPState]:
    """Mark ``states`` as exposing full parameters (a wrapper in flat mode shows its original
    parameters meanwhile); returns the states switched out of flat mode, for `end_summon`."""
    flat_mode = [s for s in states if _in_flat_mode(s)]
    for s in states:
        _set_training_state(s, TrainingState.SUMMON_FULL_PARAMS)
    for s in flat_mode:
        _switch_flat_mode(s, on=False)
    return flat_mode


def end_summon(states: list[_FSDPState], handles: list[FlatParamHandle], flat_mode: list[_FSDPState]) -> None:
    """Undo `begin_summon` once the handles' parameters view their shards again."""
    for handle in handles:
        if handle.training_state is HandleTrainingState.SUMMON_FULL_PARAMS:
            handle.set_training_state(HandleTrainingState.IDLE)
    for s in flat_mode:
        _switch_flat_mode(s, on=True)
    for s in states:
        _set_training_state(s, TrainingState.IDLE)


def _in_flat_mode(state: _FSDPState) -> bool:
    return any(h.module._parameters.get(h.name) is h.flat_param for h in state.handles)


def _switch_flat_mode(state: _FSDPState, on: bool) -> None:
    _use_flat_params(state) if on else _use_orig_params(state)


@dataclass
class _Summoned:
    """One handle inside `unshard_params`: the full tensors its parameters (and gradients) view."""

    handle: FlatParamHandle
    full: Optional[torch.Tensor] = None  # None on ranks that hold no full values (rank0_only)
    grad_full: Optional[torch.Tensor] = None
    with_grads: bool = False
    views: list[torch.Tensor] = field(default_factory=list)
    grad_views: list[Optional[torch.Tensor]] = field(default_factory=list)


@_rank_agreement.entry_point("unshard_params()")
def _summon_handle(handle: FlatParamHandle, rank0_only: bool, offload_to_cpu: bool, with_grads: bool) -> _Summoned:
    _exposed_grads.stash_sharded_grads(handle)  # the flat gradient now reflects what the user left in `.grad`
    if handle.is_unsharded or handle.unshard_in_flight:  # by `unshard(module)`: its buffer would go stale
        handle.reshard()
    full = gather_full_flat(handle)
    grad_full = _gather_full_grad(handle) if with_grads else None
    shows = not rank0_only or dist.get_rank(handle.process_group) == 0
    if handle.extensions is not None:  # tensor-subclass parameters: [Note: extension parameters]
        handle.extensions.summon(handle.device, shows, offload_to_cpu, with_grads)
    if not shows:
        _exposed_grads.expose_sharded_grads(handle)
        return _Summoned(handle)
    if offload_to_cpu:
        full = full.cpu()
        grad_full = grad_full.cpu() if grad_full is not None else None
    if grad_full is not None and grad_full.dtype != full.dtype:  # keep_low_precision_grads: full precision here
        grad_full = grad_full.to(full.dtype)
    entry = _Summoned(handle, full, grad_full, with_grads)
    for param, info in zip(handle.params, handle.layout.infos):
        view = full[info.offset : info.offset + info.numel].view(info.shape)
        point_at(param, view)
        entry.views.append(view)
        grad_view = None
        if grad_full is not None and param.requires_grad:
            grad_view = grad_full[info.offset : info.offset + info.numel].view(info.shape)
        param.grad = as_param_grad(info.tp, grad_view) if grad_view is not None else None
        entry.grad_views.append(grad_view)
    handle.register_params()
    return entry


def _gather_full_grad(handle: FlatParamHandle) -> Optional[torch.Tensor]:
    """The unit's full gradient, or None when no rank has one (before any backward, as in torch)."""
    grad = handle.flat_param.grad
    if not any_rank(handle, grad is not None):
        return None
    return gather_full_flat(handle, grad.detach() if grad is not None else torch.zeros_like(handle.flat_param))


def _is_view(tensor: torch.Tensor, view: torch.Tensor) -> bool:
    return (
        tensor.data_ptr() == view.data_ptr()
        and tensor.shape == view.shape
        and tensor.dtype == view.dtype
        and tensor.device == view.device
    )


def _restore_handle(entry: _Summoned, writeback: bool) -> list[str]:
    """Write the full values (and gradients) back into the shard if asked; point the parameters at
    the shard again. Returns what could not be written back, naming each parameter."""
    handle = entry.handle
    problems: list[str] = []
    if handle.extensions is not None:
        handle.extensions.end_summon(writeback and entry.full is not None)
    if entry.full is not None and writeback:
        problems = _collect_edits(entry)
        layout = handle.layout
        with torch.no_grad():
            handle.flat_param.data.copy_(layout.shard_of(entry.full).to(handle.flat_param.device))
            if entry.with_grads and entry.grad_full is not None:
                _write_back_grad(handle, layout.shard_of(entry.grad_full))
    for param in handle.params:
        param.grad = None
    handle.use_sharded_views()
    _exposed_grads.expose_sharded_grads(handle)
    return problems


def _collect_edits(entry: _Summoned) -> list[str]:
    """Fold ``p.data = t`` and ``p.grad = g`` (same shapes) into the full tensors the shard is copied from."""
    handle, full = entry.handle, entry.full
    assert full is not None
    problems = []
    for param, info, view, grad_view in zip(handle.params, handle.layout.infos, entry.views, entry.grad_views):
        fqn = _join(handle.unit_fqn, info.fqn)
        with torch.no_grad():
            data = local_of(param)
            if not _is_view(data, view):
                if data.shape != info.shape:
                    problems.append(f"parameter '{fqn}' now has shape {tuple(data.shape)}, not {tuple(info.shape)}")
                else:
                    view.copy_(data)
            if not entry.with_grads or not param.requires_grad:
                continue
            grad = local_of(param.grad) if param.grad is not None else None
            if grad_view is not None and grad is not None and _is_view(grad, grad_view):
                continue
            if grad is not None and grad.shape != info.shape:
                problems.append(f"the gradient of '{fqn}' now has shape {tuple(grad.shape)}, not {tuple(info.shape)}")
                continue
            if grad is None and grad_view is None:
                continue
            if entry.grad_full is None:  # the first gradient of this unit: start from zeros
                entry.grad_full = torch.zeros_like(full)
            target = entry.grad_full[info.offset : info.offset + info.numel].view(info.shape)
            target.zero_() if grad is None else target.copy_(grad)
    return problems


def _write_back_grad(handle: FlatParamHandle, local: torch.Tensor) -> None:
    flat_grad = handle.flat_param.grad
    if flat_grad is None:
        _exposed_grads.assign_grad(
            handle.flat_param, local.to(device=handle.flat_param.device, dtype=handle.flat_param.dtype)
        )
    else:
        flat_grad.copy_(local)
