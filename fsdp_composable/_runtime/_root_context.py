"""`RootContext`: what every state under one root shares for a step, reset in one place; and `_FSDPState`
(with its `TrainingState`), the state of one `fully_shard` call, which points at its root's context as the
context points at its states (`_common_utils`, the seeds' path for both, imports them from here).

[Note: the root context]
The root's lazy init (`_lazy_init`) builds one `RootContext` and gives it to every state under the
root. It is the only owner of what those states share and of everything that lives for one step:
the states themselves (each owns its handles; ``handles``, ``non_root_handles``, ``unit_of`` and
``units()`` are derived from them, once, when the context is built), the execution order, the
all-gather limiter, the CUDA side streams (handles get them as arguments, e.g.
``handle.unshard(ctx.unshard_stream)``), the gradient reductions in
flight or waiting for the end of backward, the per-step counters of each unit (``steps``:
`UnitStep`), and the root-wide switch ``sync_gradients``. A switch has no home before the root's
first forward, so ``no_sync`` entered then runs the root's lazy init itself (it needs no collective)
and sets the switch here, the one place the hooks read it. `begin_step` opens a step
(the root pre-forward), `end_step` closes it normally (the final callback, or the root's
post-forward when no backward follows) and `abort_step` closes it after a failure; the counters are
cleared by `reset_counters` (called by those two) and nowhere else.

A step is *unfinished* when a forward is open (``open_forwards``) or a backward started
(``final_callback_queued``) and nothing is running now. That is how a `BaseException` (e.g.
`KeyboardInterrupt`), which skips torch's ``always_call`` forward hooks and autograd's final
callback, is noticed: at the next entry point (root pre-forward, `no_sync`, `clip_grad_norm_`,
`unshard_params`), which aborts the step first (`_entry_points`).

[Note: a step that stops midway]
A step is opened by `begin_step` and closed by `end_step` (the final callback, or the root
post-forward when no backward follows). When forward or backward raises, `abort_step` closes it
instead: it waits for every collective already posted (each rank that failed at the same point
posted the same ones, so nothing stays half-matched) and starts none (HYBRID_SHARD's all-reduce
across replicas of a reduction that completed is not issued: the replicas may be elsewhere), drops
everything the step produced for the gradients ([Note: the gradient lifecycle]), reshards and
returns every state and handle to IDLE, while the sharded gradients of earlier backwards and
``no_sync``'s kept sums stay. It runs from the root post-forward (``always_call``: an ``Exception``
in forward), from a registered forward method (any ``BaseException``), and, for what neither sees (a
``BaseException`` in forward, anything in backward, where autograd skips the final callback), from
the next entry point that finds the step unfinished ([Note: the root context]).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, NoReturn, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_composable._base._copy_guard import refusal
from fsdp_composable._base._grad_records import GradState
from fsdp_composable._base._state_machine import Transitions, check_transition
from fsdp_composable._comm import _collectives, _rank_agreement
from fsdp_composable._config import UnitConfig
from fsdp_composable._flat_param import FlatParamHandle, HandleTrainingState
from fsdp_composable._grads import _exposed_grads, _host_flags
from fsdp_composable._grads import _reduce_utils as grads
from fsdp_composable._grads._reduce_utils import PendingReduce
from fsdp_composable.api import BackwardPrefetch, StateDictConfig, StateDictType

if TYPE_CHECKING:
    from fsdp_composable._runtime._exec_order_utils import _ExecOrderData
    from fsdp_composable._runtime._limiter_utils import _AllGatherLimiter

__all__ = ["RootContext", "TrainingState", "UnitStep", "_FSDPState"]


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


@dataclass
class UnitStep:
    """One unit's counters for the current step (see [Note: when post-backward runs])."""

    ran_pre_backward: bool = False
    pending_triggers: int = 0  # post-backward triggers attached in forward and not yet fired
    untriggered_calls: int = 0  # forward calls whose inputs needed no grad (no trigger possible)
    forward_depth: int = 0  # > 1 while the unit's module calls itself (a registered method's self(...))
    # a unit of several modules: the members whose forward is still to run in this forward (see
    # [Note: several modules as one unit] in `_group_units`)
    group_left: set[int] = field(default_factory=set)
    # each parameter's ``.grad`` when the unit's forward began: one that differs at its pre-backward
    # was accumulated in this step into the unsharded parameter (see [Note: gradients before backward])
    grads_at_forward: list[Optional[torch.Tensor]] = field(default_factory=list)

    def reset(self) -> None:
        self.grads_at_forward = []
        self.ran_pre_backward = False
        self.pending_triggers = 0
        self.untriggered_calls = 0
        self.forward_depth = 0
        self.group_left.clear()


@dataclass
class RootContext:
    """Shared by every state under one root; see [Note: the root context]."""

    root: "_FSDPState"
    states: list["_FSDPState"]  # outermost first; each owns its handles (root unit first, pre-order)
    exec_order: "_ExecOrderData"
    limiter: "_AllGatherLimiter"
    unshard_stream: Optional[torch.cuda.Stream] = None
    reduce_stream: Optional[torch.cuda.Stream] = None
    all_reduce_stream: Optional[torch.cuda.Stream] = None  # HYBRID_SHARD's all-reduce across replicas
    # `set_post_optim_event`: what the next root forward's all-gathers wait for, used once
    post_optim_event: Optional[Any] = None
    # gradient reductions issued this backward: in flight, then finished but not yet committed (their
    # results reach `.grad` only once the whole backward has succeeded)
    pending_reductions: list["PendingReduce"] = field(default_factory=list)
    finished_reductions: list["PendingReduce"] = field(default_factory=list)
    # root-wide switch: False inside `no_sync` (keep unsharded gradients locally instead of reducing)
    sync_gradients: bool = True
    # set_is_last_backward: accepted for FSDP2 code; every backward here completes its reductions
    is_last_backward: bool = True
    final_callback_queued: bool = False
    open_forwards: int = 0  # root forwards entered and not yet left
    # weak references to this step's pre-backward hooks: one still alive means a graph of this step
    # that a backward may still run through (see `backward_may_come`)
    backward_hooks: list[Any] = field(default_factory=list)
    method_calls: int = 0  # registered forward methods running now (each opens a forward)
    # `_composable_state.registrations()` at the last full edit check ([Note: cheap edit checks])
    checked_registrations: Optional[int] = None
    # each unit's counters for the current step; the only place they live
    steps: dict["FlatParamHandle", UnitStep] = field(default_factory=dict)
    # The root-wide state-dict setting (see [Note: the state-dict setting is root-wide] in
    # `_state_dict_settings`); taken over from the root's state when the context is built.
    state_dict_type: StateDictType = StateDictType.FULL_STATE_DICT
    state_dict_config: Optional[StateDictConfig] = None
    optim_state_dict_config: Optional[StateDictConfig] = None

    # derived from the states once (their handles are fixed once the context exists, and a handle's
    # process groups from its construction on), so the hooks do no work per unit of the model to find
    # them: see [Note: the limiter counts units]
    _handles: list["FlatParamHandle"] = field(init=False, repr=False)
    _units: list[tuple["_FSDPState", "FlatParamHandle"]] = field(init=False, repr=False)
    _grouped: list[tuple["_FSDPState", "FlatParamHandle"]] = field(init=False, repr=False)  # several modules
    _unit_of: dict["FlatParamHandle", tuple["FlatParamHandle", ...]] = field(init=False, repr=False)
    _groups: list[Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.state_dict_type, self.state_dict_config = self.root.state_dict_type, self.root.state_dict_config
        self.optim_state_dict_config = self.root.optim_state_dict_config
        self._units = [(s, h) for s in self.states for h in s.handles]
        self._handles = [h for _, h in self._units]
        self._grouped = [(s, h) for s, h in self._units if len(h.members) > 1]
        by_module: dict[int, list["FlatParamHandle"]] = {}
        for h in self._handles:
            by_module.setdefault(id(h.module), []).append(h)
        units = {key: tuple(group) for key, group in by_module.items()}
        self._unit_of = {h: units[id(h.module)] for h in self._handles}
        groups = (g for h in self._handles for g in (h.process_group, h.replicate_group, h.post_forward_group))
        self._groups = list({id(g): g for g in groups if g is not None}.values())

    @property
    def handles(self) -> list["FlatParamHandle"]:
        """Every unit's handles, root first then pre-order (derived from the states, which own them)."""
        return self._handles

    @property
    def non_root_handles(self) -> list["FlatParamHandle"]:
        """Every unit's handles but the root unit's."""
        return [h for h in self._handles if h.module is not self.root.module]

    def unit_of(self, handle: "FlatParamHandle") -> tuple["FlatParamHandle", ...]:
        """Every handle of ``handle``'s unit (one per dtype/requires_grad group), itself included."""
        return self._unit_of[handle]

    def is_root_unit(self, handle: "FlatParamHandle") -> bool:
        return handle.module is self.root.module

    def units(self) -> Iterator[tuple["_FSDPState", "FlatParamHandle"]]:
        """Every (state, handle) pair, in the order of `handles`."""
        return iter(self._units)

    def grouped_units(self) -> list[tuple["_FSDPState", "FlatParamHandle"]]:
        """The (state, handle) pairs of units of several modules (the only ones with ``group_left``)."""
        return self._grouped

    def reset_counters(self) -> None:
        """The one place per-step bookkeeping is cleared (by `end_step` and `abort_step`)."""
        for counters in self.steps.values():
            counters.reset()
        self.final_callback_queued = False
        self.open_forwards = 0
        self.backward_hooks = []

    def backward_may_come(self) -> bool:
        """A forward of this step finished with gradients enabled, no backward started, and a graph
        holding its pre-backward hooks is still alive (a dropped graph frees them)."""
        return not self.final_callback_queued and any(ref() is not None for ref in self.backward_hooks)

    def close_skipped_backward(self) -> None:
        """At a root pre-forward: if the last forward finished with gradients enabled, no backward
        started and none can come (its graph was dropped), abort that step (telling the peers).

        [Note: a skipped backward]
        A rank whose loss raised after its forward skips that backward while its peers run it. Told
        nothing, the peers would refuse this rank's next forward at their first backward collective,
        so this rank would lose that iteration too and the ranks' loops would end one step apart. So
        it aborts the step it skipped, as a failed step's recovery does ([Note: a step that stops
        midway]), and leaves it ([Note: collective headers]): a peer inside that backward raises
        there, on every rank the step is over, every unit is resharded, and this forward runs in the
        next epoch. Where every rank dropped its forward (a forward whose output was not used), every
        rank does the same and skips the others' notice as stale."""
        if self.open_forwards or self.final_callback_queued or self.backward_may_come():
            return
        if any(s.training_state is TrainingState.FORWARD_BACKWARD for s in self.states):
            self.abort_step()

    def unfinished(self) -> bool:
        """A previous step stopped midway (see the Note); call only when no forward/backward runs."""
        return self.open_forwards > self.method_calls or self.final_callback_queued

    # ------------------------------------------------------------------ the step
    def enter_forward(self) -> bool:
        """A root forward starts; True when it is the outermost one (it opens a step)."""
        self.open_forwards += 1
        return self.open_forwards == 1

    def leave_forward(self, failed: bool) -> bool:
        """A root forward returns, or raised (``failed``); True when it closed the outermost forward
        normally. The outermost forward failing aborts the step; a nested one leaves that to the
        registered method around it."""
        if failed:
            # Only a forward that was opened needs closing: if pre-forward refused to start one (e.g.
            # forward inside unshard_params), resetting would break the context that owns the states.
            if self.open_forwards > 1:
                self.open_forwards -= 1
            elif self.open_forwards == 1:
                self.abort_step()
            return False
        self.open_forwards = max(self.open_forwards - 1, 0)
        return self.open_forwards == 0

    def begin_step(self) -> None:
        """Open a step (the root pre-forward of a forward that is not nested in another)."""
        for s in self.states:
            _set_training_state(s, TrainingState.FORWARD_BACKWARD)
        self.exec_order.start_forward()
        for group in self._groups:  # the root's own group was opened by the order check
            if group is not self.exec_order.group:
                _rank_agreement.start_step(group)  # else a step left there stays left: later ones refused
        event, self.post_optim_event = self.post_optim_event, None
        if event is not None and self.unshard_stream is not None:  # the user's: [Note: reduction controls]
            self.unshard_stream.wait_event(event)
        else:
            _collectives.wait_for_compute(self.unshard_stream)  # once per root forward: see _collectives.issue
        for handle in self.handles:
            _exposed_grads.release_cleared_grads(handle)
            # a slice kept by a forward whose backward never ran (its output dropped) may predate an
            # optimizer step or a load since: [Note: resharding to a smaller group]
            handle.drop_post_forward_shard()

    def end_step(self) -> None:
        """Close a step that succeeded: its gradients reach ``.grad`` (or no_sync's kept sums) now."""
        self.wait_reductions()
        for handle in self.handles:
            # set_reshard_after_backward(unit, False): stays unsharded for the next forward
            after_backward = handle.training_state is HandleTrainingState.BACKWARD_POST
            kept = after_backward and not handle.switches.reshard_after_backward
            if (handle.is_unsharded or handle.unshard_in_flight) and not kept:
                handle.reshard()
            if handle.training_state is not HandleTrainingState.IDLE:
                handle.set_training_state(HandleTrainingState.IDLE)
        self.limiter.release_freed(self.handles)
        finished, self.finished_reductions = self.finished_reductions, []
        grads.finish_all(finished, self.handles)
        for reduction in finished:
            reduction.commit()
        for handle in self.handles:
            if handle.grads.state is GradState.STAGED:
                grads.commit_staged(handle)
        for s in self.states:
            if s.training_state is TrainingState.FORWARD_BACKWARD:
                _set_training_state(s, TrainingState.IDLE)
        self.reset_counters()
        self.exec_order.next_iter()

    def collective_groups(self) -> list[Any]:
        """Every process group the step's collectives use (shard, replicate and post-forward groups),
        once each: a step opens and is left on all of them ([Note: collective headers]). Derived with
        `handles`, from the same fixed handles; callers only read it."""
        return self._groups

    def abort_step(self) -> None:
        """Close a step that stopped midway; see [Note: a step that stops midway]."""
        # tell the peers first: one still inside a collective of this step raises instead of waiting
        _rank_agreement.leave_step(self.collective_groups())
        error: Optional[BaseException] = None
        reductions = self.pending_reductions + self.finished_reductions
        self.pending_reductions, self.finished_reductions = [], []
        for reduction in reductions:
            # wait for what is posted, start nothing: HYBRID_SHARD's all-reduce across replicas not
            # issued yet would wait for replicas that are elsewhere (a hang), and the user's hook is moot
            reduction.replicate_group, reduction.hook = None, None
            try:
                reduction.finish()  # its buffers must outlive the collective; its result is dropped
            except Exception as e:  # a peer died: still reset everything, then report it
                error = error or e
        try:  # the flags' sums issued so far end as on every peer: [Note: presence flags agreed on the host]
            _host_flags.finish_many([r.host_flags for r in reductions if r.host_flags is not None])
        except Exception as e:
            error = error or e
        for handle in self.handles:
            # A forward refused before its pre-forward released what zero_grad() cleared (e.g. the edit
            # check) must not bring the cleared gradients back as .grad below.
            _exposed_grads.release_cleared_grads(handle)
            grads.abort(handle)
            try:
                handle.reshard()  # waits for an all-gather in flight
            except Exception as e:
                error = error or e
            handle.training_state = HandleTrainingState.IDLE  # a reset, not a transition
            _exposed_grads.expose_sharded_grads(handle)
        self.limiter.release_freed(self.handles)
        for s in self.states:
            if s.training_state is TrainingState.FORWARD_BACKWARD:
                s.training_state = TrainingState.IDLE  # a reset, not a transition
        self.reset_counters()
        if error is not None:
            raise error

    def start_reduce(self, handle: FlatParamHandle) -> None:
        """Issue ``handle``'s gradient reduction on the reduce stream; it finishes in `wait_reductions`."""
        self.pending_reductions.append(grads.start_reduce(handle, self.reduce_stream, self.all_reduce_stream))

    def wait_reductions(self) -> None:
        """Finish the reductions in flight; their results wait for the end of backward."""
        pending, self.pending_reductions = self.pending_reductions, []
        for reduction in pending:
            reduction.wait()
            self.finished_reductions.append(reduction)

    def __repr__(self) -> str:
        return f"RootContext(states={len(self.states)}, handles={len(self.handles)})"

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: Any) -> bool:
        return self is other
