"""The state-dict setting in effect (`state_dict_type`'s type and config) and what it means: where
values go (``offload_to_cpu``) and which ranks keep them (``rank0_only``)."""

from __future__ import annotations

import torch
import torch.nn.utils

from fsdp_composable._common_utils import _FSDPState
from fsdp_composable.api import (
    FullStateDictConfig,
    LocalStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictType,
)

__all__: list[str] = []


_CONFIG_TYPES: dict[StateDictType, type[StateDictConfig]] = {
    StateDictType.FULL_STATE_DICT: FullStateDictConfig,
    StateDictType.SHARDED_STATE_DICT: ShardedStateDictConfig,
    StateDictType.LOCAL_STATE_DICT: LocalStateDictConfig,
}


def _config(state: _FSDPState) -> StateDictConfig:
    return state.state_dict_config or _CONFIG_TYPES[state.state_dict_type]()


def _drops_values(state: _FSDPState) -> bool:
    """FULL with ``rank0_only``: this rank takes part in the collectives but returns nothing."""
    config = _config(state)
    return (
        state.state_dict_type is StateDictType.FULL_STATE_DICT
        and isinstance(config, FullStateDictConfig)
        and config.rank0_only
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


def _to_output(state: _FSDPState, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.cpu() if _config(state).offload_to_cpu else tensor


def _check_not_rank0_only_load(state: _FSDPState) -> None:
    config = _config(state)
    if isinstance(config, FullStateDictConfig) and config.rank0_only:
        raise ValueError(
            "load_state_dict under FULL_STATE_DICT with FullStateDictConfig(rank0_only=True) is not supported: "
            "rank0_only only applies to saving (other ranks would have nothing to load). Load with "
            "rank0_only=False and the full state dict on every rank (e.g. torch.load it on every rank, or send "
            "it with torch.distributed.broadcast_object_list), or load it into the unsharded model on rank 0 "
            "before fully_shard(..., sync_module_states=True)"
        )
