"""The main check: sharded training matches unsharded training step for step."""

from __future__ import annotations

import pytest
import torch
from models import Block, OddMLP, TinyGPT, gpt_batch, gpt_loss, mlp_batch, mlp_loss
from parity import train_side_by_side
from torch import nn

from fsdp_composable import FullyShardedDataParallel, ModuleWrapPolicy, ShardingStrategy, fully_shard

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


def _gpt_policy(strategy: str, tied: bool, optim: str) -> dict:
    torch.manual_seed(0)
    ref = TinyGPT(tied=tied)

    def shard(m: nn.Module) -> nn.Module:
        return fully_shard(m, ModuleWrapPolicy({Block}), strategy=ShardingStrategy[strategy])

    return train_side_by_side(ref, shard, gpt_loss, gpt_batch, per_rank_batch=2, steps=3, optim=optim)


def _mlp_manual_nesting(strategy: str, optim: str) -> dict:
    torch.manual_seed(1)
    ref = OddMLP()

    def shard(m: nn.Module) -> nn.Module:
        s = ShardingStrategy[strategy]
        fully_shard(m.l2, strategy=s)
        fully_shard(m.l3, strategy=s)
        return fully_shard(m, strategy=s)

    return train_side_by_side(ref, shard, mlp_loss, mlp_batch, per_rank_batch=3, steps=4, optim=optim)


def _wrapper_flat_params(strategy: str) -> dict:
    torch.manual_seed(2)
    ref = TinyGPT()

    def shard(m: nn.Module) -> nn.Module:
        return FullyShardedDataParallel(
            m, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy]
        )

    out = train_side_by_side(ref, shard, gpt_loss, gpt_batch, per_rank_batch=2, steps=3, optim="sgd-flat")
    return out


def _check(results: list[dict], tol: float) -> None:
    for r in results:
        assert r["keys_equal"] and r["shapes_equal"], r
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=1e-5, atol=1e-5)
        assert r["max_weight_diff"] < tol, r["max_weight_diff"]
    assert all(r["losses"] == results[0]["losses"] for r in results), "ranks disagree on the global loss"


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gpt_parity_adamw_tied(dist_run, world_size: int, strategy: str) -> None:
    _check(dist_run(world_size, _gpt_policy, strategy, True, "adamw"), tol=1e-5)


@pytest.mark.parametrize("world_size", [2, 4])
def test_gpt_parity_sgd_untied(dist_run, world_size: int) -> None:
    _check(dist_run(world_size, _gpt_policy, "FULL_SHARD", False, "sgd"), tol=1e-5)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_padded_manual_nesting_parity(dist_run, world_size: int, strategy: str) -> None:
    _check(dist_run(world_size, _mlp_manual_nesting, strategy, "sgd"), tol=1e-5)
    _check(dist_run(world_size, _mlp_manual_nesting, strategy, "adamw"), tol=1e-5)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_wrapper_class_parity(dist_run, world_size: int, strategy: str) -> None:
    _check(dist_run(world_size, _wrapper_flat_params, strategy), tol=1e-5)
