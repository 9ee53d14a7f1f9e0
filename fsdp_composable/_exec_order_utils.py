"""`_ExecOrderData`: the order units run in, recorded per iteration, to drive prefetching."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from fsdp_composable import _collectives

if TYPE_CHECKING:
    from fsdp_composable._flat_param import FlatParamHandle

__all__: list[str] = []


END_OF_FORWARD = -1


class ExecutionOrderError(RuntimeError):
    """Ranks ran different units (or a different number of them) in the first iteration."""


class _ExecOrderData:
    """Shared by every state under one root.

    - ``pre_forward_order``: each unit's first pre-forward of the *first* iteration (forward prefetch
      assumes later iterations repeat it).
    - ``post_forward_order``: post-forwards of the *current* iteration; backward runs them in reverse,
      so it is the backward prefetch order.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, unit_names: Optional[list[str]] = None) -> None:
        # [Note: execution order validation]
        # In the first iteration, before each unit's first all-gather, every rank contributes the
        # index of the unit it is about to run to one tiny all-gather (and -1 at the end of forward).
        # Because every rank makes the same number of these calls until they disagree, a rank that
        # runs another unit, or skips one, is caught by an error on every rank instead of pairing the
        # wrong all-gathers (garbage) or waiting forever (hang).
        self.group = group
        self.unit_names = unit_names or []
        self._index: dict[int, int] = {}
        self._warned = False
        self.is_first_iter = True
        self.iteration = 0
        self.pre_forward_order: list["FlatParamHandle"] = []
        self._pre_forward_index: dict[int, int] = {}
        self.post_forward_order: list["FlatParamHandle"] = []
        self._post_forward_index: dict[int, int] = {}
        # (phase, unit FQN) of each prefetch this iteration; the previous iteration's is kept for
        # inspection (tests, debugging)
        self.prefetch_log: list[tuple[str, str]] = []
        # pre-backward order of this and the last iteration: a unit skipped in backward (no gradient
        # reached it) is absent, so the last order predicts the next backward better than the forward does
        self.pre_backward_order: list["FlatParamHandle"] = []
        self.last_pre_backward_order: list["FlatParamHandle"] = []
        self.last_prefetch_log: list[tuple[str, str]] = []
        self._current_forward: list["FlatParamHandle"] = []
        self.first_forward_calls: list["FlatParamHandle"] = []
        self._forward_ended = False

    def set_units(self, handles: "list[FlatParamHandle]", names: list[str]) -> None:
        self._index = {id(h): i for i, h in enumerate(handles)}
        self.unit_names = names

    def record_pre_forward(self, handle: "FlatParamHandle") -> None:
        if self.is_first_iter:
            if id(handle) not in self._pre_forward_index:
                self._validate(self._index.get(id(handle), -2))
                self._pre_forward_index[id(handle)] = len(self.pre_forward_order)
                self.pre_forward_order.append(handle)
            if not self._forward_ended:  # the first forward's every call, repeats included
                self.first_forward_calls.append(handle)
        else:
            self._warn_if_order_changed(handle)
        self._current_forward.append(handle)

    def start_forward(self) -> None:
        """Root pre-forward: positions count from the start of each forward."""
        self._current_forward = []

    def end_forward(self) -> None:
        """Root post-forward: in the first iteration, check every rank ran the same number of units."""
        if self.is_first_iter and not self._forward_ended:
            self._forward_ended = True
            self._validate(END_OF_FORWARD)

    def _name(self, index: int) -> str:
        if index == END_OF_FORWARD:
            return "<end of forward>"
        return repr(self.unit_names[index]) if 0 <= index < len(self.unit_names) else f"<unit #{index}>"

    def _validate(self, index: int) -> None:
        group = self.group
        if group is None or dist.get_world_size(group) == 1:
            return
        mine = torch.tensor([index], dtype=torch.int64)
        everyone = torch.empty(dist.get_world_size(group), dtype=torch.int64)
        _collectives.wait(_collectives.all_gather(everyone, mine, group), "the execution-order check")
        if bool((everyone != everyone[0]).any()):
            step = len(self.pre_forward_order)
            detail = "; ".join(f"rank {r}: {self._name(int(i))}" for r, i in enumerate(everyone.tolist()))
            raise ExecutionOrderError(
                f"fully_shard: ranks disagree on the unit to run at position {step} of the forward in "
                f"iteration {self.iteration} ({detail}). Every rank must run the same modules in the same "
                "order; look for data-dependent branches or modules skipped on some ranks"
            )

    def _warn_if_order_changed(self, handle: "FlatParamHandle") -> None:
        position = len(self._current_forward)
        calls = self.first_forward_calls
        expected = calls[position] if position < len(calls) else None
        if expected is handle or self._warned:
            return
        self._warned = True
        got = self._name(self._index.get(id(handle), -2))
        want = self._name(self._index[id(expected)]) if expected is not None else "<end of forward>"
        warnings.warn(
            f"fully_shard: in iteration {self.iteration}, unit {got} ran at forward position {position} where "
            f"the first iteration ran {want}. Prefetching follows the first iteration's order, so it may "
            "fetch the wrong unit (this is expected for eval vs train; warned once)",
            stacklevel=4,
        )

    def record_post_forward(self, handle: "FlatParamHandle") -> None:
        self._post_forward_index[id(handle)] = len(self.post_forward_order)
        self.post_forward_order.append(handle)

    def forward_prefetch_target(self, handle: "FlatParamHandle") -> Optional["FlatParamHandle"]:
        """The unit expected to run forward after ``handle`` (from the first iteration's order)."""
        if self.is_first_iter:
            return None
        i = self._pre_forward_index.get(id(handle))
        if i is None or i + 1 >= len(self.pre_forward_order):
            return None
        return self.pre_forward_order[i + 1]

    def record_pre_backward(self, handle: "FlatParamHandle") -> None:
        self.pre_backward_order.append(handle)

    def backward_prefetch_target(self, handle: "FlatParamHandle") -> Optional["FlatParamHandle"]:
        """The unit whose backward comes after ``handle``'s: the next one in the last iteration's
        backward order, else the previous one in this iteration's post-forward order, skipping units
        whose backward already started."""
        last = self.last_pre_backward_order
        if handle in last:
            for candidate in last[last.index(handle) + 1 :]:
                if not candidate.ran_pre_backward:
                    return candidate
            return None
        i = self._post_forward_index.get(id(handle))
        if i is None:
            return None
        for j in range(i - 1, -1, -1):
            candidate = self.post_forward_order[j]
            if candidate is not handle and not candidate.ran_pre_backward:
                return candidate
        return None

    def next_iter(self) -> None:
        self.end_forward()  # a forward whose root post-forward did not run still closes the check
        self.is_first_iter = False
        self._current_forward = []
        self.iteration += 1
        self.post_forward_order.clear()
        self._post_forward_index.clear()
        self.last_prefetch_log, self.prefetch_log = self.prefetch_log, []
        if self.pre_backward_order:  # keep the last order that had a backward (eval steps have none)
            self.last_pre_backward_order, self.pre_backward_order = self.pre_backward_order, []
