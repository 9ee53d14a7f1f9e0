"""Public enums, frozen configuration dataclasses and the public errors. No logic lives here beyond
validation."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "CollectiveError",
    "ExecutionOrderError",
    "FSDPError",
    "FullStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "ModelEditedAfterShardingError",
    "RankMismatchError",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictType",
    "ShardedModelWrappedError",
    "StateTransitionError",
]


class ShardingStrategy(enum.Enum):
    """How a unit's parameters, gradients and optimizer state are split across ranks.

    - ``FULL_SHARD``: parameters are sharded between steps and resharded after forward; gradients
      are reduce-scattered. Least memory, one extra all-gather in backward.
    - ``SHARD_GRAD_OP``: parameters stay unsharded from forward to the end of backward; gradients and
      optimizer state are sharded. No all-gather in backward.
    - ``NO_SHARD``: every rank holds everything; gradients are all-reduced (DDP semantics).
    - ``HYBRID_SHARD``: ``FULL_SHARD`` inside a shard group, replicated across groups.
    - ``_HYBRID_SHARD_ZERO2``: ``SHARD_GRAD_OP`` inside a shard group, replicated across groups
      (FSDP1's name: HYBRID_SHARD without resharding after forward).
    """

    FULL_SHARD = enum.auto()
    SHARD_GRAD_OP = enum.auto()
    NO_SHARD = enum.auto()
    HYBRID_SHARD = enum.auto()
    _HYBRID_SHARD_ZERO2 = enum.auto()


class BackwardPrefetch(enum.Enum):
    """When backward issues the next unit's all-gather.

    - ``BACKWARD_PRE``: before the current unit computes its gradients (most overlap, one more unit
      unsharded at once).
    - ``BACKWARD_POST``: after the current unit's gradients are computed (less memory).
    """

    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()


class StateDictType(enum.Enum):
    """What ``module.state_dict()`` returns inside :func:`state_dict_type`."""

    FULL_STATE_DICT = enum.auto()
    SHARDED_STATE_DICT = enum.auto()
    LOCAL_STATE_DICT = enum.auto()


def _check_bool(where: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{where} must be True or False, got {type(value).__name__}: {value!r}")


def _check_float_dtype(field: str, dtype: Optional[torch.dtype]) -> None:
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"MixedPrecision.{field} must be a floating-point torch.dtype or None, got {dtype!r}; "
            "use e.g. torch.bfloat16 or torch.float16"
        )


@dataclass(frozen=True)
class MixedPrecision:
    """Low-precision compute and communication with full-precision sharded parameters.

    ``param_dtype``: dtype of unsharded parameters (all-gather and compute). ``reduce_dtype``: dtype
    of gradient reduction (defaults to ``param_dtype``). ``buffer_dtype``: dtype of every floating
    buffer during compute (``None`` keeps buffers as they are). ``output_dtype``: dtype the
    floating-point outputs of the module `fully_shard` was applied to are cast to (FSDP2's
    ``MixedPrecisionPolicy.output_dtype``; ``None`` leaves them as computed).
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    output_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype", "output_dtype"):
            _check_float_dtype(field, getattr(self, field))
        for field in ("keep_low_precision_grads", "cast_forward_inputs", "cast_root_forward_inputs"):
            _check_bool(f"MixedPrecision.{field}", getattr(self, field))


@dataclass(frozen=True)
class CPUOffload:
    """Keep sharded parameters and gradients in CPU memory; the optimizer steps there.

    On a machine without an accelerator parameters already live on the CPU, so this changes nothing.
    """

    offload_params: bool = False

    def __post_init__(self) -> None:
        _check_bool("CPUOffload.offload_params", self.offload_params)


@dataclass(frozen=True)
class StateDictConfig:
    """Base of the per-type state-dict configs. ``offload_to_cpu`` moves returned tensors to CPU."""

    offload_to_cpu: bool = False


@dataclass(frozen=True)
class FullStateDictConfig(StateDictConfig):
    """``rank0_only``: only rank 0 materialises the full state dict; other ranks get ``{}``."""

    rank0_only: bool = False


@dataclass(frozen=True)
class ShardedStateDictConfig(StateDictConfig):
    """Sharded state dict of ``DTensor`` values (for ``torch.distributed.checkpoint``)."""


@dataclass(frozen=True)
class LocalStateDictConfig(StateDictConfig):
    """Local state dict: this rank's flat shards."""


# ---------------------------------------------------------------------------- errors
# [Note: public errors]
# Bad arguments raise Python's own TypeError / ValueError. What goes wrong later, when ranks disagree,
# a peer dies, the model was edited behind our back or hooks ran out of order, raises one of the
# classes below. Each derives from `FSDPError` (catch every one of them) and from RuntimeError, which
# they have always been (existing ``except RuntimeError`` clauses keep working). The modules that raise
# them import them from here.


class FSDPError(Exception):
    """Base class of every error fsdp_composable defines."""


class CollectiveError(FSDPError, RuntimeError):
    """A collective of a named unit failed: a rank died, timed out, or ran something else."""


class RankMismatchError(FSDPError, RuntimeError):
    """Ranks reached different collectives (or one left the step): raised on every rank, before any
    data moved."""


class ExecutionOrderError(FSDPError, RuntimeError):
    """Ranks ran different units (or a different number of them) in the first iteration."""


class ModelEditedAfterShardingError(FSDPError, RuntimeError):
    """The model was changed after `fully_shard` in a way the sharded units cannot follow."""


class StateTransitionError(FSDPError, RuntimeError):
    """An illegal transition of a `TrainingState`, `HandleTrainingState` or `GradState`."""


class ShardedModelWrappedError(FSDPError, RuntimeError):
    """DistributedDataParallel (also through accelerate's ``prepare``) was asked to wrap a model that
    fully_shard already shards."""
