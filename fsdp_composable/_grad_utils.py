"""Gradient accumulation (`no_sync`) and global gradient clipping (`clip_grad_norm_`).

[Note: two ways to accumulate gradients]
- ``with no_sync(model):`` skips the reduction: every unit keeps its *unsharded* gradient buffer
  (the full unit size, in compute dtype) across micro-batches, and the first backward outside the
  context reduces the sum once. Fast (one reduction per step) but each rank holds a full-size
  gradient per unit: memory grows from 1/N of the gradients to all of them.
- Plain accumulation (call ``backward()`` per micro-batch, ``step()`` once): every micro-batch is
  reduced into the *sharded* gradient, which sums across backwards. Memory stays at 1/N; the cost
  is one reduction per micro-batch. This is the memory-lean choice.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Union

import torch
import torch.distributed as dist
from torch import nn

from fsdp_composable._common_utils import TrainingState, _FSDPState, _get_fsdp_states

__all__ = ["clip_grad_norm_", "no_sync"]


def _root_states(module: nn.Module, api: str) -> list[_FSDPState]:
    states = _get_fsdp_states(module)
    if not states:
        raise ValueError(f"{api}: no fully_shard state on this {type(module).__name__}; call fully_shard(module) first")
    return states


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """Accumulate unsharded gradients locally, without communication, until the context exits."""
    states = _root_states(module, "no_sync")
    for s in states:
        if s.training_state is not TrainingState.IDLE:
            raise RuntimeError("no_sync must be entered between steps, not during forward/backward")
    previous = [s.sync_gradients for s in states]
    for s in states:
        s.sync_gradients = False
    try:
        yield
    finally:
        for s, prev in zip(states, previous):
            s.sync_gradients = prev


def clip_grad_norm_(module: nn.Module, max_norm: Union[float, int], norm_type: Union[float, int] = 2.0) -> torch.Tensor:
    """Clip all gradients of ``module`` by their global norm, computed over every shard of every unit
    (and parameters fully_shard does not manage). Returns the total norm, the same on every rank and
    equal to the unsharded model's. A collective: call it on every rank."""
    if not isinstance(max_norm, (int, float)) or max_norm < 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be a non-negative number, got {max_norm!r}")
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be positive (or inf), got {norm_type!r}")
    states = _root_states(module, "clip_grad_norm_")
    group = states[0].process_group
    sharded, replicated = _grads_by_placement(module, states)
    device = states[0].device
    local_sharded = _norm_term(sharded, norm_type, device)
    local_replicated = _norm_term(replicated, norm_type, device)
    if math.isinf(norm_type):
        total = torch.maximum(local_sharded, local_replicated)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        dist.all_reduce(local_sharded, group=group)
        total = (local_sharded + local_replicated) ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for grad in sharded + replicated:
            grad.mul_(coef.to(grad.dtype))
    return total


def _grads_by_placement(module: nn.Module, states: list[_FSDPState]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Flat sharded gradients (summed over ranks) and gradients every rank holds whole (counted once)."""
    sharded: list[torch.Tensor] = []
    replicated: list[torch.Tensor] = []
    managed: set[int] = set()
    for s in states:
        for handle in s.handles:
            handle.stash_sharded_grads()  # fold the user's `.grad` edits into the flat gradient
            handle.expose_sharded_grads()
            managed.update(id(p) for p in handle.params)
            grad = handle.flat_param.grad
            if grad is not None:
                (sharded if handle.layout.world_size > 1 else replicated).append(grad)
    for p in module.parameters():
        if id(p) not in managed and p.grad is not None:
            replicated.append(p.grad)
    return sharded, replicated


def _norm_term(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """sum(|g|^p) (or max |g| for inf) over ``grads``, in float32."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    if math.isinf(norm_type):
        return torch.stack(
            [g.detach().abs().max().float() if g.numel() else g.new_zeros(()).float() for g in grads]
        ).max()
    return torch.stack([g.detach().float().norm(norm_type) ** norm_type for g in grads]).sum()
