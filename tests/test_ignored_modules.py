"""Ignored modules: ``clip_grad_norm_`` returns one norm on every rank and clips with it (ignored
gradients are each rank's own and count as their mean over ranks), a weight tied between an ignored
module and a sharded one is refused while sharding, and so are ranks that ignore different modules,
on every rank. Compared with the unsharded model on the same global batch, at 2 and 4 ranks (odd
sizes: every shard is padded), for ``fully_shard`` and the wrapper class."""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import expecttest
import pytest
import torch
import torch.distributed as dist
from models import OddMLP, mlp_batch
from parity import error_text, local_slice
from torch import nn

from fsdp_composable import (
    FullyShardedDataParallel,
    ModuleWrapPolicy,
    ShardingStrategy,
    clip_grad_norm_,
    fully_shard,
    unshard_params,
)


class _WithSide(nn.Module):
    """OddMLP and a side head, ``side``, to ignore; ``tie`` ties a sharded weight to it."""

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.mlp = OddMLP()
        self.side = nn.Linear(5, 3)
        self.out = nn.Linear(5, 3)
        if tie:
            self.out.weight = self.side.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) + self.side(x).sum(-1, keepdim=True) + self.out(x).mean(-1, keepdim=True)


def _shard(model: _WithSide, kind: str, strategy: str, ignored: list[nn.Module] | None) -> nn.Module:
    policy = ModuleWrapPolicy({nn.Sequential})
    if kind == "fully_shard":
        return fully_shard(model, policy, strategy=ShardingStrategy[strategy], ignored_modules=ignored)
    return FullyShardedDataParallel(
        model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy[strategy], ignored_modules=ignored
    )


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    with unshard_params(model, with_grads=True, writeback=False):
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def clip_with_ignored(kind: str, strategy: str, norm_type: float) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = _WithSide()
    model = copy.deepcopy(ref)
    model = _shard(model, kind, strategy, [model.side])
    x, _ = mlp_batch(0, 4 * world)
    ref(x).pow(2).mean().backward()
    model(local_slice((x, x), rank, world)[0]).pow(2).mean().backward()
    side = [p for n, p in model.named_parameters() if "side" in n]
    # 1. the ignored gradients as each rank computed them (they differ): one norm everywhere
    local = [p.grad.clone() for p in side]
    managed = {n: g for n, g in _full_grads(model).items() if "side" not in n}
    if math.isinf(norm_type):
        ignored_term = torch.stack([g.abs().max() for g in local]).max()
        dist.all_reduce(ignored_term, op=dist.ReduceOp.MAX)
        expected = max(max(g.abs().max().item() for g in managed.values()), ignored_term.item())
    else:
        ignored_term = sum(g.pow(2).sum() for g in local)
        dist.all_reduce(ignored_term)
        expected = math.sqrt(sum(g.pow(2).sum().item() for g in managed.values()) + ignored_term.item() / world)
    norm = clip_grad_norm_(model, 0.01, norm_type=norm_type).item()
    coef = min(1.0, 0.01 / (norm + 1e-6))
    clipped = max((p.grad - g * coef).abs().max().item() for p, g in zip(side, local))
    # 2. averaged by hand, as DDP would: the plain model's norm, and training goes on like it
    for p, g in zip(side, local):  # the gradients before the clip, averaged
        p.grad = g.clone()
        dist.all_reduce(p.grad)
        p.grad /= world
    for n, p in model.named_parameters():  # undo the clip
        if "side" not in n and p.grad is not None:
            p.grad /= coef
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01, norm_type=norm_type).item()
    synced = clip_grad_norm_(model, 0.01, norm_type=norm_type).item()
    for m in (ref, model):
        torch.optim.SGD(m.parameters(), lr=1.0).step()
    sd, ref_sd = model.state_dict(), ref.state_dict()
    return {
        "norm": norm,
        "expected": expected,
        "clipped": clipped,
        "synced": synced,
        "ref_norm": ref_norm,
        "weights": max((sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd),
    }


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    "kind, strategy, norm_type",
    [("fully_shard", "FULL_SHARD", 2.0), ("wrapper", "FULL_SHARD", math.inf), ("wrapper", "SHARD_GRAD_OP", 2.0)],
)
def test_clip_grad_norm_with_ignored_modules_is_one_norm_on_every_rank(
    dist_run: Callable[..., Any], world_size: int, kind: str, strategy: str, norm_type: float
) -> None:
    results = dist_run(world_size, clip_with_ignored, kind, strategy, norm_type)
    assert len({r["norm"] for r in results}) == 1, results
    assert len({r["synced"] for r in results}) == 1, results
    for r in results:
        assert r["norm"] == pytest.approx(r["expected"], rel=1e-5), r
        assert r["clipped"] < 1e-7, r
        assert r["synced"] == pytest.approx(r["ref_norm"], rel=1e-5), r
        assert r["weights"] < 1e-6, r


def tied_to_ignored(kind: str) -> str:
    torch.manual_seed(0)
    model = _WithSide(tie=True)
    return error_text(lambda: _shard(model, kind, "FULL_SHARD", [model.side]))


@pytest.mark.parametrize("kind", ["fully_shard", "wrapper"])
def test_weight_tied_to_an_ignored_module_is_refused_while_sharding(dist_run: Callable[..., Any], kind: str) -> None:
    results = dist_run(2, tied_to_ignored, kind)
    assert results[0] == results[1]
    api = "fully_shard" if kind == "fully_shard" else "FullyShardedDataParallel"
    expecttest.TestCase().assertExpectedInline(
        results[0].replace(api, "<api>"),
        """ValueError: <api> argument 'ignored_modules': parameter 'out.weight' is tied to 'side.weight' of an ignored module. Ignored parameters' gradients are not reduced, so each rank would train its own copy of it. Ignore the module of 'out.weight' as well, untie them, or do not ignore the module of 'side.weight'""",  # noqa: E501
    )


def ignore_differently(kind: str, how: str) -> dict[str, str]:
    torch.manual_seed(0)
    model = _WithSide()
    if how == "none" and dist.get_rank() == 1:
        ignored = None
    else:
        ignored = [model.side if dist.get_rank() % 2 == 0 or how == "none" else model.out]
    error = error_text(lambda: _shard(model, kind, "FULL_SHARD", ignored))
    torch.manual_seed(0)
    again = _WithSide()  # the same call on every rank still works afterwards
    _shard(again, kind, "FULL_SHARD", [again.side])
    x = local_slice(mlp_batch(0, 4 * dist.get_world_size()), dist.get_rank(), dist.get_world_size())[0]
    again(x).sum().backward()
    return {"error": error}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kind", ["fully_shard", "wrapper"])
def test_ranks_that_ignore_different_modules_are_refused_on_every_rank(
    dist_run: Callable[..., Any], world_size: int, kind: str
) -> None:
    results = dist_run(world_size, ignore_differently, kind, "other")
    assert len({r["error"] for r in results}) == 1, results
    api = "fully_shard" if kind == "fully_shard" else "FullyShardedDataParallel"
    expected = "; ".join(f"rank {r}: {['side' if r % 2 == 0 else 'out']}" for r in range(world_size))
    assert results[0]["error"] == (
        f"ValueError: {api} argument 'ignored_modules': the ranks ignore different modules ({expected}). "
        "Every rank must build the same units: pass the same ignored_modules on every rank"
    )
    if world_size == 2:
        results = dist_run(2, ignore_differently, kind, "none")
        assert {r["error"] for r in results} == {
            f"ValueError: {api} argument 'ignored_modules': the ranks ignore different modules (rank 0: ['side']; "
            "rank 1: []). Every rank must build the same units: pass the same ignored_modules on every rank"
        }, results
