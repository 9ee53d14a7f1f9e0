"""fsdp_composable: shard an unmodified PyTorch model for data-parallel training with one call."""

from fsdp_composable._grad_utils import clip_grad_norm_, no_sync
from fsdp_composable._optim_utils import init_optim_state, optim_state_dict, optim_state_dict_to_load
from fsdp_composable._runtime_utils import register_fsdp_forward_method
from fsdp_composable._state_dict_utils import state_dict_type
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
from fsdp_composable.checkpoint import CheckpointWrapper, apply_activation_checkpointing, checkpoint, checkpoint_wrapper
from fsdp_composable.fully_shard import fully_shard
from fsdp_composable.inspect import MemoryEstimate, ShardingPlan, UnitPlan, describe, estimate_memory
from fsdp_composable.wrapper import FullyShardedDataParallel

__version__ = "0.1.0"

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "CheckpointWrapper",
    "CustomPolicy",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalStateDictConfig",
    "MemoryEstimate",
    "MixedPrecision",
    "ModuleWrapPolicy",
    "Policy",
    "SizeBasedPolicy",
    "ShardedStateDictConfig",
    "ShardingPlan",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictType",
    "UnitPlan",
    "apply_activation_checkpointing",
    "checkpoint",
    "checkpoint_wrapper",
    "describe",
    "estimate_memory",
    "clip_grad_norm_",
    "fully_shard",
    "init_optim_state",
    "no_sync",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "register_fsdp_forward_method",
    "state_dict_type",
    "summon_full_params",
    "unshard_params",
]
