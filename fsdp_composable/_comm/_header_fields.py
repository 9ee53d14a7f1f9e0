"""What a collective header says, as numbers every rank reads alike: the collective (`Op`), what it
is for (`_PURPOSES`), the payload's dtype (`_DTYPES`) and the unit whose collective it is
(`for_unit`). See [Note: collective headers] in `_rank_agreement`."""

from __future__ import annotations

import contextlib
import enum
import zlib
from contextvars import ContextVar
from typing import Iterator, Optional

import torch

__all__: list[str] = []


class Op(enum.IntEnum):
    ALL_GATHER = 1
    REDUCE_SCATTER = 2
    ALL_REDUCE = 3
    ALL_TO_ALL = 4
    ALL_GATHER_OBJECT = 5
    BROADCAST = 6
    START = 7  # an entry point that moves no data (load_state_dict of a FULL state dict) checks in
    LEFT = 8  # not a collective: the sender left its step (see `leave_step`)


_OP_TEXT = {
    Op.ALL_GATHER: "an all-gather",
    Op.REDUCE_SCATTER: "a reduce-scatter",
    Op.ALL_REDUCE: "an all-reduce",
    Op.ALL_TO_ALL: "an all-to-all",
    Op.ALL_GATHER_OBJECT: "an all_gather_object",
    Op.BROADCAST: "a broadcast",
    Op.START: "its start",
    Op.LEFT: "nothing (it left the step)",
}

# Index = purpose code in the header. The first two are training; the rest are entry points that
# must be called on every rank.
_PURPOSES = (
    "forward",
    "backward",
    "the execution-order check",
    "state_dict()",
    "load_state_dict()",
    "optim_state_dict()",
    "optim_state_dict_to_load()",
    "unshard_params()",
    "clip_grad_norm_()",
    "sync_module_states",
    "reset_parameters()",
    "fully_shard()",
    "optimizer.state_dict()",
    "optimizer.load_state_dict()",
    "GradScaler.unscale_()",
)
_FIRST_ENTRY_POINT = 3

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)

# the unit whose collective is being issued ("" for none): see [Note: the unit in the header]
_UNIT: ContextVar[str] = ContextVar("fsdp_composable_unit", default="")


def _dtype_code(dtype: Optional[torch.dtype]) -> int:
    if dtype is None:
        return -1
    return _DTYPES.index(dtype) if dtype in _DTYPES else 99


@contextlib.contextmanager
def for_unit(name: str) -> Iterator[None]:
    """Collectives issued inside are those of unit ``name`` (its FQN, ``<root>`` for the root).

    [Note: the unit in the header]
    Units of one model often have the same size (a stack of equal blocks), so a rank that runs
    another unit than its peers (a data-dependent branch taken differently after the first
    iteration, whose order check ([Note: execution order validation]) no longer runs) would pass the
    header check and exchange one unit's shard for another's: silently wrong parameters and
    gradients, or with forward prefetch a wait for a unit the peer never gathers. So every header
    also carries a checksum of the unit's FQN, and ranks that gather or reduce different units get a
    `RankMismatchError` naming each rank's unit."""
    token = _UNIT.set(name)
    try:
        yield
    finally:
        _UNIT.reset(token)


def current_unit() -> str:
    return _UNIT.get()


def _unit_code(name: str) -> int:
    return zlib.crc32(name.encode()) if name else 0
