"""The per-call state `_FSDPState`, its `TrainingState` machine, and traversal helpers.

Imports flow one way: this module uses `_flat_param`, `_config` and `_state_machine`, none of which
imports it back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, NoReturn, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_composable._composable_state import _get_module_state
from fsdp_composable._config import UnitConfig
from fsdp_composable._copy_guard import refusal
from fsdp_composable._flat_param import FSDP_FLATTENED, FlatParamHandle
from fsdp_composable._state_machine import StateTransitionError, Transitions, check_transition
from fsdp_composable.api import BackwardPrefetch, StateDictConfig, StateDictType

if TYPE_CHECKING:
    from fsdp_composable._exec_order_utils import _ExecOrderData
    from fsdp_composable._limiter_utils import _AllGatherLimiter
    from fsdp_composable._root_context import RootContext

__all__ = ["FSDP_FLATTENED", "StateTransitionError", "TrainingState", "UnitConfig", "_FSDPState"]

API_NAME = "fully_shard"

# Set on original parameters while a wrapper exposes flat parameters instead (use_orig_params=False).
FLAT_MODE = "_fsdp_flat_mode"


class NoGrad:
    """``torch.no_grad()`` for the per-unit path (the gradient reductions): the same switch, without the
    ``set_grad_enabled`` object torch's context builds at every entry (microseconds, twice per unit and step)."""

    __slots__ = ("prev",)

    def __enter__(self) -> None:
        self.prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        torch._C._set_grad_enabled(self.prev)


class TrainingState(enum.Enum):
    """What a `fully_shard` call's modules are doing: idle, in a step, or inside `unshard_params`."""

    IDLE = enum.auto()
    FORWARD_BACKWARD = enum.auto()
    SUMMON_FULL_PARAMS = enum.auto()

    __hash__ = object.__hash__  # members are singletons: see `_state_machine`


_TRAINING_TRANSITIONS: Transitions = {
    TrainingState.IDLE: frozenset({TrainingState.FORWARD_BACKWARD, TrainingState.SUMMON_FULL_PARAMS}),
    TrainingState.FORWARD_BACKWARD: frozenset({TrainingState.IDLE, TrainingState.FORWARD_BACKWARD}),
    TrainingState.SUMMON_FULL_PARAMS: frozenset({TrainingState.IDLE}),
}


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
    handles: list[FlatParamHandle] = field(default_factory=list)
    ignored_params: set[nn.Parameter] = field(default_factory=set)
    ignored_modules: set[nn.Module] = field(default_factory=set)
    # where each parameter ignored by itself (not through its module) is registered: (module, name)
    ignored_param_holders: list[tuple[nn.Module, str]] = field(default_factory=list)
    # buffer FQN (relative to `module`) -> dtype at construction, for checkpointing under mixed precision
    buffer_name_to_orig_dtype: dict[str, torch.dtype] = field(default_factory=dict)
    training_state: TrainingState = TrainingState.IDLE
    # Set by the root's lazy init: what every state under the root shares (see [Note: the root context]).
    ctx: Optional["RootContext"] = None
    state_dict_type: StateDictType = StateDictType.FULL_STATE_DICT
    state_dict_config: Optional[StateDictConfig] = None
    # FSDP1's optim_state_dict_config, as our config type (None: optimizer state follows the model's)
    optim_state_dict_config: Optional[StateDictConfig] = None
    hook_handles: list[Any] = field(default_factory=list)
    # a state_dict()/load_state_dict() in progress: handle -> its open unit (see `_state_dict_open`)
    open_units: dict[FlatParamHandle, Any] = field(default_factory=dict)

    def __deepcopy__(self, memo: object) -> "_FSDPState":
        raise refusal(f"the state of '{type(self.module).__name__}'")  # see [Note: copying a sharded model]

    def __reduce_ex__(self, protocol: object) -> NoReturn:
        raise refusal(f"the state of '{type(self.module).__name__}'")

    def __repr__(self) -> str:  # the dataclass repr would print whole modules
        return (
            f"_FSDPState(module={type(self.module).__name__}, units={len(self.handles)}, "
            f"rank={self.rank}/{self.world_size}, training_state={self.training_state.name})"
        )

    # Read-only views of the root context.
    @property
    def is_root(self) -> Optional[bool]:
        """Whether this state is its root's (None before the root's lazy init)."""
        return self.ctx.root is self if self.ctx is not None else None

    @property
    def root_state(self) -> Optional["_FSDPState"]:
        return self.ctx.root if self.ctx is not None else None

    @property
    def all_states(self) -> list["_FSDPState"]:
        return self.ctx.states if self.ctx is not None else []

    @property
    def exec_order_data(self) -> Optional["_ExecOrderData"]:
        return self.ctx.exec_order if self.ctx is not None else None

    @property
    def limiter(self) -> Optional["_AllGatherLimiter"]:
        return self.ctx.limiter if self.ctx is not None else None

    @property
    def final_callback_queued(self) -> bool:
        return self.ctx is not None and self.ctx.final_callback_queued

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


def _set_training_state(state: _FSDPState, new: TrainingState) -> None:
    if new in _TRAINING_TRANSITIONS[state.training_state]:  # the common case, without building the message
        state.training_state = new
        return
    check_transition(
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


def _registrations_of(
    module: nn.Module, params: Iterable[nn.Parameter], skip: set[nn.Module]
) -> list[tuple[nn.Module, str]]:
    """Every (module, name) under ``module`` (outside ``skip``) registering one of ``params``: where
    parameters ignored by themselves live, since initialisation may replace the objects."""
    wanted = {id(p) for p in params}
    return [
        (m, name)
        for m in module.modules()
        if m not in skip and wanted
        for name, p in m._parameters.items()
        if p is not None and id(p) in wanted
    ]
