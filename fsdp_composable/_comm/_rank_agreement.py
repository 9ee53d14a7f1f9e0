"""Ranks agree on each collective before its payload is posted (gloo), so a disagreement is an error.

[Note: collective headers]
On gloo, a receive posted for a message of another size kills the process from gloo's own thread
("terminate called ... Received data size doesn't match expected size"), and a message of the same
size from another collective is silently wrong data. So before any payload of ours is posted on a
gloo group, every rank sends every peer a small fixed-size header and receives theirs (`agree`):
which collective (`Op`), what for (`purpose`: forward, backward, or a collective entry point such as
``state_dict()``), how many elements of which dtype (for an all-gather also the dtype the shard had
before a mixed-precision cast, so ranks whose parameters were cast differently disagree: [Note: casts
after sharding] in `_dtype_casts`), the unit whose collective it is ([Note: the unit in the header]
in `_header_fields`), and the group's step (root forwards so far) and epoch (see below). Headers
are all the same size, so they cannot abort; every rank sees every header, so every rank reaches
the same verdict: all complete the collective, or all raise `RankMismatchError` naming the ranks
and what each was doing, with no payload received anywhere.

Native collectives (`agree`) are posted once the headers agreed: the check blocks until every peer
reached the same collective. Our point-to-point exchanges do not wait ([Note: agreement without a
round trip]).

[Note: agreement without a round trip]
A header is only a guard against receiving a payload of the wrong size, so an exchange posts its
header and its payload together (`begin`) and checks the peers' headers when it is waited for
(`settle`). The payload's tag is derived from the group's epoch, the collective and its size
(`payload_tag`), so a receive can only meet a send of the same size and purpose: if the ranks
disagree, the messages stay unmatched instead of killing the process, every rank raises at
``settle`` as before, and the group's epoch moves on so that nothing posted in that step can ever be
matched later (the unmatched requests are kept in the group's record, never freed under gloo). The
headers of several exchanges may be in flight at once: each carries its sequence number within the
epoch, and ``settle`` reads each peer's headers in the order they were sent, keeping those of
exchanges not waited for yet. Each header receive is posted with its exchange, before its sends
([Note: receives before sends] in `_exchanges`). ``settle`` waits for its own header sends only
when no peer left or refused the step: such a peer receives them only at its next exchange on the
group, which may come after collectives of another group that wait for this rank (two roots trained
together). Two different sizes could in principle hash to the same tag (one chance in 2^29 per pair
of disagreeing exchanges): only in a step whose ranks disagree anyway, where gloo would then end the
process, as it would without headers.

A rank that raises in forward or backward (a user hook, the loss, a bad batch on one rank) leaves the
step on its own. Its recovery calls `leave_step`, which sends every peer an ``Op.LEFT`` header: the
next `agree` on each peer reads it and raises too, in the same step, so every rank gets an error and
the ranks stay in step for the next iteration. Headers a rank posted in a step that was left are
stale; the group's *epoch* counts steps left (or refused after a disagreement), every header carries
it, and a header from an older epoch is skipped. A rank that learned of the departure from a peer
(or whose error was a header mismatch every rank saw) does not announce it again (``left``). If a
rank leaves a step that a peer already completed, the ranks may hold different parameters: that peer
raises and the group is marked broken, as it is after a timeout or a dead peer (gloo cannot withdraw a
posted receive, so the group's message streams can no longer be trusted); every later collective on
it raises at once.

NCCL and other backends: no headers (reading one would synchronise the CPU with the GPU at every
collective); the first iteration's order and structure check (`_exec_order_utils`) is what runs
there. See docs/troubleshooting.md.
"""

from __future__ import annotations

import collections
import contextlib
import operator
import struct
import zlib
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from fsdp_composable._base import _safety
from fsdp_composable._comm._header_fields import (
    _DTYPES,
    _FIRST_ENTRY_POINT,
    _OP_TEXT,
    _PURPOSES,
    Op,
    _dtype_code,
    _unit_code,
    current_unit,
)
from fsdp_composable._composable_state import group_record, group_records
from fsdp_composable.api import CollectiveError, RankMismatchError

__all__: list[str] = []

# Far from the small tags user code picks, and from the payload tags in `_exchanges`.
_HEADER_TAG = 0x46530010
_MAGIC = 0x46534450
# An exchange's payload tag when headers are on: [_PAYLOAD_TAGS, _PAYLOAD_TAGS + _PAYLOAD_TAG_SPAN),
# clear of the tags above and below 2**31 (gloo's tags are non-negative int32)
_PAYLOAD_TAGS = 0x50000000
_PAYLOAD_TAG_SPAN = 1 << 29


# ``origin``: an all-gather's shard dtype before a mixed-precision cast (see [Note: casts after sharding])
# ``unit``: a checksum of the unit's FQN (0: no unit), see [Note: the unit in the header]
_FIELDS = ("magic", "op", "purpose", "epoch", "step", "numel", "dtype", "world", "origin", "unit", "seq")
_COMPARED = ("op", "purpose", "step", "numel", "dtype", "world", "origin", "unit")
_SAME = operator.itemgetter(*_COMPARED, "epoch")  # what every peer's header must share with this rank's
_PACK = struct.Struct(f"{len(_FIELDS)}q")  # a header's bytes (native int64s, as the tensor holds them)


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
    pending: list[Any] = field(default_factory=list)  # header sends in flight (`Op.LEFT` ones too)
    seq: int = 0  # headers sent in this epoch ([Note: agreement without a round trip])
    # per peer: header receives posted, oldest first, and headers read of this epoch not settled yet
    posted: dict[int, collections.deque[tuple[torch.Tensor, Any]]] = field(default_factory=dict)
    inbox: dict[int, dict[int, dict[str, int]]] = field(default_factory=dict)
    unmatched: list[Any] = field(default_factory=list)  # payload requests of refused exchanges
    gloo: Optional[bool] = None  # the group's backend is gloo (None: not asked yet)
    several: bool = False  # the group has more than one rank
    # a group's size and ranks never change: asked of torch once (`_learn`), not at every collective
    size: int = 0
    rank: int = 0
    global_ranks: tuple[int, ...] = ()  # by group rank (filled by `group_ranks` when first needed)
    peers: tuple[int, ...] = ()  # the other ranks' group ranks
    unit_names: dict[int, str] = field(default_factory=dict)  # unit checksum -> FQN, to name a peer's unit


# the entry points running now, innermost last (a context variable: no shared mutable container)
_ENTRY: ContextVar[tuple[int, ...]] = ContextVar("fsdp_composable_entry_points", default=())


def _record(group: dist.ProcessGroup) -> _GroupRecord:
    return group_record(group, _GroupRecord)


def _learn(group: dist.ProcessGroup, record: _GroupRecord) -> None:
    """A group's backend, size and this rank's place in it never change: asked of torch once."""
    record.size, record.rank = dist.get_world_size(group), dist.get_rank(group)
    record.peers = tuple(p for p in range(record.size) if p != record.rank)
    record.several = record.size > 1
    record.gloo = dist.get_backend(group) == "gloo"


def checks(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether collectives on ``group`` exchange headers first: gloo groups of more than one rank
    (unless a benchmark switched the headers off, [Note: safety switches]). The one switch every
    header path asks (tests replace it)."""
    if group is None:
        return False
    record = _record(group)
    if record.gloo is None:
        _learn(group, record)
    return bool(record.gloo and record.several) and _safety.current().headers


def is_gloo(group: dist.ProcessGroup) -> bool:
    """Whether ``group``'s backend is gloo (asked of torch once per group)."""
    record = _record(group)
    if record.gloo is None:
        _learn(group, record)
    return bool(record.gloo)


def group_ranks(group: dist.ProcessGroup) -> tuple[int, int, tuple[int, ...]]:
    """``group``'s size, this rank's group rank and every group rank's global rank (asked once)."""
    record = _record(group)
    if record.gloo is None:
        _learn(group, record)
    if not record.global_ranks:
        record.global_ranks = tuple(dist.get_global_rank(group, r) for r in range(record.size))
    return record.size, record.rank, record.global_ranks


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


def name_units(group: Optional[dist.ProcessGroup], names: Iterable[str]) -> None:
    """Remember the units' names for ``group``'s messages: a peer's header carries only a checksum."""
    if checks(group):
        assert group is not None
        _record(group).unit_names.update((_unit_code(n), n) for n in names)


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
        header = _tensor(_header(record, Op.LEFT, 0, None))
        try:
            _, _, global_ranks = group_ranks(group)
            for peer in record.peers:
                record.pending.append(dist.isend(header, global_ranks[peer], group, _HEADER_TAG))
        except RuntimeError as e:  # a peer is gone: nothing to tell it
            record.broken = f"a peer could not be told that this rank left step {record.step} ({e})"
        _new_epoch(record)
        record.left = True
        record.abandoned = None  # the step is over here; what follows belongs to the next


def saw_mismatch(group: Optional[dist.ProcessGroup], reason: str) -> None:
    """Every rank found the same disagreement (the first iteration's order check) and raises: none
    needs to announce that it leaves the step, whichever way its error unwinds."""
    if checks(group):
        assert group is not None
        record = _record(group)
        if not record.left:  # exchanges of the step may still be posted: their tags must not match again
            _new_epoch(record)
        record.left = True
        record.abandoned = reason


def generation(group: dist.ProcessGroup) -> int:
    return _record(group).generation if checks(group) else 0


def settled(group: dist.ProcessGroup, created: int) -> bool:
    """Whether the step in which a collective was refused (``created``: `generation` then) is over on
    this rank: its recovery ran or the next step began. Waiting for it then only discards it."""
    return checks(group) and _record(group).generation != created


def _new_epoch(record: _GroupRecord) -> None:
    """The step was left or refused on every rank: what was posted in it belongs to no later step."""
    record.epoch += 1
    record.seq = 0
    record.inbox.clear()


def _header(
    record: _GroupRecord,
    op: Op,
    numel: int,
    dtype: Optional[torch.dtype],
    origin: Optional[torch.dtype] = None,
    seq: int = -1,
) -> tuple[int, ...]:
    """This rank's header, in the order of `_FIELDS`."""
    return (
        _MAGIC,
        int(op),
        _purpose(),
        record.epoch,
        record.step,
        numel,
        _dtype_code(dtype),
        record.size,
        _dtype_code(origin if origin != dtype else None),
        _unit_code(current_unit()),
        seq,
    )


def _tensor(header: tuple[int, ...]) -> torch.Tensor:
    """A header as the int64 tensor sent, made from its bytes (half the cost of ``torch.tensor``)."""
    return torch.frombuffer(bytearray(_PACK.pack(*header)), dtype=torch.int64)


def _describe(h: dict[str, int], units: Optional[dict[int, str]] = None) -> str:
    """``units`` (checksum -> name): also name the unit, where the ranks' units differ."""
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
    unit = ""
    if units is not None:
        unit = " of no unit" if not h["unit"] else f" of unit {units.get(h['unit'], '<unknown>')!r}"
    return f"{purpose}: {_OP_TEXT[Op(h['op'])]}{unit}{size} (step {h['step']})"


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
        raise CollectiveError(f"fully_shard: the {doing()} {what} did not complete: {e}") from e


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
    agreement = begin(group, op, numel, dtype, origin)
    if agreement is not None:
        settle(agreement)


@dataclass
class Agreement:
    """A header sent to every peer and the receives of theirs, checked by `settle`."""

    group: dist.ProcessGroup
    mine: dict[str, int]
    peers: list[int]
    sends: list[Any]


def begin(
    group: dist.ProcessGroup,
    op: Op,
    numel: int,
    dtype: Optional[torch.dtype],
    origin: Optional[torch.dtype] = None,
) -> Optional[Agreement]:
    """Send this rank's header for a collective to every peer without waiting for theirs (None where
    `checks` is false); `settle` checks it. Raises at once if the group is unusable or the step was
    already abandoned. See [Note: agreement without a round trip]."""
    if not checks(group):
        return None
    record = _record(group)
    if record.broken is not None:
        raise RankMismatchError(
            f"this process group can no longer be used: {record.broken}. Restart the job (from a checkpoint)"
        )
    if record.abandoned is not None and _purpose() < _FIRST_ENTRY_POINT:
        raise RankMismatchError(f"not run: this step was already abandoned ({record.abandoned})")
    record.pending = [w for w in record.pending if not w.is_completed()]
    record.unmatched = [w for w in record.unmatched if not w.is_completed()]
    header = _header(record, op, numel, dtype, origin, record.seq)
    if current_unit():
        record.unit_names.setdefault(header[_FIELDS.index("unit")], current_unit())
    mine = _tensor(header)
    record.seq += 1
    peers = list(record.peers)
    try:
        _, _, global_ranks = group_ranks(group)
        for peer in peers:  # first: [Note: receives before sends]
            record.posted.setdefault(peer, collections.deque()).append(_post_recv(group, peer))
        sends = [dist.isend(mine, global_ranks[p], group, _HEADER_TAG) for p in peers]
    except RuntimeError as e:
        record.broken = f"a collective did not complete ({e})"
        raise RuntimeError(f"{e}. While sending this rank's collective header{_entry_hint({_purpose()})}") from e
    # held until done even if the exchange is refused unread: gloo must never see a request destroyed
    # while it is still posted (it would write into freed memory)
    record.pending.extend(sends)
    return Agreement(group, dict(zip(_FIELDS, header)), peers, sends)


def payload_tag(agreement: Optional[Agreement], tag: int) -> int:
    """The tag of an exchange's payload: ``tag`` itself without headers, else one that only a payload
    of the same collective, size and epoch carries ([Note: agreement without a round trip])."""
    if agreement is None:
        return tag
    h = agreement.mine
    key = struct.pack("<8q", tag, h["epoch"], h["op"], h["purpose"], h["numel"], h["dtype"], h["origin"], h["unit"])
    return _PAYLOAD_TAGS + zlib.crc32(key) % _PAYLOAD_TAG_SPAN


def keep_unmatched(group: dist.ProcessGroup, requests: Iterable[Any]) -> None:
    """The payload requests of a refused exchange: held by the group's record, so gloo never writes
    into or reads from freed memory (nothing will match them: their epoch is over)."""
    _record(group).unmatched.extend(requests)


def settle(agreement: Agreement) -> None:
    """Wait for every peer's header of ``agreement``'s collective and check it is the same one; raise
    `RankMismatchError` (on every rank) if not."""
    group, mine = agreement.group, agreement.mine
    record = _record(group)
    if mine["epoch"] != record.epoch:  # the step was left or refused meanwhile (here or by a peer)
        raise RankMismatchError(f"not run: this step was already abandoned ({record.abandoned or 'it was left'})")
    theirs: dict[int, dict[str, int]] = {}
    try:
        for peer in agreement.peers:
            header = _header_of(group, record, peer, mine["seq"])
            if header["epoch"] > mine["epoch"]:  # the peer refused the step already: [Note: ...]
                theirs = {peer: header}
                break
            theirs[peer] = header
        if all(h["op"] != Op.LEFT and h["epoch"] == mine["epoch"] for h in theirs.values()):
            # a peer that left posts no receive for this header before its next exchange on this group,
            # which may wait for this rank elsewhere (another root's group): kept in ``pending`` instead
            for send in agreement.sends:
                send.wait()
    except RuntimeError as e:
        record.broken = f"a collective did not complete ({e})"
        hint = _entry_hint({_purpose()})
        raise RuntimeError(f"{e}. While waiting for the other ranks to reach this collective{hint}") from e
    _verdict(group, record, mine, theirs)


def _header_of(group: dist.ProcessGroup, record: _GroupRecord, peer: int, seq: int) -> dict[str, int]:
    """``peer``'s header number ``seq`` of this epoch, read in the order the peer sent its headers
    (those of exchanges not settled yet are kept in the inbox); its departure (`Op.LEFT`) or a header
    of a later epoch if the peer left or refused this step first."""
    inbox = record.inbox.setdefault(peer, {})
    while seq not in inbox:
        queue = record.posted.setdefault(peer, collections.deque())
        if not queue:  # each `begin` posted one; skipped stale headers used some
            queue.append(_post_recv(group, peer))
        buffer, work = queue[0]
        work.wait()  # only then dropped: a request must not be destroyed while gloo may still fill it
        queue.popleft()
        header = dict(zip(_FIELDS, buffer.tolist()))
        if header["epoch"] < record.epoch:  # posted in a step that was left: skip it
            continue
        if header["op"] == Op.LEFT or header["epoch"] > record.epoch:
            return header
        inbox[header["seq"]] = header
    return inbox.pop(seq)


def _post_recv(group: dist.ProcessGroup, peer: int) -> tuple[torch.Tensor, Any]:
    buffer = torch.empty(len(_FIELDS), dtype=torch.int64)
    return buffer, dist.irecv(buffer, group_ranks(group)[2][peer], group, _HEADER_TAG)


def entry_hint() -> str:
    """"; X is a collective: it must be called on every rank" for the entry point running now ("" in
    training)."""
    return _entry_hint({_purpose()})


def _entry_hint(purposes: set[int]) -> str:
    entries = sorted(_PURPOSES[p] for p in purposes if _FIRST_ENTRY_POINT <= p < len(_PURPOSES))
    if not entries:
        return ""
    verb = "is a collective" if len(entries) == 1 else "are collectives"
    return f"; {' and '.join(entries)} {verb}: it must be called on every rank"


def _global(group: dist.ProcessGroup, ranks: list[int]) -> list[int]:
    """The global ranks of ``group``'s ``ranks``: messages name the ranks users know, also on a subgroup."""
    return [group_ranks(group)[2][r] for r in ranks]


def _verdict(
    group: dist.ProcessGroup, record: _GroupRecord, mine: dict[str, int], theirs: dict[int, dict[str, int]]
) -> None:
    everyone = {**theirs, record.rank: mine}
    ahead = sorted(r for r, h in theirs.items() if h["op"] != Op.LEFT and h["epoch"] > mine["epoch"])
    if ahead:  # a peer refused this step at an exchange this rank had not settled yet: so does this one
        _new_epoch(record)
        record.left = True
        named = _global(group, ahead)
        record.abandoned = f"rank(s) {named} abandoned it"
        for r in ahead:  # the first header of its next step: keep it for that step
            if theirs[r]["epoch"] == record.epoch:
                record.inbox.setdefault(r, {})[theirs[r]["seq"]] = theirs[r]
        raise RankMismatchError(
            f"rank(s) {named} found that the ranks reached different collectives in this step and abandoned "
            "it. Every rank must run the same modules, steps and collective calls in the same order"
        )
    left = sorted(r for r, h in theirs.items() if h["op"] == Op.LEFT)
    same = _SAME(mine)
    if not left and all(_SAME(h) == same for h in theirs.values()):
        return
    ranks = sorted(everyone)
    units = {h["unit"] for h in everyone.values() if h["op"] != Op.LEFT}
    names = record.unit_names if len(units) > 1 else None
    detail = "; ".join(f"rank {g}: {_describe(everyone[r], names)}" for r, g in zip(ranks, _global(group, ranks)))
    if left:
        steps = {theirs[r]["step"] for r in left}
        named = _global(group, left)
        if steps != {record.step}:  # it left a step this rank already finished
            record.broken = f"rank {named[0]} left step {min(steps)} after this rank finished it"
            raise RankMismatchError(
                f"rank(s) {named} raised in step {min(steps)} after this rank had completed that step ({detail}). "
                "The ranks may now hold different parameters: restart from a checkpoint"
            )
        _new_epoch(record)
        record.left = True
        record.abandoned = f"rank(s) {named} left it"
        raise RankMismatchError(
            f"rank(s) {named} raised an exception in this step and left it ({detail}). Every rank abandons "
            "the step; the next one can run. See the failing rank's log for its exception"
        )
    _new_epoch(record)  # on every rank: what was posted in this step must not match later
    record.left = True  # every rank saw the same headers: none announces leaving
    if _purpose() < _FIRST_ENTRY_POINT:
        record.abandoned = "the ranks reached different collectives"
    record.step = max(h["step"] for h in everyone.values())
    hint = _entry_hint({h["purpose"] for h in everyone.values()})
    if all(h[k] == mine[k] for h in theirs.values() for k in _COMPARED if k != "unit"):
        hint += (
            "; the ranks ran different units: look for data-dependent branches or modules skipped on some "
            "ranks (the units run in every iteration must be the same on every rank)"
        )
    elif all(h[k] == mine[k] for h in theirs.values() for k in _COMPARED if k not in ("dtype", "origin")):
        hint += (
            "; the ranks' parameters have different dtypes: cast the model alike on every rank "
            "(model.half(), model.to(dtype), ...)"
        )
    raise RankMismatchError(
        f"ranks reached different collectives ({detail}). No rank completed it{hint}. Every rank must run the same "
        "modules, steps and collective calls in the same order"
    )
