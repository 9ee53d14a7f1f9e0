"""`unshard_params` (alias `summon_full_params`): full-shape, full-precision parameters in a context."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_composable import _rank_agreement
from fsdp_composable._common_utils import (
    TrainingState,
    _FSDPState,
    _get_fsdp_state,
    _get_fsdp_states,
    _is_inside_unit,
    _set_training_state,
)
from fsdp_composable._flat_param import FlatParamHandle, HandleTrainingState
from fsdp_composable._state_dict_utils import _gather_full_flat
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
    """Inside the context every original parameter has its full shape and full-precision values.

    ``writeback``: changes to the parameters persist on exit. ``rank0_only``: only rank 0 holds full
    parameters (others keep their shard views); it cannot be combined with ``writeback``.
    ``offload_to_cpu``: the full parameters live on the CPU. ``with_grads``: ``.grad`` holds the full
    gradient too (zeros where a unit has none yet). Collective: every rank must enter it.
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
    _check_idle(states)
    handles = [h for s in states for h in s.handles]
    fulls: list[Optional[torch.Tensor]] = []
    for s in states:
        _set_training_state(s, TrainingState.SUMMON_FULL_PARAMS)
    try:
        for handle in handles:
            handle.set_training_state(HandleTrainingState.SUMMON_FULL_PARAMS)
            fulls.append(_summon_handle(handle, rank0_only, offload_to_cpu, with_grads))
        yield
    finally:
        for handle, full in zip(handles, fulls):
            _restore_handle(handle, full, writeback)
        for handle in handles:
            if handle.training_state is HandleTrainingState.SUMMON_FULL_PARAMS:
                handle.set_training_state(HandleTrainingState.IDLE)
        for s in states:
            _set_training_state(s, TrainingState.IDLE)


summon_full_params = unshard_params


@_rank_agreement.entry_point("unshard_params()")
def _summon_handle(
    handle: FlatParamHandle, rank0_only: bool, offload_to_cpu: bool, with_grads: bool
) -> Optional[torch.Tensor]:
    handle.stash_sharded_grads()  # the flat gradient now reflects what the user left in `.grad`
    full = _gather_full_flat(handle)
    grad_full = _gather_full_grad(handle) if with_grads else None
    if rank0_only and dist.get_rank(handle.process_group) != 0:
        return None
    if offload_to_cpu:
        full = full.cpu()
        grad_full = grad_full.cpu() if grad_full is not None else None
    for param, info in zip(handle.params, handle.layout.infos):
        param.data = full[info.offset : info.offset + info.numel].view(info.shape)
        if grad_full is not None and param.requires_grad:
            param.grad = grad_full[info.offset : info.offset + info.numel].view(info.shape)
    return full


def _gather_full_grad(handle: FlatParamHandle) -> torch.Tensor:
    grad = handle.flat_param.grad
    return _gather_full_flat(handle, grad.detach() if grad is not None else torch.zeros_like(handle.flat_param))


def _restore_handle(handle: FlatParamHandle, full: Optional[torch.Tensor], writeback: bool) -> None:
    if full is not None and writeback:
        lo = handle.layout.rank * handle.layout.shard_numel
        with torch.no_grad():
            handle.flat_param.data.copy_(full[lo : lo + handle.layout.shard_numel].to(handle.flat_param.device))
    for param in handle.params:
        param.grad = None
    handle.use_sharded_views()
    handle.expose_sharded_grads()
