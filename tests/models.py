"""Small models for tests: a GPT-like transformer (optionally tied) and an MLP with odd sizes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int = 2) -> None:
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


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 37, d: int = 16, n_layers: int = 2, seq: int = 8, tied: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    idx, target = batch
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def gpt_batch(step: int, global_batch: int, seq: int = 8, vocab: int = 37) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, vocab, (global_batch, seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


class OddMLP(nn.Module):
    """Layer sizes chosen so no unit's numel is a multiple of 2 or 4: every shard is padded."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(5, 7)
        self.l2 = nn.Sequential(nn.Linear(7, 3), nn.Tanh(), nn.Linear(3, 7))
        self.l3 = nn.Linear(7, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


def mlp_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def mlp_batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(global_batch, 5, generator=g), torch.randn(global_batch, 1, generator=g)


class Branchy(nn.Module):
    """Three blocks of one size run in ``order``, chosen per rank (a data-dependent branch, a router,
    a skipped layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.order = [0, 1, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.order:
            x = torch.tanh(self.blocks[i](x))
        return x


class Toy(nn.Module):
    """A scale and three Linears of odd sizes, for memory estimates by hand. Units under
    ModuleWrapPolicy({nn.Linear}): root (scale, 3), a (20), b (42), c (8)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.a = nn.Linear(3, 5)
        self.b = nn.Linear(5, 7)
        self.c = nn.Linear(7, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x * self.scale)))))
