"""Validated configuration, built once: one call's arguments (`ShardConfig`) and one unit's
settings (`UnitConfig`). Frozen: nothing changes them after construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from fsdp_composable.api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy

__all__ = ["ShardConfig", "UnitConfig"]


@dataclass(frozen=True)
class UnitConfig:
    """Per-unit settings: the call's arguments, possibly overridden per unit by `CustomPolicy`."""

    strategy: ShardingStrategy
    mixed_precision: Optional[MixedPrecision]
    offload_params: bool


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
    device_id: Union[int, torch.device, None] = None
    param_init_fn: Optional[Callable[[nn.Module], None]] = None
    sync_module_states: bool = False
    forward_prefetch: bool = False
    backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE
    limit_all_gathers: bool = True
    use_orig_params: bool = True
    api: str = "fully_shard"
