"""Parity helpers run on every rank: train a sharded copy and the unsharded reference side by side."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist
from models import gpt_batch, gpt_loss, mlp_batch, mlp_loss
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


def local_slice(batch: Batch, rank: int, world_size: int) -> Batch:
    per = batch[0].shape[0] // world_size
    return batch[0][rank * per : (rank + 1) * per], batch[1][rank * per : (rank + 1) * per]


def two_group_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    """Two param groups drawn from the same unit: weights decay, biases/norms do not, different lr.
    ``kind == "sgd-flat"``: one group, for optimizers over flat parameters."""
    if kind == "sgd-flat":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # by name only: a sharded parameter is 1-D, so its dim() says nothing
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "ln" not in n]
    ids = {id(p) for p in decay}
    rest = [p for p in model.parameters() if id(p) not in ids]
    groups: list[dict[str, Any]] = [
        {"params": decay, "weight_decay": 0.1},
        {"params": rest, "weight_decay": 0.0, "lr": 0.02},
    ]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(groups, lr=0.01)


def global_mean(value: torch.Tensor) -> float:
    t = value.detach().clone()
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def train_side_by_side(
    ref: nn.Module,
    shard: Callable[[nn.Module], nn.Module],
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor],
    batch_fn: Callable[[int, int], Batch],
    per_rank_batch: int,
    steps: int,
    optim: str,
) -> dict[str, Any]:
    """Return reference and sharded losses per step and the max abs difference of final weights."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard(copy.deepcopy(ref))
    opt_ref, opt = two_group_optimizer(ref, optim), two_group_optimizer(model, optim)
    ref_losses, losses = [], []
    for step in range(steps):
        batch = batch_fn(step, per_rank_batch * world)
        loss_ref = loss_fn(ref, batch)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        loss = loss_fn(model, local_slice(batch, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss_ref.item())
        losses.append(global_mean(loss))
    sd, ref_sd = model.state_dict(), ref.state_dict()
    return {
        "ref_losses": ref_losses,
        "losses": losses,
        "keys_equal": list(sd) == list(ref_sd),
        "shapes_equal": all(sd[k].shape == ref_sd[k].shape and sd[k].dtype == ref_sd[k].dtype for k in ref_sd),
        "max_weight_diff": max((sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd),
    }


def same_values(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same keys in the same order, and equal shapes and values (``torch.equal``)."""
    return list(a) == list(b) and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def count_forwards(modules: list[nn.Module]) -> list[int]:
    """A one-element list counting the forwards of ``modules`` (recomputations included)."""
    calls = [0]

    def hook(*_: Any) -> None:
        calls[0] += 1

    for m in modules:
        m.register_forward_pre_hook(hook)  # a pre-hook: recomputation may stop early, before any post-hook
    return calls


def gpt_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> float:
    """One training step of a GPT model on this rank's slice of ``gpt_batch(step, 4)``: the global mean loss."""
    loss = gpt_loss(model, local_slice(gpt_batch(step, 4), dist.get_rank(), dist.get_world_size()))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return global_mean(loss)


def error_text(fn: Callable[[], Any]) -> str:
    """``"<ExceptionType>: <message>"`` of what ``fn()`` raises, or ``"no error"``."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what we compare
        return f"{type(e).__name__}: {e}"
    return "no error"


def mlp_sgd_diff(model: nn.Module, ref: nn.Module, steps: int = 3) -> float:
    """SGD on the same global MLP batches: the sharded model on this rank's slice, the plain one on
    all; the largest difference of their state dicts afterwards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(steps):
        batch = mlp_batch(step, 3 * world)
        for m, o, b in ((model, opt, local_slice(batch, rank, world)), (ref, opt_ref, batch)):
            mlp_loss(m, b).backward()
            o.step()
            o.zero_grad()
    sd, ref_sd = model.state_dict(), ref.state_dict()
    return max((sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd)


def train_gpt(model: nn.Module, optim: torch.optim.Optimizer, steps: range, global_batch: int) -> None:
    """Train ``steps`` of the GPT batches, each rank on its slice of the global batch."""
    for step in steps:
        batch = local_slice(gpt_batch(step, global_batch), dist.get_rank(), dist.get_world_size())
        gpt_loss(model, batch).backward()
        optim.step()
        optim.zero_grad()
