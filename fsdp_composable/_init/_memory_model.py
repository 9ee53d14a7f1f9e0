"""The memory model behind `estimate_memory`: each predicted unit's costs, the per-rank terms of a
training step (see [Note: the memory model]), and the activations a forward saves for backward,
measured on fake tensors (see [Note: measuring activations])."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fsdp_composable._config import UnitConfig
from fsdp_composable._flat._extensions import is_extension
from fsdp_composable._flat_param import _build_layout
from fsdp_composable._init._loss_memory import LossFn, _LiveBytes, _loss_bytes
from fsdp_composable._init._sharding_plan import UnitPlan, _itemsize, _unit_plan
from fsdp_composable._init._wrap_utils import SubmoduleState

__all__: list[str] = []

# optimizer name -> how many tensors of a parameter's shape and dtype it keeps per trainable parameter
OPTIMIZER_STATE_FACTORS: dict[str, int] = {"adam": 2, "adamw": 2, "sgd": 0, "sgd-momentum": 1}
# optimizer name -> how many temporaries of the trainable parameters' size its step (foreach) allocates
# at once: Adam's sqrt(exp_avg_sq) (torch._foreach_sqrt, divided and shifted by eps in place); SGD's
# updates are in place
OPTIMIZER_STEP_FACTORS: dict[str, int] = {"adam": 1, "adamw": 1, "sgd": 0, "sgd-momentum": 0}


@dataclass(frozen=True)
class _UnitCost:
    """A predicted unit plus what its memory terms need beyond the plan."""

    plan: UnitPlan
    is_root: bool
    requires_grad: bool
    trainable_shard_numel: int  # elements of trainable parameters in rank 0's shard
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    grad_dtype: torch.dtype  # of the sharded gradient kept between steps
    needs_unsharded_buffer: bool  # the handle allocates an unsharded buffer (see FlatParamHandle)
    reshard_after_forward: bool  # (unless it is the root unit)
    # its all-gather lands in a second, rank-major buffer that is copied out ([Note: moving chunks])
    copied_out: bool = False
    # reshard_after_forward=<int>: the k ranks it stays sharded over after forward (None: not used)
    post_forward_ranks: Optional[int] = None
    # its tensor-subclass parameters, kept beside the flat parameter ([Note: extension parameters]):
    # their own bytes in this rank's chunk and in every rank's (what their all-gather's outputs hold),
    # and their elements in this rank's chunk and in all (their gradients and optimizer state)
    extension: "_Extension" = field(default_factory=lambda: _Extension())


@dataclass(frozen=True)
class _Extension:
    shard_bytes: int = 0
    unsharded_bytes: int = 0
    shard_numel: int = 0
    numel: int = 0


def _own_bytes(t: torch.Tensor) -> int:
    """What a tensor holds: a subclass's inner tensors (4-bit codes and scales for NF4), recursively."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        return sum(_own_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def _extension_cost(params: Sequence[nn.Parameter], world: int) -> _Extension:
    """Rank 0's chunk of each subclass parameter as fully_shard cuts it (dim 0, the subclass's own
    ``chunk``), and every rank's chunks together."""
    shard_bytes = shard_numel = 0
    for param in params:
        try:
            chunk = torch.chunk(param.detach(), world, dim=0)[0]
            shard_bytes += _own_bytes(chunk)
        except (AssertionError, NotImplementedError, RuntimeError):  # fully_shard refuses it with the reason
            shard_bytes += -(-_own_bytes(param.detach()) // world)
        shard_numel += -(-param.numel() // world)
    return _Extension(shard_bytes, shard_bytes * world, shard_numel, sum(p.numel() for p in params))


def _unit_cost(
    sub: SubmoduleState,
    base: UnitConfig,
    world_size: int,
    fqns: dict[nn.Module, str],
    device: torch.device,
    post_forward_ranks: Optional[int] = None,
) -> _UnitCost:
    config = base.with_overrides(sub.overrides)
    world = world_size if config.sharded else 1
    # as the handle splits them: subclass parameters beside the flat parameter, the rest in it
    flat = [(p, h) for p, h in zip(sub.params, sub.holders) if not is_extension(p)]
    extension = _extension_cost([p for p in sub.params if is_extension(p)], world)
    layout = _build_layout([p for p, _ in flat], [h for _, h in flat], 0, world)
    dtype = sub.params[0].dtype
    plan = _unit_plan(sub.fqn, layout, dtype, config, fqns)
    requires_grad = any(p.requires_grad for p in sub.params)  # one group: all or none
    trainable = 0
    if requires_grad:
        trainable = extension.shard_numel + sum(end - start for start, end in map(layout.shard_range, layout.infos))
    return _UnitCost(
        plan=plan,
        is_root=sub.fqn == "",
        requires_grad=requires_grad,
        trainable_shard_numel=trainable,
        compute_dtype=config.compute_dtype(dtype),
        reduce_dtype=config.reduce_dtype(dtype),
        grad_dtype=config.grad_dtype(dtype),
        needs_unsharded_buffer=config.needs_unsharded_buffer(dtype, device),
        reshard_after_forward=config.reshard_after_forward,
        copied_out=not layout.same_order and (device.type != "cpu" or not layout.direct),
        post_forward_ranks=post_forward_ranks if config.reshards_to_post_forward_group else None,
        extension=extension,
    )


# [Note: computing through a subclass parameter]
# A tensor-subclass parameter is stored in its own bytes (NF4: 4-bit codes and scales), but its
# forward and backward compute in plain tensors: torchao's NF4 linear dequantizes the whole weight,
# through several full-size float32 temporaries (about five, 20 MiB for a 2048 x 512 weight), in
# forward and again in backward, where every activation is still saved. `estimate_memory` measures
# this (``subclass_compute``) on a fake copy of the largest 2-D subclass parameter (`FakeTensorMode`
# fakes a subclass's inner tensors, so nothing is allocated): the peak bytes the ops make
# (`_LiveBytes`) during a linear forward and backward of one row through it. A subclass the fake mode
# or a linear cannot take, and other shapes, add nothing. It is counted at the backward moment.
def _subclass_compute_bytes(params: Sequence[nn.Parameter]) -> int:
    """The ``subclass_compute`` term: see [Note: computing through a subclass parameter]."""
    matrices = [p for p in params if is_extension(p) and p.dim() == 2]
    if not matrices:
        return 0
    largest = max(matrices, key=lambda p: p.numel())
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    live = _LiveBytes(())
    try:
        weight = fake_mode.from_tensor(largest.detach())
        with fake_mode:
            row = torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device, requires_grad=True)
        with fake_mode, live, torch.enable_grad():
            torch.nn.functional.linear(row, weight).sum().backward()
    except Exception:  # a subclass without fake tensors or a linear: nothing measured
        return 0
    return live.peak


# [Note: the memory model]
# Bytes are per rank, for rank 0: each parameter is padded with rows at the end of its last chunks, so
# rank 0's chunks are whole rows of every parameter and its optimizer state is the largest.
# Terms, with P/S a unit's padded/shard numel, b its parameter dtype size, c its compute dtype size
# (MixedPrecision.param_dtype, else b) and r its reduce dtype size (reduce_dtype, else c):
# - sharded_params: sum of S*b. NO_SHARD (or world size 1) keeps the whole unit, S = P = numel. A
#   tensor-subclass parameter with its own all-gather stays out of the flat parameter ([Note: extension
#   parameters]): counted in its own bytes (rank 0's chunk of its inner tensors), its all-gather's
#   outputs in unsharded_params with its unit, its gradient (plain) like the flat parameter's.
# - sharded_grads: sum of S*b over units with a trainable parameter (the reduced gradient is cast
#   back to the parameter dtype and kept in the flat parameter's .grad; S*r with
#   keep_low_precision_grads).
# - optimizer_state: factor * (trainable elements in the shard) * b; factor 2 for adam/adamw
#   (exp_avg, exp_avg_sq, same dtype as the parameter), 1 for sgd-momentum, 0 for sgd. Scalar
#   step counters are ignored.
# - unsharded_params: P*c for every unit whose handle keeps an unsharded buffer (sharded, or
#   NO_SHARD with a different compute dtype) and that is unsharded at the peak in backward:
#   the root unit (never resharded after forward), every non-root SHARD_GRAD_OP/NO_SHARD unit
#   (unsharded from its forward to its backward), and the largest FULL_SHARD units that can be
#   unsharded at once: two with BACKWARD_PRE prefetch (the current unit and the prefetched one) or
#   forward prefetch, else one (`ShardConfig.units_in_flight`; the limiter allows that many), plus
#   the largest unit whose all-gather lands in a second buffer before its copy-out (every unit of
#   several parameters on CUDA, the small ones on gloo: [Note: moving chunks]): the next unit's
#   gather is issued before the current one's wait. Which
#   units keep a buffer and stay unsharded, and every dtype, are `UnitConfig`'s rules, the ones the
#   runtime follows (see [Note: one place for each rule] in `_config`).
# - unsharded_grads: one unit's padded gradient buffer, P*c, plus its P*r reduce-dtype copy when r
#   differs from c; the largest such unit. This assumes a unit's reduction input is freed before
#   the next unit's backward allocates its buffer; a runtime that holds every reduction until the
#   end of backward has all units' buffers live at once (their sum, not the largest). Where autograd's
#   gradients are sent as they are (gloo) or concatenated into the rank-major input (a unit of
#   several parameters elsewhere) there is no flat buffer: autograd's per-parameter gradients reach
#   this size only at the end of the unit's backward, while the previous unit's are still being
#   sent; the two roughly cancel.
# - activations: see [Note: measuring activations]; only with a batch_example.
# - output_and_loss: the forward's output, the loss and the loss's backward down to the output's
#   gradient, at their peak ([Note: measuring the loss]); only with a batch_example. Without loss_fn,
#   the output's gradient alone.
# - optimizer_step: the optimizer step's temporaries, factor * (trainable elements in the shard) * b:
#   1 for adam/adamw, whose foreach step (torch's default on GPUs) takes sqrt(exp_avg_sq) of every
#   parameter at once into new tensors; 0 for sgd and sgd-momentum (in place). A per-parameter loop
#   holds two temporaries of one parameter, fused none: for those the term is an upper bound.
# - post_forward_shards: only with reshard_after_forward=<int> (k ranks): P/k*c for every non-root unit
#   it applies to (`UnitConfig.reshards_to_post_forward_group`), the slice of the unsharded flat
#   parameter each keeps from its post-forward to its backward's all-gather ([Note: resharding to a
#   smaller group]). They pile up through forward, as the activations do, and are all alive where
#   backward starts. The root unit's is left out: its backward comes first, so at the peak it is
#   unsharded again (counted in unsharded_params) and its slice gone. The one or two units in flight
#   at that moment have consumed theirs too; counting them keeps the term an upper bound.
# peak_bytes (`MemoryEstimate.moments`): the step peaks at one of four moments. The runtime drops a
# unit's sharded gradient as soon as the user clears its `.grad` (`zero_grad()`, set_to_none by
# default), so until backward returns them there are none. With params = sharded_params +
# optimizer_state and saved = activations + post_forward_shards:
# - loss: the loss's backward, before any unit's: params + the units kept unsharded after their forward
#   (`unsharded_at_backward_start`: the root, SHARD_GRAD_OP units, cast NO_SHARD units; a root that
#   reshards to its post-forward group holds its 1/k slice) + saved + output_and_loss. No unit's
#   gradient buffer exists yet and no FULL_SHARD unit is gathered: the root's pre-backward hook, which
#   prefetches, fires when the output's gradient arrives. Where the vocabulary is large against the
#   width, this is the peak (the benchmark's 10M model).
# - backward: units in flight, every activation still saved: params + unsharded_params +
#   unsharded_grads + saved (an upper bound: the activations shrink as backward goes), + subclass_compute
#   ([Note: computing through a subclass parameter]).
# - backward_end: activations and post-forward slices freed, every sharded gradient back: params +
#   unsharded_params + unsharded_grads + sharded_grads.
# - optimizer_step: params + sharded_grads + optimizer_step (no unsharded buffer is left). NO_SHARD,
#   whose gradients are the whole model's, peaks here, and so does a large sharded model in bf16.
# Measured against the benchmark model at 10M-97M parameters, every strategy, bf16 and
# reshard_after_forward=2, the largest is within a few percent of the measured step peak
# (benchmarks/README.md), and on small models within 10% (tests/test_memory_estimate_peak.py,
# tests/test_memory_estimate_step_loss.py). upper_bound_bytes is the plain sum. Neither counts
# fragmentation, communication buffers or CPU-offload accounting.
def _memory_terms(units: Sequence[_UnitCost], optimizer: str, in_flight: int) -> tuple[dict[str, int], dict[str, str]]:
    factor, step_factor = OPTIMIZER_STATE_FACTORS[optimizer], OPTIMIZER_STEP_FACTORS[optimizer]
    any_extension, subclasses = any(u.extension.numel for u in units), " and of each subclass one, in its own bytes"
    trainable_bytes = sum(u.trainable_shard_numel * _itemsize(u.plan.dtype) for u in units)
    breakdown = {
        "sharded_params": sum(u.plan.shard_bytes + u.extension.shard_bytes for u in units),
        "sharded_grads": sum(
            (u.plan.shard_numel + u.extension.shard_numel) * _itemsize(u.grad_dtype) for u in units if u.requires_grad
        ),
        "optimizer_state": factor * trainable_bytes,
        "optimizer_step": step_factor * trainable_bytes,
        "unsharded_params": _unsharded_param_bytes(units, in_flight),
        "unsharded_grads": max((_grad_buffer_bytes(u) for u in units if u.requires_grad), default=0),
    }
    explanations = {
        "sharded_params": "this rank's shard of every flat parameter" + (subclasses if any_extension else ""),
        "sharded_grads": "sharded gradient of every unit with a trainable parameter",
        "optimizer_state": f"{optimizer}: {factor} x the trainable sharded parameters",
        "optimizer_step": f"{optimizer} step's foreach temporaries: {step_factor} x the trainable sharded parameters",
        "unsharded_params": _unsharded_param_explanation(units, in_flight),
        "unsharded_grads": "largest unit's unsharded gradient buffer (compute + reduce dtype)",
    }
    k = next((u.post_forward_ranks for u in units if u.post_forward_ranks is not None), None)
    if k is not None:  # reshard_after_forward=<int>: one k per call
        breakdown["post_forward_shards"] = sum(_post_forward_bytes(u) for u in units if not u.is_root)
        explanations["post_forward_shards"] = f"1/{k} of every non-root FULL_SHARD unit, kept from forward to backward"
    return breakdown, explanations


def _post_forward_bytes(unit: _UnitCost) -> int:
    """The slice a unit keeps from its post-forward to its backward: 1/k of its unsharded flat parameter."""
    if unit.post_forward_ranks is None:
        return 0
    return unit.plan.padded_numel // unit.post_forward_ranks * _itemsize(unit.compute_dtype)


def _unsharded_at_backward_start(units: Sequence[_UnitCost]) -> int:
    """The part of unsharded_params alive where backward starts (the loss's backward, before any unit's):
    the units kept unsharded after their forward (the root, SHARD_GRAD_OP and cast NO_SHARD units), a
    root that reshards to its post-forward group holding only its 1/k slice."""
    kept, _ = _in_flight_units(units, 0)
    return sum(_post_forward_bytes(u) if u.post_forward_ranks is not None else _unsharded_bytes(u) for u in kept)


def _flat_unsharded_bytes(unit: _UnitCost) -> int:
    """The unit's unsharded flat parameter (none when its compute uses the shard itself)."""
    return unit.plan.padded_numel * _itemsize(unit.compute_dtype) if unit.needs_unsharded_buffer else 0


def _unsharded_bytes(unit: _UnitCost) -> int:
    return _flat_unsharded_bytes(unit) + unit.extension.unsharded_bytes


def _in_flight_units(units: Sequence[_UnitCost], in_flight: int) -> tuple[list[_UnitCost], list[_UnitCost]]:
    """(units unsharded through the whole step, the largest FULL_SHARD units unsharded at once)."""
    with_buffer = [u for u in units if u.needs_unsharded_buffer or u.extension.unsharded_bytes]
    kept = [u for u in with_buffer if u.is_root or not u.reshard_after_forward]
    transient = [u for u in with_buffer if not u.is_root and u.reshard_after_forward]
    return kept, sorted(transient, key=_unsharded_bytes, reverse=True)[:in_flight]


def _unsharded_param_bytes(units: Sequence[_UnitCost], in_flight: int) -> int:
    kept, transient = _in_flight_units(units, in_flight)
    return sum(_unsharded_bytes(u) for u in (*kept, *transient)) + _copy_out_bytes(units)


def _copy_out_bytes(units: Sequence[_UnitCost]) -> int:
    """The largest buffer an all-gather lands in before its copy-out (one at a time): a unit's flat
    parameter, or its subclass parameters' bytes, copied out into one output per inner tensor."""
    flat = [_flat_unsharded_bytes(u) for u in units if u.copied_out]
    return max(flat + [u.extension.unsharded_bytes for u in units], default=0)


def _unsharded_param_explanation(units: Sequence[_UnitCost], in_flight: int) -> str:
    kept, transient = _in_flight_units(units, in_flight)
    parts = ["root unit"] if any(u.is_root for u in kept) else []
    if len(kept) > len(parts):
        parts.append(f"{len(kept) - len(parts)} SHARD_GRAD_OP/NO_SHARD unit(s) kept unsharded")
    if transient:
        parts.append(f"{len(transient)} largest FULL_SHARD unit(s) in flight")
    if _copy_out_bytes(units):
        parts.append("1 gathered before its copy-out")
    return " + ".join(parts) or "none: full-precision NO_SHARD computes on the shard itself"


def _grad_buffer_bytes(unit: _UnitCost) -> int:
    padded = unit.plan.padded_numel + unit.extension.numel  # a subclass parameter's gradient is plain
    copy_bytes = padded * _itemsize(unit.reduce_dtype) if unit.reduce_dtype != unit.compute_dtype else 0
    return padded * _itemsize(unit.compute_dtype) + copy_bytes


# ---------------------------------------------------------------------------- activations
# [Note: measuring activations]
# We copy the module with fake tensors (`FakeTensorMode`: every parameter and buffer replaced by a
# tensor of the same shape that records device and dtype but owns no memory; in the compute dtype
# under mixed precision), fake the batch too, and run one forward with grad enabled inside
# `torch.autograd.graph.saved_tensors_hooks`. The pack hook sees every tensor autograd saves for
# backward; we add up the bytes of each distinct storage once (views share a storage) and skip the
# parameters' and buffers' storages (parameters are counted as unsharded_params). This is what the
# forward keeps alive until backward; temporaries freed during forward and the loss are not counted.
# The fake tensors claim the device the parameters are on (CPU for a meta-device module), so each op
# picks the kernel it would pick there: on the meta device scaled_dot_product_attention takes its
# math path and saves the attention matrix, which the CPU and CUDA kernels do not (24% too much on
# the benchmark model). A forward that reads tensor values (`.item()`, data-dependent shapes) cannot
# run on fake tensors: we raise and say so. The copy is a `copy.deepcopy` whose memo maps each
# parameter and buffer to its fake replacement, so only plain (unregistered) tensor attributes are
# copied as they are.
def _forward_bytes(
    module: nn.Module, batch_example: Any, config: UnitConfig, loss_fn: Optional[LossFn] = None
) -> tuple[int, int]:
    """(activations, output_and_loss): what forward saves for backward, and the output and the loss
    ([Note: measuring the loss])."""
    mp = config.mixed_precision
    param_dtype = mp.param_dtype if mp is not None else None
    buffer_dtype = mp.buffer_dtype if mp is not None else None
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)  # plain tensor attributes become fake on use
    device = _forward_device(module)
    fake_module = _fake_copy(module, fake_mode, device, param_dtype, buffer_dtype)
    input_dtype = config.input_dtype(is_root=True)
    args, kwargs = _call_args(batch_example)
    with fake_mode:
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: _fake_like(t, device, input_dtype), (args, kwargs))
    model_storages = {_storage_key(t) for t in [*fake_module.parameters(), *fake_module.buffers()]}
    counted: set[int] = set()
    kept: list[torch.Tensor] = []  # keep saved storages alive so no storage address is reused
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        key = _storage_key(t)
        if key not in model_storages and key not in counted:
            counted.add(key)
            total += t.untyped_storage().nbytes()
        kept.append(t)
        return t

    try:
        with fake_mode, torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            holder = [fake_module(*args, **kwargs)]
    except Exception as e:
        raise RuntimeError(
            f"estimate_memory could not run {type(module).__name__}.forward(batch_example) on fake tensors "
            f"({type(e).__name__}: {e}); make the forward value-independent (no .item(), no data-dependent "
            "shapes), or leave batch_example=None and add activations yourself"
        ) from e
    # `kept` holds the saved storages until the loss is measured, so no storage address is reused
    return total, _loss_bytes(holder, loss_fn, fake_mode, model_storages | counted)


def _forward_device(module: nn.Module) -> torch.device:
    """Where the forward's kernels are chosen for: the parameters' device, CPU for a meta module."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    return torch.device("cpu") if device.type == "meta" else device


def _call_args(batch_example: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(batch_example, torch.Tensor):
        return (batch_example,), {}
    if isinstance(batch_example, (tuple, list)):
        return tuple(batch_example), {}
    if isinstance(batch_example, dict):
        return (), dict(batch_example)
    raise TypeError(
        "estimate_memory argument 'batch_example' must be a tensor, a tuple of positional arguments or a dict "
        f"of keyword arguments for module.forward, got {type(batch_example).__name__}"
    )


def _fake_like(t: torch.Tensor, device: torch.device, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """A fake tensor shaped like ``t`` on ``device``; call inside the fake mode."""
    cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return torch.empty(t.shape, device=device, dtype=cast).requires_grad_(t.requires_grad and cast.is_floating_point)


def _fake_copy(
    module: nn.Module,
    fake_mode: FakeTensorMode,
    device: torch.device,
    param_dtype: Optional[torch.dtype],
    buffer_dtype: Optional[torch.dtype],
) -> nn.Module:
    """A deep copy whose parameters and buffers are fake tensors on ``device``; tied parameters stay tied."""
    memo: dict[int, Any] = {}
    with fake_mode:
        for p in module.parameters():
            dtype = param_dtype if param_dtype is not None and p.is_floating_point() else p.dtype
            memo[id(p)] = nn.Parameter(_fake_like(p, device, dtype), requires_grad=p.requires_grad)
        for b in module.buffers():
            dtype = buffer_dtype if buffer_dtype is not None and b.is_floating_point() else b.dtype
            memo[id(b)] = _fake_like(b, device, dtype)
    return copy.deepcopy(module, memo)


def _storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)
