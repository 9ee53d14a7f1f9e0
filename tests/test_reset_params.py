"""``reset_parameters()`` on a sharded model (issue 13): it runs on the full-shape parameters, gives
exactly the plain model's values under the same seed, agrees on every rank under different seeds, and
training then goes on in parity with a plain model started from those weights. See
[Note: reset_parameters after sharding] in ``fsdp_composable/_init/_reset_params.py``.

Upstream: torch FSDP runs ``reset_parameters()`` on full parameters in
test/distributed/fsdp/test_fsdp_meta.py::TestFSDPWithMetaDevice::test_simple_model_with_meta_device_reset_params
and, after sharding, on FSDP2's DTensor parameters in
test/distributed/_composable/fsdp/test_fully_shard_init.py::TestFullyShardMetaDeviceInit::test_meta_device_1d_init.
"""

from __future__ import annotations

import copy
from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
from harness import DistPool, error_of, shared_pool
from models import OddMLP, mlp_batch, mlp_loss
from parity import local_slice, mlp_sgd_diff, same_values
from torch import nn

from fsdp_composable import (
    FullyShardedDataParallel,
    ModuleWrapPolicy,
    ShardingStrategy,
    fully_shard,
    unshard_params,
)
from fsdp_composable._comm._rank_agreement import RankMismatchError

PG_TIMEOUT_S = 4.0


def _reset_all(model: nn.Module) -> None:
    model.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _agree_across_ranks(sd: dict[str, torch.Tensor]) -> bool:
    """Every rank holds exactly rank 0's values."""
    ok = True
    for v in sd.values():
        theirs = v.clone()
        dist.broadcast(theirs, src=0)
        ok = ok and torch.equal(theirs, v)
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _shard(model: nn.Module, strategy: str) -> nn.Module:
    """Bottom-up by hand (two states below the root's), as in test_parity; HYBRID on a 2 x 2 layout."""
    if strategy == "HYBRID_SHARD":
        shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        rank = dist.get_rank()
        group: Any = (shards[rank // 2], replicas[rank % 2])
    else:
        group = None
    s = ShardingStrategy[strategy]
    fully_shard(model.l2, strategy=s, process_group=group)
    fully_shard(model.l3, strategy=s, process_group=group)
    return fully_shard(model, strategy=s, process_group=group)


def reset_strategies(strategies: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for strategy in strategies:
        torch.manual_seed(0)
        ref = OddMLP()
        model = _shard(copy.deepcopy(ref), strategy)
        r: dict[str, Any] = {}
        # the same seed on every rank: exactly the plain model's reset under that seed
        torch.manual_seed(11)
        _reset_all(model)
        torch.manual_seed(11)
        _reset_all(ref)
        r["same_seed"] = same_values(_state(model), _state(ref))
        # a different seed on every rank: every rank ends with the lowest rank's draw
        torch.manual_seed(100 + dist.get_rank())
        _reset_all(model)
        after = _state(model)
        r["ranks_agree"] = _agree_across_ranks(after)
        torch.manual_seed(100)
        _reset_all(ref)
        r["is_rank0_draw"] = same_values(after, _state(ref))
        # one module inside a unit, by name
        torch.manual_seed(12 + dist.get_rank())
        model.l2[0].reset_parameters()
        torch.manual_seed(12)
        ref.l2[0].reset_parameters()
        r["one_module"] = same_values(_state(model), _state(ref))
        weight = model.l1.weight  # a face: the global shape; this rank's rows, or all under NO_SHARD
        whole = dist.get_world_size() == 1 or strategy == "NO_SHARD"
        r["still_shards"] = weight.shape == (7, 5) and (weight.to_local().shape[0] == 7) == whole
        r["train_diff"] = mlp_sgd_diff(model, ref, steps=3)
        out[strategy] = r
    return out


def _check(results: list[dict[str, dict[str, Any]]]) -> None:
    for per_rank in results:
        for strategy, r in per_rank.items():
            assert r["same_seed"] and r["ranks_agree"] and r["is_rank0_draw"] and r["one_module"], (strategy, r)
            assert r["still_shards"], (strategy, r)
            assert r["train_diff"] < 1e-5, (strategy, r)


@pytest.mark.parametrize(
    "world_size, strategies",
    [
        (1, ["FULL_SHARD"]),
        (2, ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]),
        (4, ["FULL_SHARD", "NO_SHARD", "HYBRID_SHARD"]),
    ],
)
def test_reset_parameters_after_sharding_is_plain_reset_on_every_rank(dist_run, world_size, strategies) -> None:
    """Upstream: test_fsdp_meta.py::TestFSDPWithMetaDevice::test_simple_model_with_meta_device_reset_params
    (reset_parameters() on full parameters gives the plain model's values). After fully_shard, with padded
    shards at world sizes 1/2/4 and every strategy: same seed -> the plain model's reset; per-rank seeds ->
    every rank holds the lowest rank's draw; a single module by name; then training in parity."""
    _check(dist_run(world_size, reset_strategies, strategies))


# ---------------------------------------------------------------------------- the flat-mode wrapper
def reset_wrapper_flat_mode() -> dict[str, Any]:
    torch.manual_seed(0)
    ref = OddMLP()
    model = FullyShardedDataParallel(copy.deepcopy(ref), auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))
    flat_names = [n for n, _ in model.named_parameters()]
    torch.manual_seed(21 + dist.get_rank())
    _reset_all(model.module)
    torch.manual_seed(21)
    _reset_all(ref)
    return {
        "flat_mode": all("_flat_param" in n for n in flat_names),
        "still_flat": [n for n, _ in model.named_parameters()] == flat_names,
        "same": same_values(_state(model), _state(ref)),
        "train_diff": mlp_sgd_diff(model, ref, steps=3),
    }


def test_reset_parameters_flat_mode_wrapper(dist_run) -> None:
    """Upstream: test_fsdp_meta.py::TestFSDPWithMetaDevice::test_simple_model_with_meta_device_reset_params
    (FSDP1 wrapper, use_orig_params=False). The wrapper's inner modules reset on full shapes, every rank
    takes rank 0's draw, the flat parameters stay registered, and training goes on in parity."""
    for r in dist_run(2, reset_wrapper_flat_mode):
        assert r["flat_mode"] and r["still_flat"] and r["same"], r
        assert r["train_diff"] < 1e-5, r


# ---------------------------------------------------------------------------- nesting, unshard_params, errors
class Scaled(nn.Module):
    """A parent whose own reset_parameters resets a parameter of its own and calls its child's."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(3))
        self.lin = nn.Linear(4, 3)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.scale)
        self.lin.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class Failing(nn.Linear):
    def reset_parameters(self) -> None:
        super().reset_parameters()
        if getattr(self, "fail_on", None) == dist.get_rank():
            raise ValueError("bad init on this rank")


def reset_nested_inside_and_failing() -> dict[str, Any]:
    torch.manual_seed(0)
    ref = nn.Sequential(Scaled(), Failing(3, 5))
    model = fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({Scaled}))
    out: dict[str, Any] = {}
    torch.manual_seed(31 + dist.get_rank())
    model[0].reset_parameters()
    torch.manual_seed(31)
    ref[0].reset_parameters()
    out["nested"] = same_values(_state(model), _state(ref))
    # inside unshard_params the parameters are full already: reset them there and broadcast
    with unshard_params(model):
        torch.manual_seed(32 + dist.get_rank())
        model[1].reset_parameters()
    torch.manual_seed(32)
    ref[1].reset_parameters()
    out["inside_unshard_params"] = same_values(_state(model), _state(ref))
    # raising on rank 1 only: every rank raises, nothing is written back
    before = _state(model)
    model[1].fail_on = 1
    try:
        model[1].reset_parameters()
        out["failed"] = "no error"
    except Exception as e:  # noqa: BLE001 - the message is what we compare
        out["failed"] = f"{type(e).__name__}: {e}"
    out["unchanged_after_failure"] = same_values(_state(model), before)
    model[1].fail_on = None
    # during forward: refused, naming the module; the next step runs
    handle = model[1].register_forward_pre_hook(lambda m, args: model[0].lin.reset_parameters())
    try:
        model(torch.ones(2, 4))
        out["in_forward"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["in_forward"] = f"{type(e).__name__}: {e}"
    handle.remove()
    model(torch.ones(2, 4)).sum().backward()
    out["usable_after"] = model[0].lin.weight.grad is not None or model[0].lin.weight.numel() == 0
    return out


def test_reset_parameters_nested_inside_unshard_params_anderror_of(dist_run) -> None:
    """Upstream: test_fsdp_meta.py::TestFSDPWithMetaDevice::test_nested_model_with_meta_device_reset_params
    (a parent's reset calling its children's). Also: inside unshard_params, a reset raising on one rank
    (an error on every rank, nothing written back) and a reset during forward (a clear error)."""
    results = dist_run(2, reset_nested_inside_and_failing)
    tc = expecttest.TestCase()
    for r in results:
        assert r["nested"] and r["inside_unshard_params"] and r["unchanged_after_failure"] and r["usable_after"], r
    tc.assertExpectedInline(results[1]["failed"], """ValueError: bad init on this rank""")
    tc.assertExpectedInline(
        results[0]["failed"],
        """RuntimeError: reset_parameters() of module '1' (Failing) raised on another rank (see its log); nothing was written back, the parameters are unchanged""",  # noqa: E501
    )
    tc.assertExpectedInline(
        results[0]["in_forward"],
        """RuntimeError: reset_parameters() of module '0.lin' (Linear) was called during forward or backward of a fully_shard model: its unit is unsharded for the running step. Call it between steps (outside forward and backward); it then re-initialises the full-shape parameters on every rank""",  # noqa: E501
    )
    assert results[1]["in_forward"] == results[0]["in_forward"]


# ---------------------------------------------------------------------------- a reset on one rank only
@pytest.fixture(scope="module")
def pool() -> DistPool:
    return shared_pool(2, pg_timeout_s=PG_TIMEOUT_S)


def reset_on_rank0_only(strategy: str) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = OddMLP()
    model = fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({nn.Sequential}), strategy=ShardingStrategy[strategy])
    rank = dist.get_rank()

    def step(i: int) -> None:
        mlp_loss(model, local_slice(mlp_batch(i, 4), rank, 2)).backward()

    step(0)
    message = error_of(model.l1.reset_parameters) if rank == 0 else error_of(lambda: step(1))
    model.zero_grad()
    step(2)  # the ranks are in step again
    return {"message": message, "agree": _agree_across_ranks(_state(model))}


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_reset_parameters_on_one_rank_only(pool: DistPool, strategy: str) -> None:
    """A reset on rank 0 while rank 1 trains: RankMismatchError on both (never a hang or a gloo abort),
    the parameters unchanged, and the next step runs on both. NO_SHARD moves no all-gather: its first
    collective is the status exchange."""
    r0, r1 = pool.run(reset_on_rank0_only, strategy, timeout=60)
    for r in (r0, r1):
        assert r["message"].startswith(f"{RankMismatchError.__name__}: fully_shard: "), r
        assert "reset_parameters() is a collective: it must be called on every rank" in r["message"], r
        assert r["agree"], r
    assert "rank 0: reset_parameters()" in r1["message"], (r0, r1)
    assert "rank 1: forward" in r0["message"] or "rank 1: backward" in r0["message"], (r0, r1)

