"""A unit's all-gather and reduce-scatter run by the user's objects (FSDP2's ``AllGather`` /
``ReduceScatter``, set with `set_custom_all_gather` / `set_custom_reduce_scatter`).

[Note: custom collectives]
A custom collective is an object with ``allocate(size, *, dtype, device)`` and a call: FSDP2's
``AllGather.__call__(output, input, group, async_op)`` and ``ReduceScatter.__call__(output, input,
group, op, async_op)``. It decides where the collective's buffers live (a memory pool, symmetric
memory) and how they are moved. Ours keeps its own buffers (the param-major unsharded flat parameter,
the gradient buffers), so the user's buffers are staging ones:
- all-gather: ``allocate`` the rank-major gather buffer, call, copy out into the unsharded buffer by
  parameter (the copy-out a native all-gather makes anyway unless both orders are one tensor);
- reduce-scatter: ``allocate`` the input, copy the rank-major gradient in, ``allocate`` the output,
  call with ``ReduceOp.SUM`` (we divide apart, as always), copy the output into the shard gradient.
On gloo they replace the point-to-point exchanges our collectives use there. The ranks' headers are
checked first, as for a native collective ([Note: collective headers]). The extension parameters'
byte all-gather goes through the same object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from fsdp_composable._comm import _trace
from fsdp_composable._comm._collectives import CopiedOut, Exchange, Op, Waitable, _checked

__all__ = ["CopiedBack", "all_gather", "reduce_scatter"]


def all_gather(
    comm: Any,
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    async_op: bool = True,
    origin: Optional[torch.dtype] = None,
    regions: Optional[Sequence[torch.Tensor]] = None,
) -> Optional[Waitable]:
    """`_collectives.all_gather` through ``comm``: into its buffer, then copied out into ``output``
    (into ``regions`` of it when given, else as it is)."""
    with _trace.span("all_gather", None, output):
        size = dist.get_world_size(group)
        target = comm.allocate((size * shard.numel(),), dtype=shard.dtype, device=output.device)
        call = lambda: comm(target, shard, group, async_op)  # noqa: E731
        work = _checked(group, Op.ALL_GATHER, output, output.numel(), call, origin)
        if isinstance(work, Exchange) and work.error is not None:
            return work
        copy = CopiedOut(work if async_op else None, target, [output.view(size, -1)] if regions is None else regions)
        if not async_op:
            copy.wait()  # queued on the stream after the collective
            return work
        return copy


@dataclass
class CopiedBack:
    """A reduce-scatter into ``result`` (the user's buffer), copied into ``output`` once done."""

    work: Optional[Waitable]
    result: torch.Tensor
    output: torch.Tensor

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        self.output.copy_(self.result)
        return True


def reduce_scatter(
    comm: Any, output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup, async_op: bool = True
) -> Optional[Waitable]:
    """`_collectives.reduce_scatter` through ``comm``: ``full`` (rank-major, 1-D) copied into its input
    buffer, summed into its output buffer, which is copied into ``output``."""
    with _trace.span("reduce_scatter", None, output):
        send = comm.allocate((full.numel(),), dtype=output.dtype, device=output.device)
        send.copy_(full.view(-1))
        result = comm.allocate((output.numel(),), dtype=output.dtype, device=output.device)
        call = lambda: comm(result, send, group, dist.ReduceOp.SUM, async_op)  # noqa: E731
        work = _checked(group, Op.REDUCE_SCATTER, output, send.numel(), call)
        if isinstance(work, Exchange) and work.error is not None:
            return work
        back = CopiedBack(work if async_op else None, result, output)
        if not async_op:
            back.wait()
            return work
        return back
