"""A unit's layout: where each original parameter lives in the rank-major flat shard and in the
param-major unsharded buffer, and the two copies between them.

[Note: rank-major flat shards]
Each original parameter is cut into ``world`` equal dim-0 chunks by torch's ``chunk`` rule (``c =
ceil(rows / world)`` rows each, the last ones padded with zero rows), the layout ``Shard(0)`` describes.
Rank r's flat shard is the concatenation of every parameter's chunk r, in parameter order, so
each rank holds exactly its ``Shard(0)`` piece of every parameter, contiguous. Two tensors of the
same padded size ``world * shard_numel`` meet at every unshard and every reduction:

- the **rank-major** flat (what the all-gather writes and the reduce-scatter reads): rank 0's
  shard, then rank 1's, ...;
- the **param-major** unsharded buffer (what forward and backward compute with, and where the
  gradients accumulate): each parameter's ``world`` chunks in a row, its region starting at
  ``info.offset``, the parameter itself viewing the region's front.

Viewed as a (world, shard_numel) matrix the rank-major flat's columns are the parameters' chunks,
and each parameter's region is a (world, chunk_numel) matrix: `copy_out` is one
``split_with_sizes_copy`` along the columns and `copy_in` one ``cat`` (or, from autograd's
per-parameter gradients, `cat_in` one ``_chunk_cat``, which pads each by the same rule). A unit
whose chunks are all one parameter's (one parameter, or one rank) needs neither: both orders are
the same tensor.

A 0-dim parameter has no dim 0 to cut: every rank's chunk holds it whole (``replicated``), the
copy-out writes ``world`` equal copies of which the parameter views the first, and the copy-in
repeats its one gradient into every rank's chunk so that each rank's shard gets the same reduced
value. A unit with nothing to shard keeps one element of padding per rank (``tail``), so no
collective is ever of size zero.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from fsdp_composable._base import _param_major
from fsdp_composable._comm._tensor_parallel import TPSpec, local_of, spec_of

__all__ = ["FlatLayout", "ParamInfo", "build_layout"]

# [Note: moving chunks]
# On gloo our all-gather and reduce-scatter are point-to-point messages, and a rank-major shard can
# travel as one message per parameter chunk, each received into (or sent from) where the param-major
# buffer holds it: no copy and no second buffer, at the cost of more messages. Each message costs
# tens of microseconds of fixed work, a copy costs per byte: a unit whose chunks average at least
# DIRECT_CHUNK_NUMEL elements moves them directly, a smaller one through one rank-major buffer, one
# message per peer and one copy (benchmarks/README.md, "rank-major shards", has the measurements).
DIRECT_CHUNK_NUMEL = 16384


@dataclass(frozen=True)
class ParamInfo:
    """One original parameter of a unit. ``holders`` lists every (module, attribute, FQN) that
    registers it: more than one for tied parameters. FQNs are relative to the unit's module.

    ``offset``: where its region starts in the param-major unsharded buffer (``world * chunk_numel``
    elements); ``shard_offset``: where its chunk starts in every rank's flat shard."""

    fqn: str
    shape: torch.Size
    numel: int
    offset: int
    holders: tuple[tuple[nn.Module, str, str], ...]
    # a tensor-parallel DTensor parameter's layout: ``shape``/``numel`` are then its local tensor's
    # (see [Note: tensor-parallel parameters])
    tp: Optional[TPSpec] = None
    shard_offset: int = 0
    chunk_numel: int = 0
    replicated: bool = False  # 0-dim, or a layout of one rank: every chunk holds it whole


@dataclass(frozen=True)
class FlatLayout:
    """Where each original parameter lives in the flat shard and the unsharded buffer; see
    [Note: rank-major flat shards]."""

    infos: tuple[ParamInfo, ...]
    unpadded_numel: int  # the parameters' elements
    padded_numel: int  # world_size * shard_numel: the unsharded buffer and the gathered flat
    shard_numel: int  # every rank's flat shard
    rank: int
    world_size: int
    tail: int = 0  # padding at the end of every shard that belongs to no parameter

    def local_numel(self, info: ParamInfo, rank: Optional[int] = None) -> int:
        """Elements of ``info``'s value that rank ``rank`` (default: this rank) holds."""
        if info.replicated:
            return info.numel
        r = self.rank if rank is None else rank
        return min(max(info.numel - r * info.chunk_numel, 0), info.chunk_numel)

    def shard_range(self, info: ParamInfo) -> tuple[int, int]:
        """``info``'s value in this rank's shard, as [start, end) offsets into the shard."""
        return info.shard_offset, info.shard_offset + self.local_numel(info)

    def param_range(self, info: ParamInfo, rank: Optional[int] = None) -> tuple[int, int]:
        """The [start, end) of ``info``'s flattened value that rank ``rank`` (default: this rank) holds."""
        if info.replicated:
            return 0, info.numel
        r = self.rank if rank is None else rank
        start = min(r * info.chunk_numel, info.numel)
        return start, start + self.local_numel(info, r)

    def local_shape(self, info: ParamInfo, rank: Optional[int] = None) -> torch.Size:
        """The shape of rank ``rank``'s chunk of ``info`` (``Shard(0)``'s local shape)."""
        if info.replicated or self.world_size == 1:
            return info.shape
        # by rows, not elements: a zero-size (3, 0) parameter still has rows to hand out
        rows, r = info.shape[0], self.rank if rank is None else rank
        per = -(-rows // self.world_size)
        first = min(r * per, rows)
        return torch.Size((min(first + per, rows) - first, *info.shape[1:]))

    @functools.cached_property
    def direct(self) -> bool:
        """Whether gloo moves each chunk where it goes, one message per chunk ([Note: moving chunks]);
        otherwise through one rank-major buffer and one copy."""
        chunks = sum(1 for c in self.chunk_sizes if c)
        return self.shard_numel >= DIRECT_CHUNK_NUMEL * max(chunks, 1)

    @functools.cached_property
    def same_order(self) -> bool:
        """Whether the rank-major flat and the param-major buffer are the same tensor (no copy-out)."""
        return self.world_size == 1 or sum(1 for i in self.infos if i.chunk_numel) + (self.tail > 0) <= 1

    @functools.cached_property
    def same_order_in(self) -> bool:
        """Whether gradients need no copy-in (as `same_order`, and no replicated parameter to repeat)."""
        return self.same_order and (self.world_size == 1 or not any(i.replicated for i in self.infos))

    @functools.cached_property
    def chunk_sizes(self) -> list[int]:
        """Every parameter's chunk (and the tail, if any): the columns of the rank-major flat."""
        return [i.chunk_numel for i in self.infos] + ([self.tail] if self.tail else [])

    def _regions(self, full: torch.Tensor, expand: bool) -> list[torch.Tensor]:
        """Each region of the param-major ``full`` as (world, chunk); ``expand``: a replicated
        parameter's front repeated (gradients live in the front only)."""
        out = _param_major.regions(full, self.chunk_sizes, self.world_size)
        if expand:
            for k, info in enumerate(self.infos):
                if info.replicated:
                    front = full[info.offset : info.offset + info.numel]
                    out[k] = front.view(1, info.numel).expand(self.world_size, info.numel)
        return out

    def regions_of(self, full: torch.Tensor) -> list[torch.Tensor]:
        """The (world, chunk) view of each parameter's region (and the tail's) of the param-major ``full``:
        what a copy-out or an all-gather by parameter writes into. Views stay valid when the storage
        is freed and grown again, so a buffer's regions are made once."""
        return _param_major.regions(full, self.chunk_sizes, self.world_size)

    def copy_out(self, gathered: torch.Tensor, out: torch.Tensor) -> None:
        """Rank-major ``gathered`` into the param-major ``out`` (both 1-D, ``padded_numel``): one kernel."""
        _param_major.copy_out(gathered, self.regions_of(out))

    def copy_in(self, full: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The param-major ``full`` (gradients: a replicated parameter's front only) as a rank-major
        flat, in ``out`` if given: one kernel."""
        if out is None:
            out = torch.empty(self.padded_numel, dtype=full.dtype, device=full.device)
        torch.cat(self._regions(full, expand=True), dim=1, out=out.view(self.world_size, self.shard_numel))
        return out

    @functools.cached_property
    def cats_params_in(self) -> bool:
        """Whether `cat_in` can build the rank-major flat from the parameters' own tensors: each is
        cut by ``torch._chunk_cat``'s rule, which is ours for every parameter that is not empty,
        replicated or tensor-parallel."""
        return self.tail == 0 and not any(i.numel == 0 or i.replicated or i.tp is not None for i in self.infos)

    def cat_in(self, parts: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Every parameter's own tensor (in its shape: autograd's gradients) into the rank-major
        ``out`` (1-D ``padded_numel``, or a (world, shard_numel) view; any dtype): one kernel, padding
        included, no param-major copy first. Only where `cats_params_in`."""
        rows = out if out.dim() == 2 else out.view(self.world_size, self.shard_numel)
        torch._chunk_cat(parts, 0, self.world_size, out=rows)
        return out

    def ranks_of(self, full: torch.Tensor, first: int, last: int) -> torch.Tensor:
        """The flat shards of ranks [first, last) of the param-major ``full``, rank-major: a new tensor."""
        rows = [region[first:last] for region in self._regions(full, expand=True)]
        return torch.cat(rows, dim=1).view(-1)

    def shard_of(self, full: torch.Tensor, rank: Optional[int] = None) -> torch.Tensor:
        """Rank ``rank``'s (default: this rank's) flat shard of the param-major ``full``, to copy from:
        a view of ``full`` when both orders are the same tensor, else a new tensor."""
        r = self.rank if rank is None else rank
        if self.same_order_in:
            return full[r * self.shard_numel : (r + 1) * self.shard_numel]
        return self.ranks_of(full, r, r + 1)

    def rank_major_pieces(self, parts: list[Optional[torch.Tensor]], zeros: torch.Tensor) -> list[torch.Tensor]:
        """1-D pieces whose concatenation is the rank-major flat of the param-major tensor whose
        parameters are ``parts`` (flattened; None: zeros); padding is sliced from ``zeros`` (1-D, at
        least one chunk long). Views only: what gloo's point-to-point reduce-scatter sends as it is."""
        out: list[torch.Tensor] = []
        for r in range(self.world_size):
            for info, part in zip(self.infos, parts):
                lo, hi = self.param_range(info, r)
                if part is not None and hi > lo:
                    out.append(part[lo:hi])
                    pad = info.chunk_numel - (hi - lo)
                else:
                    pad = info.chunk_numel
                if pad:
                    out.append(zeros[:pad])
            if self.tail:
                out.append(zeros[: self.tail])
        return out


def _chunk_numel(local: torch.Tensor, world: int) -> tuple[int, bool]:
    """(elements of one rank's chunk, replicated) of a parameter with local tensor ``local``."""
    if world == 1 or local.dim() == 0:
        return local.numel(), world > 1
    rows = local.shape[0]
    row = local.numel() // rows if rows else 0
    return -(-rows // world) * row, False


def build_layout(
    params: list[nn.Parameter], holders: list[list[tuple[nn.Module, str, str]]], rank: int, world_size: int
) -> FlatLayout:
    infos = []
    offset = shard_offset = unpadded = 0
    for param, param_holders in zip(params, holders):
        local = local_of(param)
        chunk, replicated = _chunk_numel(local, world_size)
        infos.append(
            ParamInfo(
                param_holders[0][2],
                local.shape,
                local.numel(),
                offset,
                tuple(param_holders),
                spec_of(param),
                shard_offset,
                chunk,
                replicated,
            )
        )
        offset += chunk * world_size
        shard_offset += chunk
        unpadded += local.numel()
    tail = 0 if shard_offset else 1
    shard = shard_offset + tail
    return FlatLayout(tuple(infos), unpadded, shard * world_size, shard, rank, world_size, tail)
