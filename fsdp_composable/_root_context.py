"""`RootContext`: what every state under one root shares for a step, reset in one place.

[Note: the root context]
The root's lazy init builds one `RootContext` and gives it to every state under the root: the
states themselves, the execution order, the all-gather limiter, the CUDA side streams, the gradient
reductions in flight or waiting for the end of backward, and the per-step counters of each unit
(`UnitStep`). `begin_step` opens a step, `end_step` closes it normally (the final callback, or
the root's post-forward when no backward follows) and `_runtime_utils._abort_step` closes it after
a failure; the counters are cleared by `reset_counters` and nowhere else.

A step is *unfinished* when a forward is open (``open_forwards``) or a backward started
(``final_callback_queued``) and nothing is running now. That is how a `BaseException` (e.g.
`KeyboardInterrupt`), which skips torch's ``always_call`` forward hooks and autograd's final
callback, is noticed: at the next entry point (root pre-forward, `no_sync`, `clip_grad_norm_`,
`unshard_params`), which aborts the step first.

[Note: a step that stops midway]
A step is opened by the root pre-forward and closed by `_end_step` (the final callback, or the root
post-forward when no backward follows). When forward or backward raises, `_abort_step` closes it
instead: it waits for every collective already posted (each rank that failed at the same point
posted the same ones, so nothing stays half-matched), drops everything the step produced for the
gradients ([Note: the gradient lifecycle]), reshards and returns every state and handle to IDLE,
while the sharded gradients of earlier backwards and ``no_sync``'s kept sums stay. It runs from the
root post-forward (``always_call``: an ``Exception`` in forward), from a registered forward method
(any ``BaseException``), and, for what neither sees (a ``BaseException`` in forward, anything in
backward, where autograd skips the final callback), from the next entry point that finds the step
unfinished ([Note: the root context]).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

from fsdp_composable import _rank_agreement
from fsdp_composable import _reduce_utils as grads
from fsdp_composable._common_utils import TrainingState, _FSDPState, _set_training_state
from fsdp_composable._flat_param import FlatParamHandle, HandleTrainingState
from fsdp_composable._reduce_utils import GradState, PendingReduce

if TYPE_CHECKING:
    from fsdp_composable._exec_order_utils import _ExecOrderData
    from fsdp_composable._limiter_utils import _AllGatherLimiter

__all__ = ["RootContext", "UnitStep"]


@dataclass
class UnitStep:
    """One unit's counters for the current step (see [Note: when post-backward runs])."""

    ran_pre_backward: bool = False
    pending_triggers: int = 0  # post-backward triggers attached in forward and not yet fired
    untriggered_calls: int = 0  # forward calls whose inputs needed no grad (no trigger possible)
    forward_depth: int = 0  # > 1 while the unit's module calls itself (a registered method's self(...))

    def reset(self) -> None:
        self.ran_pre_backward = False
        self.pending_triggers = 0
        self.untriggered_calls = 0
        self.forward_depth = 0


@dataclass
class RootContext:
    """Shared by every state under one root; see [Note: the root context]."""

    root: "_FSDPState"
    states: list["_FSDPState"]  # outermost first; each owns its handles (root unit first, pre-order)
    exec_order: "_ExecOrderData"
    limiter: "_AllGatherLimiter"
    unshard_stream: Optional[torch.cuda.Stream] = None
    reduce_stream: Optional[torch.cuda.Stream] = None
    # gradient reductions issued this backward: in flight, then finished but not yet committed (their
    # results reach `.grad` only once the whole backward has succeeded)
    pending_reductions: list["PendingReduce"] = field(default_factory=list)
    finished_reductions: list["PendingReduce"] = field(default_factory=list)
    final_callback_queued: bool = False
    open_forwards: int = 0  # root forwards entered and not yet left
    method_calls: int = 0  # registered forward methods running now (each opens a forward)
    # each unit's counters for the current step; the only place they live
    steps: dict["FlatParamHandle", UnitStep] = field(default_factory=dict)

    @property
    def handles(self) -> list["FlatParamHandle"]:
        """Every unit's handles, root first then pre-order (derived from the states, which own them)."""
        return [h for s in self.states for h in s.handles]

    @property
    def non_root_handles(self) -> list["FlatParamHandle"]:
        """The handles the all-gather limiter counts: every unit's but the root unit's."""
        return [h for s in self.states for h in s.handles if h.module is not self.root.module]

    def units(self) -> Iterator[tuple["_FSDPState", "FlatParamHandle"]]:
        """Every (state, handle) pair, in the order of `handles`."""
        for s in self.states:
            for h in s.handles:
                yield s, h

    def reset_counters(self) -> None:
        """The one place per-step bookkeeping is cleared."""
        for counters in self.steps.values():
            counters.reset()
        self.final_callback_queued = False
        self.open_forwards = 0

    def unfinished(self) -> bool:
        """A previous step stopped midway (see the Note); call only when no forward/backward runs."""
        return self.open_forwards > self.method_calls or self.final_callback_queued

    def __repr__(self) -> str:
        return f"RootContext(states={len(self.states)}, handles={len(self.handles)})"

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: Any) -> bool:
        return self is other


def _end_step(ctx: RootContext) -> None:
    """Close a step that succeeded: its gradients reach ``.grad`` (or no_sync's kept sums) now."""
    _wait_reductions(ctx)
    for handle in ctx.handles:
        if handle.is_unsharded or handle.unshard_in_flight:
            handle.reshard()
        if handle.training_state is not HandleTrainingState.IDLE:
            handle.set_training_state(HandleTrainingState.IDLE)
    finished, ctx.finished_reductions = ctx.finished_reductions, []
    for reduction in finished:
        reduction.commit()
    for handle in ctx.handles:
        if handle.grads.state is GradState.STAGED:
            grads.commit_staged(handle)
    for s in ctx.states:
        if s.training_state is TrainingState.FORWARD_BACKWARD:
            _set_training_state(s, TrainingState.IDLE)
    ctx.reset_counters()
    ctx.exec_order.next_iter()


def _abort_step(ctx: RootContext) -> None:
    """Close a step that stopped midway; see [Note: a step that stops midway]."""
    # tell the peers first: one still inside a collective of this step raises instead of waiting
    _rank_agreement.leave_step(g for h in ctx.handles for g in (h.process_group, h.replicate_group))
    error: Optional[BaseException] = None
    reductions = ctx.pending_reductions + ctx.finished_reductions
    ctx.pending_reductions, ctx.finished_reductions = [], []
    for reduction in reductions:
        try:
            reduction.wait()  # its buffers must outlive the collective; its result is dropped
        except Exception as e:  # a peer died: still reset everything, then report it
            error = error or e
    for handle in ctx.handles:
        # A forward refused before its pre-forward released what zero_grad() cleared (e.g. the edit
        # check) must not bring the cleared gradients back as .grad below.
        grads.release_cleared_grads(handle)
        grads.abort(handle)
        try:
            handle.reshard()  # waits for an all-gather in flight
        except Exception as e:
            error = error or e
        handle.training_state = HandleTrainingState.IDLE  # a reset, not a transition
        grads.expose_sharded_grads(handle)
    for s in ctx.states:
        if s.training_state is TrainingState.FORWARD_BACKWARD:
            s.training_state = TrainingState.IDLE  # a reset, not a transition
    ctx.reset_counters()
    if error is not None:
        raise error


def _wait_reductions(ctx: RootContext) -> None:
    """Finish the reductions in flight; their results wait for the end of backward."""
    pending, ctx.pending_reductions = ctx.pending_reductions, []
    for reduction in pending:
        reduction.wait()
        ctx.finished_reductions.append(reduction)
