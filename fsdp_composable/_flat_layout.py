"""Index computations between original parameters, a unit's flat shards and torch's chunk layout.
Pure functions: no communication, no tensors allocated."""

from __future__ import annotations

import torch
import torch.nn.utils

from fsdp_composable._flat_param import FlatLayout, ParamInfo

__all__: list[str] = []


# ---------------------------------------------------------------------------- flat <-> chunk layout
def _is_replicated_info(info: ParamInfo, layout: FlatLayout) -> bool:
    return layout.world_size == 1 or len(info.shape) == 0


def _chunk_rows(info: ParamInfo, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s rows [first, last) of ``info`` under ``Shard(0)``: the `torch.chunk` rule."""
    rows = info.shape[0]
    per_rank = -(-rows // world)
    first = min(rank * per_rank, rows)
    return first, min(first + per_rank, rows)


def _chunk_range(info: ParamInfo, layout: FlatLayout, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s chunk of ``info`` as a [start, end) range of the unit's unpadded flat tensor."""
    if _is_replicated_info(info, layout):
        return info.offset, info.offset + info.numel
    first, last = _chunk_rows(info, layout.world_size, rank)
    row_numel = info.numel // info.shape[0] if info.shape[0] else 0
    return info.offset + first * row_numel, info.offset + last * row_numel


def _chunk_shape(info: ParamInfo, layout: FlatLayout, rank: int) -> torch.Size:
    if _is_replicated_info(info, layout):
        return info.shape
    first, last = _chunk_rows(info, layout.world_size, rank)
    return torch.Size((last - first, *info.shape[1:]))


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return lo, max(lo, hi)


def _shard_span(layout: FlatLayout, rank: int) -> tuple[int, int]:
    return rank * layout.shard_numel, (rank + 1) * layout.shard_numel


def _saved_shape(info: ParamInfo) -> torch.Size:
    """The shape of ``info``'s value in a FULL or SHARDED state dict: the global shape."""
    return info.tp.shape if info.tp is not None else info.shape


def _stride(shape: torch.Size) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))
