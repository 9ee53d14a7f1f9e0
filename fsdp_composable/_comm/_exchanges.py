"""Our all-gather and reduce-scatter on gloo, built from point-to-point messages: the exchanges.

[Note: gloo collectives as point-to-point exchanges]
On gloo, `all_gather` and `reduce_scatter` are built from ``isend``/``irecv`` instead of gloo's own
``all_gather_single``/``reduce_scatter_single``: every rank sends its piece straight to each peer and
receives straight into the output. Measured on 2 CPU ranks with one 12 MiB block
(``benchmarks/bench_collectives.py``, table in ``benchmarks/README.md``), gloo's own calls took
8.1 ms (all-gather) and 17.1 ms (reduce-scatter, slower than gloo's all-reduce of the same tensor,
which sends twice the bytes); the exchanges took 5.9 ms and 4.3 ms (6.6 ms sent as 10 parameter
pieces). The bytes each rank sends are the same as a ring's, (N-1)/N of the payload.

Each kind has its own tag; every rank issues the exchanges of a kind in the same order (the units'
order, which the first iteration's order check enforces), and gloo matches the messages of one
(peer, tag) first in, first out, so the k-th message a rank receives from a peer is the k-th that
peer sent it. A reduce-scatter given parts (autograd's gradients, one per parameter) sends each
part's slice of a peer's chunk as its own message; the slice boundaries depend only on the sizes, so
both sides agree on them. A reduce-scatter receives the lowest other rank's chunk into the output
itself and the others' through its own chunk's memory once that is summed ([Note: the reduce-scatter's scratch]),
so it usually needs no memory beyond its output. A send request holds the tensor it sends until
the request itself is dropped, and a gradient reduction is kept to the end of backward (its result
is committed there), so a completed exchange drops its requests at once: otherwise every reduced
unit's gradients, the slices sent to peers, stay alive through the whole backward. NCCL and other
backends use their native collectives.

[Note: receives before sends]
gloo's point-to-point messages meet by rendezvous: a send's bytes go out once the receiving side
has said that a matching receive is posted, so a send posted before the peer's receive waits one more
round trip between the two processes' gloo threads, each a thread wake-up, which on cores busy with
compute can cost a scheduler tick. Every exchange (and the header exchange of `_rank_agreement`)
posts its receives first: by the time a peer sends, it has usually heard of the receive already and
writes at once. Matching is per peer, tag and direction, first in first out, so the order of a rank's
own receives and sends changes nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from fsdp_composable._comm import _rank_agreement
from fsdp_composable._comm._rank_agreement import Op
from fsdp_composable.api import RankMismatchError

__all__: list[str] = []

# Tags far from the small numbers user code picks for its own isend/irecv on the same group.
_ALL_GATHER_TAG = 0x46530001
_REDUCE_SCATTER_TAG = 0x46530002
_REDUCE_SCATTER_LATE_TAG = 0x46530003  # the chunks a reduce-scatter receives late: [Note: the reduce-scatter's scratch]


@dataclass
class Exchange:
    """Point-to-point requests in flight and what to do with the received data once they complete.
    ``error``: posting them failed (a peer already gone, or the ranks disagreed); `wait` raises it, so
    it is reported like a native collective's failure, naming the unit. A refused collective waited
    for after its step was left (the recovery discarding it) zeroes ``output`` instead, so a gradient
    reduction of the failed step adds nothing (see [Note: collective headers])."""

    requests: Sequence[dist.Work]
    then: Optional[Callable[[], None]] = None
    error: Optional[RuntimeError] = None
    output: Optional[torch.Tensor] = None
    group: Optional[dist.ProcessGroup] = None
    generation: int = 0
    # the headers sent with the payload, checked first by `wait` ([Note: agreement without a round trip])
    agreement: Optional[_rank_agreement.Agreement] = None
    # refused with its payload posted: a receive may still write into ``output`` (see `left_posted`)
    unmatched: bool = False
    # a reduce-scatter's chunks received after its first one ([Note: the reduce-scatter's scratch])
    late: Optional["LateChunks"] = None

    def wait(self) -> bool:
        if self.agreement is not None:
            agreement, self.agreement = self.agreement, None
            try:
                _rank_agreement.settle(agreement)
            except RuntimeError as e:  # refused (or a peer died): the payload may never be matched
                if self.late is not None:  # a peer may be waiting for its late send to complete
                    late, self.late = self.late, None
                    try:
                        self.requests = [*self.requests, *late.abandon()]
                    except RuntimeError:  # the group is broken (a peer died): nobody waits any more
                        self.requests = [*self.requests, *late.sends]
                _rank_agreement.keep_unmatched(agreement.group, self.requests)
                self.unmatched = bool(self.requests)
                self.requests, self.then, self.error = (), None, e
        if self.error is not None:
            refused = isinstance(self.error, RankMismatchError) and self.group is not None
            if refused and _rank_agreement.settled(self.group, self.generation):  # type: ignore[arg-type]
                if self.output is not None:
                    self.output.zero_()
                return True
            raise self.error
        for request in self.requests:
            request.wait()
        # the requests hold what they sent (slices of a unit's gradients): see [Note: gloo
        # collectives as point-to-point exchanges]
        self.requests = ()
        if self.then is not None:
            then, self.then = self.then, None
            then()
        if self.late is not None:
            late, self.late = self.late, None
            late.receive()
        return True


@dataclass
class LateChunks:
    """The chunks a reduce-scatter over more than 2 ranks receives after its first, one at a time
    into its scratch and added to the output ([Note: the reduce-scatter's scratch])."""

    group: dist.ProcessGroup
    sources: list[int]  # global ranks, in the order their chunks are received
    tag: int
    scratch: list[torch.Tensor]  # where each message of a chunk lands: [Note: the reduce-scatter's scratch]
    output: torch.Tensor
    sizes: list[int]  # a chunk's messages, as its sender cut it (`_pieces_by_chunk`)
    # this rank's late sends: waited for after its late receives, since a peer posts the receive of
    # one only once its own early chunks arrived (waiting for them first could wait in a circle)
    sends: list[Any]
    # this rank's own chunk, when it comes among the late ones: its pieces that are not scratch are
    # added before ``sources[mine_before]``, the scratch ones (`free_mine`) before the first receive
    add_mine: Optional[Callable[[], None]] = None
    mine_before: int = 0
    free_mine: Optional[Callable[[], None]] = None

    def _post(self, source: int, into: list[torch.Tensor]) -> list[Any]:
        return [dist.irecv(piece, source, group=self.group, tag=self.tag) for piece in into]

    def receive(self) -> None:
        if self.free_mine is not None:
            self.free_mine()
        outputs = list(self.output.split(self.sizes))
        for i, source in enumerate(self.sources):
            if i == self.mine_before and self.add_mine is not None:
                self.add_mine()
            for request in self._post(source, self.scratch):
                request.wait()
            torch._foreach_add_(outputs, self.scratch)
        if self.mine_before == len(self.sources) and self.add_mine is not None:
            self.add_mine()
        sends, self.sends = self.sends, []
        for request in sends:
            request.wait()

    def abandon(self) -> list[Any]:
        """The exchange failed: post the receives anyway, into memory of their own (kept with the
        unmatched requests, as the late sends are), so a peer that sent its chunk is not left waiting."""
        own = [self._post(source, list(torch.empty_like(self.output).split(self.sizes))) for source in self.sources]
        return [request for requests in own for request in requests] + self.sends


def reusable_pieces(pieces: list[list[torch.Tensor]], me: int, writable: Sequence[torch.Tensor]) -> list[bool]:
    """For each piece of this rank's chunk (``pieces[me]``): whether its memory may take a later
    chunk once it was added to the output ([Note: the reduce-scatter's scratch]): inside a tensor of ``writable``
    (memory nothing else holds) and in no piece of another chunk (a 0-dim parameter's gradient, sent
    whole in every chunk; shared zeros and flags are not ``writable``)."""
    owned = {t.untyped_storage().data_ptr() for t in writable if t.numel()}
    if not owned:
        return [False] * len(pieces[me])

    def span(t: torch.Tensor) -> tuple[int, int, int]:
        start = int(t.storage_offset()) * t.element_size()
        return t.untyped_storage().data_ptr(), start, start + t.numel() * t.element_size()

    sent: dict[int, list[tuple[int, int]]] = {}
    for r, chunk in enumerate(pieces):
        if r != me:
            for piece in chunk:
                ptr, lo, hi = span(piece)
                if ptr in owned:
                    sent.setdefault(ptr, []).append((lo, hi))
    out = []
    for piece in pieces[me]:
        ptr, lo, hi = span(piece)
        out.append(ptr in owned and piece.is_contiguous() and not any(a < hi and lo < b for a, b in sent.get(ptr, ())))
    return out


def _peers(group: dist.ProcessGroup) -> tuple[int, int, list[tuple[int, int]]]:
    """(group size, my group rank, [(destination, source)] as group ranks for k = 1..N-1)."""
    size, me, _ = _rank_agreement.group_ranks(group)
    return size, me, [((me + k) % size, (me - k) % size) for k in range(1, size)]


Message = tuple[Callable[..., Any], torch.Tensor, int]  # (dist.isend or dist.irecv, tensor, group rank)


@dataclass(frozen=True)
class LatePlan:
    """What a reduce-scatter over more than 2 ranks receives and sends late, in group ranks: `_start`
    posts the sends under the late tag and turns the rest into the exchange's `LateChunks`."""

    sends: list[Message]  # this rank's chunks for the peers that receive them late
    sources: list[int]  # the peers this rank receives from late, in the order their chunks are added
    scratch: list[torch.Tensor]
    sizes: list[int]
    add_mine: Optional[Callable[[], None]]
    mine_before: int
    free_mine: Optional[Callable[[], None]] = None


def _start(
    group: dist.ProcessGroup,
    tag: int,
    messages: list[Message],
    then: Optional[Callable[[], None]] = None,
    numel: int = 0,
    output: Optional[torch.Tensor] = None,
    origin: Optional[torch.dtype] = None,
    late: Optional[LatePlan] = None,
) -> Exchange:
    """Post ``messages`` with this rank's header; `Exchange.wait` checks the peers' headers before it
    waits for the payload (``numel``: the exchange's whole size, the same on every rank; see [Note:
    agreement without a round trip] in `_rank_agreement`). ``late``: what a reduce-scatter sends and
    receives late ([Note: the reduce-scatter's scratch])."""
    requests: list[dist.Work] = []
    generation = _rank_agreement.generation(group)
    agreement = None
    chunks: Optional[LateChunks] = None
    try:
        dtype = messages[0][1].dtype if messages else None
        op = Op.ALL_GATHER if tag == _ALL_GATHER_TAG else Op.REDUCE_SCATTER
        agreement = _rank_agreement.begin(group, op, numel, dtype, origin)
        payload_tag = _rank_agreement.payload_tag(agreement, tag)
        _, _, global_ranks = _rank_agreement.group_ranks(group)
        for post, tensor, peer in messages:
            requests.append(post(tensor, global_ranks[peer], group=group, tag=payload_tag))
        if late is not None:
            late_tag = _rank_agreement.payload_tag(agreement, _REDUCE_SCATTER_LATE_TAG)
            assert output is not None
            sources = [global_ranks[p] for p in late.sources]
            out, scratch, sizes = output.view(-1), late.scratch, late.sizes
            chunks = LateChunks(
                group, sources, late_tag, scratch, out, sizes, [], late.add_mine, late.mine_before, late.free_mine
            )
            for post, tensor, peer in late.sends:
                chunks.sends.append(post(tensor, global_ranks[peer], group=group, tag=late_tag))
    except RuntimeError as e:  # the step was abandoned, or gloo noticed a dead peer while posting
        requests += chunks.sends if chunks is not None else []
        _rank_agreement.keep_unmatched(group, requests)  # posted ones stay referenced, never waited
        return Exchange((), error=e, output=output, group=group, generation=generation, unmatched=bool(requests))
    return Exchange(requests, then, output=output, group=group, generation=generation, agreement=agreement, late=chunks)


def _param_major_targets(regions: Sequence[torch.Tensor], size: int) -> list[list[torch.Tensor]]:
    """For each rank of a group of ``size``: the rows of the param-major output's ``regions`` its piece
    fills, in the piece's order ([Note: rank-major flat shards] in `_rank_major`): as many of the
    layout's ranks in each piece as the layout has ranks per group rank."""
    kept = [region for region in regions if region.shape[1]]
    per = regions[0].shape[0] // size if regions else 1
    return [[region[r * per + j] for j in range(per) for region in kept] for r in range(size)]


def _all_gather_exchange(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    origin: Optional[torch.dtype] = None,
    regions: Optional[Sequence[torch.Tensor]] = None,
) -> Exchange:
    size, me, pairs = _peers(group)
    if regions is None:
        targets = [[piece] for piece in output.view(size, -1).unbind(0)]
        sends = [shard.reshape(-1)]
    else:  # every piece received straight where it goes: no copy-out
        targets = _param_major_targets(regions, size)
        chunks = [region.shape[1] for region in regions]
        per = regions[0].shape[0] // size if regions else 1
        sends = [piece for piece in shard.reshape(-1).split(chunks * per) if piece.numel()]
    torch._foreach_copy_(targets[me], sends)
    # receives first (see [Note: receives before sends])
    messages: list[Message] = [(dist.irecv, view, src) for _, src in pairs for view in targets[src]]
    messages += [(dist.isend, piece, dst) for dst, _ in pairs for piece in sends]
    return _start(group, _ALL_GATHER_TAG, messages, numel=output.numel(), output=output, origin=origin)


def _pieces_by_chunk(parts: Sequence[torch.Tensor], size: int) -> list[list[torch.Tensor]]:
    """Slices of the 1-D ``parts`` grouped by which of ``size`` equal chunks of their concatenation
    they fall in. The boundaries depend only on the parts' sizes, so they agree on every rank."""
    chunk = sum(part.numel() for part in parts) // size
    pieces: list[list[torch.Tensor]] = [[] for _ in range(size)]
    offset = 0
    for part in parts:
        start = 0
        while start < part.numel():
            index = (offset + start) // chunk
            end = min(part.numel(), (index + 1) * chunk - offset)
            pieces[index].append(part[start:end])
            start = end
        offset += part.numel()
    return pieces


def _reduce_scatter_exchange(
    output: torch.Tensor,
    parts: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    writable: Sequence[torch.Tensor] = (),
) -> Exchange:
    """[Note: the reduce-scatter's scratch]
    A rank receives its lowest peer's chunk straight into the output, posted with the exchange, and
    the other peers' chunks once that one arrived and was added (`LateChunks`, when the exchange is
    waited for), one at a time into one scratch chunk, each added before the next is posted. The
    scratch is this rank's own chunk of the input, once it is in the output, wherever nothing else
    holds that memory (``writable``: autograd's gradients that no one else references, or our own
    copy; `reusable_pieces`), and a temporary only for the rest (shared zeros, the flags, a 0-dim
    parameter's gradient, which every chunk sends whole): so at any group size a reduce-scatter
    usually needs no memory beyond its output (a temporary of a whole chunk at 4 ranks made the
    step's peak a block's shard above FSDP2's; N-2 chunks and their sum, before that).

    Every rank adds what it receives in the ranks' order, so an element every rank holds (the 0-dim
    gradient repeated into each chunk) comes out bit for bit the same everywhere; only pieces the
    scratch reuses may take this rank's own term early (each of their elements is summed by this
    rank alone). A late chunk travels under a tag of its own (both sides know it is late: the sender
    is not the receiver's lowest peer), so a late receive can never take an early message, nor a
    later exchange's; the late sends are posted with the others and waited for after the late
    receives (a peer posts its late receive only once its early chunk arrived, so waiting for a late
    send first could wait in a circle of ranks). Exchanges are waited for in the order they were
    issued, so the late receives of one come before any later exchange's. An exchange that fails
    still posts its late receives, into memory of their own kept with its unmatched requests, so no
    peer waits forever for a late send to complete."""
    size, me, _ = _rank_agreement.group_ranks(group)
    pieces = _pieces_by_chunk(parts, size)
    mine = pieces[me]
    sizes = [piece.numel() for piece in mine]
    out = output.view(-1)
    outs = list(out.split(sizes))
    sources = [r for r in range(size) if r != me]  # in the ranks' order: the order of the sum
    early, late_sources = sources[:1], sources[1:]
    messages: list[Message] = []  # receives first (see [Note: receives before sends])
    for src in early:
        messages += [(dist.irecv, piece, src) for piece in outs]
    late_sends: list[Message] = []
    for dst in range(size):
        if dst != me:
            is_late = me != min(r for r in range(size) if r != dst)
            (late_sends if is_late else messages).extend((dist.isend, piece, dst) for piece in pieces[dst])

    def add(indices: list[int]) -> Optional[Callable[[], None]]:
        if not indices:
            return None
        return lambda: torch._foreach_add_([outs[j] for j in indices], [mine[j] for j in indices])

    every = list(range(len(mine)))

    def add_early() -> None:
        """The output holds the lowest peer's chunk: this rank's own follows it when it comes before
        every late one (the first two in either order: a + b is b + a)."""
        if size == 1:  # nothing was received into the output: it is just this rank's chunk
            torch._foreach_copy_(outs, mine)
        elif (not late_sources or me < late_sources[0]) and mine:
            torch._foreach_add_(outs, mine)

    late = None
    if late_sources:
        reuse = reusable_pieces(pieces, me, writable)
        rest = [j for j in every if not reuse[j]]
        temporary = torch.empty(sum(sizes[j] for j in rest), dtype=output.dtype, device=output.device)
        spare = iter(temporary.split([sizes[j] for j in rest]) if rest else ())
        scratch = [mine[j] if reuse[j] else next(spare) for j in every]
        if me < late_sources[0]:  # already in the output (`add_early`)
            late = LatePlan(late_sends, late_sources, scratch, sizes, None, 0)
        else:
            mine_before = next((i for i, r in enumerate(late_sources) if r > me), len(late_sources))
            free = add([j for j in every if reuse[j]])
            late = LatePlan(late_sends, late_sources, scratch, sizes, add(rest), mine_before, free)
    return _start(
        group, _REDUCE_SCATTER_TAG, messages, add_early, numel=output.numel() * size, output=output, late=late
    )
