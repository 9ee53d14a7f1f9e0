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
import functools
import math
import warnings
from typing import Iterator, Union

import torch
import torch.distributed as dist
from torch import nn

from fsdp_composable import _collectives, _rank_agreement, _reduce_utils
from fsdp_composable._common_utils import _FSDPState, _get_fsdp_states, _is_inside_unit
from fsdp_composable._runtime_utils import _forward_running, _in_backward, _settle_unfinished_step

__all__ = ["clip_grad_norm_", "no_sync"]


def _root_states(module: nn.Module, api: str, why: str) -> list[_FSDPState]:
    """The states under ``module``, which must be a fully_shard root (``why``: what covers every unit)."""
    _check_module_arg(module, api)
    states = _get_fsdp_states(module)
    if not states:
        if _is_inside_unit(module):
            raise ValueError(
                f"{api}: this {type(module).__name__} is not a fully_shard root or unit (its parameters belong "
                "to an enclosing unit); call it on the module fully_shard was applied to"
            )
        raise ValueError(f"{api}: no fully_shard state on this {type(module).__name__}; call fully_shard(module) first")
    _check_root(states[0], module, api, why)
    return states


def _check_module_arg(module: object, api: str) -> None:
    if not isinstance(module, nn.Module):
        unlike = " (not its parameters, unlike torch.nn.utils.clip_grad_norm_)" if api == "clip_grad_norm_" else ""
        raise TypeError(
            f"{api} argument 'module' must be the nn.Module fully_shard was applied to{unlike}, "
            f"got {type(module).__name__}"
        )


def _check_root(outer: _FSDPState, module: nn.Module, api: str, why: str) -> None:
    """``module`` holds the outermost state's module (a unit of it does not), and that state is the
    root (known once a forward ran: a manually nested state is not)."""
    root = outer.root_state if outer.root_state is not None else outer
    if any(m is root.module for m in module.modules()):
        return
    fqn = next((name for name, m in root.module.named_modules() if m is module), None)
    raise ValueError(
        f"{api} must be called on the fully_shard root ({type(root.module).__name__}), not on its "
        f"{'unit ' + repr(fqn) if fqn is not None else type(module).__name__}: {why}"
    )


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """Accumulate unsharded gradients locally, without communication, until the context exits."""
    states = _root_states(module, "no_sync", "it must skip the reduction of every unit")
    # A step that stopped midway is closed first; between a forward and its backward is fine (the
    # choice to reduce is made at each unit's post-backward), as in torch FSDP.
    _settle_unfinished_step(states[0])
    if _in_backward() or _forward_running(states[0]):
        raise RuntimeError("no_sync must be entered between steps, not during forward/backward")
    previous = [s.sync_gradients for s in states]
    for s in states:
        s.sync_gradients = False
    try:
        yield
    finally:
        for s, prev in zip(states, previous):
            s.sync_gradients = prev


@_rank_agreement.entry_point("clip_grad_norm_()")
def clip_grad_norm_(
    module: nn.Module, max_norm: Union[float, int], norm_type: Union[float, int, str] = 2.0
) -> torch.Tensor:
    """Clip all gradients of ``module`` by their global norm, computed over every shard of every unit
    (and parameters fully_shard does not manage). Returns the total norm, the same on every rank and
    equal to the unsharded model's. A collective: call it on every rank."""
    norm_type = _check_clip_args(module, max_norm, norm_type)
    states = _root_states(module, "clip_grad_norm_", "the norm covers every unit")
    _settle_unfinished_step(states[0])  # a step that stopped midway (see _runtime_utils)
    group = states[0].process_group
    sharded, replicated = _grads_by_placement(module, states)
    device = states[0].device
    grads = sharded + replicated
    local_sharded = _norm_term(sharded, norm_type, device)
    local_replicated = _norm_term(replicated, norm_type, device)
    if math.isinf(norm_type):
        total = torch.maximum(local_sharded, local_replicated)
        _collectives.wait(_collectives.all_reduce(total, group, dist.ReduceOp.MAX), "the clip_grad_norm_() all-reduce")
    else:
        _collectives.wait(_collectives.all_reduce(local_sharded, group), "the clip_grad_norm_() all-reduce")
        total = (local_sharded + local_replicated) ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for grad in grads:
            grad.mul_(coef.to(grad.dtype))
    if not grads:  # this rank has none (the norm still counts the other ranks')
        warnings.warn(
            f"clip_grad_norm_ called on rank {dist.get_rank(group)} with no gradients; returning the total "
            f"norm in {total.dtype}",
            stacklevel=2,
        )
        return total
    # as torch FSDP: computed in float32, returned in the gradients' (promoted) dtype
    return total.to(functools.reduce(torch.promote_types, [g.dtype for g in grads]))


def _check_clip_args(module: nn.Module, max_norm: Union[float, int], norm_type: Union[float, int, str]) -> float:
    """Validate the numbers (a NaN or inf ``max_norm`` would silently scale every gradient by NaN or 1);
    returns ``norm_type`` as a float ("inf" is accepted, as torch's clip_grad_norm_ does)."""
    _check_module_arg(module, "clip_grad_norm_")
    if (
        isinstance(max_norm, bool)
        or not isinstance(max_norm, (int, float))
        or not math.isfinite(max_norm)
        or max_norm < 0
    ):
        raise ValueError(f"clip_grad_norm_: max_norm must be a finite non-negative number, got {max_norm!r}")
    if norm_type == "inf":
        return math.inf
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise ValueError(
            "clip_grad_norm_: norm_type must be a positive number or inf, "
            f"got {type(norm_type).__name__}: {norm_type!r}"
        )
    return float(norm_type)


def _grads_by_placement(module: nn.Module, states: list[_FSDPState]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Flat sharded gradients (summed over ranks) and gradients every rank holds whole (counted once)."""
    sharded: list[torch.Tensor] = []
    replicated: list[torch.Tensor] = []
    managed: set[int] = set()
    for s in states:
        for handle in s.handles:
            _reduce_utils.stash_sharded_grads(handle)  # fold the user's `.grad` edits into the flat gradient
            _reduce_utils.expose_sharded_grads(handle)
            # a wrapper in flat mode registers the flat parameter itself: count it once, as a shard
            managed.update([id(p) for p in handle.params] + [id(handle.flat_param)])
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
