"""Casting forward inputs for mixed precision, and moving the root's inputs to the compute device:
every tensor concerned, wherever it sits.

[Note: dataclass inputs]
pytree knows tuples, lists, dicts and namedtuples, but treats an unregistered dataclass as a leaf, so
its tensors would reach the forward uncast (a dtype error in the first matmul, or a silently full-
precision computation). We look inside dataclasses too: a shallow copy of the instance (no
``__init__`` call, so ``init=False`` fields and ``__post_init__`` side effects are left alone) gets each
field set to its cast value with ``object.__setattr__``, which works for frozen dataclasses as well.
The caller's instance is never modified.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

__all__ = ["cast_floating", "to_device"]


def cast_floating(structure: Any, dtype: torch.dtype) -> Any:
    """Cast floating-point tensors in ``structure`` to ``dtype``; integers and others pass through."""
    return _map_tensors(structure, lambda t: t.to(dtype) if t.is_floating_point() else t)


def to_device(structure: Any, device: torch.device) -> Any:
    """The root's inputs on the compute device, as FSDP1 and FSDP2 move them (floating, integer and
    boolean tensors alike; non-blocking, so a pinned host batch is copied asynchronously). Tensors
    already there are passed through untouched; so is everything on a CPU compute device."""
    if device.type == "cpu":
        return structure
    return _map_tensors(structure, lambda t: t if t.device == device else t.to(device, non_blocking=True))


def _map_tensors(structure: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    def one(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return fn(leaf)
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            out = copy.copy(leaf)
            for f in dataclasses.fields(leaf):
                object.__setattr__(out, f.name, _map_tensors(getattr(leaf, f.name), fn))
            return out
        return leaf

    return pytree.tree_map(one, structure)
