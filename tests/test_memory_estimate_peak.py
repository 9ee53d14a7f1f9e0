"""estimate_memory().peak_bytes against the measured peak of a whole training step (zero_grad, forward,
loss, backward, Adam step), every live tensor counted by the benchmarks' `LiveBytesTracker`, for every
strategy, bf16 mixed precision and ``reshard_after_forward=<int>``, at world sizes 2 and 4: within 10%.
The terms are pinned to the byte elsewhere (test_memory_estimate.py, test_memory_estimate_int_reshard.py);
this checks that together they are the step's peak."""

from __future__ import annotations

import gc
import os
import sys
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
import torch.distributed as dist
from models import Block, TinyGPT, gpt_batch, gpt_loss
from parity import local_slice
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_composable import MixedPrecision, ModuleWrapPolicy, ShardingStrategy, estimate_memory, fully_shard

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks._mem_tracker import LiveBytesTracker  # noqa: E402

POLICY = ModuleWrapPolicy({Block})
BF16 = MixedPrecision(param_dtype=torch.bfloat16)
# large enough that the parameters, activations and unsharded units dwarf the loss and the bookkeeping
SHAPE = {"vocab": 64, "d": 64, "n_layers": 4, "seq": 32}
PER_RANK_BATCH = 4

# name -> fully_shard keywords; estimate_memory takes the same ones (HYBRID_SHARD: a 2-D mesh of
# (replicate, shard) with shard groups of 2, and world_size=2 for the estimate)
CONFIGS: dict[str, dict[str, Any]] = {
    "FULL_SHARD": {},
    "FULL_SHARD bf16": {"mixed_precision": BF16},
    "SHARD_GRAD_OP": {"strategy": ShardingStrategy.SHARD_GRAD_OP},
    "SHARD_GRAD_OP bf16": {"strategy": ShardingStrategy.SHARD_GRAD_OP, "mixed_precision": BF16},
    "NO_SHARD": {"strategy": ShardingStrategy.NO_SHARD},
    "NO_SHARD bf16": {"strategy": ShardingStrategy.NO_SHARD, "mixed_precision": BF16},
    "HYBRID_SHARD": {"strategy": ShardingStrategy.HYBRID_SHARD},
    "HYBRID_SHARD bf16": {"strategy": ShardingStrategy.HYBRID_SHARD, "mixed_precision": BF16},
    "reshard_after_forward=2": {"reshard_after_forward": 2},
    "reshard_after_forward=2 bf16": {"reshard_after_forward": 2, "mixed_precision": BF16},
}
BY_WORLD_SIZE = {
    # HYBRID_SHARD needs 2 x 2 ranks; at 2 ranks an int is SHARD_GRAD_OP (1) or FULL_SHARD (2), which
    # test_memory_estimate_int_reshard.py shows the estimate and the runtime both take as those. Each
    # configuration runs at one world size: FULL_SHARD beside what needs 4 ranks, the others at 2
    2: [c for c in CONFIGS if c.startswith(("SHARD_GRAD_OP", "NO_SHARD"))],
    4: [c for c in CONFIGS if c.startswith(("HYBRID_SHARD", "reshard_after_forward", "FULL_SHARD"))],
}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ws = dist.get_world_size()
    full = gpt_batch(step, PER_RANK_BATCH * ws, seq=SHAPE["seq"], vocab=SHAPE["vocab"])
    return local_slice(full, dist.get_rank(), ws)


def _alive(model: nn.Module, optim: torch.optim.Optimizer) -> Iterator[Optional[torch.Tensor]]:
    """What lives between steps (a generator: a list would keep the gradients zero_grad frees alive)."""
    for p in model.parameters():
        yield p
        yield p.grad
    yield from model.buffers()
    for state in optim.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    optim.zero_grad(set_to_none=True)
    gpt_loss(model, _batch(step)).backward()
    optim.step()


def estimate_and_peak(name: str) -> tuple[int, int]:
    """(estimated, measured) peak bytes of this rank for the third step of config ``name``."""
    kwargs = dict(CONFIGS[name])
    world_size = dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT(**SHAPE)
    hybrid = kwargs.get("strategy") is ShardingStrategy.HYBRID_SHARD
    est = estimate_memory(
        model, policy=POLICY, world_size=2 if hybrid else world_size, batch_example=_batch(0)[0], **kwargs
    )
    if hybrid:
        kwargs["process_group"] = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, POLICY, **kwargs)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    return est.peak_bytes, third_step_peak(model, optim, _step)


def third_step_peak(
    model: nn.Module, optim: torch.optim.Optimizer, step: Callable[[nn.Module, torch.optim.Optimizer, int], None]
) -> int:
    """This rank's measured peak of ``step(model, optim, 2)``, after two steps (the optimizer state
    exists from the first step on), every tensor alive between steps counted."""
    step(model, optim, 0)
    step(model, optim, 1)
    gc.collect()
    dist.barrier()
    with LiveBytesTracker() as tracker:
        tracker.add_existing(_alive(model, optim))
        step(model, optim, 2)
    return tracker.peak_bytes


def estimates_and_peaks() -> dict[str, tuple[int, int]]:
    return {name: estimate_and_peak(name) for name in BY_WORLD_SIZE[dist.get_world_size()]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_estimate_within_ten_percent_of_the_measured_step_peak(dist_run, world_size: int) -> None:
    """(The bytes of each run are in the test's output with -s; measured on 28 Nov 2026 the ratio
    estimate / measured was 0.96-1.06 everywhere: NO_SHARD's gradients, full size, come back while
    backward still holds activations; elsewhere the estimate's two units in flight and every
    post-forward slice are a little more than what is alive at once.)"""
    for rank, results in enumerate(dist_run(world_size, estimates_and_peaks)):
        for name, (estimated, measured) in results.items():
            if rank == 0:
                print(f"world size {world_size}, {name}: estimate {estimated:,} measured {measured:,}")
            assert 0.9 <= estimated / measured <= 1.1, (rank, name, estimated, measured)
