"""The three collectives the runtime issues, named once so every call site is the same.

torch 2.13 renamed ``all_gather_into_tensor``/``reduce_scatter_tensor`` to ``*_single`` and warns
on the old names; older releases (we support ``torch>=2.5``) only have the old ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

__all__: list[str] = []

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup) -> Optional[dist.Work]:
    """Gather every rank's equal-sized ``shard`` into ``output`` (async; returns the work)."""
    return _all_gather(output, shard, group=group, async_op=True)  # type: ignore[no-any-return]


def reduce_scatter(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup) -> Optional[dist.Work]:
    """Sum ``full`` over ranks and leave this rank's slice in ``output`` (async)."""
    return _reduce_scatter(output, full, op=dist.ReduceOp.SUM, group=group, async_op=True)  # type: ignore[no-any-return]


class CollectiveError(RuntimeError):
    """A collective of a named unit failed: a rank died, timed out, or ran something else."""


def wait(work: Optional[dist.Work], what: str) -> None:
    """Wait for ``work``; on failure say which collective of which unit never completed."""
    if work is None:
        return
    try:
        work.wait()
    except RuntimeError as e:
        raise CollectiveError(
            f"fully_shard: {what} did not complete: {e}. Another rank probably died, hung, or ran "
            "different modules; check the other ranks' logs (the process group timeout bounds the wait)"
        ) from e


@dataclass
class InFlight:
    """A collective under way: a work handle to wait on (CPU/gloo), or an event recorded on the side
    stream that ran it (CUDA), which the compute stream waits on without blocking the CPU."""

    work: Optional[dist.Work] = None
    event: Optional["torch.cuda.Event"] = None

    def wait(self, what: str) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        else:
            wait(self.work, what)


def issue(stream: Optional["torch.cuda.Stream"], collective: Callable[[], Optional[dist.Work]]) -> InFlight:
    """Run ``collective`` on ``stream`` (CUDA) or asynchronously on the CPU (``stream`` is None).

    [Note: streams without record_stream]
    Every tensor a collective touches is allocated on the compute stream, before this call, and kept
    alive by its owner until the compute stream has waited for the returned event. The side stream
    first waits for the compute stream (the inputs are ready), runs the collective, and records an
    event. So memory is only ever freed on the compute stream's timeline, after the collective is
    known complete there: no ``record_stream`` is needed and the allocator never hands out a block a
    collective may still be reading or writing."""
    if stream is None:
        return InFlight(work=collective())
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        work = collective()
        if work is not None:
            work.wait()  # on CUDA this orders `stream` after the collective; the CPU does not block
        event = torch.cuda.Event()
        event.record(stream)
    return InFlight(event=event)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> Optional[dist.Work]:
    """Sum ``tensor`` over ranks in place (async)."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
