"""The state-dict setting in effect (`state_dict_type`'s type and config) and what it means: where
values go (``offload_to_cpu``) and which ranks keep them (``rank0_only``): the one place each is read.

[Note: the state-dict setting is root-wide]
``state_dict_type`` is a switch of the whole root, like ``sync_gradients``: one save or load runs the
hooks of every unit under the root, and they must all follow one setting. Once the root's lazy init
ran, the setting is held once, by the `RootContext` every state under the root shares. Before that no
root is decided yet (the first forward decides it), so each state holds its own copy and
`state_dict_type(module, ...)` writes the copy of every state under ``module``; the `RootContext`
takes over the root state's copy when it is built. `_owners` gives the holders a write must reach
(a context once, or each uninitialised state), `_holder` the one a read (`_kind`, `_config`) sees.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from fsdp_composable._common_utils import _FSDPState
from fsdp_composable.api import (
    FullStateDictConfig,
    LocalStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictType,
)

if TYPE_CHECKING:
    from fsdp_composable._runtime._root_context import RootContext

__all__: list[str] = []


_CONFIG_TYPES: dict[StateDictType, type[StateDictConfig]] = {
    StateDictType.FULL_STATE_DICT: FullStateDictConfig,
    StateDictType.SHARDED_STATE_DICT: ShardedStateDictConfig,
    StateDictType.LOCAL_STATE_DICT: LocalStateDictConfig,
}


Holder = Union["RootContext", _FSDPState]
# (type, the model's config, the optimizer's config: None follows the model's)
Setting = tuple[StateDictType, Optional[StateDictConfig], Optional[StateDictConfig]]


def _holder(state: _FSDPState) -> Holder:
    return state.ctx if state.ctx is not None else state


def _owners(states: list[_FSDPState]) -> list[Holder]:
    """The distinct holders of the setting of ``states``, in order."""
    return list(dict.fromkeys(_holder(s) for s in states))


def _set_setting(
    states: list[_FSDPState],
    kind: StateDictType,
    config: Optional[StateDictConfig],
    optim_config: Optional[StateDictConfig] = None,
) -> list[Setting]:
    """Set the setting of ``states`` (see the Note); returns the previous ones for `_restore_setting`."""
    owners = _owners(states)
    previous = [(o.state_dict_type, o.state_dict_config, o.optim_state_dict_config) for o in owners]
    for owner in owners:
        owner.state_dict_type, owner.state_dict_config, owner.optim_state_dict_config = kind, config, optim_config
    return previous


def _restore_setting(states: list[_FSDPState], previous: list[Setting]) -> None:
    for owner, (kind, config, optim_config) in zip(_owners(states), previous):
        owner.state_dict_type, owner.state_dict_config, owner.optim_state_dict_config = kind, config, optim_config


def _kind(state: _FSDPState) -> StateDictType:
    return _holder(state).state_dict_type


def _config(state: _FSDPState) -> StateDictConfig:
    holder = _holder(state)
    return holder.state_dict_config or _CONFIG_TYPES[holder.state_dict_type]()


def _optim_config(state: _FSDPState) -> StateDictConfig:
    """What optimizer state dicts follow: FSDP1's ``optim_state_dict_config`` where one was set (its
    ``offload_to_cpu`` and ``rank0_only``; FSDP1's defaults offload the optimizer state, not the model's),
    else the model's config."""
    return _holder(state).optim_state_dict_config or _config(state)


def _rank0_only(config: StateDictConfig) -> bool:
    """FULL with ``rank0_only``: one process keeps the whole values (see `_drops_values` for which)."""
    return isinstance(config, FullStateDictConfig) and config.rank0_only


def _drops_values(state: _FSDPState, config: Optional[StateDictConfig] = None) -> bool:
    """FULL with ``rank0_only`` (of ``config``, default the model's): this rank takes part in the
    collectives but returns nothing."""
    config = config if config is not None else _config(state)
    return (
        _kind(state) is StateDictType.FULL_STATE_DICT
        and _rank0_only(config)
        and (state.rank != 0 or not _first_tensor_parallel_rank(state))
    )


def _first_tensor_parallel_rank(state: _FSDPState) -> bool:
    """With tensor parallelism, "rank 0" is rank 0 of both the data-parallel and the tensor-parallel
    group (its tensor-parallel peers are data-parallel rank 0 too, and would keep a copy)."""
    return all(
        info.tp.mesh.get_local_rank() == 0
        for s in state.all_states or [state]
        for handle in s.handles
        for info in handle.layout.infos
        if info.tp is not None
    )


def _copy(value: Any, config: StateDictConfig) -> Any:
    """A copy of ``value`` that owns its memory (on the CPU if ``offload_to_cpu``), so its source can be
    freed; anything but a tensor as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().cpu() if config.offload_to_cpu and value.device.type != "cpu" else value.detach().clone()


def _to_output(state: _FSDPState, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or on the CPU if ``offload_to_cpu``."""
    return tensor.cpu() if _config(state).offload_to_cpu else tensor


def _check_not_rank0_only_load(state: _FSDPState) -> None:
    if _rank0_only(_config(state)):
        raise ValueError(
            "load_state_dict under FULL_STATE_DICT with FullStateDictConfig(rank0_only=True) is not supported: "
            "rank0_only only applies to saving (other ranks would have nothing to load). Load with "
            "rank0_only=False and the full state dict on every rank (e.g. torch.load it on every rank, or send "
            "it with torch.distributed.broadcast_object_list), or load it into the unsharded model on rank 0 "
            "before fully_shard(..., sync_module_states=True)"
        )
