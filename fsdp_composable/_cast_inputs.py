"""Casting forward inputs for mixed precision: every floating-point tensor, wherever it sits.

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
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["cast_floating"]


def cast_floating(structure: Any, dtype: torch.dtype) -> Any:
    """Cast floating-point tensors in ``structure`` to ``dtype``; integers and others pass through."""

    def cast(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.to(dtype) if leaf.is_floating_point() else leaf
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            out = copy.copy(leaf)
            for f in dataclasses.fields(leaf):
                object.__setattr__(out, f.name, cast_floating(getattr(leaf, f.name), dtype))
            return out
        return leaf

    return pytree.tree_map(cast, structure)
