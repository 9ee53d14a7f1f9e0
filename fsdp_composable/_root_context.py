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
from typing import TYPE_CHECKING, Any, Optional

import torch

from fsdp_composable.api import StateDictConfig, StateDictType

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
    states: list["_FSDPState"]
    handles: list["FlatParamHandle"]  # every unit's handles, root first then pre-order
    exec_order: "_ExecOrderData"
    limiter: "_AllGatherLimiter"
    non_root_handles: list["FlatParamHandle"]
    state_of: dict["FlatParamHandle", "_FSDPState"]  # the state owning each handle
    unshard_stream: Optional[torch.cuda.Stream] = None
    reduce_stream: Optional[torch.cuda.Stream] = None
    # gradient reductions issued this backward: in flight, then finished but not yet committed (their
    # results reach `.grad` only once the whole backward has succeeded)
    pending_reductions: list["PendingReduce"] = field(default_factory=list)
    finished_reductions: list["PendingReduce"] = field(default_factory=list)
    final_callback_queued: bool = False
    open_forwards: int = 0  # root forwards entered and not yet left
    method_calls: int = 0  # registered forward methods running now (each opens a forward)
    steps: dict["FlatParamHandle", UnitStep] = field(default_factory=dict)
    # The root-wide state-dict setting (see [Note: the state-dict setting is root-wide] in
    # `_state_dict_settings`); taken over from the root's state when the context is built.
    state_dict_type: StateDictType = StateDictType.FULL_STATE_DICT
    state_dict_config: Optional[StateDictConfig] = None

    def __post_init__(self) -> None:
        self.state_dict_type, self.state_dict_config = self.root.state_dict_type, self.root.state_dict_config

    def step_of(self, handle: "FlatParamHandle") -> UnitStep:
        return self.steps[handle]

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
