"""A unit opened for one FULL save: its parameters given their full form, and closed again afterwards
(see [Note: a unit is unsharded around its subtree's save and load])."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from fsdp_composable._common_utils import _FSDPState
from fsdp_composable._flat_param import FlatParamHandle
from fsdp_composable._runtime._state_dict_keys import _join

__all__: list[str] = []


# ---------------------------------------------------------------------------- a unit unsharded for one save/load
# [Note: a unit is unsharded around its subtree's save and load]
# A FULL save never looks keys up by name. A state-dict *pre*-hook on the unit module registers the
# original parameters again, pointed at views of the unit's all-gathered flat tensor, before
# ``nn.Module`` visits the unit's subtree, so every module below sees what it would see without
# sharding: its own state-dict hooks (a fused QKV weight split into three, torchtitan-style), a module
# registered under two FQNs, a `CheckpointWrapper` renaming keys. The post-hook takes over whatever
# tensors ended up viewing the gathered flat tensor (cloning them, so it can be freed) and registers
# the faces again. Cost: a unit's full flat tensor lives while its subtree is saved, so nested units
# hold their ancestors' too (the root unit plus one unit at a time for a root/blocks policy).
# SHARDED saves and every load need no opening: the faces are the values and take the loaded ones
# ([Note: sharded state dicts are the faces], [Note: loading into the faces]; a tensor-parallel
# parameter's face is 2-D: [Note: 2-D faces]). A save that raised midway leaves its units open; the
# next save, load or forward closes them (`close_stale_units`).
@dataclass(frozen=True)
class _OpenUnit:
    full: torch.Tensor  # the all-gathered flat tensor the parameters view


def close_stale_units(state: _FSDPState) -> None:
    """Close units that a failed save or load left open (nothing is written back)."""
    for handle in list(state.open_units):  # usually none: checked at every forward
        _close_stale(state, handle)


def _check_registered(handle: FlatParamHandle) -> None:
    """Every holder still registers what the unit registered (its faces between steps), else we would
    save or overwrite another tensor."""
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
    """Register what was registered before: the faces (or the unsharded parameters, if it is unsharded)."""
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
