"""``reshard_after_forward`` given to the root's `fully_shard` call reshards the root unit after
forward too (as FSDP2); left out, the root unit stays unsharded for backward."""

from __future__ import annotations

import copy
from typing import Any, Callable, Union

import pytest
import torch
import torch.distributed as dist
from models import Block, TinyGPT, gpt_batch, gpt_loss
from parity import local_slice

from fsdp_composable import ModuleWrapPolicy, fully_shard


def root_after_forward(given: Union[bool, int, None]) -> dict[str, Any]:
    """Whether the root unit is unsharded right after a grad-enabled forward, and the largest weight
    difference from the unsharded model after two SGD steps."""
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = TinyGPT()
    model = fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({Block}), reshard_after_forward=given)
    root = fully_shard.state(model).handles[0]
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    unsharded = []
    for step in range(2):
        batch = gpt_batch(step, 2 * world)
        gpt_loss(ref, batch).backward()
        idx, target = local_slice(batch, rank, world)
        logits = model(idx)
        unsharded.append(root.is_unsharded)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    sd = model.state_dict()
    diff = max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return {"unsharded": unsharded, "diff": diff}


@pytest.mark.parametrize(
    ("world_size", "given", "unsharded"), [(2, None, True), (2, True, False), (4, 2, False), (4, 1, True)]
)
def test_root_unit_follows_the_argument(
    dist_run: Callable[..., Any], world_size: int, given: Union[bool, int, None], unsharded: bool
) -> None:
    for r in dist_run(world_size, root_after_forward, given):
        assert r["unsharded"] == [unsharded] * 2, r
        assert r["diff"] < 1e-5, r
