"""`register_comm_hook`: FSDP1's API that attaches a communication hook to every unit of a root; the
hook's record and its call in place of the gradient collective are `_comm_hooks`' ([Note: communication
hooks])."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch import nn

from fsdp_composable._common_utils import _FSDPState, _get_fsdp_states
from fsdp_composable._composable_state import _get_module_state, _insert_module_state
from fsdp_composable._grads._comm_hooks import API_NAME, CommHook

__all__ = ["register_comm_hook"]

_LOW_PRECISION_HOOKS = {"fp16_compress_hook": torch.float16, "bf16_compress_hook": torch.bfloat16}
_TORCH_HOOKS_MODULE = "torch.distributed.algorithms._comm_hooks"
_HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def _compression_of(hook: Callable[..., Any]) -> Optional[torch.dtype]:
    target = hook.func if isinstance(hook, functools.partial) else hook
    module = getattr(target, "__module__", "") or ""
    if not module.startswith(_TORCH_HOOKS_MODULE):
        return None
    return _LOW_PRECISION_HOOKS.get(getattr(target, "__name__", ""))


def register_comm_hook(module: nn.Module, state: Any, hook: Callable[..., Any]) -> None:
    """Reduce every unit's gradient under ``module`` (the root: the module `fully_shard` was called on
    last, or the wrapper) with ``hook(state, grad, output)`` (sharded strategies) or ``hook(state, grad)``
    (NO_SHARD) instead of our collective; torch's default hooks work. Before the first forward, once.
    See [Note: communication hooks]."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_comm_hook argument 'module' must be an nn.Module, got {type(module).__name__}")
    states = _get_fsdp_states(module)
    if not states:
        raise ValueError(
            f"register_comm_hook: no fully_shard state on this {type(module).__name__} or its submodules; "
            "call fully_shard(module) first"
        )
    _register(states, state, hook, "register_comm_hook")


def _register(states: list[_FSDPState], hook_state: Any, hook: Any, where: str) -> None:
    """Attach ``hook`` (called with ``hook_state``) to every unit of ``states``; see [Note: communication
    hooks]. ``where`` names the caller in messages. Checked before anything is attached."""
    if not callable(hook):
        raise TypeError(f"{where}: the communication hook must be callable, got {type(hook).__name__}")
    low_precision = _compression_of(hook)
    for state in states:
        if state.is_root is False:
            raise RuntimeError(
                f"{where}: call it on the root (the outermost sharded module), not on the "
                f"{type(state.module).__name__} inside it"
            )
        if state.ctx is not None:
            raise RuntimeError(
                f"{where}: register the communication hook before the first forward; this "
                f"{type(state.module).__name__} has already run one"
            )
        for handle in state.handles:
            unit = handle.unit_fqn or "<root>"
            if _get_module_state(handle.module, API_NAME) is not None:
                raise RuntimeError(
                    f"{where}: a communication hook is already registered (unit '{unit}'); register one, once"
                )
            if handle.config.strategy.name in _HYBRID:
                raise ValueError(
                    f"{where}: communication hooks are not supported with {handle.config.strategy.name} (unit "
                    f"'{unit}'): the all-reduce across replicas has no place in the hook's signature"
                )
            mp = handle.config.mixed_precision
            if low_precision is not None and mp is not None and mp.reduce_dtype is not None:
                raise ValueError(
                    f"{where}: {getattr(hook, '__name__', 'the hook')} casts gradients itself, but unit '{unit}' "
                    f"has MixedPrecision(reduce_dtype={mp.reduce_dtype}); use one of them, not both"
                )
    registered_hook = CommHook(hook_state, hook, low_precision)
    for state in states:
        for module in {h.module for h in state.handles}:
            _insert_module_state(module, API_NAME, registered_hook)
