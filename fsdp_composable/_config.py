"""Validated configuration, built once: one call's arguments (`ShardConfig`) and one unit's
settings (`UnitConfig`). Frozen: nothing changes them after construction.

[Note: one place for each rule]
What a unit's settings imply (its compute, reduce and gradient dtypes, whether it is resharded after
forward, whether it needs an unsharded buffer, where its shard lives, what its inputs are cast to),
that world size 1 means NO_SHARD, and how many units may be unsharded at once are decided here, by
the methods below. The runtime (handles, hooks, the all-gather limiter) and the memory estimator in
`inspect` both call them, so the estimate cannot drift from what the runtime does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from fsdp_composable.api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy

__all__ = ["MAX_UNSHARDED_UNITS", "ShardConfig", "UnitConfig"]

# The all-gather limiter's bound: non-root units unsharded (or being gathered) at once. Two lets the
# next unit's all-gather overlap the current unit's compute; more only costs memory.
MAX_UNSHARDED_UNITS = 2

# Freed after forward and gathered again in backward; SHARD_GRAD_OP and NO_SHARD keep them to backward.
_RESHARD_AFTER_FORWARD = frozenset({ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD})


@dataclass(frozen=True)
class UnitConfig:
    """Per-unit settings: the call's arguments, possibly overridden per unit by `CustomPolicy`."""

    strategy: ShardingStrategy
    mixed_precision: Optional[MixedPrecision]
    offload_params: bool

    def with_overrides(self, overrides: dict[str, Any]) -> UnitConfig:
        """A unit's settings: ``overrides`` (from `CustomPolicy`) over the call's. A NO_SHARD call (world
        size 1 forces it) stays NO_SHARD in every unit."""
        strategy = overrides.get("strategy", self.strategy)
        if self.strategy is ShardingStrategy.NO_SHARD:  # world size 1 forces NO_SHARD everywhere
            strategy = ShardingStrategy.NO_SHARD
        return UnitConfig(strategy, overrides.get("mixed_precision", self.mixed_precision), self.offload_params)

    @property
    def sharded(self) -> bool:
        """Whether the flat parameter is split across the shard group (every strategy but NO_SHARD)."""
        return self.strategy is not ShardingStrategy.NO_SHARD

    @property
    def reshard_after_forward(self) -> bool:
        """Whether a non-root unit frees its unsharded parameters after forward. The root unit never
        does: backward needs it first."""
        return self.strategy in _RESHARD_AFTER_FORWARD

    @property
    def reshards_to_post_forward_group(self) -> bool:
        """Whether ``reshard_after_forward=<int>`` applies to the unit: FULL_SHARD units only (a unit a
        `CustomPolicy` made SHARD_GRAD_OP or NO_SHARD keeps its own rule); see [Note: resharding to a
        smaller group] in `_post_forward_group`."""
        return self.strategy is ShardingStrategy.FULL_SHARD

    @property
    def low_precision_compute(self) -> bool:
        """Whether parameters are cast for compute; then each BatchNorm becomes a full-precision unit."""
        return self.mixed_precision is not None and self.mixed_precision.param_dtype is not None

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the unsharded parameters (all-gather and compute) for parameters of ``dtype``."""
        mp = self.mixed_precision
        return (mp.param_dtype if mp and mp.param_dtype else None) or dtype

    def reduce_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype gradients are reduced in: ``reduce_dtype``, else the compute dtype."""
        mp = self.mixed_precision
        return (mp.reduce_dtype if mp and mp.reduce_dtype else None) or self.compute_dtype(dtype)

    def grad_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the sharded gradient kept between steps: the parameter's, or the reduce dtype
        with ``keep_low_precision_grads``."""
        mp = self.mixed_precision
        return self.reduce_dtype(dtype) if mp is not None and mp.keep_low_precision_grads else dtype

    def shard_device(self, device: torch.device) -> torch.device:
        """Where the shard, its gradient and the optimizer state live: the CPU under `CPUOffload`."""
        return torch.device("cpu") if self.offload_params else device

    def needs_unsharded_buffer(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the handle allocates a padded unsharded buffer (the all-gather's output, viewed by the
        original parameters): always, unless there is nothing to gather, cast or copy (NO_SHARD in
        full precision with the shard on ``device``); then the shard is the whole."""
        return self.sharded or self.compute_dtype(dtype) != dtype or self.shard_device(device) != device

    @property
    def output_dtype(self) -> Optional[torch.dtype]:
        """What the outputs of the module a `fully_shard` call was applied to are cast to (``None``:
        left as computed); read from the call's settings, not a policy unit's."""
        mp = self.mixed_precision
        return mp.output_dtype if mp is not None else None

    def input_dtype(self, is_root: bool) -> Optional[torch.dtype]:
        """What the unit's module casts floating-point forward inputs to (``None``: left as they are)."""
        mp = self.mixed_precision
        if mp is None or mp.param_dtype is None:
            return None
        return mp.param_dtype if (mp.cast_root_forward_inputs if is_root else mp.cast_forward_inputs) else None


@dataclass(frozen=True)
class ShardConfig:
    """The arguments of one `fully_shard` call or one wrapper construction, as given.

    ``api`` names the caller in error messages (see [Note: API names in messages] in `_init_utils`);
    ``use_orig_params`` is False only for a wrapper exposing flat parameters."""

    policy: Any = None
    process_group: Any = None
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    mixed_precision: Optional[MixedPrecision] = None
    cpu_offload: Optional[CPUOffload] = None
    ignored_modules: Optional[Any] = None
    ignored_params: tuple[nn.Parameter, ...] = ()  # ignored one by one; their modules' others are sharded
    device_id: Union[int, torch.device, None] = None
    param_init_fn: Optional[Callable[[nn.Module], None]] = None
    sync_module_states: bool = False
    forward_prefetch: Optional[bool] = None  # None: see [Note: forward prefetch by default]
    backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE
    limit_all_gathers: bool = True
    use_orig_params: bool = True
    api: str = "fully_shard"
    # FSDP2's reshard_after_forward=<int>: the ranks a FULL_SHARD unit stays sharded over after forward
    # (see [Note: resharding to a smaller group] in `_post_forward_group`)
    reshard_after_forward_ranks: Optional[int] = None

    def unit_config(self, world_size: int) -> UnitConfig:
        """The call's settings for its units, before per-unit overrides. World size 1 is NO_SHARD:
        there is nothing to shard, so the collectives are skipped entirely."""
        strategy = ShardingStrategy.NO_SHARD if world_size == 1 else self.strategy
        offload = bool(self.cpu_offload and self.cpu_offload.offload_params)
        return UnitConfig(strategy, self.mixed_precision, offload)

    @property
    def units_in_flight(self) -> int:
        """How many non-root FULL_SHARD/HYBRID_SHARD units are unsharded at once at the peak: with
        BACKWARD_PRE or forward prefetch (None counts as on: the CPU prefetches, and on CUDA the unshard
        stream gathers the next unit while the current one computes), the current one and the prefetched
        one (the limiter allows `MAX_UNSHARDED_UNITS`); otherwise one."""
        prefetch = self.backward_prefetch is BackwardPrefetch.BACKWARD_PRE or self.forward_prefetch is not False
        return MAX_UNSHARDED_UNITS if prefetch else 1
