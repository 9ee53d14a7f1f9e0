"""A chunked loss: the head, held by the root unit, called alone on pieces of the root's output, with
backward run on each piece before backward through the root's output (as FSDP2 supports)."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import Block
from parity import local_slice
from torch import nn

from fsdp_composable import ModuleWrapPolicy, fully_shard


class Trunk(nn.Module):
    """Its forward returns the hidden states; the head is used by the loss only."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(37, 16)
        self.blocks = nn.ModuleList(Block(16) for _ in range(2))
        self.head = nn.Linear(16, 37)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return x


def chunked_step(model: Trunk, idx: torch.Tensor, target: torch.Tensor, chunks: int) -> None:
    hidden = model(idx)
    cut = hidden.detach().requires_grad_()
    for h, t in zip(cut.chunk(chunks, dim=1), target.chunk(chunks, dim=1)):
        loss = F.cross_entropy(model.head(h).flatten(0, 1), t.flatten(), reduction="sum") / target.numel()
        loss.backward()
    hidden.backward(cut.grad)


def train_chunked(head_unit: bool) -> float:
    """Three SGD steps of the chunked loss next to the unsharded model: the largest weight difference."""
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = Trunk()
    model = copy.deepcopy(ref)
    fully_shard(model, ModuleWrapPolicy({Block, nn.Linear} if head_unit else {Block}))
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        data = torch.randint(0, 37, (2 * world, 9), generator=g)
        chunked_step(ref, data[:, :-1], data[:, 1:], chunks=2)
        idx, target = local_slice((data[:, :-1], data[:, 1:]), rank, world)
        chunked_step(model, idx, target, chunks=2)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    sd = model.state_dict()
    return max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items())


@pytest.mark.parametrize("head_unit", [False, True])
def test_chunked_loss_matches_the_unsharded_model(dist_run: Callable[..., Any], head_unit: bool) -> None:
    for diff in dist_run(2, train_chunked, head_unit):
        assert diff < 1e-5, diff
