"""Which units a root-wide switch reaches: `no_sync` and `register_comm_hook` given a unit before the
first forward, `no_sync` over a parent of several sharded roots, and `fully_shard` under an existing
DDP (a known gap, pinned as a strict expected failure). Each fixed test failed before its fix."""

from __future__ import annotations

import copy
from typing import Any

import expecttest
import torch
import torch.distributed as dist
from harness import error_of
from models import OddMLP, TinyGPT, gpt_batch, gpt_loss, mlp_batch, mlp_loss
from parity import local_slice
from torch import nn

from fsdp_composable import fully_shard, no_sync, register_comm_hook, unshard_params


def _bottom_up_gpt() -> tuple[TinyGPT, TinyGPT]:
    torch.manual_seed(0)
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    for block in model.blocks:  # bottom-up by hand: the root is known only at the first forward
        fully_shard(block)
    fully_shard(model)
    return ref, model


def no_sync_on_unit_before_first_forward() -> dict[str, Any]:
    """no_sync on a non-root unit is refused after the first forward; before it, the same call must not be
    accepted and then silently ignored (the root's first forward builds the context the switch lives in)."""
    ref, model = _bottom_up_gpt()
    rank, world = dist.get_rank(), dist.get_world_size()
    b0 = gpt_batch(0, 2 * world)
    err = ""
    try:
        with no_sync(model.blocks[0]):
            gpt_loss(model, local_slice(b0, rank, world)).backward()
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    # the model stays usable: the next step matches the unsharded model's
    gpt_loss(model, local_slice(b0, rank, world)).backward()
    gpt_loss(ref, b0).backward()
    with unshard_params(model, with_grads=True, writeback=False):
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    after = list(grads) == [n for n, _ in ref.named_parameters()] and all(
        torch.allclose(grads[n], p.grad, atol=1e-6) for n, p in ref.named_parameters()
    )
    return {"error": err, "after": after}


def test_no_sync_on_unit_before_first_forward(dist_run) -> None:
    expected = {
        "error": "ValueError: no_sync must be called on the fully_shard root (TinyGPT), not on its unit "
        "'blocks.0': it must skip the reduction of every unit",
        "after": True,
    }
    assert dist_run(2, no_sync_on_unit_before_first_forward) == [expected] * 2


class _TwoRoots(nn.Module):
    """A plain parent of two separately sharded siblings (as a Lightning parallelize_fn may leave it)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = OddMLP()
        self.out = nn.Linear(1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x)).sum(-1, keepdim=True)


def no_sync_on_parent_of_two_roots(warm: bool) -> dict[str, Any]:
    """no_sync on the parent must skip the reduction of both roots, not only the first one's."""
    torch.manual_seed(0)
    ref = _TwoRoots()
    model = copy.deepcopy(ref)
    fully_shard(model.body)
    fully_shard(model.out)
    rank, world = dist.get_rank(), dist.get_world_size()
    b0, b1 = mlp_batch(0, 2 * world), mlp_batch(1, 2 * world)
    if warm:  # the roots are known (lazy init ran)
        with torch.no_grad():
            model(local_slice(b0, rank, world)[0])
    with no_sync(model):
        (0.5 * mlp_loss(model, local_slice(b0, rank, world))).backward()
    reduced_inside = [n for n, p in model.named_parameters() if p.grad is not None]
    (0.5 * mlp_loss(model, local_slice(b1, rank, world))).backward()
    (0.5 * mlp_loss(ref, b0) + 0.5 * mlp_loss(ref, b1)).backward()
    full = {}  # by name: unshard_params registers the originals in place of the faces
    for prefix, sub in (("body", model.body), ("out", model.out)):
        with unshard_params(sub, with_grads=True, writeback=False):
            full.update({f"{prefix}.{n}": p.grad.clone() for n, p in sub.named_parameters()})
    parity = all(torch.allclose(full[n], p.grad, atol=1e-6) for n, p in ref.named_parameters())
    return {"reduced_inside": reduced_inside, "parity": parity}


def test_no_sync_on_parent_of_two_roots(dist_run) -> None:
    for warm in (False, True):
        assert dist_run(2, no_sync_on_parent_of_two_roots, warm) == [{"reduced_inside": [], "parity": True}] * 2


def shard_after_ddp(which: str) -> list[str]:
    """DDP built first, fully_shard on a child afterwards: DDP's reducer would all-reduce the shards
    (one gradient came out wrong, silently). The first forward through DDP raises instead, before
    any collective of ours, and so does the next one."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = OddMLP()
    ddp = DistributedDataParallel(model)
    fully_shard(model.get_submodule(which))
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = local_slice(mlp_batch(0, 2 * world), rank, world)
    return [error_of(lambda: mlp_loss(ddp, batch).backward()) for _ in range(2)]


def shard_what_ddp_ignores() -> float:
    """DDP told to ignore l2's parameters, fully_shard on l2: each reduces its own parameters, and
    every gradient matches the unsharded model's on the global batch (not refused)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = OddMLP()
    ref = copy.deepcopy(model)
    ignored = [f"l2.{name}" for name, _ in model.l2.named_parameters()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    ddp = DistributedDataParallel(model)
    fully_shard(model.l2)
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = mlp_batch(0, 2 * world)
    mlp_loss(ddp, local_slice(batch, rank, world)).backward()
    mlp_loss(ref, batch).backward()
    with unshard_params(model.l2, with_grads=True, writeback=False):
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())


def test_fully_shard_of_what_ddp_ignores(dist_run) -> None:
    assert all(diff < 1e-6 for diff in dist_run(2, shard_what_ddp_ignores))


def test_fully_shard_inside_existing_ddp(dist_run) -> None:
    errors = []
    for which in ("l2", ""):  # a child, the model DDP wraps itself
        results = dist_run(2, shard_after_ddp, which)
        assert results[0] == results[1], results  # every rank
        first, again = results[0]
        assert first == again
        errors.append(first)
    expecttest.TestCase().assertExpectedInline("\n".join(errors), """\
ShardedModelWrappedError: fully_shard was applied to 'l2' (Sequential) after DistributedDataParallel wrapped the OddMLP that holds it: DDP all-reduces the gradients of the full parameters it was built with, which are now this rank's shards, so the gradients would mix two reductions. Apply fully_shard to the model instead of DistributedDataParallel (it reduce-scatters the gradients across the ranks itself), or build DDP only over modules that fully_shard does not manage
ShardedModelWrappedError: fully_shard was applied to the OddMLP that DistributedDataParallel had wrapped before: DDP all-reduces the gradients of the full parameters it was built with, which are now this rank's shards, so the gradients would mix two reductions. Apply fully_shard to the model instead of DistributedDataParallel (it reduce-scatters the gradients across the ranks itself), or build DDP only over modules that fully_shard does not manage""")  # noqa: E501


def comm_hook_on_unit_before_first_forward() -> dict[str, Any]:
    """register_comm_hook on a unit of a model sharded bottom-up is refused once the root is known;
    before it, the hook must not silently reduce only that unit's gradients."""
    from torch.distributed.algorithms._comm_hooks import default_hooks

    _, model = _bottom_up_gpt()
    calls: list[int] = []

    def hook(state: Any, grad: torch.Tensor, output: torch.Tensor) -> None:
        calls.append(grad.numel())
        default_hooks.reduce_scatter_hook(state, grad, output)

    register_comm_hook(model.blocks[0], default_hooks.DefaultState(dist.group.WORLD), hook)
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = local_slice(gpt_batch(0, 2 * world), rank, world)
    err = ""
    try:
        gpt_loss(model, batch).backward()
    except Exception as e:  # noqa: BLE001 - the test compares the text on every rank
        err = f"{type(e).__name__}: {e}"
    return {"error": err, "hooked_units": len(calls)}


def test_comm_hook_on_unit_before_first_forward(dist_run) -> None:
    expected = {
        "error": "RuntimeError: register_comm_hook: call it on the root (the outermost sharded module), "
        "not on the Block 'blocks.0' inside it",
        "hooked_units": 0,
    }
    assert dist_run(2, comm_hook_on_unit_before_first_forward) == [expected] * 2
