"""`_ExecOrderData`: the order units run in, recorded per iteration, to drive prefetching."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from fsdp_composable._flat_param import FlatParamHandle

__all__: list[str] = []


class _ExecOrderData:
    """Shared by every state under one root.

    - ``pre_forward_order``: each unit's first pre-forward of the *first* iteration (forward prefetch
      assumes later iterations repeat it).
    - ``post_forward_order``: post-forwards of the *current* iteration; backward runs them in reverse,
      so it is the backward prefetch order.
    """

    def __init__(self) -> None:
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

    def record_pre_forward(self, handle: "FlatParamHandle") -> None:
        if self.is_first_iter and id(handle) not in self._pre_forward_index:
            self._pre_forward_index[id(handle)] = len(self.pre_forward_order)
            self.pre_forward_order.append(handle)

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
        self.is_first_iter = False
        self.iteration += 1
        self.post_forward_order.clear()
        self._post_forward_index.clear()
        self.last_prefetch_log, self.prefetch_log = self.prefetch_log, []
        if self.pre_backward_order:  # keep the last order that had a backward (eval steps have none)
            self.last_pre_backward_order, self.pre_backward_order = self.pre_backward_order, []
