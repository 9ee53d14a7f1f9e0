"""`UnitSwitches`: one unit's run-time switches, set by the per-module controls and read by the hooks.

[Note: per-unit switches]
``UnitConfig`` is what a unit was built with and never changes; these are what a user may flip
between steps (`_module_controls`: ``set_requires_gradient_sync``, ``set_reshard_after_forward``,
...), as FSDP2's per-module methods do. Each handle owns its own record (``handle.switches``; a unit
with several handles has one per handle, all set together), and the runtime hooks read it where the
matching decision is made: post-forward (reshard), pre-backward (unshard; a unit not gathered there
points its parameters at full-shape views without storage, since autograd checks gradients against
the parameters' shapes), post-backward (reduce or keep, reshard), the final callback (reduce kept
gradients), `RootContext.end_step` (what stays unsharded), `_prefetch` (explicit targets, and no
backward prefetch of a unit not gathered in backward) and `_reduce_utils.start_reduce` (the
all-reduce across replicas). Defaults reproduce the behaviour without any control call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Optional, TypeVar

__all__ = ["UnitSwitches"]

# the handle type (`FlatParamHandle`, whose module builds the record and sits above this one)
H = TypeVar("H")


@dataclass
class UnitSwitches(Generic[H]):
    """One handle's switches; see [Note: per-unit switches]. ``H``: the handle type, for the prefetch targets."""

    # False: keep this unit's unsharded gradient locally (as inside ``no_sync``) instead of reducing it
    reduce_grads: bool = True
    # False (HYBRID_SHARD): reduce-scatter but keep the result apart instead of all-reducing it
    # across replicas; the next backward that all-reduces adds it in
    all_reduce_grads: bool = True
    # None: the unit's strategy decides (and the root unit stays unsharded after forward)
    reshard_after_forward: Optional[bool] = None
    # False: the unit stays unsharded after backward, so the next forward needs no all-gather
    reshard_after_backward: bool = True
    # False: backward does not all-gather the unit (its parameters are not needed for gradients)
    unshard_in_backward: bool = True
    # the user's all-gather (FSDP2's ``AllGather``: ``allocate`` and a call), used in place of ours
    all_gather_comm: Optional[Any] = None
    # explicit prefetch targets (None: the recorded execution order decides)
    forward_prefetch: Optional[tuple[H, ...]] = None
    backward_prefetch: Optional[tuple[H, ...]] = None
