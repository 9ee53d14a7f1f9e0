"""A refused ``load_state_dict`` leaves the model as it was, on every rank.

[Note: a refused load writes nothing]
``nn.Module.load_state_dict`` copies each value as it meets it and raises at the end (missing or
unexpected keys with ``strict=True``, a value of the wrong shape), so a refused load of a plain model
has already overwritten every parameter it reached. For a sharded model that is worse: a value of
the wrong shape on one rank leaves that rank's shards old and the others' new. So the outermost
state's load pre-hook keeps a copy of what the load can write under its module (each unit's flat
shard, every buffer and every parameter we do not shard, 1/N of the model plus the buffers), and the
state's last load post-hook decides, after every unit wrote its shard back: the ranks exchange
whether their load failed (a collective, inside the ``load_state_dict()`` entry point), and if any
did, every rank copies the kept values back and every rank's ``load_state_dict`` raises (a rank whose
own load was fine is told which ranks failed). The copy lives in a context variable for the one
load call that made it (it is recognised by torch's ``error_msgs`` list of that call), never in a
module-level container; an exception that leaves a load midway leaves a stale copy that the next
load replaces. torch hands its load hooks ``strict=True`` whatever the caller passed (its
``load_state_dict`` passes a literal ``True`` to ``_load_from_state_dict``, which hands it to every
pre-hook; post-hooks get only the keys, and strictness is applied after them), so the caller's
``strict`` is read (never changed) from the frame of ``nn.Module.load_state_dict``: a strict load with
a missing or unexpected key is refused on every rank, a non-strict one loads (tests/test_misuse.py).
"""

from __future__ import annotations

import sys
from contextvars import ContextVar
from dataclasses import dataclass
from types import FrameType
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_composable._common_utils import FSDP_FLATTENED, _FSDPState, _get_fsdp_states
from fsdp_composable._flat._checkpoint_comm import all_gather_object
from fsdp_composable._flat_param import FlatParameter

__all__: list[str] = []


@dataclass
class _Kept:
    owner: _FSDPState  # the state whose pre-hook made it: its post-hook decides
    error_msgs: list[str]  # torch's list of this load call (identifies the call)
    strict: bool
    values: list[tuple[torch.Tensor, torch.Tensor]]  # (live tensor, its value before the load)


_KEPT: ContextVar[Optional[_Kept]] = ContextVar("fsdp_composable_kept_before_load", default=None)


def _strict_of_this_load() -> bool:
    """The ``strict`` argument of the ``nn.Module.load_state_dict`` call running now: torch passes its
    load hooks ``strict=True`` whatever the caller asked, and checks strictness itself at the end.
    Read from that call's frame (read only); False where no such frame is found (a load that calls
    ``_load_from_state_dict`` itself), so missing keys alone never refuse a load torch accepts."""
    code = nn.Module.load_state_dict.__code__
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return bool(frame.f_locals.get("strict", True))
        frame = frame.f_back
    return False


def keep_before_load(state: _FSDPState, module: nn.Module, error_msgs: list[str]) -> None:
    """From the outermost state's load pre-hook: keep what the load can overwrite."""
    kept = _KEPT.get()
    if kept is not None and kept.error_msgs is error_msgs:
        return  # an inner state of the same load
    values: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen: set[int] = set()
    for inner in _get_fsdp_states(module):
        for handle in inner.handles:
            if id(handle.flat_param) not in seen:
                seen.add(id(handle.flat_param))
                values.append((handle.flat_param, handle.flat_param.detach().clone()))
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) in seen or getattr(tensor, FSDP_FLATTENED, False) or type(tensor) is FlatParameter:
            continue
        seen.add(id(tensor))
        values.append((tensor, tensor.detach().clone()))
    _KEPT.set(_Kept(state, error_msgs, _strict_of_this_load(), values))


def decide_after_load(state: _FSDPState, incompatible_keys: Any) -> None:
    """From the state's last load post-hook: if the load failed on any rank, put everything back
    on every rank and make every rank's ``load_state_dict`` raise."""
    kept = _KEPT.get()
    if kept is None or kept.owner is not state:
        return
    _KEPT.set(None)
    failed_here = bool(kept.error_msgs) or (
        kept.strict and bool(incompatible_keys.missing_keys or incompatible_keys.unexpected_keys)
    )
    failed = [r for r, f in _every_rank(state, failed_here) if f]
    if not failed:
        return
    with torch.no_grad():
        for live, before in kept.values:
            if live.shape == before.shape:  # not a tensor the load replaced (``assign=True``)
                live.data.copy_(before)
    if failed_here:
        kept.error_msgs.append(
            "fully_shard: the load was refused, so nothing was loaded: every parameter and buffer keeps its "
            f"value on every rank (ranks that could not load: {failed}). Fix the state dict and load again"
        )
    else:
        kept.error_msgs.append(
            f"fully_shard: rank(s) {failed} could not load their state dict (see their errors), so nothing was "
            "loaded on any rank: every parameter and buffer keeps its value. Every rank must load a state dict "
            "that fits the model"
        )


def _every_rank(state: _FSDPState, failed: bool) -> list[tuple[int, bool]]:
    """(global rank, its verdict) for every rank of the state's shard group and its replicas."""
    shard = all_gather_object(state.process_group, (dist.get_rank(), failed), state.device, "exchange of load verdicts")
    if state.replicate_group is not None and dist.get_world_size(state.replicate_group) > 1:
        replicas = all_gather_object(state.replicate_group, shard, state.device, "exchange of load verdicts")
        return [entry for replica in replicas for entry in replica]
    return list(shard)
