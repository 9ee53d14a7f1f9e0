"""The param-major side of a unit's layout as plain index arithmetic over chunk sizes, shared by the
layout (`_rank_major`) and the collectives that fill a param-major buffer (`_collectives`): see
[Note: rank-major flat shards] in `_rank_major`."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["copy_out", "regions"]


def regions(flat: torch.Tensor, chunks: Sequence[int], ranks: int) -> list[torch.Tensor]:
    """Each parameter's region of the param-major 1-D ``flat``, as a (ranks, chunk) view."""
    pieces = flat[: ranks * sum(chunks)].split([ranks * chunk for chunk in chunks])  # one call for all
    return [piece.view(ranks, chunk) for piece, chunk in zip(pieces, chunks)]


def copy_out(gathered: torch.Tensor, out_regions: Sequence[torch.Tensor]) -> None:
    """The rank-major 1-D ``gathered`` into the `regions` of a param-major buffer: one kernel."""
    ranks = out_regions[0].shape[0] if out_regions else 1
    chunks = [region.shape[1] for region in out_regions]
    torch.split_with_sizes_copy(gathered.view(ranks, -1), chunks, dim=1, out=list(out_regions))
