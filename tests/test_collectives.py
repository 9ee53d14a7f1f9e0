"""Our gloo all-gather / reduce-scatter (point-to-point exchanges) against gloo's own collectives,
and training parity on the path other backends take (native collectives, a zeroed flat gradient
buffer): forced here on gloo, because CI has no GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_parity import _check, _gpt_policy, _mlp_manual_nesting

from fsdp_composable import _collectives


def _compare_with_gloo(dtype: torch.dtype) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    shard_numel = 7
    shard = torch.randn(shard_numel, generator=gen).to(dtype)
    ours, theirs = torch.empty(world * shard_numel, dtype=dtype), torch.empty(world * shard_numel, dtype=dtype)
    _collectives.wait(_collectives.all_gather(ours, shard, dist.group.WORLD), "test")
    dist.all_gather_into_tensor(theirs, shard)
    gathered = torch.equal(ours, theirs)

    full = torch.randn(world * shard_numel, generator=gen).to(dtype)
    expected = torch.empty(shard_numel, dtype=dtype)
    dist.reduce_scatter_tensor(expected, full.clone())
    whole = torch.empty(shard_numel, dtype=dtype)
    _collectives.wait(_collectives.reduce_scatter(whole, full, dist.group.WORLD), "test")
    # parts whose boundaries fall inside chunks and on them, and an empty part
    total = world * shard_numel
    cuts = sorted({c for c in (0, 3, shard_numel, shard_numel + 2, total - 1, total) if c <= total})
    parts = [full[a:b] for a, b in zip(cuts, cuts[1:])] + [full[:0]]
    in_parts = torch.empty(shard_numel, dtype=dtype)
    _collectives.wait(_collectives.reduce_scatter(in_parts, parts, dist.group.WORLD), "test")
    return {
        "gathered": gathered,
        "whole": (whole - expected).abs().max().item(),
        "parts": (in_parts - expected).abs().max().item(),
        "point_to_point": _collectives.point_to_point(dist.group.WORLD, torch.device("cpu")),
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_point_to_point_collectives_match_gloo(dist_run, world_size: int, dtype: torch.dtype) -> None:
    # bit-equal up to 2 ranks (a + b is commutative); at 4 the summation order differs from gloo's
    tol = 0.0 if world_size < 4 and dtype == torch.float32 else (1e-5 if dtype == torch.float32 else 0.05)
    for r in dist_run(world_size, _compare_with_gloo, dtype):
        assert r["gathered"] and r["point_to_point"], r
        assert r["whole"] <= tol and r["parts"] <= tol, r


def _with_native_collectives(fn: Any, *args: Any) -> Any:
    original = _collectives.point_to_point
    _collectives.point_to_point = lambda group, device: False  # type: ignore[assignment]
    try:
        return fn(*args)
    finally:
        _collectives.point_to_point = original


@pytest.mark.parametrize("world_size", [2, 4])
def test_native_collectives_flat_gradient_buffer_parity(dist_run, world_size: int) -> None:
    _check(dist_run(world_size, _with_native_collectives, _gpt_policy, "FULL_SHARD", True, "adamw"), tol=1e-5)
    _check(dist_run(world_size, _with_native_collectives, _mlp_manual_nesting, "FULL_SHARD", "sgd"), tol=1e-5)


def _failing_post_is_reported_at_wait() -> str:
    def post(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Connection closed by peer")  # what gloo raises when the peer is gone

    exchange = _collectives._start(dist.group.WORLD, 1, [(post, torch.ones(1), 1 - dist.get_rank())])
    try:
        _collectives.wait(exchange, "the all-gather of unit 'blocks.1'")
    except _collectives.CollectiveError as e:
        return str(e)
    return "no error"


def test_a_send_that_fails_while_posting_names_the_unit_at_wait(dist_run) -> None:
    for message in dist_run(2, _failing_post_is_reported_at_wait):
        expected = "fully_shard: the all-gather of unit 'blocks.1' did not complete: Connection closed by peer"
        assert message.startswith(expected), message
