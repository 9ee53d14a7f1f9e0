"""`ShardedGradScaler`: an inf in one rank's gradient slice makes every rank skip that step and lower
its scale, as ``torch.amp.GradScaler`` does for the plain model whose gradient holds the inf (with
torch's own scaler each rank would decide alone: one skips, the others step).

Upstream: torch FSDP's ShardedGradScaler tests (an inf on one rank only)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_composable import ModuleWrapPolicy, ShardedGradScaler, fully_shard, unshard_params


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(step))


def scaled_steps(kind: str) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    model = fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({nn.Linear}))
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    scales = []
    for step in range(4):
        x = _batch(step)
        ref_scaler.scale(ref(x).pow(2).mean()).backward()
        scaler.scale(model(x.chunk(world)[rank]).pow(2).mean()).backward()
        if step == 1:  # the last element of the first weight: in the last rank's slice only
            ref[0].weight.grad.view(-1)[-1] = float("inf")
            if rank == world - 1:  # this rank's chunk of the DTensor gradient (indexing it is a collective)
                model[0].weight.grad.to_local().view(-1)[-1] = float("inf")
        if kind == "unscale first":  # e.g. to clip the unscaled gradients before the step
            ref_scaler.unscale_(opt_ref)
            scaler.unscale_(opt)
        ref_scaler.step(opt_ref)
        scaler.step(opt)
        ref_scaler.update()
        scaler.update()
        opt_ref.zero_grad()
        opt.zero_grad()
        scales.append((scaler.get_scale(), ref_scaler.get_scale()))
    with unshard_params(model, writeback=False):
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return {"diff": diff, "scales": scales}


@pytest.mark.parametrize("kind", ["step", "unscale first"])
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(dist_run, kind) -> None:
    r0, r1 = dist_run(2, scaled_steps, kind)
    assert r0["scales"] == r1["scales"], (r0, r1)
    assert all(mine == ref for mine, ref in r0["scales"]), r0  # grows, halves at the inf, grows again
    assert r0["scales"][1][0] < r0["scales"][0][0], r0
    for r in (r0, r1):
        assert r["diff"] < 1e-6, r
