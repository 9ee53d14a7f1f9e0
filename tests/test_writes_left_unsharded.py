"""In-place writes on the parameters of a unit left unsharded between steps
(``set_reshard_after_backward(False)``) are kept: by ``reshard()`` and by the next forward, in full
precision exactly as on the unsharded model, under mixed precision as the written low-precision value."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from models import OddMLP, mlp_batch, mlp_loss
from parity import local_slice
from torch import nn

from fsdp_composable import (
    MixedPrecision,
    ModuleWrapPolicy,
    fully_shard,
    reshard,
    set_reshard_after_backward,
)


def _halve(model: nn.Module) -> None:
    with torch.no_grad():
        model.l2[0].weight.mul_(0.5)  # unit 'l2'
        model.l1.bias.mul_(0.5)  # the root unit


def write_then(how: str) -> float:
    """Backward with the units kept unsharded, the write, then ``reshard()`` before the step
    ("reshard"), or another forward and backward first ("forward"); SGD steps next to the unsharded
    model given the same write: the largest weight difference."""
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = OddMLP().double()
    model = fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({nn.Sequential}))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    set_reshard_after_backward(model, False)
    for step in range(2 if how == "forward" else 1):
        batch = tuple(t.double() for t in mlp_batch(step, 2 * world))
        mlp_loss(ref, batch).backward()
        mlp_loss(model, local_slice(batch, rank, world)).backward()
        if step == 0:
            _halve(ref)
            _halve(model)
    reshard(model)
    reshard(model.l2)
    for opt in opts:
        opt.step()
    sd = model.state_dict()
    return max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items())


@pytest.mark.parametrize("how", ["reshard", "forward"])
def test_writes_on_a_unit_left_unsharded_are_kept(dist_run: Callable[..., Any], how: str) -> None:
    for diff in dist_run(2, write_then, how):
        assert diff < 1e-12, diff


def write_in_low_precision() -> dict[str, bool]:
    """Under a bf16 ``param_dtype`` the written elements take the written bf16 value; the others keep
    their float32 value."""
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = OddMLP()
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    model = fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({nn.Sequential}), mixed_precision=mp)
    set_reshard_after_backward(model, False)
    mlp_loss(model, local_slice(mlp_batch(0, 2 * world), rank, world)).backward()
    with torch.no_grad():
        model.l2[0].weight.mul_(0.5)
    reshard(model.l2)
    reshard(model)
    sd = model.state_dict()
    want = (ref.l2[0].weight.bfloat16() * 0.5).float()
    others = [k for k in sd if k != "l2.0.weight"]
    return {
        "written": torch.equal(sd["l2.0.weight"], want),
        "others": all(torch.equal(sd[k], ref.state_dict()[k]) for k in others),
    }


def test_low_precision_writes_are_kept(dist_run: Callable[..., Any]) -> None:
    assert dist_run(2, write_in_low_precision) == [{"written": True, "others": True}] * 2
