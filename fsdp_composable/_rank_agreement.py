"""Ranks agree on each collective before its payload is posted (gloo), so a disagreement is an error.

[Note: collective headers]
On gloo, a receive posted for a message of another size kills the process from gloo's own thread
("terminate called ... Received data size doesn't match expected size"), and a message of the same
size from another collective is silently wrong data. So before any payload of ours is posted on a
gloo group, every rank sends every peer a small fixed-size header and receives theirs (`agree`):
which collective (`Op`), what for (`purpose`: forward, backward, or a collective entry point such as
``state_dict()``), how many elements of which dtype (for an all-gather also the dtype the shard had
before a mixed-precision cast, so ranks whose parameters were cast differently disagree: [Note: casts
after sharding] in `_dtype_casts`), and the group's step (root forwards so far) and epoch (see
below). Headers are all the same size, so they cannot abort; every rank sees every header, so every
rank reaches the same verdict: all post the payload, or all raise
`RankMismatchError` naming the ranks and what each was doing, with no payload posted anywhere.
The check blocks until every peer has reached the same collective, one round trip of 72 bytes per
peer; the payload itself stays asynchronous.

A rank that raises in forward or backward (a user hook, the loss, a bad batch on one rank) leaves the
step on its own. Its recovery calls `leave_step`, which sends every peer an ``Op.LEFT`` header: the
next `agree` on each peer reads it and raises too, in the same step, so every rank gets an error and
the ranks stay in step for the next iteration. Headers a rank posted in a step that was left are
stale; the group's *epoch* counts steps left, every header carries it, and a header from an older
epoch is skipped. A rank that learned of the departure from a peer (or whose error was a header
mismatch every rank saw) does not announce it again (``left``). If a rank leaves a step that a peer
already completed, the ranks may hold different parameters: that peer raises and the group is
marked broken, as it is after a timeout or a dead peer (gloo cannot withdraw a posted receive, so
the group's message streams can no longer be trusted); every later collective on it raises at once.

NCCL and other backends: no headers (reading one would synchronise the CPU with the GPU at every
collective); the first iteration's order and structure check (`_exec_order_utils`) is what runs
there. See docs/troubleshooting.md.
"""

from __future__ import annotations

import contextlib
import enum
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from fsdp_composable import _safety
from fsdp_composable._composable_state import group_record, group_records
from fsdp_composable.api import RankMismatchError

__all__: list[str] = []

# Far from the small tags user code picks, and from the payload tags in `_collectives`.
_HEADER_TAG = 0x46530010
_MAGIC = 0x46534450


class Op(enum.IntEnum):
    ALL_GATHER = 1
    REDUCE_SCATTER = 2
    ALL_REDUCE = 3
    ALL_TO_ALL = 4
    ALL_GATHER_OBJECT = 5
    BROADCAST = 6
    START = 7  # an entry point that moves no data (load_state_dict of a FULL state dict) checks in
    LEFT = 8  # not a collective: the sender left its step (see `leave_step`)


_OP_TEXT = {
    Op.ALL_GATHER: "an all-gather",
    Op.REDUCE_SCATTER: "a reduce-scatter",
    Op.ALL_REDUCE: "an all-reduce",
    Op.ALL_TO_ALL: "an all-to-all",
    Op.ALL_GATHER_OBJECT: "an all_gather_object",
    Op.BROADCAST: "a broadcast",
    Op.START: "its start",
    Op.LEFT: "nothing (it left the step)",
}

# Index = purpose code in the header. The first two are training; the rest are entry points that
# must be called on every rank.
_PURPOSES = (
    "forward",
    "backward",
    "the execution-order check",
    "state_dict()",
    "load_state_dict()",
    "optim_state_dict()",
    "optim_state_dict_to_load()",
    "unshard_params()",
    "clip_grad_norm_()",
    "sync_module_states",
    "reset_parameters()",
    "fully_shard()",
    "optimizer.state_dict()",
    "optimizer.load_state_dict()",
)
_FIRST_ENTRY_POINT = 3

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)

# ``origin``: an all-gather's shard dtype before a mixed-precision cast (see [Note: casts after sharding])
_FIELDS = ("magic", "op", "purpose", "epoch", "step", "numel", "dtype", "world", "origin")
_COMPARED = ("op", "purpose", "step", "numel", "dtype", "world", "origin")


@dataclass
class _GroupRecord:
    """What this rank knows about one process group's collectives (see [Note: collective headers])."""

    step: int = 0
    epoch: int = 0
    left: bool = False  # this rank already left the current step (or every rank saw the mismatch)
    broken: Optional[str] = None
    # the step's forward or backward already failed here: the collectives it still issues (a
    # prefetch) fail at once instead of meeting a peer that moved on; cleared by the next step
    abandoned: Optional[str] = None
    generation: int = 0  # bumped when a step starts or is left: see `settled`
    pending: list[Any] = field(default_factory=list)  # `Op.LEFT` sends in flight
    gloo: Optional[bool] = None  # the group's backend is gloo (None: not asked yet)
    several: bool = False  # the group has more than one rank


# the entry points running now, innermost last (a context variable: no shared mutable container)
_ENTRY: ContextVar[tuple[int, ...]] = ContextVar("fsdp_composable_entry_points", default=())


def _record(group: dist.ProcessGroup) -> _GroupRecord:
    return group_record(group, _GroupRecord)


def checks(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether collectives on ``group`` exchange headers first: gloo groups of more than one rank
    (unless a benchmark switched the headers off, [Note: safety switches])."""
    if group is None:
        return False
    record = _record(group)
    if record.gloo is None:  # a group's backend and size never change: asked once
        record.gloo = dist.get_backend(group) == "gloo"
        record.several = dist.get_world_size(group) > 1
    return bool(record.gloo and record.several) and _safety.current().headers


def is_gloo(group: dist.ProcessGroup) -> bool:
    """Whether ``group``'s backend is gloo (asked of torch once per group)."""
    record = _record(group)
    if record.gloo is None:
        checks(group)
    return bool(record.gloo)


@contextlib.contextmanager
def entry_point(name: str) -> Iterator[None]:
    """Collectives issued inside are labelled as ``name`` (one of `_PURPOSES`), which every rank must
    call: a rank elsewhere gets an error saying so."""
    index = _PURPOSES.index(name)
    if index >= _FIRST_ENTRY_POINT:  # entry points run between steps
        for record in group_records():
            record.abandoned = None
    token = _ENTRY.set((*_ENTRY.get(), index))
    try:
        yield
    finally:
        _ENTRY.reset(token)


def doing() -> str:
    """What the collectives issued now are for (an entry point's name, "forward" or "backward"), to
    name them in errors."""
    return _PURPOSES[_purpose()]


def check_in(groups: Iterable[Optional[dist.ProcessGroup]]) -> None:
    """An entry point that may move no data still meets the other ranks (``Op.START``): called on
    one rank only, it is an error on every rank instead of ranks silently holding different state."""
    for group in {id(g): g for g in groups if checks(g)}.values():
        assert group is not None
        agree_before(group, Op.START, 0, None, "check-in of every rank")


def _purpose() -> int:
    entries = _ENTRY.get()
    if entries:
        return entries[-1]
    return 1 if torch._C._current_graph_task_id() != -1 else 0


def start_step(group: Optional[dist.ProcessGroup]) -> None:
    """A root forward begins: count it (ranks compare counts) and forget that a step was left."""
    if checks(group):
        assert group is not None
        record = _record(group)
        record.step += 1
        record.generation += 1
        record.left = False
        record.abandoned = None


def leave_step(groups: Iterable[Optional[dist.ProcessGroup]]) -> None:
    """This rank's forward or backward raised: tell every peer, unless it already knows."""
    for group in {id(g): g for g in groups if checks(g)}.values():
        assert group is not None
        record = _record(group)
        record.generation += 1
        if record.left or record.broken is not None:
            continue
        header = _header(group, record, Op.LEFT, 0, None)
        me = dist.get_rank(group)
        try:
            for peer in range(dist.get_world_size(group)):
                if peer != me:
                    record.pending.append(dist.isend(header, dist.get_global_rank(group, peer), group, _HEADER_TAG))
        except RuntimeError as e:  # a peer is gone: nothing to tell it
            record.broken = f"a peer could not be told that this rank left step {record.step} ({e})"
        record.epoch += 1
        record.left = True
        record.abandoned = None  # the step is over here; what follows belongs to the next


def saw_mismatch(group: Optional[dist.ProcessGroup], reason: str) -> None:
    """Every rank found the same disagreement (the first iteration's order check) and raises: none
    needs to announce that it leaves the step, whichever way its error unwinds."""
    if checks(group):
        assert group is not None
        record = _record(group)
        record.left = True
        record.abandoned = reason


def generation(group: dist.ProcessGroup) -> int:
    return _record(group).generation if checks(group) else 0


def settled(group: dist.ProcessGroup, created: int) -> bool:
    """Whether the step in which a collective was refused (``created``: `generation` then) is over on
    this rank: its recovery ran or the next step began. Waiting for it then only discards it."""
    return checks(group) and _record(group).generation != created


def _dtype_code(dtype: Optional[torch.dtype]) -> int:
    if dtype is None:
        return -1
    return _DTYPES.index(dtype) if dtype in _DTYPES else 99


def _header(
    group: dist.ProcessGroup,
    record: _GroupRecord,
    op: Op,
    numel: int,
    dtype: Optional[torch.dtype],
    origin: Optional[torch.dtype] = None,
) -> torch.Tensor:
    values = (
        _MAGIC,
        int(op),
        _purpose(),
        record.epoch,
        record.step,
        numel,
        _dtype_code(dtype),
        dist.get_world_size(group),
        _dtype_code(origin if origin != dtype else None),
    )
    return torch.tensor(values, dtype=torch.int64)


def _describe(h: dict[str, int]) -> str:
    if h["op"] == Op.LEFT:
        return f"left step {h['step']} (it raised an exception there)"
    purpose = _PURPOSES[h["purpose"]] if 0 <= h["purpose"] < len(_PURPOSES) else f"<purpose {h['purpose']}>"
    dtype = _DTYPES[h["dtype"]] if 0 <= h["dtype"] < len(_DTYPES) else None
    size = (
        ""
        if h["op"] in (Op.START, Op.ALL_GATHER_OBJECT)
        else f" of {h['numel']:,} {str(dtype).replace('torch.', '')} elements"
    )
    if 0 <= h.get("origin", -1) < len(_DTYPES):
        size += f" cast from {str(_DTYPES[h['origin']]).replace('torch.', '')}"
    return f"{purpose}: {_OP_TEXT[Op(h['op'])]}{size} (step {h['step']})"


def agree_before(
    group: dist.ProcessGroup, op: Op, numel: int, dtype: Optional[torch.dtype], what: str, purpose: Optional[str] = None
) -> None:
    """`agree` before a blocking native collective: errors name it (``what``, e.g. "the all-to-all of
    unit 'blocks.1'"), as `_collectives.wait` names the asynchronous ones."""
    try:
        with entry_point(purpose) if purpose is not None else contextlib.nullcontext():
            agree(group, op, numel, dtype)
    except RankMismatchError as e:
        raise RankMismatchError(f"fully_shard: the {doing()} {what} was not run: {e}") from e
    except RuntimeError as e:
        raise RuntimeError(f"fully_shard: the {doing()} {what} did not complete: {e}") from e


def agree(
    group: dist.ProcessGroup,
    op: Op,
    numel: int,
    dtype: Optional[torch.dtype],
    origin: Optional[torch.dtype] = None,
) -> None:
    """Block until every rank of ``group`` reached a collective and check it is the same one; raise
    `RankMismatchError` (on every rank) if not. ``numel``: a size every rank must agree on; ``origin``:
    the dtype the payload was cast from, which every rank must agree on too. No-op where `checks` is
    false. See [Note: collective headers]."""
    if not checks(group):
        return
    record = _record(group)
    if record.broken is not None:
        raise RankMismatchError(
            f"this process group can no longer be used: {record.broken}. Restart the job (from a checkpoint)"
        )
    if record.abandoned is not None and _purpose() < _FIRST_ENTRY_POINT:
        raise RankMismatchError(f"not run: this step was already abandoned ({record.abandoned})")
    record.pending = [w for w in record.pending if not w.is_completed()]
    mine = _header(group, record, op, numel, dtype, origin)
    me, size = dist.get_rank(group), dist.get_world_size(group)
    peers = [p for p in range(size) if p != me]
    theirs: dict[int, dict[str, int]] = {}
    try:
        posted = {p: _post_recv(group, p) for p in peers}  # first: [Note: receives before sends]
        sends = [dist.isend(mine, dist.get_global_rank(group, p), group, _HEADER_TAG) for p in peers]
        while posted:
            for peer, (buffer, work) in list(posted.items()):
                work.wait()
                header = dict(zip(_FIELDS, buffer.tolist()))
                if header["epoch"] < record.epoch:  # posted in a step that was left: skip it
                    posted[peer] = _post_recv(group, peer)
                    continue
                theirs[peer] = header
                del posted[peer]
        for send in sends:
            if send is not None:
                send.wait()
    except RuntimeError as e:
        record.broken = f"a collective did not complete ({e})"
        hint = _entry_hint({_purpose()})
        raise RuntimeError(f"{e}. While waiting for the other ranks to reach this collective{hint}") from e
    _verdict(group, record, dict(zip(_FIELDS, mine.tolist())), theirs)


def _post_recv(group: dist.ProcessGroup, peer: int) -> tuple[torch.Tensor, Any]:
    buffer = torch.empty(len(_FIELDS), dtype=torch.int64)
    return buffer, dist.irecv(buffer, dist.get_global_rank(group, peer), group, _HEADER_TAG)


def _entry_hint(purposes: set[int]) -> str:
    entries = sorted(_PURPOSES[p] for p in purposes if _FIRST_ENTRY_POINT <= p < len(_PURPOSES))
    if not entries:
        return ""
    verb = "is a collective" if len(entries) == 1 else "are collectives"
    return f"; {' and '.join(entries)} {verb}: it must be called on every rank"


def _verdict(
    group: dist.ProcessGroup, record: _GroupRecord, mine: dict[str, int], theirs: dict[int, dict[str, int]]
) -> None:
    me = dist.get_rank(group)
    everyone = {**theirs, me: mine}
    left = sorted(r for r, h in theirs.items() if h["op"] == Op.LEFT)
    if not left and all(
        all(h[k] == mine[k] for k in _COMPARED) and h["epoch"] == mine["epoch"] for h in theirs.values()
    ):
        return
    detail = "; ".join(f"rank {r}: {_describe(everyone[r])}" for r in sorted(everyone))
    if left:
        steps = {theirs[r]["step"] for r in left}
        if steps != {record.step}:  # it left a step this rank already finished
            record.broken = f"rank {left[0]} left step {min(steps)} after this rank finished it"
            raise RankMismatchError(
                f"rank(s) {left} raised in step {min(steps)} after this rank had completed that step ({detail}). "
                "The ranks may now hold different parameters: restart from a checkpoint"
            )
        record.epoch += 1
        record.left = True
        record.abandoned = f"rank(s) {left} left it"
        raise RankMismatchError(
            f"rank(s) {left} raised an exception in this step and left it ({detail}). Every rank abandons "
            "the step; the next one can run. See the failing rank's log for its exception"
        )
    record.left = True  # every rank saw the same headers: none announces leaving
    if _purpose() < _FIRST_ENTRY_POINT:
        record.abandoned = "the ranks reached different collectives"
    record.step = max(h["step"] for h in everyone.values())
    hint = _entry_hint({h["purpose"] for h in everyone.values()})
    if all(h[k] == mine[k] for h in theirs.values() for k in _COMPARED if k not in ("dtype", "origin")):
        hint += (
            "; the ranks' parameters have different dtypes: cast the model alike on every rank "
            "(model.half(), model.to(dtype), ...)"
        )
    raise RankMismatchError(
        f"ranks reached different collectives ({detail}). Nothing was sent{hint}. Every rank must run the same "
        "modules, steps and collective calls in the same order"
    )
