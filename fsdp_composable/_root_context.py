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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

if TYPE_CHECKING:
    from fsdp_composable._common_utils import _FSDPState
    from fsdp_composable._exec_order_utils import _ExecOrderData
    from fsdp_composable._flat_param import FlatParamHandle
    from fsdp_composable._limiter_utils import _AllGatherLimiter
    from fsdp_composable._reduce_utils import PendingReduce

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
