"""The three collectives the runtime issues, named once so every call site is the same.

torch 2.13 renamed ``all_gather_into_tensor``/``reduce_scatter_tensor`` to ``*_single`` and warns
on the old names; older releases (we support ``torch>=2.5``) only have the old ones.
"""

from __future__ import annotations

from typing import Optional

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


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> Optional[dist.Work]:
    """Sum ``tensor`` over ranks in place (async)."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
