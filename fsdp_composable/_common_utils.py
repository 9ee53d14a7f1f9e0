"""The per-call state `_FSDPState`, its `TrainingState` machine, and traversal helpers."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_composable._composable_state import _get_module_state
from fsdp_composable.api import BackwardPrefetch, MixedPrecision, ShardingStrategy, StateDictConfig, StateDictType

if TYPE_CHECKING:
    from fsdp_composable._exec_order_utils import _ExecOrderData
    from fsdp_composable._flat_param import FlatParamHandle
    from fsdp_composable._limiter_utils import _AllGatherLimiter

__all__ = ["FSDP_FLATTENED", "TrainingState", "_FSDPState"]

# Attribute set on every original parameter that a unit manages, so that a later call (manual
# nesting) or another composable API never flattens it twice.
FSDP_FLATTENED = "_fsdp_flattened"

API_NAME = "fully_shard"

# Set on original parameters while a wrapper exposes flat parameters instead (use_orig_params=False).
FLAT_MODE = "_fsdp_flat_mode"


class StateTransitionError(RuntimeError):
    """An illegal transition of a `TrainingState` or `HandleTrainingState`."""


def _check_transition(
    kind: str, where: str, current: enum.Enum, new: enum.Enum, allowed: dict[Any, frozenset[Any]]
) -> None:
    if new not in allowed[current]:
        raise StateTransitionError(
            f"{kind} of {where} cannot go from {current.name} to {new.name} "
            f"(allowed from {current.name}: {sorted(s.name for s in allowed[current]) or 'none'}). "
            "This usually means a previous forward/backward raised midway or modules ran in an order "
            "fully_shard does not support; see docs/errors.md"
        )


class TrainingState(enum.Enum):
    """What a `fully_shard` call's modules are doing: idle, in a step, or inside `unshard_params`."""

    IDLE = enum.auto()
    FORWARD_BACKWARD = enum.auto()
    SUMMON_FULL_PARAMS = enum.auto()


_TRAINING_TRANSITIONS: dict[Any, frozenset[Any]] = {
    TrainingState.IDLE: frozenset({TrainingState.FORWARD_BACKWARD, TrainingState.SUMMON_FULL_PARAMS}),
    TrainingState.FORWARD_BACKWARD: frozenset({TrainingState.IDLE, TrainingState.FORWARD_BACKWARD}),
    TrainingState.SUMMON_FULL_PARAMS: frozenset({TrainingState.IDLE}),
}


@dataclass(frozen=True)
class UnitConfig:
    """Per-unit settings: the call's arguments, possibly overridden per unit by `CustomPolicy`."""

    strategy: ShardingStrategy
    mixed_precision: Optional[MixedPrecision]
    offload_params: bool


@dataclass
class _FSDPState:
    """Everything one `fully_shard` call (or one wrapper instance) attached to its module."""

    module: nn.Module
    process_group: dist.ProcessGroup
    rank: int
    world_size: int
    device: torch.device
    config: UnitConfig
    backward_prefetch: Optional[BackwardPrefetch]
    forward_prefetch: bool
    limit_all_gathers: bool
    use_orig_params: bool = True
    # HYBRID_SHARD: gradients are all-reduced across this group after the shard group's reduce-scatter
    replicate_group: Optional[dist.ProcessGroup] = None
    # every handle, root unit first then pre-order; a unit with parameters of several dtypes, or
    # frozen and trainable ones, has one handle per group (`handle.module` is the unit module)
    handles: list["FlatParamHandle"] = field(default_factory=list)
    ignored_params: set[nn.Parameter] = field(default_factory=set)
    ignored_modules: set[nn.Module] = field(default_factory=set)
    # buffer FQN (relative to `module`) -> dtype at construction, for checkpointing under mixed precision
    buffer_name_to_orig_dtype: dict[str, torch.dtype] = field(default_factory=dict)
    training_state: TrainingState = TrainingState.IDLE
    # Set by the root's lazy init; shared by every state under the root.
    is_root: Optional[bool] = None
    root_state: Optional["_FSDPState"] = None
    all_states: list["_FSDPState"] = field(default_factory=list)
    exec_order_data: Optional["_ExecOrderData"] = None
    limiter: Optional["_AllGatherLimiter"] = None
    non_root_handles: list["FlatParamHandle"] = field(default_factory=list)
    # Root only: per-backward bookkeeping.
    final_callback_queued: bool = False
    pending_reductions: list[Any] = field(default_factory=list)
    state_dict_type: StateDictType = StateDictType.FULL_STATE_DICT
    state_dict_config: Optional[StateDictConfig] = None
    hook_handles: list[Any] = field(default_factory=list)
    # Inside `no_sync`: keep unsharded gradients locally instead of reducing them.
    sync_gradients: bool = True

    def __repr__(self) -> str:  # the dataclass repr would print whole modules
        return (
            f"_FSDPState(module={type(self.module).__name__}, units={len(self.handles)}, "
            f"rank={self.rank}/{self.world_size}, training_state={self.training_state.name})"
        )

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


def _set_training_state(state: _FSDPState, new: TrainingState) -> None:
    _check_transition(
        "TrainingState",
        f"fully_shard({type(state.module).__name__})",
        state.training_state,
        new,
        _TRAINING_TRANSITIONS,
    )
    state.training_state = new


def _get_fsdp_state(module: nn.Module) -> Optional[_FSDPState]:
    return _get_module_state(module, API_NAME)  # type: ignore[no-any-return]


def _get_fsdp_states(module: nn.Module) -> list[_FSDPState]:
    """Every distinct state in ``module``'s subtree, outermost first."""
    seen: dict[int, _FSDPState] = {}
    for submodule in module.modules():
        state = _get_fsdp_state(submodule)
        if state is not None and id(state) not in seen:
            seen[id(state)] = state
    return list(seen.values())


def _is_inside_unit(module: nn.Module) -> bool:
    """``module`` has no state of its own but its parameters are managed by an enclosing unit."""
    return any(getattr(p, FSDP_FLATTENED, False) for p in module.parameters())


def _iter_handles(state: _FSDPState) -> Iterator["FlatParamHandle"]:
    """Handles of every state under the root ``state`` (or just ``state``'s if not yet initialised)."""
    for s in state.all_states or [state]:
        yield from s.handles
