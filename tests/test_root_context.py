"""One owner for every piece of runtime state: the root context ([Note: the root context])."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from models import TinyGPT, gpt_batch, gpt_loss
from parity import local_slice

from fsdp_composable import fully_shard, no_sync
from fsdp_composable._common_utils import _FSDPState, _get_fsdp_states
from fsdp_composable._runtime._root_context import RootContext

# what used to be copied onto handles and states, and now lives once in the root context (or is derived)
_NOT_ON_HANDLES = ("step", "siblings", "unshard_stream", "reduce_stream", "ran_pre_backward")
_NOT_STATE_FIELDS = ("sync_gradients", "is_root", "root_state")
_NOT_CONTEXT_FIELDS = ("handles", "non_root_handles", "state_of")


def ownership() -> dict:
    torch.manual_seed(0)
    model = TinyGPT()
    for block in model.blocks:  # bottom-up by hand: three states under one root
        fully_shard(block)
    fully_shard(model)
    state = fully_shard.state(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = local_slice(gpt_batch(0, 2 * world), rank, world)
    out: dict = {"ctx_before": state.ctx is None}
    with no_sync(model):  # before the first forward: the switch needs the root context
        ctx = state.ctx
        assert ctx is not None
        out["switch_inside"] = ctx.sync_gradients
        gpt_loss(model, batch).backward()
    out["switch_after"] = ctx.sync_gradients
    gpt_loss(model, batch).backward()
    states = _get_fsdp_states(model)
    out["one_context"] = all(s.ctx is ctx for s in states) and ctx.root is state
    out["roots"] = [s.is_root for s in states]
    out["handles_derived"] = ctx.handles == [h for s in states for h in s.handles]
    out["non_root_are_blocks"] = [h.module for h in ctx.non_root_handles] == list(model.blocks)
    out["counters_per_handle"] = set(ctx.steps) == set(ctx.handles)
    out["counters_reset"] = all(dataclasses.astuple(c) == (False, 0, 0, 0, set(), []) for c in ctx.steps.values())
    out["on_handles"] = sorted({a for h in ctx.handles for a in _NOT_ON_HANDLES if hasattr(h, a)})
    out["state_fields"] = sorted({f.name for f in dataclasses.fields(_FSDPState)} & set(_NOT_STATE_FIELDS))
    out["context_fields"] = sorted({f.name for f in dataclasses.fields(RootContext)} & set(_NOT_CONTEXT_FIELDS))
    return out


def test_runtime_state_has_one_owner(dist_run) -> None:
    r = dist_run(2, ownership)[0]
    assert r == {
        "ctx_before": True,
        "switch_inside": False,
        "switch_after": True,
        "one_context": True,
        "roots": [True, False, False],
        "handles_derived": True,
        "non_root_are_blocks": True,
        "counters_per_handle": True,
        "counters_reset": True,
        "on_handles": [],
        "state_fields": [],
        "context_fields": [],
    }, r
