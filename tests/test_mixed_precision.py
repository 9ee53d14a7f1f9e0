"""Mixed precision: parameter/reduce/buffer dtypes per submodule, inputs, overrides, BatchNorm, offload."""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from models import Block, OddMLP, TinyGPT, gpt_batch, gpt_loss, mlp_batch
from parity import global_mean, local_slice
from torch import nn

from fsdp_composable import CPUOffload, CustomPolicy, MixedPrecision, ModuleWrapPolicy, fully_shard, unshard_params

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Scaled(nn.Module):
    """A linear layer with a float buffer and an int buffer, each under a name unique to the instance."""

    def __init__(self, d: int, buf_name: str) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.buf_name = buf_name
        self.register_buffer(buf_name, torch.full((d,), 0.5))
        self.register_buffer(f"{buf_name}_count", torch.zeros((), dtype=torch.long))
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buf = getattr(self, self.buf_name)
        self.seen = {"x": x.dtype, "weight": self.lin.weight.dtype, "buffer": buf.dtype}
        self.seen["count"] = getattr(self, f"{self.buf_name}_count").dtype
        return torch.tanh(self.lin(x) * buf.to(x.dtype))


class BufNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Scaled(6, "scale_first")
        self.inner = nn.Sequential(Scaled(6, "gain_inner"), Scaled(6, "bias_deep"))
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.ids_dtype = ids.dtype
        return self.head(self.inner(self.first(x)).to(self.head.weight.dtype)) + ids.float().mean()


def dtypes_inside_and_after(buffer_dtype: str) -> dict:
    torch.manual_seed(0)
    model = BufNet()
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=DTYPES.get(buffer_dtype))
    fully_shard(model, ModuleWrapPolicy({nn.Sequential}), mixed_precision=mp)
    x, ids = torch.randn(4, 6), torch.arange(4)
    model(x, ids).sum().backward()
    scaled = [model.first, model.inner[0], model.inner[1]]
    return {
        "inside": [m.seen for m in scaled],
        "ids": model.ids_dtype,
        "grads": {p.grad.dtype for p in model.parameters() if p.numel()},  # an empty slice: an empty .grad
        "params": {p.dtype for p in model.parameters()},
        "state_dict": {
            k: v.dtype for k, v in model.state_dict().items() if "scale" in k or "gain" in k or "bias_" in k
        },
    }


@pytest.mark.parametrize("buffer_dtype", ["bf16", "none"])
def test_dtypes_per_submodule(dist_run, buffer_dtype: str) -> None:
    r = dist_run(2, dtypes_inside_and_after, buffer_dtype)[0]
    expect_buf = torch.bfloat16 if buffer_dtype == "bf16" else torch.float32
    for seen in r["inside"]:
        assert seen == {"x": torch.bfloat16, "weight": torch.bfloat16, "buffer": expect_buf, "count": torch.long}
    assert r["ids"] is torch.long
    assert r["grads"] == {torch.float32} and r["params"] == {torch.float32}
    assert r["state_dict"] == {
        "first.scale_first": torch.float32,
        "first.scale_first_count": torch.long,
        "inner.0.gain_inner": torch.float32,
        "inner.0.gain_inner_count": torch.long,
        "inner.1.bias_deep": torch.float32,
        "inner.1.bias_deep_count": torch.long,
    }


def low_precision_parity(dtype_name: str) -> dict:
    """Reference: fp32 master weights, a copy cast to ``dtype`` computes the global batch."""
    dtype = DTYPES[dtype_name]
    torch.manual_seed(0)
    master = TinyGPT()
    model = copy.deepcopy(master)
    fully_shard(model, ModuleWrapPolicy({Block}), mixed_precision=MixedPrecision(param_dtype=dtype))
    rank, world = dist.get_rank(), dist.get_world_size()
    opt_ref, opt = torch.optim.SGD(master.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    losses, ref_losses = [], []
    for step in range(3):
        batch = gpt_batch(step, 2 * world)
        low = copy.deepcopy(master).to(dtype)
        loss_ref = gpt_loss(low, batch)
        loss_ref.backward()
        for p, q in zip(master.parameters(), low.parameters()):
            p.grad = q.grad.float()
        opt_ref.step()
        opt_ref.zero_grad()
        loss = gpt_loss(model, local_slice(batch, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss_ref.item())
        losses.append(global_mean(loss.float()))
    sd = model.state_dict()
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "dtypes": {v.dtype for v in sd.values()},
        "diff": max((sd[k] - v).abs().max().item() for k, v in master.state_dict().items()),
    }


@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
def test_low_precision_parity(dist_run, dtype_name: str) -> None:
    tol = 3e-2 if dtype_name == "bf16" else 5e-3
    for r in dist_run(2, low_precision_parity, dtype_name):
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=tol, atol=tol)
        assert r["dtypes"] == {torch.float32}
        assert r["diff"] < tol, r["diff"]


def override_and_low_grads() -> dict:
    torch.manual_seed(0)
    model = BufNet()

    def per_unit(m: nn.Module) -> bool | dict:
        if m is model.inner:
            mp = MixedPrecision(param_dtype=torch.float16, keep_low_precision_grads=True, cast_forward_inputs=True)
            return {"mixed_precision": mp}
        return False

    fully_shard(model, CustomPolicy(per_unit))
    model(torch.randn(4, 6), torch.arange(4)).sum().backward()
    return {
        "first": model.first.seen["weight"],
        "inner": model.inner[0].seen["weight"],
        "inner_grads": {p.grad.dtype for p in model.inner.parameters() if p.numel()},
        "first_grads": {p.grad.dtype for p in model.first.parameters() if p.numel()},
    }


def test_per_unit_override_and_keep_low_precision_grads(dist_run) -> None:
    r = dist_run(2, override_and_low_grads)[0]
    assert r == {
        "first": torch.float32,
        "inner": torch.float16,
        "inner_grads": {torch.float16},
        "first_grads": {torch.float32},
    }


def batchnorm_unit() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fully_shard(model, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))
    state = fully_shard.state(model)
    model(torch.randn(8, 4)).sum().backward()
    return {
        "units": {h.unit_fqn: h.compute_dtype for h in state.handles},
        "running_mean": model[1].running_mean.dtype,
        "warning": [str(w.message) for w in caught],
    }


def test_batchnorm_gets_full_precision_unit(dist_run) -> None:
    r = dist_run(2, batchnorm_unit)[0]
    assert r["units"] == {"": torch.bfloat16, "1": torch.float32}
    assert r["running_mean"] is torch.float32
    expecttest.TestCase().assertExpectedInline(
        r["warning"][0],
        """fully_shard under mixed precision gives each BatchNorm module its own unit in full precision ('1'): low-precision running statistics are inaccurate. Its inputs keep their dtype""",  # noqa: E501
    )


def cpu_offload_parity() -> float:
    torch.manual_seed(0)
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    fully_shard(model, ModuleWrapPolicy({Block}), cpu_offload=CPUOffload(offload_params=True))
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = gpt_batch(0, 2 * world)
    gpt_loss(ref, batch).backward()
    gpt_loss(model, local_slice(batch, rank, world)).backward()
    sd = {k: v for k, v in ref.named_parameters()}
    from fsdp_composable import unshard_params

    with unshard_params(model, with_grads=True, writeback=False):
        return max((p.grad - sd[n].grad).abs().max().item() for n, p in model.named_parameters())


def test_cpu_offload_is_accepted_on_cpu(dist_run) -> None:
    # On a machine without an accelerator parameters already live on the CPU: offload changes nothing.
    assert max(dist_run(2, cpu_offload_parity)) < 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CPU offload moves shards between a CUDA device and the host")
def test_cpu_offload_cuda() -> None:  # pragma: no cover - needs a GPU
    import os

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29641")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = TinyGPT().cuda()
        fully_shard(model, ModuleWrapPolicy({Block}), cpu_offload=CPUOffload(offload_params=True))
        assert all(p.device.type == "cpu" for p in model.parameters())
        gpt_loss(model, tuple(t.cuda() for t in gpt_batch(0, 2))).backward()
        assert all(p.grad.device.type == "cpu" for p in model.parameters())
    finally:
        dist.destroy_process_group()


def test_mixed_precision_validation() -> None:
    with pytest.raises(ValueError) as e:
        MixedPrecision(param_dtype=torch.int32)
    expecttest.TestCase().assertExpectedInline(
        str(e.value),
        """MixedPrecision.param_dtype must be a floating-point torch.dtype or None, got torch.int32; use e.g. torch.bfloat16 or torch.float16""",  # noqa: E501
    )
    with pytest.raises(ValueError, match="reduce_dtype"):
        MixedPrecision(reduce_dtype="bf16")  # type: ignore[arg-type]


class _FloatTrunk(nn.Module):
    """Blocks fed float32 activations (the embedding's output cast up), each optionally checkpointed."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.emb = nn.Embedding(37, 16)
        self.blocks = nn.ModuleList(Block(16) for _ in range(2))
        self.head = nn.Linear(16, 37)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx).float()
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(x)


def checkpointed_units_cast_again() -> float:
    """Units casting their own inputs (``cast_forward_inputs``) inside ``torch.utils.checkpoint``: the
    recomputed forward casts as the forward did, so gradients equal those of the model without it."""
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
    plain = _FloatTrunk(checkpointed=False)
    models = [plain, copy.deepcopy(plain)]
    models[1].checkpointed = True
    idx, target = local_slice(gpt_batch(0, 2 * world), rank, world)
    grads = []
    for model in models:
        fully_shard(model, ModuleWrapPolicy({Block}), mixed_precision=mp)
        F.cross_entropy(model(idx).float().flatten(0, 1), target.flatten()).backward()
        with unshard_params(model, with_grads=True, writeback=False):
            grads.append([p.grad.clone() for p in model.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*grads))


def test_checkpointed_units_cast_again(dist_run: Callable[..., Any]) -> None:
    assert dist_run(2, checkpointed_units_cast_again) == [0.0, 0.0]


def checkpointed_root_casts_again() -> float:
    """The whole sharded model inside ``torch.utils.checkpoint``: its recomputed forward casts the
    root's inputs again, so gradients equal those without the checkpoint."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    x, y = local_slice(mlp_batch(0, 2 * world), rank, world)
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = fully_shard(OddMLP(), ModuleWrapPolicy({nn.Sequential}), mixed_precision=mp)
        out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False) if checkpointed else model(x)
        F.mse_loss(out.float(), y).backward()
        with unshard_params(model, with_grads=True, writeback=False):
            grads.append([p.grad.clone() for p in model.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*grads))


def test_checkpointed_root_casts_again(dist_run: Callable[..., Any]) -> None:
    assert dist_run(2, checkpointed_root_casts_again) == [0.0, 0.0]
