"""The CUDA path: NCCL, side streams for all-gathers and reductions. Skipped without a GPU.

At world size 1 FULL_SHARD becomes NO_SHARD and no all-gather or reduce-scatter runs, so the tests
that matter run at world size 2 and 4 in one process through torch's fake process group registered
for CUDA (one GPU cannot host two NCCL ranks): every collective is issued on the side streams with
CUDA tensors exactly as on NCCL, but moves no data, so those tests check what does not depend on
the values (no errors, the streams, no host synchronisation in a steady-state step, placement,
memory). Parity with real data runs at world size 1 on NCCL. The CPU-run checks of the same rules
are in test_device_paths.py.
"""

from __future__ import annotations

import copy
import os
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from harness import free_port
from models import Block, OddMLP, TinyGPT, gpt_batch, gpt_loss, mlp_batch, mlp_loss

from fsdp_composable import CPUOffload, ModuleWrapPolicy, ShardingStrategy, clip_grad_norm_, fully_shard
from fsdp_composable._comm import _collectives

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL and CUDA streams)")

_FAKE_CUDA = "fakecuda"


@pytest.fixture
def nccl_world_1() -> Iterator[None]:  # pragma: no cover - needs a GPU
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(params=[2, 4])
def fake_cuda_world(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[int]:  # pragma: no cover - needs a GPU
    """Rank 0 of a world of 2 or 4 whose group serves CUDA tensors only, as NCCL does. The fake
    group moves no data, so the one host read of a collective's result (the first iteration's order
    check) sees every rank agree."""
    from torch._C._distributed_c10d import FakeProcessGroup
    from torch.testing._internal.distributed.fake_pg import FakeStore

    monkeypatch.setattr(_collectives, "host_values", lambda t: torch.zeros(t.shape, dtype=t.dtype))
    if _FAKE_CUDA not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            _FAKE_CUDA,
            lambda store, rank, size, timeout: FakeProcessGroup._create_internal(rank, size),
            devices=["cuda"],
        )
    torch.cuda.set_device(0)
    dist.init_process_group(_FAKE_CUDA, store=FakeStore(), rank=0, world_size=request.param)
    yield request.param
    dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_world_size_1_parity_and_side_streams(nccl_world_1: None, strategy: str) -> None:  # pragma: no cover
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


def _steps(model: torch.nn.Module, n: int) -> None:  # pragma: no cover
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(n):
        batch = tuple(t.cuda() for t in gpt_batch(step, 4))
        gpt_loss(model, batch).backward()
        clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_sharded_steps_on_side_streams_without_host_sync(
    fake_cuda_world: int, strategy: str
) -> None:  # pragma: no cover - needs a GPU
    """World size 2/4: all-gathers and reduce-scatters on CUDA tensors on the side streams (the
    first iteration's order check included), and no host synchronisation in a steady-state step
    (torch raises on one in sync-debug "error" mode; an MLP, whose own ops never synchronise)."""
    torch.manual_seed(0)
    model = fully_shard(
        OddMLP(), lambda m: isinstance(m, torch.nn.Sequential), strategy=ShardingStrategy[strategy], device_id=0
    )
    assert all(p.is_cuda for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    x, y = mlp_batch(0, 4)
    torch.nn.functional.mse_loss(model(x), y.cuda()).backward()  # a CPU input: the root pre-forward moves it
    opt.step()
    opt.zero_grad()
    batches = [tuple(t.cuda() for t in mlp_batch(step, 4)) for step in range(2)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches:
            mlp_loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_cpu_offload_steps(fake_cuda_world: int) -> None:  # pragma: no cover - needs a GPU
    """CPU offload with a group that serves CUDA only: shards and gradients on the CPU (pinned),
    every collective on the GPU, clipping on the CPU gradients."""
    torch.manual_seed(0)
    model = fully_shard(TinyGPT(), ModuleWrapPolicy({Block}), cpu_offload=CPUOffload(offload_params=True), device_id=0)
    _steps(model, 2)
    gpt_loss(model, tuple(t.cuda() for t in gpt_batch(5, 4))).backward()
    for handle in fully_shard.state(model).handles:
        assert handle.flat_param.device.type == "cpu"
        grad = handle.flat_param.grad
        assert grad is None or (grad.device.type == "cpu" and grad.is_pinned())


def _to_empty_on_cuda(module: torch.nn.Module) -> None:  # pragma: no cover - needs a GPU
    module.to_empty(device=torch.device("cuda"), recurse=False)


def test_meta_model_materialised_on_cuda(fake_cuda_world: int) -> None:  # pragma: no cover - needs a GPU
    """A meta model with a CUDA device_id, or a param_init_fn that materialises on CUDA, ends on
    CUDA (never copied to the CPU)."""
    for kwargs in ({"device_id": 0, "param_init_fn": _to_empty_on_cuda}, {"param_init_fn": _to_empty_on_cuda}):
        with torch.device("meta"):
            model = TinyGPT()
        fully_shard(model, ModuleWrapPolicy({Block}), **kwargs)
        assert fully_shard.state(model).device.type == "cuda"
        assert all(p.is_cuda for p in model.parameters())
        _steps(model, 1)


def test_cpu_model_refused(fake_cuda_world: int) -> None:  # pragma: no cover - needs a GPU
    with pytest.raises(ValueError, match=r"pass device_id=torch\.cuda\.current_device\(\)"):
        fully_shard(TinyGPT(), ModuleWrapPolicy({Block}))


def test_device_id_moves_one_unit_at_a_time(fake_cuda_world: int) -> None:  # pragma: no cover - needs a GPU
    """While a CPU model is sharded with device_id, CUDA memory holds the shards built so far plus
    about one unit, never the whole model."""
    torch.manual_seed(0)
    model = TinyGPT(d=256, n_layers=12)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fully_shard(model, ModuleWrapPolicy({Block}), device_id=0)
    peak = torch.cuda.max_memory_allocated() - base
    final = torch.cuda.memory_allocated() - base
    assert peak <= final + 4 * block and peak < whole, (peak, final, block, whole)
