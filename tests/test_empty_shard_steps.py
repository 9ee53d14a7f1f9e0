"""A parameter whose slice is empty on some rank is stepped on every rank (its ``.grad`` there is an
empty tensor, as FSDP2 gives it), so the optimizer's per-parameter ``step`` agrees across ranks, in
``optim.state_dict()`` and in every checkpoint form, and equals the plain model's.

Upstream: torch FSDP2's tests of uneven sharding (a parameter with fewer rows than ranks)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from fsdp_composable import fully_shard, optim_state_dict, unshard_params


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(step)).double()


def _steps(state: dict[Any, Any]) -> dict[str, float]:
    return {str(k): float(v["step"]) for k, v in state.items() if "step" in v}


def empty_slices_step() -> dict[str, Any]:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1)).double()  # the last bias: one element
    model = fully_shard(copy.deepcopy(ref))
    opt_ref, opt = torch.optim.Adam(ref.parameters(), lr=0.1), torch.optim.Adam(model.parameters(), lr=0.1)
    for step in range(3):
        ref(_batch(step)).pow(2).mean().backward()
        model(_batch(step).chunk(dist.get_world_size())[dist.get_rank()]).pow(2).mean().backward()
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    names = {id(p): n for n, p in model.named_parameters()}
    full = StateDictOptions(full_state_dict=True)
    with unshard_params(model, writeback=False):
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return {
        "some_empty": any(p.to_local().numel() == 0 for p in model.parameters()),  # the faces: global numel
        "live_steps": {names[id(p)]: float(s["step"]) for p, s in opt.state.items()},
        "optim_state_dict": _steps(optim_state_dict(model, opt)["state"]),
        "torch_full": _steps(get_optimizer_state_dict(model, opt, options=full)["state"]),
        "torch_sharded": _steps(get_optimizer_state_dict(model, opt)["state"]),
        "state_dict": sorted(_steps(opt.state_dict()["state"]).values()),
        "diff": diff,
    }


def test_a_parameter_with_an_empty_slice_is_stepped_on_every_rank(dist_run) -> None:
    r0, r1 = dist_run(2, empty_slices_step)
    assert r0["some_empty"] or r1["some_empty"]  # the layout does give some rank an empty slice
    every = {n: 3.0 for n in ("0.weight", "0.bias", "2.weight", "2.bias")}  # the plain model's steps
    for r in (r0, r1):
        assert r["live_steps"] == every, r
        assert r["optim_state_dict"] == every and r["torch_full"] == every and r["torch_sharded"] == every, r
        assert r["state_dict"] == [3.0] * 4, r
        assert r["diff"] < 1e-12, r
