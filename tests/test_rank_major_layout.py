"""The rank-major layout ([Note: rank-major flat shards]): each rank's flat shard holds exactly its
``torch.chunk`` piece of every parameter, and the copy-out / copy-in between the gathered flat and
the param-major buffer are exact inverses, checked on one process for every rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from models import Block, TinyGPT, gpt_batch, gpt_loss
from parity import train_side_by_side
from test_grad_semantics import no_sync_after_synced
from torch import nn

from fsdp_composable import ModuleWrapPolicy, ShardingStrategy, fully_shard
from fsdp_composable._comm import _collectives
from fsdp_composable._flat import _rank_major
from fsdp_composable._flat._rank_major import FlatLayout, build_layout

SHAPES = [(5, 3), (), (2,), (7,), (1, 4), (0, 3)]  # uneven rows, a 0-dim value, fewer rows than ranks, empty


def _layouts(world: int) -> tuple[list[nn.Parameter], list[FlatLayout]]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s)) for s in SHAPES]
    holders = [[(nn.Module(), f"p{k}", f"p{k}")] for k in range(len(params))]
    return params, [build_layout(params, holders, r, world) for r in range(world)]  # type: ignore[arg-type]


def _param_major(params: list[nn.Parameter], layout: FlatLayout) -> torch.Tensor:
    full = torch.zeros(layout.padded_numel)
    for p, info in zip(params, layout.infos):
        full[info.offset : info.offset + info.numel] = p.detach().reshape(-1)
    return full


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_shard_holds_torch_chunks(world: int) -> None:
    params, layouts = _layouts(world)
    full = _param_major(params, layouts[0])
    shards = [layout.shard_of(full) for layout in layouts]
    assert {s.numel() for s in shards} == {layouts[0].shard_numel}
    for r, (layout, shard) in enumerate(zip(layouts, shards)):
        for p, info in zip(params, layout.infos):
            start, end = layout.shard_range(info)
            local = shard[start:end].view(layout.local_shape(info))
            if p.dim() == 0 or world == 1:
                expected = p.detach()
            else:
                expected = (list(p.detach().chunk(world)) + [p.detach()[:0]] * world)[r]
            assert torch.equal(local, expected), (world, r, info.fqn)
            lo, hi = layout.param_range(info)
            assert torch.equal(p.detach().reshape(-1)[lo:hi], local.reshape(-1))
    # rank-major: the gathered flat is the shards in rank order; copy-out lays it out by parameter
    gathered = torch.cat(shards)
    out = torch.full_like(full, float("nan"))
    layouts[0].copy_out(gathered, out)
    for p, info in zip(params, layouts[0].infos):
        assert torch.equal(out[info.offset : info.offset + info.numel].view(info.shape), p.detach())
    assert torch.equal(layouts[0].copy_in(out), gathered)


@pytest.mark.parametrize("world", [2, 4])
def test_copy_in_repeats_a_replicated_gradient_and_pieces_agree(world: int) -> None:
    params, layouts = _layouts(world)
    layout = layouts[0]
    grads = [torch.randn(p.shape) for p in params]
    full = torch.zeros(layout.padded_numel)  # a gradient buffer: each parameter at its front only
    for g, info in zip(grads, layout.infos):
        full[info.offset : info.offset + info.numel] = g.reshape(-1)
    flat = layout.copy_in(full)
    scalar = next(i for i in layout.infos if i.replicated)
    for r in range(world):  # every rank's chunk carries the 0-dim gradient, so every rank's sum is right
        assert flat[r * layout.shard_numel + scalar.shard_offset] == grads[1]
    pieces = layout.rank_major_pieces([g.reshape(-1) for g in grads], torch.zeros(layout.shard_numel))
    assert torch.equal(torch.cat(pieces), flat)
    assert layout.same_order == layout.same_order_in == False  # noqa: E712


def test_one_parameter_units_need_no_copy() -> None:
    one = [nn.Parameter(torch.randn(5, 3))]
    layout = build_layout(one, [[(nn.Module(), "w", "w")]], 0, 4)  # type: ignore[list-item]
    assert layout.same_order and layout.same_order_in and layout.padded_numel == 6 * 4


def _gather_by_param(native: bool, direct: bool) -> bool:
    """Each rank's rank-major shard, all-gathered with the layout's chunks, lands laid out by
    parameter: point-to-point receives each chunk where it goes, a native all-gather is copied out."""
    world, rank = dist.get_world_size(), dist.get_rank()
    params, layouts = _layouts(world)
    layout = layouts[rank]
    full = _param_major(params, layout)
    expected = torch.empty_like(full)
    layout.copy_out(torch.cat([layouts[r].shard_of(full) for r in range(world)]), expected)
    out = torch.full_like(full, float("nan"))
    real = _collectives.point_to_point
    if native:
        _collectives.point_to_point = lambda group, device: False  # type: ignore[assignment]
    try:
        shard = layout.shard_of(full)
        work = _collectives.all_gather(out, shard, dist.group.WORLD, regions=layout.regions_of(out), direct=direct)
        _collectives.wait(work, "test")
    finally:
        _collectives.point_to_point = real  # type: ignore[assignment]
    return torch.equal(out, expected)


@pytest.mark.parametrize("native,direct", [(False, True), (False, False), (True, True)])
@pytest.mark.parametrize("world_size", [2, 4])
def test_all_gather_lands_by_parameter(dist_run: Any, world_size: int, native: bool, direct: bool) -> None:
    assert dist_run(world_size, _gather_by_param, native, direct) == [True] * world_size


def _train_moving_chunks(direct: bool, strategy: str) -> dict[str, Any]:
    """TinyGPT's units are small (one copy through a rank-major buffer); with the threshold at 0 every
    unit moves its chunks directly ([Note: moving chunks]): both train in parity, and so do no_sync
    micro-batches (their kept sum is sent from the param-major buffer)."""
    _rank_major.DIRECT_CHUNK_NUMEL = 0 if direct else 1 << 30
    torch.manual_seed(0)
    ref = TinyGPT(tied=True)

    def shard(m: nn.Module) -> nn.Module:
        return fully_shard(m, ModuleWrapPolicy({Block}), strategy=ShardingStrategy[strategy])

    out = train_side_by_side(ref, shard, gpt_loss, gpt_batch, per_rank_batch=2, steps=3, optim="adamw")
    out["no_sync_diff"] = no_sync_after_synced(strategy)
    return out


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("strategy,world_size", [("FULL_SHARD", 2), ("FULL_SHARD", 4), ("SHARD_GRAD_OP", 4)])
def test_moving_chunks_directly_or_through_one_copy_trains_alike(
    dist_run: Any, direct: bool, strategy: str, world_size: int
) -> None:
    for r in dist_run(world_size, _train_moving_chunks, direct, strategy):
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=1e-5, atol=1e-5)
        assert r["max_weight_diff"] < 1e-5 and r["no_sync_diff"] < 1e-12, r
