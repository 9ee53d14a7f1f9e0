"""`_ExecOrderData`: the order units run in, recorded per iteration, to drive prefetching."""

from __future__ import annotations

import hashlib
import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from fsdp_composable._comm import _collectives, _rank_agreement
from fsdp_composable.api import ExecutionOrderError

if TYPE_CHECKING:
    from fsdp_composable._flat_param import FlatParamHandle

__all__: list[str] = []


END_OF_FORWARD = -1


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
        # index of the unit it is about to run, and a fingerprint of what that unit will send (its
        # FQN, each parameter's FQN, shape and dtype, its padded numel), to one tiny all-gather (and
        # -1 at the end of forward). Because every rank makes the same number of these calls until
        # they disagree, a rank that runs another unit, skips one, or built a unit differently (another
        # policy, a layer of another width) is caught by an error on every rank, naming the unit and
        # the ranks, instead of pairing the wrong all-gathers (garbage, or a gloo abort) or waiting
        # forever (hang). Later iterations rely on the per-collective headers of [Note: collective
        # headers] (gloo).
        self.group = group
        self.unit_names = unit_names or []
        # the units' compute device: the order check's tensors go to the group's communication
        # device for it (see [Note: the communication device])
        self.device: Optional[torch.device] = None
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
        self._last_pre_backward_index: dict[int, int] = {}  # id(handle) -> first position in it
        self.last_prefetch_log: list[tuple[str, str]] = []
        self._current_forward: list["FlatParamHandle"] = []
        self.first_forward_calls: list["FlatParamHandle"] = []
        self._forward_ended = False

    def set_units(self, handles: "list[FlatParamHandle]", names: list[str]) -> None:
        self._index = {id(h): i for i, h in enumerate(handles)}
        self.device = handles[0].device if handles else None
        self.unit_names = names

    def record_pre_forward(self, handle: "FlatParamHandle", unit: "list[FlatParamHandle]") -> None:
        """``unit``: every handle of ``handle``'s unit (one per dtype/requires_grad group), itself included."""
        if self.is_first_iter:
            if id(handle) not in self._pre_forward_index:
                self._validate(self._index.get(id(handle), -2), unit)
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
        _rank_agreement.start_step(self.group)

    def end_forward(self) -> None:
        """Root post-forward: in the first iteration, check every rank ran the same number of units."""
        if self.is_first_iter and not self._forward_ended:
            self._forward_ended = True
            self._validate(END_OF_FORWARD)

    def _name(self, index: int) -> str:
        if index == END_OF_FORWARD:
            return "<end of forward>"
        return repr(self.unit_names[index]) if 0 <= index < len(self.unit_names) else f"<unit #{index}>"

    def _validate(self, index: int, unit: "Optional[list[FlatParamHandle]]" = None) -> None:
        group = self.group
        if group is None or dist.get_world_size(group) == 1:
            return
        numel, fingerprint = _fingerprint(self._name(index), unit or [])
        mine = _collectives.comm_tensor([index, numel, fingerprint], group, self.device)
        gathered = mine.new_empty((dist.get_world_size(group), 3))
        with _rank_agreement.entry_point("the execution-order check"):
            work = _collectives.all_gather(gathered.view(-1), mine, group)
        _collectives.wait(work, "the execution-order check")
        everyone = _collectives.host_values(gathered)  # first iteration only: a host read is fine
        step = len(self.pre_forward_order)
        if not bool((everyone != everyone[0]).any()):
            return
        _rank_agreement.saw_mismatch(group, "the ranks ran different units")
        global_ranks = _rank_agreement.group_ranks(group)[2]  # messages name global ranks, also on a subgroup
        if bool((everyone[:, 0] != everyone[0, 0]).any()):
            units = everyone[:, 0].tolist()
            detail = "; ".join(f"rank {global_ranks[r]}: {self._name(int(i))}" for r, i in enumerate(units))
            raise ExecutionOrderError(
                f"fully_shard: ranks disagree on the unit to run at position {step} of the forward in "
                f"iteration {self.iteration} ({detail}). Every rank must run the same modules in the same "
                "order; look for data-dependent branches or modules skipped on some ranks"
            )
        # every rank is here: one more collective gathers what each would send, for the message
        described: list[Any] = [None] * dist.get_world_size(group)
        with _collectives.comm_device_current(group, self.device):  # the unit's device, not the current one
            dist.all_gather_object(described, _describe(self._name(index), unit or []), group=group)
        ranks = [global_ranks[r] for r in range(len(described)) if described[r] != described[0]]
        raise ExecutionOrderError(
            f"fully_shard: ranks built unit {self._name(index)} differently (position {step} of the forward "
            f"in iteration {self.iteration}; rank(s) {ranks} differ from rank {global_ranks[0]}): "
            f"{_first_difference(described, global_ranks)}. "
            "Every rank must build the same model and apply the same policy (same units, same parameter "
            "shapes and dtypes)"
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
        """The next unit expected to run forward after ``handle``'s (from the first iteration's order);
        a handle of the same unit is not a target, it is gathered with ``handle``."""
        if self.is_first_iter:
            return None
        i = self._pre_forward_index.get(id(handle))
        if i is None:
            return None
        order = self.pre_forward_order
        for j in range(i + 1, len(order)):
            if order[j].module is not handle.module:
                return order[j]
        return None

    def record_pre_backward(self, handle: "FlatParamHandle") -> None:
        self.pre_backward_order.append(handle)

    def backward_prefetch_target(
        self, handle: "FlatParamHandle", started: Callable[["FlatParamHandle"], bool]
    ) -> Optional["FlatParamHandle"]:
        """The unit whose backward comes after ``handle``'s: the next one in the last iteration's
        backward order, else the previous one in this iteration's post-forward order, skipping units
        whose backward already started (``started``: the root context's per-step counters) and
        ``handle``'s own unit."""
        last = self.last_pre_backward_order
        position = self._last_pre_backward_index.get(id(handle))
        if position is not None:
            for candidate in last[position + 1 :]:
                if candidate.module is not handle.module and not started(candidate):
                    return candidate
            return None
        i = self._post_forward_index.get(id(handle))
        if i is None:
            return None
        for j in range(i - 1, -1, -1):
            candidate = self.post_forward_order[j]
            if candidate.module is not handle.module and not started(candidate):
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
            self._last_pre_backward_index = {}
            for position, h in enumerate(self.last_pre_backward_order):
                self._last_pre_backward_index.setdefault(id(h), position)


def _param_list(name: str, handles: "list[FlatParamHandle]") -> list[tuple[str, tuple[int, ...], str]]:
    """(FQN, shape, dtype) of every parameter the unit will gather (all its handles)."""
    out = []
    for h in handles:
        prefix = f"{h.unit_fqn}." if h.unit_fqn else ""
        for info in h.layout.infos:
            out.append((prefix + info.fqn, tuple(info.shape), str(h.dtype).replace("torch.", "")))
    return out


def _fingerprint(name: str, handles: "list[FlatParamHandle]") -> tuple[int, int]:
    """(padded numel, a hash of the unit's name and parameters), equal on ranks that built it alike.
    hashlib, not hash(): Python salts string hashes per process."""
    if not handles:
        return 0, 0
    numel = sum(h.layout.padded_numel for h in handles)
    digest = hashlib.blake2b(repr((name, numel, _param_list(name, handles))).encode(), digest_size=7).digest()
    return numel, int.from_bytes(digest, "little")


def _describe(name: str, handles: "list[FlatParamHandle]") -> tuple[str, int, list[tuple[str, tuple[int, ...], str]]]:
    numel = sum(h.layout.padded_numel for h in handles)
    return name, numel, _param_list(name, handles)


def _first_difference(described: list[Any], global_ranks: Sequence[int]) -> str:
    """Each rank's unit name, padded numel and the first parameter where the ranks differ
    (``described`` in group-rank order, named by ``global_ranks``)."""
    lists = [d[2] for d in described]
    position = next(
        (i for i in range(max(map(len, lists))) if len({repr(p[i]) if i < len(p) else "-" for p in lists}) > 1),
        None,
    )

    def one(rank: int) -> str:
        name, numel, params = described[rank]
        text = f"rank {global_ranks[rank]}: unit {name} of {numel:,} elements"
        if position is not None:
            text += f", parameter {position}: " + (
                f"{params[position][0]} {list(params[position][1])} {params[position][2]}"
                if position < len(params)
                else "<none>"
            )
        return text

    return "; ".join(one(r) for r in range(len(described)))
