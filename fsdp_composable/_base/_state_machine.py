"""Checked transitions, shared by the three lifecycles: `TrainingState` (a call's state),
`HandleTrainingState` (a unit's parameters) and `GradState` (a unit's gradients).

Every unit makes several checked transitions per step, each two hashed look-ups of its enum; the
three enums hash by identity (``__hash__ = object.__hash__``, in C) instead of `enum.Enum`'s hash of
the member's name (a Python call). Members are singletons compared by identity, so nothing else changes."""

from __future__ import annotations

import enum
from typing import Any

from fsdp_composable.api import StateTransitionError

__all__ = ["StateTransitionError", "check_transition"]

Transitions = dict[Any, frozenset[Any]]


def check_transition(kind: str, where: str, current: enum.Enum, new: enum.Enum, allowed: Transitions) -> None:
    """Raise `StateTransitionError` unless ``allowed[current]`` contains ``new``."""
    if new not in allowed[current]:
        raise StateTransitionError(
            f"{kind} of {where} cannot go from {current.name} to {new.name} "
            f"(allowed from {current.name}: {sorted(s.name for s in allowed[current]) or 'none'}). "
            "This usually means modules ran in an order fully_shard does not support; see docs/errors.md"
        )
