"""torch's ``torch.distributed.checkpoint.state_dict`` API (get/set_model_state_dict, get/set_state_dict)
on a `fully_shard`ed model.

[Note: torch's model state-dict API]
torch's API calls ``model.state_dict()`` / ``model.load_state_dict()`` and post-processes the result
by its ``StateDictOptions``; it only switches torch FSDP's own state-dict type, which it finds by
type. Our default type is FULL (the unsharded model's state dict), so left alone it would gather
the whole model on every rank even for the default options, which torch (and DCP) mean to be
sharded. So while torch's API runs on a root we manage, the root's state-dict pre-hooks set the
type its options ask for, the way torch does for its own FSDP:
- ``full_state_dict=False`` (the default): SHARDED, ``DTensor``s of the original shapes that DCP
  saves at N ranks and loads at M;
- ``full_state_dict=True``: FULL (full tensors; ``cpu_offload=True`` also means ``offload_to_cpu``
  and ``rank0_only``, as torch sets for its FSDP).
A one-shot post-hook puts the previous type back. A call is torch's when one of the frames above
the hook runs torch's ``_get_model_state_dict`` / ``_load_model_state_dict`` with this module as its
``model``; were torch to rename them, nothing is switched and the default FULL state dict still
saves and loads correctly with DCP at any world size (full tensors on every rank), just not sharded.
The optimizer's half needs no detection: see [Note: torch's optimizer state dict] in `_optim_utils`.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from types import CodeType, FrameType
from typing import Any, Optional

from torch import nn

from fsdp_composable._common_utils import _FSDPState, _get_fsdp_states
from fsdp_composable.api import FullStateDictConfig, ShardedStateDictConfig, StateDictConfig, StateDictType

__all__: list[str] = []

_hooked: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
# root module -> the (state, type, config) to put back when torch's call finishes
_saved: "weakref.WeakKeyDictionary[nn.Module, list[tuple[_FSDPState, StateDictType, Optional[StateDictConfig]]]]" = (
    weakref.WeakKeyDictionary()
)


def _torch_codes() -> tuple[CodeType, ...]:
    try:
        from torch.distributed.checkpoint import state_dict as dsd
    except ImportError:  # pragma: no cover - torch without DCP
        return ()
    fns = [getattr(dsd, name, None) for name in ("_get_model_state_dict", "_load_model_state_dict")]
    return tuple(inspect.unwrap(fn).__code__ for fn in fns if fn is not None)


_CODES: Optional[tuple[CodeType, ...]] = None


def _torch_call_options(module: nn.Module) -> Optional[tuple[Any, bool]]:
    """(``_StateDictInfo``, is a load) of the torch API call working on ``module`` right now, or None."""
    global _CODES
    if _CODES is None:
        _CODES = _torch_codes()
    frame: Optional[FrameType] = sys._getframe(2)
    while frame is not None:
        if frame.f_code in _CODES and frame.f_locals.get("model") is module:
            return frame.f_locals.get("info"), frame.f_code is _CODES[-1]
        frame = frame.f_back
    return None


def _register_torch_api_hooks(module: nn.Module) -> None:
    """Called by `fully_shard` before it builds its state, so that on the root these pre-hooks run
    before the state-dict hooks of `_state_dict_utils` read the type."""
    if module in _hooked:
        return
    _hooked.add(module)
    module.register_state_dict_pre_hook(_state_dict_pre_hook)
    module.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)


class _OneShot:
    """A post-hook that restores the previous type once, then removes itself."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.handle: Any = None

    def __call__(self, *args: Any) -> None:
        _restore(self.module)
        self.handle.remove()


def _state_dict_pre_hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    if _switch(module):
        hook = _OneShot(module)
        hook.handle = module.register_state_dict_post_hook(hook)


def _load_state_dict_pre_hook(module: nn.Module, *args: Any) -> None:
    if _switch(module):
        hook = _OneShot(module)
        hook.handle = module.register_load_state_dict_post_hook(hook)


def _switch(module: nn.Module) -> bool:
    """Set the type torch's options ask for on every state under ``module``, if torch's API is the
    caller; True if it did (the caller then registers the one-shot hook that restores it)."""
    _restore(module)  # a previous call that raised halfway
    call = _torch_call_options(module)
    states = _get_fsdp_states(module)
    if call is None or not states:
        return False
    info, is_load = call
    config: StateDictConfig
    if getattr(info, "full_state_dict", False):
        # On load torch has already given every rank the full tensors (or broadcast them).
        rank0 = bool(getattr(info, "cpu_offload", False)) and not is_load
        kind, config = StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=rank0, rank0_only=rank0)
    else:
        kind, config = StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()
    _saved[module] = [(s, s.state_dict_type, s.state_dict_config) for s in states]
    for s in states:
        s.state_dict_type, s.state_dict_config = kind, config
    return True


def _restore(module: nn.Module) -> None:
    for s, kind, config in _saved.pop(module, []):
        s.state_dict_type, s.state_dict_config = kind, config
