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
from dataclasses import dataclass, field
from typing import Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from fsdp_composable._comm import _collectives, _rank_agreement, _tensor_parallel
from fsdp_composable._common_utils import _FSDPState, _get_fsdp_states, _is_inside_unit
from fsdp_composable._flat_param import FlatParamHandle
from fsdp_composable._grads import _exposed_grads
from fsdp_composable._guards._dtype_casts import adopt_casts
from fsdp_composable._runtime._entry_points import _forward_running, _in_backward, _settle_unfinished_step
from fsdp_composable._runtime._lazy_init import _ctx, _lazy_init

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
    # every root under ``module``: a plain parent may hold several sharded siblings, each its own root
    roots = _outermost(_root_states(module, "no_sync", "it must skip the reduction of every unit"))
    # A step that stopped midway is closed first; between a forward and its backward is fine (the
    # choice to reduce is made at each unit's post-backward), as in torch FSDP.
    for root in roots:
        _settle_unfinished_step(root)
    if _in_backward() or any(_forward_running(root) for root in roots):
        raise RuntimeError("no_sync must be entered between steps, not during forward/backward")
    # the switch lives in the root context: before the first forward, build it now ([Note: the root context])
    for root in roots:
        _lazy_init(root, root.module)
    ctxs = [_ctx(root) for root in roots]
    previous = [ctx.sync_gradients for ctx in ctxs]
    for ctx in ctxs:
        ctx.sync_gradients = False
    try:
        yield
    finally:
        for ctx, was in zip(ctxs, previous):
            ctx.sync_gradients = was


def _outermost(states: list[_FSDPState]) -> list[_FSDPState]:
    """The states (outermost first) whose module lies inside no other state's module."""
    inner = {id(m) for s in states for m in s.module.modules() if m is not s.module}
    return [s for s in states if id(s.module) not in inner]


@_rank_agreement.entry_point("clip_grad_norm_()")
def clip_grad_norm_(
    module: nn.Module, max_norm: Union[float, int], norm_type: Union[float, int, str] = 2.0
) -> torch.Tensor:
    """Clip all gradients of ``module`` by their global norm, computed over every shard of every unit
    (and parameters fully_shard does not manage). Returns the total norm, the same on every rank and
    equal to the unsharded model's. A collective: call it on every rank."""
    norm_type = _check_clip_args(module, max_norm, norm_type)
    states = _root_states(module, "clip_grad_norm_", "the norm covers every unit")
    _settle_unfinished_step(states[0])  # a step that stopped midway (see _entry_points)
    adopt_casts(_get_fsdp_states(module))  # model.half() since the last step: [Note: casts after sharding]
    group = states[0].process_group
    grads, pieces = _grads_by_placement(module, states)
    total = pieces.norm(norm_type, torch.float32, states[0].device)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    coefs: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}  # one copy per device and dtype
    with torch.no_grad():
        for grad in grads:  # CPU-offloaded gradients are scaled on the CPU, by a CPU coefficient
            key = (grad.device, grad.dtype)
            if key not in coefs:
                coefs[key] = coef.to(device=grad.device, dtype=grad.dtype)
            grad.mul_(coefs[key])
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


def _ranks(group: Optional[dist.ProcessGroup]) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group)) if group is not None else ()


@dataclass
class NormPieces:
    """Gradient pieces by the groups they are summed over (see [Note: clipping a 2-D model]): a
    data-parallel shard group, a tensor-parallel group, both, or none (every rank holds it whole).
    Keys are the groups' ranks, so every rank reduces in the same order. ``averaged``: groups over
    which a piece's terms are averaged instead of summed (gradients each rank holds for itself: [Note:
    clipping ignored parameters])."""

    pieces: dict[tuple[tuple[int, ...], ...], list[torch.Tensor]] = field(default_factory=dict)
    groups: dict[tuple[tuple[int, ...], ...], tuple[Optional[dist.ProcessGroup], ...]] = field(default_factory=dict)
    averaged: dict[tuple[tuple[int, ...], ...], tuple[dist.ProcessGroup, ...]] = field(default_factory=dict)

    def expect(
        self,
        dp: Optional[dist.ProcessGroup],
        tp: Optional[dist.ProcessGroup],
        averaged: tuple[dist.ProcessGroup, ...] = (),
    ) -> list[torch.Tensor]:
        """Register a kind of piece (so every rank reduces it, with or without gradients); its list."""
        key = (_ranks(dp), _ranks(tp), *(_ranks(g) for g in averaged))
        self.groups.setdefault(key, (dp, tp))
        self.averaged.setdefault(key, averaged)
        return self.pieces.setdefault(key, [])

    def norm(self, norm_type: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The norm over every rank's pieces, each element counted once; the same on every rank."""
        inf = math.isinf(norm_type)
        total = torch.zeros((), dtype=dtype, device=device)
        for key in sorted(self.pieces):
            term = _norm_term(self.pieces[key], norm_type, dtype, device)
            for group in self.groups[key]:
                if group is not None and dist.get_world_size(group) > 1:
                    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
                    term = term.to(_collectives.comm_device(group, device))
                    _collectives.wait(_collectives.all_reduce(term, group, op), "the clip_grad_norm_() all-reduce")
            for group in self.averaged[key]:
                if dist.get_world_size(group) > 1:
                    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
                    term = term.to(_collectives.comm_device(group, device))
                    _collectives.wait(_collectives.all_reduce(term, group, op), "the clip_grad_norm_() all-reduce")
                    term = term if inf else term / dist.get_world_size(group)
            term = term.to(device)
            total = torch.maximum(total, term) if inf else total + term
        return total if inf else total ** (1.0 / norm_type)

    def add_unit(
        self, handle: FlatParamHandle, grad: Optional[torch.Tensor], params: Optional[set[int]] = None
    ) -> None:
        """A unit's flat gradient shard (or, with ``params``, the slices of those original parameters)."""
        dp = handle.process_group if handle.layout.world_size > 1 else None
        replicated = dp is not None and any(info.replicated for info in handle.layout.infos)
        if not handle.tensor_parallel and params is None and not replicated:
            target = self.expect(dp, None)
            if grad is not None:
                target.append(grad)
            return
        slices = handle.sharded_views_of(grad) if grad is not None else [None] * len(handle.params)
        for param, info, piece in zip(handle.faces, handle.layout.infos, slices):
            if params is not None and id(param) not in params:
                continue
            # a 0-dim parameter's gradient is whole (and equal) in every rank's shard: counted once, here
            target = self.expect(None if info.replicated else dp, tp_group_of(info.tp))
            if params is not None:
                piece = _tensor_parallel.local_of(param.grad) if param.grad is not None else None
            if piece is not None:
                target.append(piece)

    def add_whole(self, param: torch.Tensor, replicated_over: tuple[dist.ProcessGroup, ...]) -> None:
        """A parameter fully_shard does not manage: its gradient is this rank's own, averaged over the
        ranks of ``replicated_over`` (summed over its tensor-parallel group if sharded); registered
        whether or not it has a gradient here."""
        target = self.expect(None, tp_group_of(_tensor_parallel.spec_of(param)), replicated_over)
        if param.grad is not None:
            target.append(_tensor_parallel.local_of(param.grad))


def tp_group_of(spec: Optional[_tensor_parallel.TPSpec]) -> Optional[dist.ProcessGroup]:
    """The group a tensor-parallel piece is summed over (None: replicated across it, or not TP)."""
    return spec.mesh.get_group() if spec is not None and _tensor_parallel.is_tp_sharded(spec) else None


# [Note: clipping ignored parameters]
# fully_shard does not reduce the gradients of parameters it does not manage (ignored modules): each
# rank holds its own. So that every rank gets the same norm and clips with it, such a gradient's
# term (sum |g|^p) is averaged over the data-parallel ranks (the root's shard and replicate groups;
# inf: the largest), i.e. counted once, as the mean over ranks. When the ranks keep those gradients
# equal (averaged by hand, as DDP would), that is exactly the plain model's norm.
#
# [Note: clipping a 2-D model]
# The global norm counts every element of the model once. A flat gradient shard is summed over the
# data-parallel group; a tensor-parallel parameter's slice of it holds that tensor-parallel rank's
# piece, so it is also summed over the tensor-parallel group, while a replicated parameter's slice is
# the same on every tensor-parallel rank and is not. Each unit's flat gradient is therefore cut into
# its parameters' slices by placement; the max norm needs no such care but goes the same way.
def _grads_by_placement(module: nn.Module, states: list[_FSDPState]) -> tuple[list[torch.Tensor], NormPieces]:
    """Every gradient tensor to scale, and its pieces by how they are spread across ranks."""
    grads: list[torch.Tensor] = []
    pieces = NormPieces()
    managed: set[int] = set()
    for s in states:
        for handle in s.handles:
            _exposed_grads.stash_sharded_grads(handle)  # fold the user's `.grad` edits into the flat gradient
            _exposed_grads.expose_sharded_grads(handle)
            # a wrapper in flat mode registers the flat parameter itself: count it once, as a shard
            managed.update([id(p) for p in (*handle.params, *handle.faces, handle.flat_param)])
            grad = handle.flat_param.grad
            pieces.add_unit(handle, grad)
            if grad is not None:
                grads.append(grad)
            extensions = handle.extensions
            for ext in extensions.params if extensions is not None else ():
                # a tensor-subclass parameter's gradient shard ([Note: extension parameters]): a dim-0
                # chunk of it, summed over the shard group (whole, and the same everywhere, under NO_SHARD)
                assert extensions is not None
                managed.add(id(ext.face))
                target = pieces.expect(handle.process_group if extensions.world > 1 else None, None)
                if ext.face.grad is not None:
                    local = ext.face.grad._local_tensor  # type: ignore[attr-defined]
                    target.append(local)
                    grads.append(local)
    root = states[0]
    replicated_over = tuple(g for g in (root.process_group, root.replicate_group) if g is not None)
    for p in module.parameters():
        if id(p) not in managed:
            pieces.add_whole(p, replicated_over)
            if p.grad is not None:
                grads.append(_tensor_parallel.local_of(p.grad))
    return grads, pieces


def _norm_term(grads: list[torch.Tensor], norm_type: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """sum(|g|^p) (or max |g| for inf) over ``grads``, in ``dtype``."""
    if not grads:
        return torch.zeros((), dtype=dtype, device=device)
    if math.isinf(norm_type):
        return torch.stack(
            [g.detach().abs().max().to(dtype) if g.numel() else g.new_zeros((), dtype=dtype) for g in grads]
        ).max().to(device)
    terms = [torch.linalg.vector_norm(g.detach().to(dtype), norm_type) ** norm_type for g in grads]
    return torch.stack(terms).sum().to(device)
