"""A unit opened for one save or load: its original parameters given their original shapes, and
closed again afterwards (see [Note: a unit is unsharded around its subtree's save and load])."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from fsdp_composable._common_utils import _FSDPState
from fsdp_composable._flat_param import FlatParamHandle
from fsdp_composable._runtime._state_dict_keys import _join
from fsdp_composable.api import StateDictType

__all__: list[str] = []


# ---------------------------------------------------------------------------- a unit unsharded for one save/load
# [Note: a unit is unsharded around its subtree's save and load]
# FULL and SHARDED state dicts never look keys up by name. A state-dict *pre*-hook on the unit module
# gives each original parameter its original shape before ``nn.Module`` visits the unit's subtree:
# FULL points ``param.data`` at a view of the unit's all-gathered flat tensor; SHARDED registers, in
# place of each original parameter, a `DTensor` parameter of the original shape holding this rank's
# `torch.chunk` rows (see [Note: sharded state dicts are DTensors in torch.chunk layout]). So every
# module below sees what it would see without sharding: its own state-dict hooks (a fused QKV weight
# split into three, torchtitan-style), a module registered under two FQNs, a `CheckpointWrapper`
# renaming keys, ``load_state_dict(assign=True)``. The post-hook takes over whatever tensors ended up
# viewing the gathered flat tensor (cloning them, so it can be freed) and restores the sharded views.
# Loading is the mirror image: the pre-hook opens the same full-shape parameters (filled with the
# current values, so a missing key keeps its value), ``nn.Module`` copies the checkpoint into them, and
# the load post-hook (which runs after the whole subtree loaded) writes this rank's part back into the
# flat shard. Cost: a unit's full flat tensor lives while its subtree is saved, so nested units hold
# their ancestors' too (the root unit plus one unit at a time for a root/blocks policy).
# A save or load that raised midway leaves its units open; the next save, load or forward closes them
# without writing anything back (`close_stale_units`).
@dataclass
class _OpenUnit:
    kind: StateDictType
    full: Optional[torch.Tensor] = None  # FULL: the flat tensor the parameters view
    # SHARDED: (module, attribute, original parameter, the DTensor parameter registered instead)
    swaps: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = field(default_factory=list)
    dparams: list[nn.Parameter] = field(default_factory=list)  # SHARDED: one per ParamInfo
    prefix: str = ""
    error_msgs: Optional[list[str]] = None


def close_stale_units(state: _FSDPState) -> None:
    """Close units that a failed save or load left open (nothing is written back)."""
    for handle in list(state.open_units):  # usually none: checked at every forward
        _close_stale(state, handle)


def _unit_name(handle: FlatParamHandle) -> str:
    return f"unit '{handle.unit_fqn or '<root>'}'"


def _check_registered(handle: FlatParamHandle) -> None:
    """Every holder still registers its original parameter (else we would save or overwrite another)."""
    for param, info in zip(handle.registered, handle.layout.infos):
        for module, attr, fqn in info.holders:
            if module._parameters.get(attr) is not param:
                raise RuntimeError(
                    f"parameter '{_join(handle.unit_fqn, fqn)}' was replaced after fully_shard (its module registers "
                    "another tensor under that name), so fully_shard cannot save or load it. Assign new values in "
                    "place (param.copy_(t) inside unshard_params(model, writeback=True)) or load them with "
                    "load_state_dict; to change the model's structure, do it before fully_shard"
                )


def _close(handle: FlatParamHandle, opened: _OpenUnit) -> None:
    """Put the original parameters back, viewing the shard (or the unsharded buffer, if it is unsharded)."""
    for module, attr, param, _ in opened.swaps:
        module._parameters[attr] = param
    if opened.full is not None:
        handle.use_unsharded_views() if handle.is_unsharded else handle.use_sharded_views()


def _close_stale(state: _FSDPState, handle: FlatParamHandle) -> None:
    stale = state.open_units.pop(handle, None)
    if stale is not None:
        _close(handle, stale)


def _open(state: _FSDPState, handle: FlatParamHandle, opened: _OpenUnit) -> None:
    """Record ``opened`` on its state (the owner of open units) until `_take_open` or a stale close."""
    _close_stale(state, handle)
    state.open_units[handle] = opened


def _take_open(state: _FSDPState, handle: FlatParamHandle) -> Optional[_OpenUnit]:
    return state.open_units.pop(handle, None)  # type: ignore[no-any-return]


def _open_unit(state: _FSDPState, handle: FlatParamHandle) -> Optional[_OpenUnit]:
    return state.open_units.get(handle)  # type: ignore[no-any-return]
