"""A grad-enabled forward whose output is dropped (no backward), then an optimizer step or a full
``load_state_dict``: the next forward computes with the new weights, also with
``reshard_after_forward=<int>`` (whose units keep a slice of the dropped forward's parameters)."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from models import Block, TinyGPT, gpt_batch, gpt_loss
from parity import local_slice

from fsdp_composable import ModuleWrapPolicy, fully_shard, reshard


def _shard(model: TinyGPT, how: str) -> None:
    if how == "bottom_up":  # the root left out: it stays unsharded after the dropped forward
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=2)
        fully_shard(model)
    else:
        fully_shard(model, ModuleWrapPolicy({Block}), reshard_after_forward=2)


def dropped_forward_then(how: str, change: str) -> float:
    """A step, a dropped forward, then ``change`` (an SGD step, or a load of other weights) on the model
    and on the unsharded reference; then two more steps: the largest weight difference."""
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = TinyGPT()
    other = TinyGPT().state_dict()
    model = copy.deepcopy(ref)
    _shard(model, how)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    for step in range(3):
        batch = gpt_batch(step, 2 * world)
        gpt_loss(ref, batch).backward()
        gpt_loss(model, local_slice(batch, rank, world)).backward()
        if step == 0:
            model(local_slice(batch, rank, world)[0])  # grad-enabled; its output is dropped
            if how == "bottom_up":
                reshard(model)  # what optimizer.step()'s refusal says to do for the root unit
        if step == 0 and change == "load":
            for m in (ref, model):
                m.load_state_dict(other)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    sd = model.state_dict()
    return max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items())


@pytest.mark.parametrize(("how", "change"), [("policy", "step"), ("policy", "load"), ("bottom_up", "step")])
def test_next_forward_uses_the_new_weights(dist_run: Callable[..., Any], how: str, change: str) -> None:
    for diff in dist_run(4, dropped_forward_then, how, change):
        assert diff < 1e-5, diff
