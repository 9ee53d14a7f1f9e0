"""fsdp_composable: shard an unmodified PyTorch model for data-parallel training with one call."""

import sys as _sys

# [Note: python -m fsdp_composable starts fast]
# ``python -m fsdp_composable`` imports this package before its ``__main__``. Importing torch takes
# seconds, so in that one case the public names below are not imported here: ``__main__`` parses and
# checks its arguments and prints its first line first, and the demo imports the submodules it
# needs itself. Every other import of the package (``import fsdp_composable``, spawned ranks,
# torchrun's workers of a script) binds every public name as usual.


def _run_as_main(argv: "list[str]") -> bool:
    """Whether the interpreter's own options (before a script, ``-c`` or ``-m``) say ``-m fsdp_composable``."""
    i = 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-c":
        if argv[i] == "-m":
            return argv[i + 1 : i + 2] == ["fsdp_composable"]
        i += 2 if argv[i] in ("-W", "-X") else 1
    return False


_RUN_AS_MAIN = _run_as_main(getattr(_sys, "orig_argv", []))

if not _RUN_AS_MAIN:
    from fsdp_composable._compat.fsdp1._register_comm_hook import register_comm_hook
    from fsdp_composable._compat.fsdp2._custom_comm_controls import set_custom_all_gather, set_custom_reduce_scatter
    from fsdp_composable._compat.fsdp2._module_switches import (
        set_is_last_backward,
        set_modules_to_backward_prefetch,
        set_modules_to_forward_prefetch,
        set_requires_all_reduce,
        set_requires_gradient_sync,
        set_reshard_after_backward,
        set_reshard_after_forward,
        set_unshard_in_backward,
    )
    from fsdp_composable._compat.fsdp2._reduce_controls import (
        set_all_reduce_hook,
        set_force_sum_reduction_for_comms,
        set_gradient_divide_factor,
        set_post_optim_event,
        set_reduce_scatter_divide_factor,
    )
    from fsdp_composable._grads._grad_scaler import ShardedGradScaler
    from fsdp_composable._init._wrap_utils import CustomPolicy, ModuleWrapPolicy, Policy, SizeBasedPolicy
    from fsdp_composable._runtime._forward_methods import register_fsdp_forward_method
    from fsdp_composable._runtime._grad_utils import clip_grad_norm_, no_sync
    from fsdp_composable._runtime._module_controls import UnshardHandle, is_sharded, reshard, sharded_modules, unshard
    from fsdp_composable._runtime._unshard_param_utils import summon_full_params, unshard_params
    from fsdp_composable._state._optim_utils import init_optim_state, optim_state_dict, optim_state_dict_to_load
    from fsdp_composable._state._state_dict_utils import state_dict_type
    from fsdp_composable.api import (
        BackwardPrefetch,
        CollectiveError,
        CPUOffload,
        ExecutionOrderError,
        FSDPError,
        FullStateDictConfig,
        LocalStateDictConfig,
        MixedPrecision,
        ModelEditedAfterShardingError,
        RankMismatchError,
        ShardedModelWrappedError,
        ShardedStateDictConfig,
        ShardingStrategy,
        StateDictConfig,
        StateDictType,
        StateTransitionError,
    )
    from fsdp_composable.checkpoint import (
        CheckpointImpl,
        CheckpointWrapper,
        apply_activation_checkpointing,
        checkpoint,
        checkpoint_wrapper,
    )
    from fsdp_composable.fully_shard import fully_shard
    from fsdp_composable.inspect import MemoryEstimate, ShardingPlan, UnitPlan, describe, estimate_memory
    from fsdp_composable.wrapper import FullyShardedDataParallel, OptimStateKeyType, StateDictSettings

__version__ = "0.1.0"

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "CheckpointImpl",
    "CheckpointWrapper",
    "CollectiveError",
    "CustomPolicy",
    "ExecutionOrderError",
    "FSDPError",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalStateDictConfig",
    "MemoryEstimate",
    "MixedPrecision",
    "ModelEditedAfterShardingError",
    "ModuleWrapPolicy",
    "OptimStateKeyType",
    "Policy",
    "RankMismatchError",
    "SizeBasedPolicy",
    "ShardedGradScaler",
    "ShardedStateDictConfig",
    "ShardingPlan",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "ShardedModelWrappedError",
    "StateTransitionError",
    "UnitPlan",
    "UnshardHandle",
    "apply_activation_checkpointing",
    "checkpoint",
    "checkpoint_wrapper",
    "describe",
    "estimate_memory",
    "clip_grad_norm_",
    "fully_shard",
    "init_optim_state",
    "is_sharded",
    "no_sync",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "register_comm_hook",
    "register_fsdp_forward_method",
    "reshard",
    "set_all_reduce_hook",
    "set_custom_all_gather",
    "set_custom_reduce_scatter",
    "set_force_sum_reduction_for_comms",
    "set_gradient_divide_factor",
    "set_is_last_backward",
    "set_modules_to_backward_prefetch",
    "set_modules_to_forward_prefetch",
    "set_post_optim_event",
    "set_reduce_scatter_divide_factor",
    "set_requires_all_reduce",
    "set_requires_gradient_sync",
    "set_reshard_after_backward",
    "set_reshard_after_forward",
    "set_unshard_in_backward",
    "sharded_modules",
    "state_dict_type",
    "summon_full_params",
    "unshard",
    "unshard_params",
]
