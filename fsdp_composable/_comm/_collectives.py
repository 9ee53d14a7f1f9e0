"""The three collectives the runtime issues, named once so every call site is the same.

torch 2.13 renamed ``all_gather_into_tensor``/``reduce_scatter_tensor`` to ``*_single`` and warns
on the old names; older releases (we support ``torch>=2.5``) only have the old ones. On gloo, the
all-gather and the reduce-scatter are our own point-to-point exchanges (`_exchanges`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from fsdp_composable._base import _param_major
from fsdp_composable._comm import _rank_agreement, _trace
from fsdp_composable._comm._exchanges import Exchange, _all_gather_exchange, _reduce_scatter_exchange
from fsdp_composable._comm._header_fields import for_unit
from fsdp_composable._comm._rank_agreement import Op, agree
from fsdp_composable.api import CollectiveError, RankMismatchError

__all__: list[str] = []

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

class Waitable(Protocol):
    """What an asynchronous collective returns: ``dist.Work`` or an `Exchange`."""

    def wait(self) -> object: ...


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
    [Note: gloo collectives as point-to-point exchanges] in `_exchanges`; CUDA tensors on gloo keep gloo's own
    collectives, which stage them through the host."""
    return _rank_agreement.is_gloo(group) and device.type == "cpu"  # the backend first: asking a type costs more


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
    writable: Sequence[torch.Tensor] = (),
) -> Optional[Waitable]:
    """Sum ``full`` over ranks and leave this rank's slice in ``output`` (async).

    ``full`` may be given as 1-D parts whose concatenation it is (a unit's gradients, one per
    parameter, then its padding): on gloo the parts are sent as they are, elsewhere they are
    concatenated first (the gradient reductions give parts to the point-to-point exchange only).
    ``writable``: tensors whose memory the gloo exchange may receive into once this rank's own part of
    them was added ([Note: the reduce-scatter's scratch] in `_exchanges`): nothing else may hold them."""
    if isinstance(full, torch.Tensor):
        parts = [full if full.dim() == 1 else full.view(-1)]  # 1-D already (a unit's buffer): as it is
    else:
        parts = list(full)
    with _trace.span("reduce_scatter", None, output):
        if point_to_point(group, output.device):
            return _reduce_scatter_exchange(output, parts, group, writable)
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
            # this, lives to the end of backward: see [Note: gloo collectives as point-to-point
            # exchanges] in `_exchanges`
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
