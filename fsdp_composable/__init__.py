"""fsdp_composable: shard an unmodified PyTorch model for data-parallel training with one call."""

from fsdp_composable._unshard_param_utils import summon_full_params, unshard_params
from fsdp_composable._wrap_utils import CustomPolicy, ModuleWrapPolicy, Policy, SizeBasedPolicy
from fsdp_composable.api import (
    BackwardPrefetch,
    CPUOffload,
    FullStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictType,
)
from fsdp_composable.fully_shard import fully_shard
from fsdp_composable.wrapper import FullyShardedDataParallel

__version__ = "0.1.0"

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "CustomPolicy",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalStateDictConfig",
    "MixedPrecision",
    "ModuleWrapPolicy",
    "Policy",
    "SizeBasedPolicy",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictType",
    "fully_shard",
    "summon_full_params",
    "unshard_params",
]
