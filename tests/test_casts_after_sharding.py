"""``model.double()`` / ``.half()`` / ``.bfloat16()`` / ``.float()`` / ``.to(dtype)`` after sharding train
on in the new dtype, as torch FSDP1 and FSDP2 do: flat shards, gradients, the optimizer's views and
state dicts follow the cast, a mixed-precision ``param_dtype`` still applies, and ranks that cast
differently get an error on every rank. Compared with the unsharded model cast alike, trained on the
same global batch, at 2 and 4 ranks (odd sizes: every shard is padded), for ``fully_shard`` and the
wrapper class (original and flat parameters)."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from models import OddMLP, mlp_batch, mlp_loss
from parity import error_text, global_mean, local_slice, same_values
from torch import nn

from fsdp_composable import (
    FullyShardedDataParallel,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    StateDictType,
    fully_shard,
    state_dict_type,
    unshard_params,
)
from fsdp_composable._flat_param import FlatParameter

_DTYPES = {"double": torch.float64, "bfloat16": torch.bfloat16, "half": torch.float16, "to": torch.float64}


def _shard(model: nn.Module, kind: str, strategy: str, mp: MixedPrecision | None = None) -> nn.Module:
    policy = ModuleWrapPolicy({nn.Sequential})  # units: l2, and the root with l1 and l3
    if kind == "fully_shard":
        return fully_shard(model, policy, strategy=ShardingStrategy[strategy], mixed_precision=mp)
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=policy,
        sharding_strategy=ShardingStrategy[strategy],
        mixed_precision=mp,
        use_orig_params=kind == "wrapper",
    )


def _cast(model: nn.Module, how: str) -> None:
    if how == "to":
        model.to(torch.float64)
    else:
        getattr(model, how)()


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return mlp_loss(model, (batch[0].to(dtype), batch[1].to(dtype)))


def cast_midway(kind: str, strategy: str, how: str) -> dict[str, Any]:
    """One float32 step, a backward whose gradients are still there at the cast, the cast, then an
    optimizer built after it steps those gradients and two more steps in the new dtype."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = OddMLP()
    model = _shard(copy.deepcopy(ref), kind, strategy)
    losses: list[tuple[float, float]] = []

    def step(dtype: torch.dtype, i: int, optims: list[torch.optim.Optimizer] | None) -> None:
        batch = mlp_batch(i, 4 * world)
        ref_loss, loss = _loss(ref, batch, dtype), _loss(model, local_slice(batch, rank, world), dtype)
        ref_loss.backward()
        loss.backward()
        losses.append((ref_loss.item(), global_mean(loss.float())))
        for optim in optims or []:
            optim.step()
            optim.zero_grad()

    step(torch.float32, 0, [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, model)])
    step(torch.float32, 1, None)  # gradients left for after the cast
    dtype = _DTYPES[how]
    _cast(ref, how)
    _cast(model, how)
    optims = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, model)]
    for optim in optims:
        optim.step()
        optim.zero_grad()
    for i in (2, 3):
        step(dtype, i, optims)
    sd, ref_sd = model.state_dict(), ref.state_dict()
    return {
        "losses": losses,
        "keys": list(sd) == list(ref_sd),
        "dtypes": sorted({str(v.dtype) for v in sd.values()}),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "flat": sorted({type(p) is FlatParameter for p in model.parameters()}),
        "max_diff": max((sd[k].double() - ref_sd[k].double()).abs().max().item() for k in ref_sd),
    }


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    "kind, strategy",
    [
        ("fully_shard", "FULL_SHARD"),
        ("fully_shard", "SHARD_GRAD_OP"),
        ("wrapper", "FULL_SHARD"),
        ("wrapper_flat", "FULL_SHARD"),
        ("wrapper_flat", "NO_SHARD"),
    ],
)
def test_double_after_sharding_trains_like_the_plain_model(
    dist_run: Callable[..., Any], world_size: int, kind: str, strategy: str
) -> None:
    for r in dist_run(world_size, cast_midway, kind, strategy, "double"):
        assert r["keys"] and r["dtypes"] == ["torch.float64"] and r["param_dtypes"] == ["torch.float64"], r
        assert r["flat"] == [kind == "wrapper_flat"]
        ref_losses, losses = zip(*r["losses"])
        assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-7)
        assert r["max_diff"] < 1e-6


@pytest.mark.parametrize("how", ["bfloat16", "to"])
@pytest.mark.parametrize("kind", ["fully_shard", "wrapper_flat"])
def test_other_casts_after_sharding(dist_run: Callable[..., Any], kind: str, how: str) -> None:
    for r in dist_run(2, cast_midway, kind, "FULL_SHARD", how):
        want = str(_DTYPES[how])
        assert r["keys"] and r["dtypes"] == [want] and r["param_dtypes"] == [want], r
        ref_losses, losses = zip(*r["losses"])
        tol = 3e-2 if how == "bfloat16" else 1e-6  # bfloat16 sums in another order than the plain model
        assert losses == pytest.approx(ref_losses, rel=tol, abs=tol)
        assert r["max_diff"] < tol


def after_vs_before(kind: str, strategy: str) -> dict[str, Any]:
    """A mixed-precision model cast after sharding trains exactly like one cast before it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    torch.manual_seed(0)
    plain = OddMLP()
    after = _shard(copy.deepcopy(plain), kind, strategy, mp)
    after.double()
    before = _shard(copy.deepcopy(plain).double(), kind, strategy, mp)
    seen: list[torch.dtype] = []
    after.l1.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    for model in (after, before):
        optim = torch.optim.AdamW(model.parameters(), lr=0.01)
        for i in range(2):
            _loss(model, local_slice(mlp_batch(i, 4 * world), rank, world), torch.float64).backward()
            optim.step()
            optim.zero_grad()
    return {
        "same": same_values(after.state_dict(), before.state_dict()),
        "compute": sorted({str(d) for d in seen}),
        "shards": sorted({str(p.dtype) for p in after.parameters()}),
    }


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kind, strategy", [("fully_shard", "FULL_SHARD"), ("wrapper_flat", "SHARD_GRAD_OP")])
def test_mixed_precision_still_applies_after_a_cast(
    dist_run: Callable[..., Any], world_size: int, kind: str, strategy: str
) -> None:
    for r in dist_run(world_size, after_vs_before, kind, strategy):
        assert r == {"same": True, "compute": ["torch.bfloat16"], "shards": ["torch.float64"]}, r


def cast_on_one_rank(mixed: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    mp = MixedPrecision(param_dtype=torch.bfloat16) if mixed else None
    model = _shard(OddMLP(), "fully_shard", "FULL_SHARD", mp)
    model(torch.randn(2, 5)).sum().backward()  # past the first iteration's check of how units were built
    if dist.get_rank() == 0:
        model.double()
    x = torch.randn(2, 5, dtype=torch.float64 if dist.get_rank() == 0 else torch.float32)
    first = error_text(lambda: model(x))
    return {"first": first, "again": error_text(lambda: model(x)).split(" (")[0]}


@pytest.mark.parametrize("mixed", [False, True])
def test_ranks_that_cast_differently_get_an_error_on_every_rank(dist_run: Callable[..., Any], mixed: bool) -> None:
    results = dist_run(2, cast_on_one_rank, mixed)
    for r in results:
        assert r["first"].startswith("RankMismatchError:"), r
        assert "different dtypes: cast the model alike on every rank" in r["first"], r
        assert r["again"].startswith("RankMismatchError:"), r  # nothing hangs; the ranks still disagree
    if mixed:
        assert "bfloat16 elements cast from float64" in results[0]["first"]
        assert "bfloat16 elements cast from float32" in results[0]["first"]


def partial_cast() -> dict[str, str]:
    torch.manual_seed(0)
    model = _shard(OddMLP(), "fully_shard", "FULL_SHARD")
    model.l1.half()  # l1 shares the root unit with l3, which stays float32
    x = torch.randn(2, 5)
    return {"error": error_text(lambda: model(x)), "after": str(model(x).dtype)}


def test_a_cast_of_part_of_a_unit_is_an_error(dist_run: Callable[..., Any]) -> None:
    for r in dist_run(2, partial_cast):
        assert r["error"].startswith("ModelEditedAfterShardingError: parameter 'l1.weight' was cast from "), r
        assert "every parameter of its unit" in r["error"], r
        assert r["after"] == "torch.float32"


class _WithBuffer(OddMLP):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((3,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale.sum()


def state_dicts_after_cast(kind: str) -> dict[str, Any]:
    """``state_dict()`` right after the cast, before any forward: every kind in the new dtype."""
    torch.manual_seed(0)
    plain = _WithBuffer()
    ref = copy.deepcopy(plain)
    model = _shard(copy.deepcopy(plain), kind, "FULL_SHARD")
    ref.double()
    model.double()
    out: dict[str, Any] = {"full": same_values(model.state_dict(), ref.state_dict())}
    for name in ("SHARDED_STATE_DICT", "LOCAL_STATE_DICT"):
        with state_dict_type(model, StateDictType[name]):
            out[name] = sorted({str(v.dtype) for v in model.state_dict().values() if isinstance(v, torch.Tensor)})
    x = torch.randn(3, 5, dtype=torch.float64)
    out["forward"] = torch.equal(model(x), ref(x))
    fresh = _shard(copy.deepcopy(plain), kind, "FULL_SHARD")
    fresh.double()
    with unshard_params(fresh):
        out["unshard_params"] = sorted({str(p.dtype) for p in fresh.parameters()})
    return out


@pytest.mark.parametrize("kind", ["fully_shard", "wrapper_flat"])
def test_state_dicts_after_a_cast(dist_run: Callable[..., Any], kind: str) -> None:
    for r in dist_run(2, state_dicts_after_cast, kind):
        assert r == {
            "full": True,
            "SHARDED_STATE_DICT": ["torch.float64"],
            "LOCAL_STATE_DICT": ["torch.float64"],
            "forward": True,
            "unshard_params": ["torch.float64"],
        }, r
