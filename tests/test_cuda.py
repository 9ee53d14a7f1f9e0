"""The CUDA path: NCCL, side streams for all-gathers and reductions. Skipped without a GPU."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from harness import free_port
from models import Block, TinyGPT, gpt_batch, gpt_loss

from fsdp_composable import ModuleWrapPolicy, ShardingStrategy, fully_shard

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL and CUDA streams)")


@pytest.fixture
def nccl_world_1():  # pragma: no cover - needs a GPU
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_world_size_1_parity_and_side_streams(nccl_world_1, strategy: str) -> None:  # pragma: no cover
    torch.manual_seed(0)
    ref = TinyGPT().cuda()
    model = fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({Block}), strategy=ShardingStrategy[strategy])
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        batch = tuple(t.cuda() for t in gpt_batch(step, 4))
        for m, o in ((ref, opt_ref), (model, opt)):
            gpt_loss(m, batch).backward()
            o.step()
            o.zero_grad()
    ctx = fully_shard.state(model).ctx
    assert ctx is not None and ctx.unshard_stream is not None and ctx.reduce_stream is not None
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v)
