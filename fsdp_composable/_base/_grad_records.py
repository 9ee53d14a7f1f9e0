"""A unit's gradient records: `GradState` (where its unsharded gradient is), `ReduceControls` (what the
user set for its reduction) and `UnitGrads` (``handle.grads``).

Records only: `_flat_param` names `UnitGrads` as the type of ``handle.grads`` and `_reduce_utils`, which
owns the lifecycle ([Note: the gradient lifecycle], the checked transitions), fills it; keeping them
here, below both, lets the handle name its gradient record without importing the reduction code.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

__all__ = ["GradState", "ReduceControls", "UnitGrads"]


class GradState(enum.Enum):
    """Where a unit's unsharded gradient is; see [Note: the gradient lifecycle]."""

    NONE = enum.auto()
    FLAT = enum.auto()
    AUTOGRAD = enum.auto()
    STAGED = enum.auto()
    KEPT_FOR_NO_SYNC = enum.auto()
    REDUCING = enum.auto()

    __hash__ = object.__hash__  # members are singletons: see `_state_machine`


_IN_BACKWARD = (GradState.FLAT, GradState.AUTOGRAD)


@dataclass(eq=False)
class ReduceControls:
    """What the user set for a unit's reduction (`_reduce_controls`): read by `_reduce_utils` at each reduction.

    ``divide_factor``: the reduced gradient is the sum divided by it (None: the number of ranks it
    averages over). ``force_sum``: FSDP2's flag; our collectives always sum and divide apart, so it
    changes nothing. ``all_reduce_hook``: run in place on the final reduced shard gradient (after the
    replica all-reduce under HYBRID_SHARD), before it reaches ``.grad``. ``reduce_scatter_comm``: the
    user's reduce-scatter (FSDP2's ``ReduceScatter``: ``allocate`` and a call), used in place of ours."""

    divide_factor: Optional[float] = None
    force_sum: bool = False
    all_reduce_hook: Optional[Callable[[torch.Tensor], None]] = None
    reduce_scatter_comm: Optional[Any] = None


@dataclass(eq=False)
class UnitGrads:
    """One handle's gradient record. ``expose_orig``: original parameters show ``.grad`` views of
    the sharded gradient (False when a wrapper exposes flat parameters instead)."""

    expose_orig: bool
    state: GradState = GradState.NONE
    buffer: Optional[torch.Tensor] = None  # FLAT: autograd's target; STAGED: this backward's gradient
    kept: Optional[torch.Tensor] = None  # the sum of completed no_sync micro-batches
    # HYBRID_SHARD with set_requires_all_reduce(False): reduced shards not yet all-reduced across
    # replicas, summed; the next reduction that all-reduces adds them in (see `PendingReduce.wait`)
    partial: Optional[torch.Tensor] = None
    # the ``.grad`` we set on each original parameter (None: none set, e.g. a parameter without a gradient)
    exposed: list[Optional[torch.Tensor]] = field(default_factory=list)
    # each exposed DTensor gradient's own (wrapper) storage: ``p.grad.data = t`` replaces it, and
    # nothing else does (the local tensor stays), so the edit checks compare it (0: not a DTensor)
    exposed_storage: list[int] = field(default_factory=list)
    controls: ReduceControls = field(default_factory=ReduceControls)
    # [Note: which parameters got a gradient]: parameters whose slice of flat_param.grad is no gradient
    missing: frozenset[int] = frozenset()
    staged_got: Optional[list[bool]] = None  # STAGED: this micro-batch's flags
    kept_got: Optional[list[bool]] = None  # KEPT_FOR_NO_SYNC: the kept micro-batches' flags
    touched: list[bool] = field(default_factory=list)  # FLAT: set by the accumulation hooks
    # FLAT: (``buffer``, its views pre-backward set as ``.grad``), until post-backward takes them or `abort`
    views: Optional[tuple[torch.Tensor, list[torch.Tensor]]] = None
    hooks: list[Any] = field(default_factory=list)  # the accumulation hooks' handles

    def in_backward(self) -> bool:
        """The unit's backward is running: ``.grad`` holds unsharded gradients, not views to expose."""
        return self.state in _IN_BACKWARD
