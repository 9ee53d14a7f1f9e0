"""FSDP2's per-module reduction controls as functions on a sharded module: the gradient divide
factor, force-sum reductions, the all-reduce hook, and the post-optimizer event.

[Note: reduction controls]
Each function takes a module owning a unit (the module `fully_shard` was called on, a module its
policy made a unit, or a `FullyShardedDataParallel` instance) and sets the value on the units that
module owns, as FSDP2's methods set it on that module's own parameters; ``recurse=True`` sets it on
every unit in the module's subtree (FSDP2 users loop over the modules instead). The values live in
each unit's gradient record (``handle.grads.controls``, `_grad_records.ReduceControls`), the one
owner, and the reduction reads them each time it starts, so they may change between steps.
- divide factor: the reduced gradient is the sum over ranks divided by the factor instead of by the
  number of ranks (1.0: a plain sum). Divided before the sum in float16, after it otherwise.
- force sum: FSDP2 may reduce with AVG or PREMUL_SUM; ours always sum and divide apart, so the flag is
  recorded and changes nothing.
- all-reduce hook: called once per unit per reduction, in place, on the reduced shard gradient in
  the reduce dtype: after the all-reduce across replicas under HYBRID_SHARD, after the
  reduce-scatter (the all-reduce under NO_SHARD) otherwise, as FSDP2 runs it. It sees the averaged
  (or divided) value: our division comes first, as in FSDP2 for float32 and bfloat16. On CUDA it
  runs on the stream of the last collective (the all-reduce stream under HYBRID_SHARD), so what it
  issues is ordered after the reduction and before the compute stream reads the result. A custom
  ``stream`` is not offered (FSDP2 refuses one under HYBRID_SHARD too).
A communication hook (`register_comm_hook`) replaces the whole reduction: setting a divide factor or
an all-reduce hook on a unit that has one is an error (one registered later takes over silently).
- post-optimizer event: the next root forward's all-gathers wait for this event instead of for
  everything issued on the compute stream (the root context holds it, and drops it once used, as
  FSDP2). On the CPU there are no streams: it is accepted and dropped.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import nn

from fsdp_composable._base._grad_records import ReduceControls
from fsdp_composable._common_utils import _get_fsdp_states
from fsdp_composable._flat_param import FlatParamHandle
from fsdp_composable._grads._comm_hooks import registered
from fsdp_composable._runtime._module_controls import _wrapper_state, module_fqn, unit_handles

__all__ = [
    "set_all_reduce_hook",
    "set_force_sum_reduction_for_comms",
    "set_gradient_divide_factor",
    "set_post_optim_event",
    "set_reduce_scatter_divide_factor",
]


def set_gradient_divide_factor(module: nn.Module, factor: float, *, recurse: bool = False) -> None:
    """Divide the summed gradients of ``module``'s units by ``factor`` instead of the number of ranks."""
    units = _units(module, "set_gradient_divide_factor", recurse)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise ValueError(
            f"set_gradient_divide_factor({_name(units)}): factor must be a positive finite number, got {factor!r}"
        )
    _check_no_comm_hook(units, "set_gradient_divide_factor")
    for handle in units:
        _controls(handle).divide_factor = float(factor)


def set_reduce_scatter_divide_factor(module: nn.Module, factor: float, *, recurse: bool = False) -> None:
    """FSDP2's older name of `set_gradient_divide_factor`."""
    set_gradient_divide_factor(module, factor, recurse=recurse)


def set_force_sum_reduction_for_comms(module: nn.Module, enable: bool, *, recurse: bool = False) -> None:
    """FSDP2's flag for sum-only collectives; ours always sum, so it is recorded only."""
    units = _units(module, "set_force_sum_reduction_for_comms", recurse)
    if not isinstance(enable, bool):
        raise TypeError(
            f"set_force_sum_reduction_for_comms({_name(units)}): enable must be True or False, got {enable!r}"
        )
    for handle in units:
        _controls(handle).force_sum = enable


def set_all_reduce_hook(
    module: nn.Module,
    hook: Optional[Callable[[torch.Tensor], None]],
    *,
    stream: Any = None,
    recurse: bool = False,
) -> None:
    """Run ``hook(grad)`` in place on each of ``module``'s units' reduced shard gradient (``None``
    removes it); see [Note: reduction controls]."""
    units = _units(module, "set_all_reduce_hook", recurse)
    if hook is not None and not callable(hook):
        raise TypeError(
            f"set_all_reduce_hook({_name(units)}): hook must be callable or None, got {type(hook).__name__}"
        )
    _check_no_comm_hook(units, "set_all_reduce_hook")
    if stream is not None:
        hybrid = any(h.replicate_group is not None for h in units)
        why = "stream cannot be set with HYBRID_SHARD" if hybrid else "a custom stream is not supported"
        raise ValueError(
            f"set_all_reduce_hook({_name(units)}): {why}; the hook runs on the stream of the unit's last "
            "gradient collective. Leave stream out"
        )
    for handle in units:
        _controls(handle).all_reduce_hook = hook


def set_post_optim_event(module: nn.Module, event: Optional[Any]) -> None:
    """The next root forward's all-gathers wait for ``event`` (recorded after the optimizer step)
    instead of the compute stream; record a new one every step. Accepted and dropped on the CPU.
    ``None`` (what a CPU stream's ``record_event()`` returns) asks for the default: wait for the
    compute stream."""
    units = _units(module, "set_post_optim_event", recurse=True)
    if event is not None and not isinstance(event, (torch.Event, torch.cuda.Event)):
        raise TypeError(
            f"set_post_optim_event({_name(units)}): event must be a torch.Event recorded after the optimizer "
            f"step (or None), got {type(event).__name__}"
        )
    ctx = _get_fsdp_states(_target(module))[0].ctx
    if event is None:
        if ctx is not None:
            ctx.post_optim_event = None
        return
    if ctx is None:
        raise RuntimeError(
            f"set_post_optim_event({_name(units)}): the model has not run a forward yet; call it after the "
            "optimizer step, before the next forward"
        )
    ctx.post_optim_event = event


def _check_no_comm_hook(units: list[FlatParamHandle], api: str) -> None:
    """A communication hook replaces the whole reduction, so it would never see the value."""
    hooked = [h for h in units if registered(h) is not None]
    if hooked:
        raise ValueError(
            f"{api}({_name(hooked)}): the unit's gradients go through a communication hook (register_comm_hook), "
            "which replaces the reduction; do the division or the extra step inside that hook"
        )


def _controls(handle: FlatParamHandle) -> ReduceControls:
    controls: ReduceControls = handle.grads.controls
    return controls


def _target(module: nn.Module) -> nn.Module:
    """The module holding the state: a wrapper instance's wrapped module, else ``module`` itself."""
    wrapper = _wrapper_state(module)
    return wrapper.module if wrapper is not None else module


def _units(module: nn.Module, api: str, recurse: bool) -> list[FlatParamHandle]:
    """The handles of the unit ``module`` owns (any member of a list unit; with ``recurse``: every
    unit in its subtree). A wrapper instance stands for the module it wraps."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{api} argument 'module' must be a sharded nn.Module, got {type(module).__name__}")
    target = _target(module)
    states = _get_fsdp_states(target)
    if recurse:
        inside = set(target.modules())
        handles = [h for s in states for h in s.handles if h.module in inside]
    else:
        handles = [h for s in states for h in unit_handles(s, target)]
    if handles:
        return handles
    where = module_fqn(target)
    if where is not None:
        raise ValueError(
            f"{api}: module '{where or '<root>'}' ({type(target).__name__}) is not a unit: its parameters belong "
            "to an enclosing unit; call it on that unit's module, or on the root with recurse=True"
        )
    if states:
        raise ValueError(
            f"{api}: this {type(target).__name__} owns no unit of its own (its parameters all belong to units "
            "below it); pass recurse=True to set it on every unit under it"
        )
    raise ValueError(f"{api}: no fully_shard state on this {type(target).__name__}; call fully_shard(module) first")


def _name(units: list[FlatParamHandle]) -> str:
    names = sorted({h.unit_fqn or "<root>" for h in units})
    return "unit " + ", ".join(f"'{n}'" for n in names[:3]) + (", ..." if len(names) > 3 else "")
