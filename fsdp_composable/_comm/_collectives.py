"""The three collectives the runtime issues, named once so every call site is the same.

torch 2.13 renamed ``all_gather_into_tensor``/``reduce_scatter_tensor`` to ``*_single`` and warns
on the old names; older releases (we support ``torch>=2.5``) only have the old ones.

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
both sides agree on them. A reduce-scatter receives its first peer's chunk into the output itself and
the others' through one temporary ([Note: one temporary]), so at 2 ranks it needs no memory beyond its
output. A send request holds the
tensor it sends until the request itself is dropped, and a gradient reduction is kept to the end of
backward (its result is committed there), so a completed exchange drops its requests at once:
otherwise every reduced unit's gradients, the slices sent to peers, stay alive through the whole
backward. NCCL and other backends use their native collectives.

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

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from fsdp_composable._base import _param_major
from fsdp_composable._comm import _rank_agreement, _trace
from fsdp_composable._comm._header_fields import for_unit
from fsdp_composable._comm._rank_agreement import Op, agree
from fsdp_composable.api import CollectiveError, RankMismatchError

__all__: list[str] = []

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Tags far from the small numbers user code picks for its own isend/irecv on the same group.
_ALL_GATHER_TAG = 0x46530001
_REDUCE_SCATTER_TAG = 0x46530002
_REDUCE_SCATTER_LATE_TAG = 0x46530003  # the chunks a reduce-scatter receives late: [Note: one temporary]


class Waitable(Protocol):
    """What an asynchronous collective returns: ``dist.Work`` or an `Exchange`."""

    def wait(self) -> object: ...


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
    # a reduce-scatter's chunks received after the first ones, through one temporary ([Note: one temporary])
    late: Optional["LateChunks"] = None

    def wait(self) -> bool:
        if self.agreement is not None:
            agreement, self.agreement = self.agreement, None
            try:
                _rank_agreement.settle(agreement)
            except RuntimeError as e:  # refused (or a peer died): the payload may never be matched
                if self.late is not None:  # a peer may be waiting for its late send to complete
                    late, self.late = self.late, None
                    self.requests = [*self.requests, *late.abandon()]
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
    """The chunks a reduce-scatter over more than 3 ranks receives after its first two, one at a time
    into one temporary and added to the output ([Note: one temporary])."""

    group: dist.ProcessGroup
    sources: list[int]  # global ranks, in the order their chunks are received
    tag: int
    temporary: torch.Tensor
    output: torch.Tensor
    sizes: list[int]  # a chunk's messages, as its sender cut it (`_pieces_by_chunk`)
    # this rank's late sends: waited for after its late receives, since a peer posts the receive of
    # one only once its own early chunks arrived (waiting for them first could wait in a circle)
    sends: list[Any]
    # this rank's own chunk, when it comes among the late ones: added before ``sources[mine_before]``
    add_mine: Optional[Callable[[], None]] = None
    mine_before: int = 0

    def _post(self, source: int, into: torch.Tensor) -> list[Any]:
        return [dist.irecv(piece, source, group=self.group, tag=self.tag) for piece in into.split(self.sizes)]

    def receive(self) -> None:
        for i, source in enumerate(self.sources):
            if i == self.mine_before and self.add_mine is not None:
                self.add_mine()
            for request in self._post(source, self.temporary):
                request.wait()
            self.output.add_(self.temporary)
        if self.mine_before == len(self.sources) and self.add_mine is not None:
            self.add_mine()
        sends, self.sends = self.sends, []
        for request in sends:
            request.wait()

    def abandon(self) -> list[Any]:
        """The exchange failed: post the receives anyway, into memory of their own (kept with the
        unmatched requests, as the late sends are), so a peer that sent its chunk is not left waiting."""
        own = [self._post(source, torch.empty_like(self.temporary)) for source in self.sources]
        return [request for requests in own for request in requests] + self.sends


def left_posted(flight: "InFlight") -> bool:
    """Whether a failed collective left a receive posted into its output: gloo cannot withdraw it, so
    that memory must never be freed or reused ([Note: agreement without a round trip])."""
    return isinstance(flight.work, Exchange) and flight.work.unmatched


def served_devices(group: dist.ProcessGroup) -> list[torch.device]:
    """The device types ``group`` has a backend for (see [Note: the communication device])."""
    served = [torch.device(d) for d in getattr(group, "_device_types", [])]
    if not served:  # an old torch or a group without registered backends: go by the backend's name
        served = [torch.device("cuda" if "nccl" in str(dist.get_backend(group)) else "cpu")]
    return served


def comm_device(group: dist.ProcessGroup, compute_device: Optional[torch.device] = None) -> torch.device:
    """The device whose tensors ``group``'s collectives take: every collective tensor of ours is built
    on, or copied to, this device (see [Note: the communication device]).

    [Note: the communication device]
    torch registers a backend per device type (``init_process_group("nccl")`` serves CUDA tensors
    only, ``"gloo"`` CPU tensors, ``"cpu:gloo,cuda:nccl"`` both), and a collective on a tensor of a
    type the group does not serve fails with "No backend type associated with device type ...". So
    the device is decided from the group, never from where a tensor happens to be: the unit's compute
    device when the group serves its type, else the first non-CPU type the group serves (CUDA: the
    current device, as ``torch.cuda.set_device`` chose), else the CPU. CPU-offloaded shards and
    values read from the host are copied to this device before a collective and back after it."""
    served = served_devices(group)
    if compute_device is None:  # no unit to ask: where this process computes by default
        compute_device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    if compute_device is not None and any(d.type == compute_device.type for d in served):
        return compute_device
    for device in served:
        if device.type == "cuda" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cpu", "cuda") and _present(device):
            return device
    return torch.device("cpu")


@contextlib.contextmanager
def comm_device_current(group: dist.ProcessGroup, device: Optional[torch.device]) -> Any:
    """Make ``group``'s communication device for ``device`` (the unit's) the current CUDA device while
    torch's object collectives run: they build their tensors on the current device, not the unit's."""
    comm = comm_device(group, device)
    with torch.cuda.device(comm) if comm.type == "cuda" else contextlib.nullcontext():
        yield


def _present(device: torch.device) -> bool:
    """Whether this process can make tensors on ``device``'s type: torch's fake process group serves
    every type it knows (``xpu`` too) on a machine that has none of them."""
    if device.type == "meta":
        return True
    try:
        is_available = getattr(getattr(torch, device.type, None), "is_available", None)
    except ImportError:  # torch's lazy submodule for a type this build lacks
        return False
    return bool(is_available()) if callable(is_available) else False


def host_values(tensor: torch.Tensor) -> torch.Tensor:
    """A collective's result read on the host (the order check's gathered values, a status flag):
    the one device-to-host read of a collective result in the library. On NCCL it is a real
    device-to-host copy that waits for the collective; such reads happen only at entry points and in
    the first iteration, never in a steady-state step."""
    return tensor.detach().cpu()


def comm_tensor(values: Sequence[int], group: dist.ProcessGroup, device: Optional[torch.device] = None) -> torch.Tensor:
    """Small int64 values to send through ``group``, on its communication device (``device``: the
    unit's compute device, see `comm_device`)."""
    return torch.tensor(list(values), dtype=torch.int64, device=comm_device(group, device))


def point_to_point(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether `all_gather` and `reduce_scatter` run as point-to-point exchanges for tensors on
    ``device`` (gloo, CPU), so a reduce-scatter sends parts without concatenating them first. See
    [Note: gloo collectives as point-to-point exchanges]; CUDA tensors on gloo keep gloo's own
    collectives, which stage them through the host."""
    return _rank_agreement.is_gloo(group) and device.type == "cpu"  # the backend first: asking a type costs more


def _peers(group: dist.ProcessGroup) -> tuple[int, int, list[tuple[int, int]]]:
    """(group size, my group rank, [(destination, source)] as group ranks for k = 1..N-1)."""
    size, me, _ = _rank_agreement.group_ranks(group)
    return size, me, [((me + k) % size, (me - k) % size) for k in range(1, size)]


Message = tuple[Callable[..., Any], torch.Tensor, int]  # (dist.isend or dist.irecv, tensor, group rank)


def _start(
    group: dist.ProcessGroup,
    tag: int,
    messages: list[Message],
    then: Optional[Callable[[], None]] = None,
    numel: int = 0,
    output: Optional[torch.Tensor] = None,
    origin: Optional[torch.dtype] = None,
    late: Optional[
        tuple[list[Message], list[int], torch.Tensor, list[int], Optional[Callable[[], None]], int]
    ] = None,
) -> Exchange:
    """Post ``messages`` with this rank's header; `Exchange.wait` checks the peers' headers before it
    waits for the payload (``numel``: the exchange's whole size, the same on every rank; see [Note:
    agreement without a round trip] in `_rank_agreement`). ``late``: a reduce-scatter's sends of the
    chunks its peers receive late, the sources this rank receives late from, and the temporary
    ([Note: one temporary])."""
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
            sends, sources, temporary, sizes, add_mine, mine_before = late
            late_tag = _rank_agreement.payload_tag(agreement, _REDUCE_SCATTER_LATE_TAG)
            assert output is not None
            sources = [global_ranks[p] for p in sources]
            chunks = LateChunks(group, sources, late_tag, temporary, output.view(-1), sizes, [], add_mine, mine_before)
            for post, tensor, peer in sends:
                chunks.sends.append(post(tensor, global_ranks[peer], group=group, tag=late_tag))
    except RuntimeError as e:  # the step was abandoned, or gloo noticed a dead peer while posting
        requests += chunks.sends if chunks is not None else []
        _rank_agreement.keep_unmatched(group, requests)  # posted ones stay referenced, never waited
        return Exchange((), error=e, output=output, group=group, generation=generation, unmatched=bool(requests))
    exchange = Exchange(requests, then, output=output, group=group, generation=generation, agreement=agreement)
    exchange.late = chunks
    return exchange


def _checked(
    group: dist.ProcessGroup,
    op: Op,
    output: torch.Tensor,
    numel: int,
    post: Callable[[], Any],
    origin: Optional[torch.dtype] = None,
) -> Optional[Waitable]:
    """A native collective, after the ranks agreed on it (see [Note: collective headers]); a
    disagreement or a failure is raised at ``wait``, where the caller names the unit."""
    if not _rank_agreement.checks(group):  # no headers (NCCL, one rank): nothing to agree on
        return post()  # type: ignore[no-any-return]
    try:
        agree(group, op, numel, output.dtype, origin)
    except RuntimeError as e:
        return Exchange([], error=e, output=output, group=group, generation=_rank_agreement.generation(group))
    return post()  # type: ignore[no-any-return]


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


def _reduce_scatter_exchange(output: torch.Tensor, parts: Sequence[torch.Tensor], group: dist.ProcessGroup) -> Exchange:
    """[Note: one temporary]
    Every rank adds the chunks it receives in the same order, the ranks' order (so an element every
    rank holds, a 0-dim parameter's gradient repeated into each chunk, comes out bit for bit the
    same everywhere). A rank receives the two lowest other ranks' chunks first, into the output and
    one temporary, both posted with the exchange; at 4 ranks and more the higher ranks' chunks are
    received once those arrived and were added, one at a time into the same temporary
    (`LateChunks`), when the exchange is waited for. So a reduce-scatter holds one chunk beyond its
    output at any group size (N-2 chunks, and their sum, were live together before: at 4 ranks the
    step peaked above FSDP2's). A late chunk travels under a tag of its own (both sides know it is late: the
    sender is not among the receiver's two lowest peers), so a late receive can never take an early
    message, nor a later exchange's; the late sends are posted with the others and waited for after
    the late receives (a peer posts its late receive only once its early chunks arrived, so waiting
    for a late send first could wait in a circle of ranks). Exchanges are waited for in the order
    they were issued, so the late receives of one come before any later exchange's. An exchange that
    fails still posts its late receives, into memory of their own kept with its unmatched requests,
    so no peer waits forever for a late send to complete."""
    size, me, _ = _rank_agreement.group_ranks(group)
    pieces = _pieces_by_chunk(parts, size)
    mine = pieces[me]
    sizes = [piece.numel() for piece in mine]
    out = output.view(-1)
    sources = [r for r in range(size) if r != me]  # in the ranks' order: the order of the sum
    early, late_sources = sources[:2], sources[2:]
    extra = torch.empty(output.numel() if size > 2 else 0, dtype=output.dtype, device=output.device)
    messages: list[Message] = []  # receives first (see [Note: receives before sends])
    for src, target in zip(early, (out, extra)):
        messages += [(dist.irecv, piece, src) for piece in target.split(sizes)]
    late_sends: list[Message] = []
    for dst in range(size):
        if dst != me:
            is_late = me not in [r for r in range(size) if r != dst][:2]
            (late_sends if is_late else messages).extend((dist.isend, piece, dst) for piece in pieces[dst])

    def add_mine() -> None:
        torch._foreach_add_(list(out.split(sizes)), mine)

    def add_early() -> None:
        """The output holds the lowest other rank's chunk: add the rest of the ranks below the first
        late one, in order (the first two in either order: a + b is b + a)."""
        if size == 1:  # nothing was received into the output: it is just this rank's chunk
            torch._foreach_copy_(list(out.split(sizes)), mine)
            return
        below = list(range(late_sources[0] if late_sources else size))
        if below[0] == me:  # the output holds below[1]'s: this rank's chunk is the sum's first term
            add_mine()
        for r in below[2:] if below[0] == me else below[1:]:
            if r == me:
                add_mine()
            else:
                out.add_(extra)

    late = None
    if late_sources:
        mine_before = next((i for i, r in enumerate(late_sources) if r > me), len(late_sources))
        then = add_mine if me > late_sources[0] else None  # this rank's own chunk comes among the late ones
        late = (late_sends, late_sources, extra, sizes, then, mine_before)
    return _start(
        group, _REDUCE_SCATTER_TAG, messages, add_early, numel=output.numel() * size, output=output, late=late
    )


@dataclass
class CopiedOut:
    """An all-gather into the rank-major ``buffer``, copied out into the ``regions`` of the param-major
    output once done (see [Note: rank-major flat shards] in `_rank_major`)."""

    work: Optional[Waitable]
    buffer: torch.Tensor
    regions: Sequence[torch.Tensor]

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        _param_major.copy_out(self.buffer, self.regions)
        return True


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    async_op: bool = True,
    origin: Optional[torch.dtype] = None,
    regions: Optional[Sequence[torch.Tensor]] = None,
    direct: bool = True,
) -> Optional[Waitable]:
    """Gather every rank's equal-sized ``shard`` into ``output`` (async; returns the work; with
    ``async_op=False``, on a CUDA side stream, see `issue`). ``origin``: the dtype ``shard`` was
    cast from, checked across ranks with the header (see [Note: casts after sharding]).

    ``regions``: ``output`` is laid out by parameter, these (ranks, chunk) views of it (`_param_major.
    regions`), and each shard is rank-major ([Note: rank-major flat shards] in `_rank_major`). With
    ``direct``, point-to-point receives each
    chunk where it goes; otherwise (and always for a native collective) the shards are gathered into
    one rank-major buffer and copied out (one kernel, on the same stream)."""
    with _trace.span("all_gather", None, output):  # named by the unit whose method issues it
        p2p = point_to_point(group, output.device)
        if p2p and (regions is None or direct):
            return _all_gather_exchange(output, shard, group, origin, regions)
        target = output if regions is None else torch.empty_like(output)
        if p2p:
            work: Optional[Waitable] = _all_gather_exchange(target, shard, group, origin)
        else:
            work = _checked(
                group,
                Op.ALL_GATHER,
                output,
                output.numel(),
                lambda: _all_gather(target, shard, group=group, async_op=async_op),
                origin,
            )
        if regions is None or (isinstance(work, Exchange) and work.error is not None):
            return work
        copy = CopiedOut(work if async_op or p2p else None, target, regions)
        if not async_op and not p2p:
            copy.wait()  # queued on the stream after the collective
            return work
        return copy


def reduce_scatter(
    output: torch.Tensor,
    full: torch.Tensor | Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    async_op: bool = True,
) -> Optional[Waitable]:
    """Sum ``full`` over ranks and leave this rank's slice in ``output`` (async).

    ``full`` may be given as 1-D parts whose concatenation it is (a unit's gradients, one per
    parameter, then its padding): on gloo the parts are sent as they are, elsewhere they are
    concatenated first (the gradient reductions give parts to the point-to-point exchange only)."""
    if isinstance(full, torch.Tensor):
        parts = [full if full.dim() == 1 else full.view(-1)]  # 1-D already (a unit's buffer): as it is
    else:
        parts = list(full)
    with _trace.span("reduce_scatter", None, output):
        if point_to_point(group, output.device):
            return _reduce_scatter_exchange(output, parts, group)
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        return _checked(
            group,
            Op.REDUCE_SCATTER,
            output,
            flat.numel(),
            lambda: _reduce_scatter(output, flat, op=dist.ReduceOp.SUM, group=group, async_op=async_op),
        )


@dataclass
class InOrder:
    """Collectives issued back to back (on one stream), waited for as one, in the order issued."""

    works: list[Waitable]

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


def in_order(*collectives: Callable[[], Optional[Waitable]]) -> Optional[Waitable]:
    """Issue each collective in turn; one refused by the ranks (see [Note: collective headers])
    stops the rest, and waiting raises its error."""
    works: list[Waitable] = []
    for collective in collectives:
        work = collective()
        if work is not None:
            works.append(work)
        if isinstance(work, Exchange) and work.error is not None:
            break
    return InOrder(works) if works else None


def wait(work: Optional[Waitable], what: str) -> None:
    """Wait for ``work``; on failure say which collective of which unit never completed."""
    if work is None:
        return
    try:
        with _trace.span("wait", None):  # inside the span of the unit that waits
            work.wait()
    except RankMismatchError as e:
        raise RankMismatchError(f"fully_shard: {what} was not run: {e}") from e
    except RuntimeError as e:
        raise CollectiveError(
            f"fully_shard: {what} did not complete: {e}. Another rank probably died, hung, or ran "
            "different modules; check the other ranks' logs (the process group timeout bounds the wait)"
        ) from e


@dataclass
class InFlight:
    """A collective under way: a work handle to wait on (CPU/gloo), or an event recorded on the side
    stream that ran it (CUDA), which the compute stream of its device waits on without blocking the
    CPU."""

    work: Optional[Waitable] = None
    event: Optional["torch.cuda.Event"] = None
    device: Optional[torch.device] = None

    def wait(self, what: str) -> None:
        if self.event is not None:
            compute_stream(self.device).wait_event(self.event)
        else:
            wait(self.work, what)
            # a completed work still holds its tensors (a native one too), and a reduction, which owns
            # this, lives to the end of backward: see [Note: gloo collectives as point-to-point exchanges]
            if not left_posted(self):
                self.work = None


def compute_stream(device: Optional[torch.device]) -> "torch.cuda.Stream":
    """The current (compute) stream of ``device``, the unit's device, whichever device is current."""
    return torch.cuda.current_stream(device)


def on_stream(stream: Optional["torch.cuda.Stream"]) -> "contextlib.AbstractContextManager[Any]":
    """Run what follows on ``stream`` (CUDA), or as it is (``stream`` is None: CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def wait_for_compute(stream: Optional["torch.cuda.Stream"]) -> None:
    """``stream`` waits for all work issued so far on its device's compute stream (the unshard
    stream: once per root forward, after the optimizer wrote the shards)."""
    if stream is not None:
        stream.wait_stream(compute_stream(stream.device))


def issue(
    stream: Optional["torch.cuda.Stream"],
    collective: Callable[[bool], Optional[Waitable]],
    after: Optional["torch.cuda.Stream"] = None,
    then: Optional[Callable[[], None]] = None,
    wait_first: bool = True,
    unit: str = "",
) -> InFlight:
    """Run ``collective(async_op)`` on ``stream`` (CUDA) or asynchronously on the CPU (``stream`` is
    None). ``then``: work to run on the stream once the collective is done (CUDA only: on the CPU the
    caller runs it after waiting). ``after``: the stream that produced the inputs (default: the compute
    stream); ``wait_first=False``: the inputs were made on ``stream`` itself.

    [Note: streams without record_stream]
    Side streams of the unit's device run the collectives: all-gathers on the unshard stream,
    reduce-scatters on the reduce stream, HYBRID_SHARD's cross-replica all-reduces on their own
    stream after the reduce-scatter (the compute stream waits for a reduce-scatter in the next
    unit's post-backward and for the all-reduce at the end of backward, as FSDP2 does). A collective
    is called with ``async_op=False`` inside the side stream, and the CPU does not block. What
    ProcessGroupNCCL does with it depends on the torch release: from 2.8 it launches the collective
    on the current stream (our side stream) and calls ``record_stream`` on nothing; on 2.5-2.7 it
    runs it on its internal stream ordered after ours and back, and skips ``record_stream`` for
    ``all_gather_into_tensor``/``reduce_scatter_tensor`` only: an ``all_reduce`` (the presence flags,
    NO_SHARD, HYBRID_SHARD across replicas) still records its tensor on that internal stream unless
    ``TORCH_NCCL_AVOID_RECORD_STREAMS=1``, which delays the reuse of its memory (not its
    correctness: our own events order every read and free). An event recorded on the side stream is
    what the compute stream waits on before it reads the result (`InFlight.wait`).

    Memory is never freed while another stream may still use it:
    - A reduction's inputs and output are made on the compute stream before the reduce stream waits
      for it; their owner (`PendingReduce`) keeps them until the compute stream has waited for the
      collective's event, so the compute stream's allocator reuses them only after it.
    - An all-gather's input (the shard, or its copy on the device in the compute dtype) and output (the
      unsharded buffer) are allocated on the unshard stream itself, so the unshard stream does not wait
      for the compute issued before it: the next unit's all-gather overlaps this unit's compute. The
      unshard stream waits for the compute stream once per root forward (the optimizer wrote the shards
      before it), and before the all-gather of a unit called outside the root's forward. A reshard in
      forward or backward frees nothing at once: it records an event on the compute stream after the
      unit's last use; the buffer is freed once the unshard stream has waited for that event, right
      after the next all-gather is issued (or when the step ends or is abandoned), so the unshard stream
      can reuse the block only after the compute stream is done with it, and the all-gather just issued
      did not wait for the compute before it. At most two units' buffers are alive at once, as the
      limiter counts. A reshard anywhere else makes the unshard stream wait for that event and frees at
      once.
    tests/test_device_paths.py checks these rules on CPU with recording streams and events."""
    if stream is None:
        assert then is None, "on the CPU the caller runs `then` once it waited"
        with for_unit(unit):
            return InFlight(work=collective(True))
    if wait_first:
        stream.wait_stream(after if after is not None else compute_stream(stream.device))
    with on_stream(stream), for_unit(unit):
        work = collective(False)
        if work is not None:
            work.wait()  # a refused exchange raises; a native collective was already ordered
        if then is not None:
            then()
        event = stream.record_event()
    return InFlight(event=event, device=stream.device)


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = True,
) -> Optional[Waitable]:
    """Reduce ``tensor`` over ranks in place (async; a sum unless ``op`` says otherwise)."""
    with _trace.span("all_reduce", None, tensor):
        return _checked(
            group,
            Op.ALL_REDUCE,
            tensor,
            tensor.numel(),
            lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op),
        )
