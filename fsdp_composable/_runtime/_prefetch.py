"""Unshard a unit for the runtime, and start the next unit's all-gather early (prefetch), within the
all-gather limiter's bound ([Note: why limit all-gathers])."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from fsdp_composable._comm import _collectives
from fsdp_composable._common_utils import _FSDPState
from fsdp_composable._flat_param import FlatParamHandle
from fsdp_composable._runtime._entry_points import _in_backward
from fsdp_composable._runtime._lazy_init import _ctx

__all__: list[str] = []


def default_forward_prefetch(given: Optional[bool], group: dist.ProcessGroup, device: torch.device) -> bool:
    """``forward_prefetch`` as the runtime uses it: ``given``, or (None, the default) on where a
    unit's all-gather would otherwise not overlap the previous unit's forward.

    [Note: forward prefetch by default]
    On CUDA the all-gather runs on the unshard stream: the CPU issues unit k+1's all-gather in its
    pre-forward while the GPU still computes unit k, so without any prefetch the two already overlap
    (FSDP2's implicit prefetching), and two units are unsharded at once. On the CPU (gloo, the
    point-to-point exchanges of `_collectives`) nothing runs ahead: the all-gather issued in unit
    k+1's pre-forward is waited for at once, so each unit's exchange is a wait. There the default
    issues it in unit k's pre-forward instead, as ``forward_prefetch=True`` does: the same two units
    unsharded at once as on CUDA, within the limiter's bound (the measured peak did not change), and
    the benchmark model's step on 2 ranks was 1-4 % shorter (``benchmarks/bench_paired.py``, which
    interleaves the steps of both settings in the same ranks). ``False`` turns it off everywhere."""
    if given is not None:
        return given
    return _collectives.point_to_point(group, device)


# ---------------------------------------------------------------------------- unshard / prefetch
def _unshard(state: _FSDPState, handle: FlatParamHandle) -> None:
    ctx = state.ctx
    if ctx is not None and ctx.open_forwards == 0 and not _in_backward():
        # a unit called outside the root's forward: no root pre-forward ordered its all-gather after
        # the shards' last writes (the optimizer's), see _collectives.issue
        _collectives.wait_for_compute(ctx.unshard_stream)
    handle.unshard(ctx.unshard_stream if ctx is not None else None)
    if ctx is not None:
        ctx.limiter.record(ctx.unit_of(handle), counted=not ctx.is_root_unit(handle))
        if ctx.unshard_stream is not None:  # only side streams leave freed storage behind
            ctx.limiter.release_resharded()


def _prefetch(state: _FSDPState, handle: Optional[FlatParamHandle], phase: str, listed: bool = False) -> None:
    """Start the all-gathers of ``handle``'s unit early (every handle of it: one unit for the limiter,
    [Note: the limiter counts units]), unless already under way or the limiter says no.

    [Note: explicit prefetch lists]
    A unit the user listed (``set_modules_to_forward_prefetch`` / ``..._backward_prefetch``, ``listed``)
    is gathered whatever the limiter says, as FSDP2 (which has no limiter) gathers every unit listed: the
    list says how far ahead to gather, and gathering less would silently ignore part of it. The limiter
    bounds only the prefetches we choose (``forward_prefetch``, ``backward_prefetch``); a listed unit
    still counts in it, so those wait until the listed ones are resharded."""
    if handle is None or handle.is_unsharded or handle.unshard_in_flight:
        return
    if phase == "backward" and not handle.switches.unshard_in_backward:
        return  # set_unshard_in_backward(unit, False): its backward does not gather it either
    ctx = _ctx(state)
    if state.limit_all_gathers and not listed and not ctx.limiter.may_prefetch():
        return
    ctx.exec_order.prefetch_log.append((phase, handle.unit_fqn))
    for sibling in ctx.unit_of(handle):
        _unshard(state, sibling)


def _prefetch_for_forward(state: _FSDPState, handle: FlatParamHandle) -> None:
    """Pre-forward: the units ``set_modules_to_forward_prefetch`` named for ``handle``'s, else (with
    ``forward_prefetch``) the next unit of the recorded order. Never in the first iteration, whose
    every unit's all-gather must follow its execution-order check ([Note: execution order validation])."""
    ctx = _ctx(state)
    if ctx.exec_order.is_first_iter:
        return
    if handle.switches.forward_prefetch is not None:
        for target in handle.switches.forward_prefetch:  # every one: [Note: explicit prefetch lists]
            if target in ctx.steps:  # a unit of this root (another root's units gather on their own)
                _prefetch(state, target, "forward", listed=True)
    elif state.forward_prefetch:
        _prefetch(state, ctx.exec_order.forward_prefetch_target(handle), "forward")


def _prefetch_for_backward(state: _FSDPState, handle: FlatParamHandle) -> None:
    if state.ctx is not None:
        steps = state.ctx.steps
        if handle.switches.backward_prefetch is not None:  # set_modules_to_backward_prefetch
            for explicit in handle.switches.backward_prefetch:
                if explicit in steps and not steps[explicit].ran_pre_backward:
                    _prefetch(state, explicit, "backward", listed=True)
            return
        target = state.ctx.exec_order.backward_prefetch_target(handle, lambda h: steps[h].ran_pre_backward)
        _prefetch(state, target, "backward")
