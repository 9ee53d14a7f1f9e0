"""The strides of a contiguous tensor of a given shape, for views and ``DTensor``s built from a shape
alone (the flat buffers' views, the sharded state dict's and tensor parallelism's ``DTensor``s)."""

from __future__ import annotations

import torch

__all__ = ["contiguous_strides"]


def contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """Row-major strides of ``shape``, as torch gives a contiguous tensor (a size-0 dimension counts
    as 1, so no stride is 0)."""
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
