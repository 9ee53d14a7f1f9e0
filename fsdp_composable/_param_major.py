"""The param-major side of a unit's layout as plain index arithmetic over chunk sizes, shared by the
layout (`_rank_major`) and the collectives that fill a param-major buffer (`_collectives`): see
[Note: rank-major flat shards] in `_rank_major`."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["copy_out", "regions"]


def regions(flat: torch.Tensor, chunks: Sequence[int], ranks: int) -> list[torch.Tensor]:
    """Each parameter's region of the param-major 1-D ``flat``, as a (ranks, chunk) view."""
    out, at = [], 0
    for chunk in chunks:
        out.append(flat[at : at + ranks * chunk].view(ranks, chunk))
        at += ranks * chunk
    return out


def copy_out(gathered: torch.Tensor, out: torch.Tensor, chunks: Sequence[int]) -> None:
    """The rank-major ``gathered`` into the param-major ``out`` (both 1-D, the same size): one kernel."""
    ranks = out.numel() // max(sum(chunks), 1)
    rows = gathered.view(ranks, -1)
    torch.split_with_sizes_copy(rows, list(chunks), dim=1, out=regions(out, chunks, ranks))
