"""Gradients whose reduction is deferred or left out: HYBRID_SHARD's all-reduce hook with
``set_requires_all_reduce(False)`` micro-batches, ``no_sync`` accumulation under mixed precision, and
parameters frozen after sharding."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from models import OddMLP, mlp_batch, mlp_loss
from parity import local_slice
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_composable import (
    MixedPrecision,
    ModuleWrapPolicy,
    fully_shard,
    set_all_reduce_hook,
    set_requires_all_reduce,
    set_requires_gradient_sync,
    unshard_params,
)

POLICY = ModuleWrapPolicy({nn.Sequential})


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    with unshard_params(model, with_grads=True, writeback=False):
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def hook_after_partial_micro_batches() -> dict[str, Any]:
    """Three micro-batches, the first two without the all-reduce across replicas; the hook doubles the
    gradient in place. It must run once per unit, on the summed gradient: twice the reference's."""
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = OddMLP()
    model = fully_shard(copy.deepcopy(ref), POLICY, mesh=init_device_mesh("cpu", (2, world // 2)))
    calls: list[int] = []

    def hook(grad: torch.Tensor) -> None:
        calls.append(grad.numel())
        grad.mul_(2.0)

    set_all_reduce_hook(model, hook)
    set_all_reduce_hook(model.l2, hook)
    for micro in range(3):
        set_requires_all_reduce(model, micro == 2)
        batch = mlp_batch(micro, 2 * world)
        mlp_loss(ref, batch).backward()
        mlp_loss(model, local_slice(batch, rank, world)).backward()
    got = _grads(model)
    diff = max((got[n] - 2 * p.grad).abs().max().item() for n, p in ref.named_parameters())
    return {"calls": len(calls), "diff": diff}


def test_all_reduce_hook_runs_once_on_the_summed_gradient(dist_run: Callable[..., Any]) -> None:
    for r in dist_run(4, hook_after_partial_micro_batches):
        assert r["calls"] == 2, r  # one per unit
        assert r["diff"] < 1e-5, r


def unsynced_sum_in_reduce_dtype() -> float:
    """Eight micro-batches without gradient sync, then a synced one, computing in bf16 and reducing in
    fp32: the sum must be kept in fp32 (the bf16 gradients of each rank's slices summed in fp32, then
    averaged), not rounded to bf16 at every micro-batch."""
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = OddMLP()
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = fully_shard(copy.deepcopy(ref), POLICY, mixed_precision=mp)
    low = copy.deepcopy(ref).to(torch.bfloat16)
    want = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    for micro in range(9):
        set_requires_gradient_sync(model, micro == 8)
        batch = mlp_batch(micro, 2 * world)
        mlp_loss(model, local_slice(batch, rank, world)).backward()
        for r in range(world):  # what each rank computes, summed in fp32
            x, y = local_slice(batch, r, world)
            mlp_loss(low, (x.to(torch.bfloat16), y)).backward()
            for n, p in low.named_parameters():
                want[n] += p.grad.float()
                p.grad = None
    got = _grads(model)
    return max((got[n] - want[n] / world).abs().max().item() for n in want)


def test_unsynced_gradients_accumulate_in_reduce_dtype(dist_run: Callable[..., Any]) -> None:
    for diff in dist_run(2, unsynced_sum_in_reduce_dtype):
        assert diff < 1e-6, diff


@contextlib.contextmanager
def _sent_bytes(out: list[int]) -> Iterator[None]:
    """Bytes this rank posts with ``dist.isend`` (gloo's gradient reductions are point-to-point)."""
    real = dist.isend

    def isend(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out.append(tensor.numel() * tensor.element_size())
        return real(tensor, *args, **kwargs)

    dist.isend = isend
    try:
        yield
    finally:
        dist.isend = real


def frozen_after_sharding() -> dict[str, Any]:
    """Unit 'l2' frozen after `fully_shard`: its backward sends what it sends frozen before (its
    gradient is not reduce-scattered any more), and the other gradients stay the reference's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = OddMLP()
    before = copy.deepcopy(ref)
    before.l2.requires_grad_(False)
    fully_shard(before, POLICY)
    after = fully_shard(copy.deepcopy(ref), POLICY)
    after.l2.requires_grad_(False)
    ref.l2.requires_grad_(False)
    batch = mlp_batch(0, 2 * world)
    mlp_loss(ref, batch).backward()
    sent: dict[str, int] = {}
    for name, model in (("before", before), ("after", after)):
        seen: list[int] = []
        with _sent_bytes(seen):
            mlp_loss(model, local_slice(batch, rank, world)).backward()
        sent[name] = sum(seen)
    got = _grads(after)
    diff = max((got[n] - p.grad).abs().max().item() for n, p in ref.named_parameters() if p.grad is not None)
    return {"sent": sent, "diff": diff, "frozen_grads": sorted(n for n in got if n.startswith("l2."))}


def test_parameters_frozen_after_sharding_are_not_reduced(dist_run: Callable[..., Any]) -> None:
    for r in dist_run(2, frozen_after_sharding):
        assert r["sent"]["after"] == r["sent"]["before"], r
        assert r["diff"] < 1e-6 and r["frozen_grads"] == [], r
