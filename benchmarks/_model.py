"""The benchmark model: a GPT-like transformer whose blocks are the sharding units.

Defined here (not imported from tests/) so the benchmark's workload never changes when a test
model does. The default size is 8 blocks at d=512 (~25.2M block parameters) plus an untied
embedding and head over an 8136-token vocabulary, 33,600,512 parameters in all.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Block",
    "BenchGPT",
    "ModelConfig",
    "DEFAULT",
    "SMALL",
    "add_shape_args",
    "config_of",
    "make_batch",
    "gpt_loss",
    "loss_of_logits",
    "count_params",
]


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    d: int
    heads: int
    n_layers: int
    seq: int
    batch_per_rank: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


# 8 * (12 d^2 + 9 d) + 2 * vocab * d + seq * d + 2 d = 33,600,512 for these sizes.
DEFAULT = ModelConfig(vocab=8136, d=512, heads=8, n_layers=8, seq=128, batch_per_rank=4)
SMALL = ModelConfig(vocab=64, d=32, heads=2, n_layers=2, seq=16, batch_per_rank=2)


def _heads(d: int) -> int:
    """Attention heads for width ``d``: the default model's 8, fewer when ``d`` is under 128."""
    return min(DEFAULT.heads, max(1, d // 16))


def _width(text: str) -> int:
    d = int(text)
    if d < 1 or d % _heads(d):
        raise argparse.ArgumentTypeError(f"must be positive and divisible by its {_heads(d)} heads, got {d}")
    return d


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {n}")
    return n


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """``--small``, ``--d`` and ``--n-layers``: the model a benchmark runs (`config_of`)."""
    p.add_argument("--small", action="store_true", help="the tiny model (smoke test)")
    p.add_argument("--d", type=_width, default=DEFAULT.d, help="block width (default: the default model's 512)")
    p.add_argument(
        "--n-layers",
        type=_positive,
        default=DEFAULT.n_layers,
        help="blocks, one unit each (default 8); 64 with --d 128: many small units",
    )


def config_of(args: argparse.Namespace) -> ModelConfig:
    """The tiny model, or the default one with ``--d`` / ``--n-layers`` (8 heads, fewer when ``--d`` is
    under 128)."""
    if args.small:
        return SMALL
    return replace(DEFAULT, d=args.d, heads=_heads(args.d), n_layers=args.n_layers)


class Block(nn.Module):
    """Pre-norm attention + MLP block: 12 d^2 + 9 d parameters."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class BenchGPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d)
        self.pos = nn.Parameter(torch.randn(cfg.seq, cfg.d) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg.d, cfg.heads) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d)
        self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def make_batch(cfg: ModelConfig, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of step ``step``'s global batch (the same for every impl)."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    data = torch.randint(0, cfg.vocab, (cfg.batch_per_rank, cfg.seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    idx, target = batch
    return loss_of_logits(target)(model(idx))


def loss_of_logits(target: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The loss `gpt_loss` takes of the logits (fp32 cross-entropy): `estimate_memory`'s ``loss_fn``."""

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))

    return loss
