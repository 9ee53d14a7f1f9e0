"""Private switches for the cross-rank safety checks, so a benchmark can measure what each costs.

[Note: safety switches]
Every check is on by default and nothing in the library turns one off. `benchmarks/bench_safety.py`
turns them off one at a time (`switched_off`) to measure each one's share of a step; no training run
should: with a check off, the mistake it catches goes unnoticed (a hang, or silently different
values on different ranks, instead of an error). The setting is process-wide (it lives in the
registry, as the per-group header records do) and must be the same on every rank at every step: a
header is exchanged by both sides of a collective or by neither.
- ``headers``: the rank-agreement header before each gloo collective ([Note: collective headers]);
  off, gloo runs as NCCL does (the first iteration's order check stays).
- ``edit_checks``: the root pre-forward's check that the model was not edited ([Note: edits of a
  sharded model]).
- ``grad_bookkeeping``: the per-parameter comparison of every ``.grad`` with what the runtime exposed
  (`_exposed_grads.stash_sharded_grads`, `release_cleared_grads`); off, it trusts that each ``.grad``
  is still what was exposed, or that ``zero_grad()`` cleared them all (it looks at the first one).
The lifecycle transitions are checked always: a set lookup per transition.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator

from fsdp_composable._composable_state import safety_setting, set_safety_setting

__all__ = ["SafetyChecks", "current", "switched_off"]


@dataclass(frozen=True)
class SafetyChecks:
    """Which safety checks run (see [Note: safety switches])."""

    headers: bool = True
    edit_checks: bool = True
    grad_bookkeeping: bool = True


_ALL_ON = SafetyChecks()
NAMES = tuple(f.name for f in dataclasses.fields(SafetyChecks))


def current() -> SafetyChecks:
    setting = safety_setting()
    return setting if setting is not None else _ALL_ON


@contextlib.contextmanager
def switched_off(*names: str) -> Iterator[SafetyChecks]:
    """Turn the named checks off inside the block, on this rank (every rank must do the same)."""
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ValueError(f"unknown safety check(s) {unknown}; the checks are {list(NAMES)}")
    before = current()
    now = dataclasses.replace(before, **{n: False for n in names})
    set_safety_setting(now)
    try:
        yield now
    finally:
        set_safety_setting(before)
