"""FSDP2's per-module switches as functions on a sharded module: ``set_requires_gradient_sync``,
``set_requires_all_reduce``, ``set_reshard_after_forward``, ``set_reshard_after_backward``,
``set_unshard_in_backward``, ``set_is_last_backward`` and the explicit prefetch lists.

Each sets the `UnitSwitches` of the module's unit (and, with ``recurse=True``, of every sharded
module below it) and lasts until set again; the hooks read them ([Note: per-unit switches]). They
need no communication, but every rank must set the same values: the switches decide which
collectives a step issues.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from fsdp_composable._flat_param import FlatParamHandle
from fsdp_composable._runtime._lazy_init import _lazy_init
from fsdp_composable._runtime._module_controls import resolve, sharded_modules, unit_handles
from fsdp_composable.api import _check_bool

__all__ = [
    "set_is_last_backward",
    "set_modules_to_backward_prefetch",
    "set_modules_to_forward_prefetch",
    "set_requires_all_reduce",
    "set_requires_gradient_sync",
    "set_reshard_after_backward",
    "set_reshard_after_forward",
    "set_unshard_in_backward",
]


def _handles(module: nn.Module, api: str, recurse: bool) -> list[FlatParamHandle]:
    """The handles of ``module``'s unit, and with ``recurse`` of every unit below it."""
    _check_bool(f"{api} argument 'recurse'", recurse)
    resolved, state = resolve(module, api)
    handles = unit_handles(state, resolved)
    if recurse:
        for sub in sharded_modules(resolved):
            sub_module, sub_state = resolve(sub, api)
            handles.extend(h for h in unit_handles(sub_state, sub_module) if h not in handles)
    return handles


def _set(module: nn.Module, api: str, flag: Any, recurse: bool, **switches: bool) -> None:
    _check_bool(f"{api} argument {next(iter(switches))!r}", flag)
    for handle in _handles(module, api, recurse):
        for name, value in switches.items():
            setattr(handle.switches, name, value)


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool, recurse: bool = True) -> None:
    """False: the units keep their unsharded gradients locally, summed over backwards, with no
    communication (``no_sync`` for these units only, until set back); the first backward after
    setting True reduces the sum once. Also sets ``set_requires_all_reduce`` (FSDP2's rule)."""
    flag = requires_gradient_sync
    _set(module, "set_requires_gradient_sync", flag, recurse, reduce_grads=flag, all_reduce_grads=flag)


def set_requires_all_reduce(module: nn.Module, requires_all_reduce: bool, recurse: bool = True) -> None:
    """HYBRID_SHARD: False skips only the all-reduce across replicas; each backward still
    reduce-scatters within the shard group, and the results are summed apart from ``.grad`` until a
    backward with True all-reduces them together."""
    flag = requires_all_reduce
    _set(module, "set_requires_all_reduce", flag, recurse, all_reduce_grads=flag)


def set_reshard_after_forward(module: nn.Module, reshard_after_forward: bool, recurse: bool = True) -> None:
    """Whether the units free their unsharded parameters after forward (overriding the strategy; True
    also reshards the root unit, which otherwise stays unsharded for backward)."""
    flag = reshard_after_forward
    _set(module, "set_reshard_after_forward", flag, recurse, reshard_after_forward=flag)


def set_reshard_after_backward(module: nn.Module, reshard_after_backward: bool, recurse: bool = True) -> None:
    """False: the units stay unsharded after backward, so the next forward needs no all-gather (for
    gradient accumulation). Reshard them (``reshard(unit)`` or set True before the last backward)
    before ``optimizer.step()``, which refuses an unsharded unit."""
    flag = reshard_after_backward
    _set(module, "set_reshard_after_backward", flag, recurse, reshard_after_backward=flag)


def set_unshard_in_backward(module: nn.Module, unshard_in_backward: bool) -> None:
    """False: backward does not all-gather this unit (not recursive): for units whose parameters
    gradients do not need (an embedding's weight)."""
    flag = unshard_in_backward
    _set(module, "set_unshard_in_backward", flag, False, unshard_in_backward=flag)


def set_is_last_backward(module: nn.Module, is_last_backward: bool) -> None:
    """Accepted for FSDP2 code, with no effect on results: every backward here finishes its
    reductions before it returns, so its gradients are complete whatever this says."""
    _check_bool("set_is_last_backward argument 'is_last_backward'", is_last_backward)
    resolved, state = resolve(module, "set_is_last_backward")
    root = state.root_state or state
    _lazy_init(root, root.module)  # the switch lives in the root context ([Note: the root context])
    assert root.ctx is not None
    root.ctx.is_last_backward = is_last_backward


def _targets(module: nn.Module, modules: Any, api: str) -> tuple[FlatParamHandle, ...]:
    if isinstance(modules, nn.Module) or not isinstance(modules, Sequence):
        raise TypeError(f"{api} argument 'modules' must be a list of sharded modules, got {type(modules).__name__}")
    out: list[FlatParamHandle] = []
    for i, target in enumerate(modules):
        target_module, state = resolve(target, f"{api} (modules[{i}])")
        out.extend(unit_handles(state, target_module))
    return tuple(out)


def set_modules_to_forward_prefetch(module: nn.Module, modules: Sequence[nn.Module]) -> None:
    """In ``module``'s pre-forward, all-gather these units early (in this order), instead of the
    recorded next unit; each within the all-gather limiter's bound (``limit_all_gathers``). From the
    second iteration: the first checks each unit's all-gather against the other ranks first."""
    api = "set_modules_to_forward_prefetch"
    targets = _targets(module, modules, api)
    for handle in _handles(module, api, False):
        handle.switches.forward_prefetch = targets


def set_modules_to_backward_prefetch(module: nn.Module, modules: Sequence[nn.Module]) -> None:
    """In ``module``'s pre-backward, all-gather these units early (in this order) instead of the
    recorded next unit, whatever ``backward_prefetch`` says; each within the limiter's bound."""
    api = "set_modules_to_backward_prefetch"
    targets = _targets(module, modules, api)
    for handle in _handles(module, api, False):
        handle.switches.backward_prefetch = targets
