"""CPU offload (``CPUOffload(offload_params=True)``), its real path on two fake CUDA devices that hold
data on the CPU ([Note: the offload ledger] in offload_fake_cuda.py): in a steady-state step every
copy between the host shards and the device is pinned on the host side and non-blocking (the uploads
of each unit's shard, the download of each unit's reduced gradient during backward on the stream
that produced it), and the host synchronises once, before the optimizer reads the gradients; and the
training matches the unsharded model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from models import Block, TinyGPT, gpt_batch, gpt_loss
from offload_fake_cuda import fake_cuda_with_data

import fsdp_composable as fc
from fsdp_composable._comm import _collectives
from fsdp_composable._init import _init_utils

CUDA1 = torch.device("cuda", 1)


def offload_steps(strategy: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    steps: list[dict[str, Any]] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_init_utils, "_check_comm_device", lambda *args: None)  # the pool's gloo serves the CPU
        mp.setattr(_collectives, "served_devices", lambda group: [torch.device("cuda")])  # as NCCL would
        with fake_cuda_with_data(mp) as ledger:
            fc.fully_shard(
                model,
                fc.ModuleWrapPolicy({Block}),
                device_id=1,
                strategy=fc.ShardingStrategy[strategy],
                cpu_offload=fc.CPUOffload(offload_params=True),
            )
            units = len(fc.fully_shard.state(model).handles)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(3):
                idx, target = gpt_batch(step, 2 * world)
                local = (idx[rank * 2 : rank * 2 + 2].to(CUDA1), target[rank * 2 : rank * 2 + 2].to(CUDA1))
                first, syncs = len(ledger.crossings), ledger.host_syncs
                gpt_loss(model, local).backward()
                opt.step()
                opt.zero_grad()
                crossings = ledger.crossings[first:]
                steps.append(
                    {
                        "blocking": [c for c in crossings if not c.non_blocking],
                        "unpinned": [c for c in crossings if not c.pinned],
                        "downloads": [
                            (c.stream != "compute", c.in_backward) for c in crossings if c.direction == "host"
                        ],
                        "uploads": sum(c.direction == "device" for c in crossings),
                        "syncs": ledger.host_syncs - syncs,
                    }
                )
                gpt_loss(ref, (idx, target)).backward()
                opt_ref.step()
                opt_ref.zero_grad()
            with fc.unshard_params(model, writeback=False):
                diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return {"steps": steps[1:], "units": units, "diff": diff}


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_offload_copies_pinned_non_blocking_one_sync(dist_run, strategy: str) -> None:
    """(A user's communication hook allocates its result with ``device=grad.device``, which this fake
    reports as the CPU: that path's download is checked in tests/test_device_paths.py, on meta.)"""
    for r in dist_run(2, offload_steps, strategy):
        assert r["diff"] < 1e-5, r["diff"]
        for step in r["steps"]:
            assert step["blocking"] == [], step["blocking"]
            assert step["unpinned"] == [], step["unpinned"]
            assert step["downloads"] == [(True, True)] * r["units"], step["downloads"]
            assert step["uploads"] >= r["units"], step
            assert step["syncs"] == 1, step
