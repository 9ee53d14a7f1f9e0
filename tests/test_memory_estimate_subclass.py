"""estimate_memory() of a QLoRA model (torchao NF4 base weights, LoRA adapters): the NF4 weights are
counted in their own bytes (4-bit codes and scales, not float32), and computing through them (NF4's
linear dequantizes each weight through full-size temporaries) is the ``subclass_compute`` term; the
whole is within 10% of the measured peak of a training step (2 ranks; benchmarks/bench_qlora.py
measures 4 too)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_extensions import QLoRABlock, needs_torchao
from test_memory_estimate_peak import third_step_peak
from torch import nn

from fsdp_composable import MemoryEstimate, ModuleWrapPolicy, estimate_memory, fully_shard

POLICY = ModuleWrapPolicy({QLoRABlock})
D, BLOCKS, TOKENS = 512, 3, 64  # tokens per rank


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(QLoRABlock(D) for _ in range(BLOCKS)))


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(1, TOKENS, D, generator=g)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    optim.zero_grad(set_to_none=True)
    _loss(model(_batch(step))).backward()
    optim.step()


def _nf4_bytes(model: nn.Module) -> tuple[int, int]:
    """(this rank's bytes of the NF4 faces' local chunks, their elements as float32 bytes)."""
    chunks = [p._local_tensor for p in model.parameters() if type(p._local_tensor).__name__ == "NF4Tensor"]
    own = sum(getattr(c, name).untyped_storage().nbytes() for c in chunks for name in c.__tensor_flatten__()[0])
    return own, sum(c.numel() * 4 for c in chunks)


def estimate_and_peak() -> tuple[MemoryEstimate, int, tuple[int, int]]:
    model = _model()
    est = estimate_memory(
        model,
        policy=POLICY,
        world_size=dist.get_world_size(),
        optimizer="adamw",
        batch_example=_batch(0),
        loss_fn=_loss,
    )
    fully_shard(model, POLICY)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, foreach=True)
    return est, third_step_peak(model, optim, _step), _nf4_bytes(model)


@needs_torchao
def test_qlora_estimate_counts_nf4_bytes_and_dequantization(dist_run) -> None:
    world_size = 2
    for rank, (est, measured, (nf4_bytes, as_float32)) in enumerate(dist_run(world_size, estimate_and_peak)):
        b = est.breakdown
        if rank == 0:
            print(f"{world_size} ranks: estimate {est.peak_bytes:,} measured {measured:,} {dict(b)}")
        # the shards the estimate counts hold what the faces hold: 4-bit codes and scales, about a
        # seventh of float32 (block sizes 64 and 256), not the float32 elements it counted before
        lora_and_norms = BLOCKS * (2 * D + 4 * (3 * D + 3 * D)) * 4 // world_size  # LayerNorm, rank-4 adapters
        assert b["sharded_params"] - lora_and_norms == pytest.approx(nf4_bytes, rel=0.01), (rank, b)
        assert nf4_bytes < as_float32 / 6, (nf4_bytes, as_float32)
        assert b["subclass_compute"] > 0 and est.peak_moment == "backward", (rank, est.moments)
        assert 0.9 <= est.peak_bytes / measured <= 1.1, (rank, est.peak_bytes, measured, dict(b))
        # without the dequantization term the estimate would miss the peak by more than 10%
        assert (est.peak_bytes - b["subclass_compute"]) / measured < 0.9, (rank, dict(b), measured)
