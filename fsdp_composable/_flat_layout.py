"""Every index computation between original parameters, a unit's flat shards and torch's chunk layout.
Pure functions of a `FlatLayout`: no communication, no tensors (the callers move the data).

Three layouts of a unit's values meet here: the unpadded flat tensor (each parameter at
``info.offset``), its padded flat shards (rank r holds [r*s, (r+1)*s), s = shard_numel), and torch's
chunk layout of each parameter (``Shard(0)``: rank r holds rows [r*c, (r+1)*c), c = ceil(rows/world);
0-dim parameters and units of world size 1 are replicated). `Exchange` says which ranges an
all-to-all sends and receives to go between the last two."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def _shard_piece(info: ParamInfo, layout: FlatLayout) -> tuple[int, int, int]:
    """(start, end, begin): this rank's shard holds ``info``'s flattened value [begin, begin + end -
    start) at [start, end) of the shard."""
    start, end = layout.shard_range(info)
    return start, end, layout.rank * layout.shard_numel + start - info.offset


@dataclass(frozen=True)
class Exchange:
    """One all-to-all between the flat-shard and chunk layouts, from this rank's point of view.

    ``sends``: (piece index, lo, hi) in send order, a range of the piece to send (to the ranks in
    order, ``in_splits[r]`` elements to rank r); ``receives``: (piece index, at, length) in arrival
    order, where each received range goes (``out_splits[r]`` elements from rank r). For `to_chunks`
    the sent piece is this rank's flat shard (index 0) and the received pieces are the parameters'
    chunks; for `to_flat` the reverse."""

    sends: tuple[tuple[int, int, int], ...]
    in_splits: tuple[int, ...]
    receives: tuple[tuple[int, int, int], ...]
    out_splits: tuple[int, ...]


def sharded_indices(layout: FlatLayout) -> list[int]:
    return [k for k, info in enumerate(layout.infos) if not _is_replicated_info(info, layout)]


def to_chunks(layout: FlatLayout) -> Exchange:
    """From each rank's flat shard to each parameter's chunk on this rank (every parameter, replicated
    ones whole)."""
    infos, world, mine = layout.infos, layout.world_size, _shard_span(layout, layout.rank)
    sends, in_splits = [], [0] * world
    for dst in range(world):
        for info in infos:
            a, b = _overlap(mine, _chunk_range(info, layout, dst))
            if b > a:
                sends.append((0, a - mine[0], b - mine[0]))
                in_splits[dst] += b - a
    receives, out_splits = [], [0] * world
    targets = [_chunk_range(info, layout, layout.rank) for info in infos]
    for src in range(world):
        for k, target in enumerate(targets):
            a, b = _overlap(_shard_span(layout, src), target)
            if b > a:
                receives.append((k, a - target[0], b - a))
                out_splits[src] += b - a
    return Exchange(tuple(sends), tuple(in_splits), tuple(receives), tuple(out_splits))


def to_flat(layout: FlatLayout) -> Exchange:
    """From each rank's chunks of the sharded (not replicated) parameters to this rank's flat shard
    (every received piece has index 0: the shard)."""
    infos, world, me = layout.infos, layout.world_size, layout.rank
    mine, sharded = _shard_span(layout, me), sharded_indices(layout)
    own = {k: _chunk_range(infos[k], layout, me) for k in sharded}
    sends, in_splits = [], [0] * world
    for dst in range(world):
        for k in sharded:
            a, b = _overlap(own[k], _shard_span(layout, dst))
            if b > a:
                sends.append((k, a - own[k][0], b - own[k][0]))
                in_splits[dst] += b - a
    receives, out_splits = [], [0] * world
    for src in range(world):
        for k in sharded:
            a, b = _overlap(_chunk_range(infos[k], layout, src), mine)
            if b > a:
                receives.append((0, a - mine[0], b - a))
                out_splits[src] += b - a
    return Exchange(tuple(sends), tuple(in_splits), tuple(receives), tuple(out_splits))


def replicated_in_shard(layout: FlatLayout) -> list[tuple[int, int, int, int]]:
    """(parameter index, at, lo, hi) for each replicated parameter: its flattened [lo, hi) goes at
    ``at`` of this rank's flat shard (no communication: every rank holds it whole)."""
    mine, out = _shard_span(layout, layout.rank), []
    for k, info in enumerate(layout.infos):
        if _is_replicated_info(info, layout):
            a, b = _overlap(mine, (info.offset, info.offset + info.numel))
            if b > a:
                out.append((k, a - mine[0], a - info.offset, b - info.offset))
    return out
