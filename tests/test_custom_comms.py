"""FSDP2's custom collectives: `set_custom_all_gather` / `set_custom_reduce_scatter` hand a unit's
all-gather and reduce-scatter to the user's objects (``allocate`` + a call, torch's ``AllGather`` /
``ReduceScatter`` interface). Checked: the model trains like the unsharded one (FULL_SHARD on 2 ranks,
HYBRID_SHARD 2 x 2), every collective of the units they were set on went through them into buffers
they allocated, the extension parameters' byte all-gather too, ``None`` gives ours back, and bad
input is refused naming the unit."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from expecttest import assert_expected_inline
from models import Block, TinyGPT, gpt_batch, gpt_loss
from parity import global_mean, local_slice
from torch import nn

from fsdp_composable import (
    ModuleWrapPolicy,
    ShardingStrategy,
    fully_shard,
    set_custom_all_gather,
    set_custom_reduce_scatter,
)


class _Comm:
    """Allocates with torch.empty and records what it allocated and how it was called."""

    def __init__(self) -> None:
        self.allocated: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.calls = 0
        self.own_buffers = True
        self.ops: set[str] = set()
        self._mine: list[torch.Tensor] = []

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        t = torch.empty(tuple(size), dtype=dtype, device=device)
        self.allocated.append((tuple(size), dtype))
        self._mine.append(t)
        return t

    def _count(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.calls += 1
        self.own_buffers &= any(output is t for t in self._mine)
        self._mine.clear()


class AllGather(_Comm):
    def __call__(self, output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool = False) -> Any:
        self._count(output, input)
        return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)


class ReduceScatter(_Comm):
    def __call__(self, output: torch.Tensor, input: torch.Tensor, group: Any, op: Any, async_op: bool = False) -> Any:
        self._count(output, input)
        self.ops.add(str(op))
        return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


def _groups(hybrid: bool) -> Any:
    if not hybrid:
        return None
    rank = dist.get_rank()
    shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return (shards[rank // 2], replicas[rank % 2])


def custom_parity(hybrid: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = _groups(hybrid)
    strategy = ShardingStrategy.HYBRID_SHARD if hybrid else ShardingStrategy.FULL_SHARD
    torch.manual_seed(0)
    ref = TinyGPT()
    model = fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({Block}), strategy=strategy, process_group=group)
    gather, scatter = AllGather(), ReduceScatter()
    for block in model.blocks:  # the blocks' units only; the root unit keeps ours
        set_custom_all_gather(block, gather)
        set_custom_reduce_scatter(block, scatter)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, counts = [], []
    for step in range(3):
        if step == 2:  # ours again
            set_custom_all_gather(model, None, recurse=True)
            set_custom_reduce_scatter(model, None, recurse=True)
        batch = gpt_batch(step, 2 * world)
        loss_ref = gpt_loss(ref, batch)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        loss = gpt_loss(model, local_slice(batch, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((loss_ref.item(), global_mean(loss.detach())))
        counts.append((gather.calls, scatter.calls))
    diff = max((p.full_tensor() - ref.get_parameter(n)).abs().max().item() for n, p in model.named_parameters())
    return {
        "losses": losses,
        "diff": diff,
        "counts": counts,
        "own_buffers": gather.own_buffers and scatter.own_buffers,
        "ops": sorted(scatter.ops),
        "dtypes": sorted({str(d) for _, d in gather.allocated + scatter.allocated}),
    }


def test_custom_collectives_run_every_collective_of_their_units(dist_run) -> None:
    for hybrid, world in ((False, 2), (True, 4)):
        for r in dist_run(world, custom_parity, hybrid):
            for a, b in r["losses"]:
                assert abs(a - b) < 1e-5 * abs(a), r
            assert r["diff"] < 1e-5, r
            # 2 blocks: all-gathered in forward and backward, reduce-scattered once, per step; none in step 3
            assert r["counts"] == [(4, 2), (8, 4), (8, 4)], r
            assert r["own_buffers"] and r["ops"] == ["RedOpType.SUM"] and r["dtypes"] == ["torch.float32"], r


def extension_bytes() -> tuple[int, list[tuple[tuple[int, ...], str]]]:
    """A unit whose parameter defines its own all-gather: its bytes go through the custom all-gather too."""
    from test_extensions import Int8Gathered

    model = nn.Sequential(nn.Linear(4, 4))
    model[0].weight = nn.Parameter(Int8Gathered(model[0].weight.detach().clone()))
    fully_shard(model)
    gather = AllGather()
    set_custom_all_gather(model, gather)
    model(torch.randn(2, 4)).sum().backward()
    return gather.calls, sorted({(s, str(d)) for s, d in gather.allocated})


def refusals() -> list[str]:
    out = []
    model = fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), ModuleWrapPolicy({nn.Linear}))
    for call in (
        lambda: set_custom_all_gather(model[0], object()),
        lambda: set_custom_reduce_scatter(model[0], lambda *a: None),
        lambda: set_custom_all_gather(nn.Linear(2, 2), AllGather()),
    ):
        try:
            call()
            out.append("")
        except (TypeError, ValueError) as e:
            out.append(f"{type(e).__name__}: {e}")
    whole = fully_shard(nn.Sequential(nn.Linear(4, 4)), strategy=ShardingStrategy.NO_SHARD)
    try:
        set_custom_reduce_scatter(whole, ReduceScatter())
        out.append("")
    except ValueError as e:
        out.append(f"ValueError: {e}")
    return out


def test_extension_bytes_and_refusals(dist_run) -> None:
    for calls, allocated in dist_run(2, extension_bytes):
        # in forward (the root unit stays whole into backward): the bias's flat parameter, and as bytes
        # both ranks' int8 codes (2 rows x 4) and float32 scales (2)
        assert calls == 2 and allocated == [((4,), "torch.float32"), ((2 * (8 + 8),), "torch.uint8")], allocated
    results = dist_run(2, refusals)
    assert results[0] == results[1]
    bad, bad_rs, plain, no_shard = results[0]
    assert_expected_inline(
        bad,
        """TypeError: set_custom_all_gather(unit '0'): comm must have allocate(size, *, dtype, device) and be callable (torch's AllGather / ReduceScatter interface), got object""",  # noqa: E501
    )
    assert_expected_inline(
        bad_rs,
        """TypeError: set_custom_reduce_scatter(unit '0'): comm must have allocate(size, *, dtype, device) and be callable (torch's AllGather / ReduceScatter interface), got function""",  # noqa: E501
    )
    assert_expected_inline(
        plain,
        """ValueError: set_custom_all_gather: no fully_shard state on this Linear; call fully_shard(module) first""",
    )
    assert no_shard == ""  # accepted, never called: nothing is gathered or reduce-scattered
