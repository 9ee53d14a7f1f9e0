"""What state dicts need of a unit's layout: each parameter's saved (global) shape and stride, and
whether its SHARDED value is replicated. This rank's ``Shard(0)`` chunk of every parameter is a
contiguous piece of its flat shard ([Note: rank-major flat shards] in `_rank_major`), so moving
between the flat shard and torch's chunk layout needs no communication."""

from __future__ import annotations

import torch

from fsdp_composable._flat_param import FlatLayout, ParamInfo

__all__: list[str] = []


def _is_replicated_info(info: ParamInfo, layout: FlatLayout) -> bool:
    """A 0-dim parameter, or any parameter of a unit of world size 1: every rank holds it whole."""
    return layout.world_size == 1 or info.replicated


def _saved_shape(info: ParamInfo) -> torch.Size:
    """The shape of ``info``'s value in a FULL or SHARDED state dict: the global shape."""
    return info.tp.shape if info.tp is not None else info.shape


