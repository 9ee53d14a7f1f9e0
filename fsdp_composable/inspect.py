"""`describe` and `estimate_memory`: what `fully_shard` did (or would do) to a module, and what it costs.

[Note: describe only reads]
`describe(module)` walks every state in ``module``'s subtree and reads each handle's `FlatLayout`
and `UnitConfig`. Layouts are fixed at construction and never change in a step, so the plan is the
same before and after the first forward, in any training state, and on every rank except for the
``rank`` field. It issues no collective, so it may be called on a single rank (e.g. only for logging
on rank 0). Unit and parameter FQNs are relative to the module described, not to the module each
`fully_shard` call was applied to (manual nesting makes one state per call, and each handle's
``unit_fqn`` is relative to its own state's module); the wrapper class's inner-module attribute is
dropped from FQNs, as its state dict does.

[Note: estimate_memory predicts the plan]
`estimate_memory` runs the same unit selection as `fully_shard` (`_get_submodule_to_states`, which
needs no process group and reads only parameter shapes and dtypes, so a meta-device model works)
and builds each unit's layout with the same function the handle uses, for rank 0. Its ``.plan`` is
therefore what `describe` returns on rank 0 after sharding, and every byte count follows from it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from fsdp_composable._common_utils import _get_fsdp_state, _get_fsdp_states
from fsdp_composable._config import ShardConfig, UnitConfig
from fsdp_composable._flat_param import FlatLayout, _build_layout
from fsdp_composable._state_dict_utils import _clean_module_fqns
from fsdp_composable._wrap_utils import SubmoduleState, _as_policy, _flat_groups, _get_submodule_to_states
from fsdp_composable.api import BackwardPrefetch, MixedPrecision, ShardingStrategy

__all__ = ["MemoryEstimate", "ShardingPlan", "UnitPlan", "describe", "estimate_memory"]

ROOT_NAME = "<root>"

# optimizer name -> how many tensors of a parameter's shape and dtype it keeps per trainable parameter
OPTIMIZER_STATE_FACTORS: dict[str, int] = {"adam": 2, "adamw": 2, "sgd": 0, "sgd-momentum": 1}

TERMS = ("sharded_params", "sharded_grads", "optimizer_state", "unsharded_params", "unsharded_grads", "activations")


# ---------------------------------------------------------------------------- result types
@dataclass(frozen=True)
class UnitPlan:
    """One unit: which original parameters its flat parameter holds and how it is sharded.

    ``param_fqns`` lists every FQN of every original parameter in flat order, all aliases of a tied
    parameter next to each other; ``tied_param_fqns`` groups those aliases. ``param_dtype`` and
    ``reduce_dtype`` are the unit's `MixedPrecision` settings (``None`` when not set).
    """

    fqn: str
    param_fqns: tuple[str, ...]
    num_params: int
    numel: int
    padded_numel: int
    shard_numel: int
    dtype: torch.dtype
    strategy: ShardingStrategy
    param_dtype: Optional[torch.dtype]
    reduce_dtype: Optional[torch.dtype]
    offload_params: bool
    tied_param_fqns: tuple[tuple[str, ...], ...] = ()
    param_shapes: tuple[tuple[int, ...], ...] = ()  # one per entry of ``param_fqns``
    # tensor parallelism: the size of the parameters' tensor-parallel mesh (1: none). Numels and
    # ``param_shapes`` are then per tensor-parallel rank; ``param_global_shapes`` are the DTensors'
    tensor_parallel_size: int = 1
    param_global_shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def shard_bytes(self) -> int:
        """Bytes of this rank's shard of the flat parameter (padding included)."""
        return self.shard_numel * _itemsize(self.dtype)


@dataclass(frozen=True)
class ShardingPlan:
    """Every unit under a module, in module pre-order, with per-rank totals. ``str()`` is a table, and
    with ``show_params`` (``describe(module, params=True)``) a second one listing every unit's parameters.

    ``world_size`` is the number of ranks a unit is sharded over: under HYBRID_SHARD the shard group's
    size, with ``replicate_world_size`` the replicate group's (``None`` for the other strategies).
    ``rank`` is this rank in that group."""

    units: tuple[UnitPlan, ...]
    world_size: int
    rank: int
    ignored_param_fqns: tuple[str, ...] = ()
    replicate_world_size: Optional[int] = None
    show_params: bool = field(default=False, compare=False)

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def padded_numel(self) -> int:
        return sum(u.padded_numel for u in self.units)

    @property
    def shard_numel(self) -> int:
        return sum(u.shard_numel for u in self.units)

    @property
    def sharded_param_bytes(self) -> int:
        """Bytes of this rank's shards of all flat parameters."""
        return sum(u.shard_bytes for u in self.units)

    @property
    def tensor_parallel_size(self) -> int:
        """The largest tensor-parallel mesh size of any unit (1: no tensor parallelism)."""
        return max((u.tensor_parallel_size for u in self.units), default=1)

    def __str__(self) -> str:
        return _format_plan(self)


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes of one training step, by term (see [Note: the memory model]).

    ``plan`` is the predicted `describe` result on rank 0; ``breakdown`` maps each term in `TERMS`
    to bytes (``activations`` only when a ``batch_example`` was given); ``explanations`` says what
    each term counted. ``str()`` is a breakdown table.
    """

    plan: ShardingPlan
    strategy: ShardingStrategy
    optimizer: str
    breakdown: dict[str, int]
    explanations: dict[str, str]

    @property
    def sharded_param_bytes(self) -> int:
        return self.breakdown["sharded_params"]

    @property
    def peak_bytes(self) -> int:
        """The larger of the two candidate peaks of a step (see [Note: the memory model])."""
        b = self.breakdown
        held = b["sharded_params"] + b["optimizer_state"] + b["unsharded_params"] + b["unsharded_grads"]
        return held + max(b.get("activations", 0), b["sharded_grads"])

    @property
    def upper_bound_bytes(self) -> int:
        """The sum of every term, as if all were live at the same instant."""
        return sum(self.breakdown.values())

    def __str__(self) -> str:
        return _format_estimate(self)


# ---------------------------------------------------------------------------- describe
def describe(module: nn.Module, params: bool = False) -> ShardingPlan:
    """The sharding plan of every `fully_shard` unit under ``module``, read locally (no communication).

    Works before and after the first forward and on any single rank; see [Note: describe only reads].
    With ``params=True``, ``str()`` of the plan adds a table of every unit's parameters (FQN, shape).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"describe() expects an nn.Module, got {type(module).__name__}")
    states = _get_fsdp_states(module)
    if not states:
        raise ValueError(
            f"describe() found no fully_shard state on this {type(module).__name__} or its submodules; "
            "call fully_shard(module, policy=...) (or wrap it in FullyShardedDataParallel) first, or use "
            "estimate_memory() to predict the plan of an unsharded module"
        )
    fqns = _clean_module_fqns(module)
    order = {m: i for i, m in enumerate(fqns)}
    handles = {id(h): h for s in states for h in s.handles if h.module in fqns}
    units = tuple(
        _unit_plan(fqns[h.module], h.layout, h.dtype, h.config, fqns)
        for h in sorted(handles.values(), key=lambda h: order[h.module])
    )
    ignored = {p for s in states for p in s.ignored_params}
    replicate = states[0].replicate_group
    return ShardingPlan(
        units,
        states[0].world_size,
        states[0].rank,
        _param_fqns_of(ignored, fqns),
        replicate_world_size=None if replicate is None else dist.get_world_size(replicate),
        show_params=bool(params),
    )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _unit_plan(
    unit_fqn: str, layout: FlatLayout, dtype: torch.dtype, config: UnitConfig, fqns: dict[nn.Module, str]
) -> UnitPlan:
    """Shared by `describe` (a handle's layout) and `estimate_memory` (a predicted layout)."""
    groups = [tuple(_join(fqns.get(m, unit_fqn), attr) for m, attr, _ in info.holders) for info in layout.infos]
    mp = config.mixed_precision
    return UnitPlan(
        fqn=unit_fqn,
        param_fqns=tuple(name for group in groups for name in group),
        num_params=len(layout.infos),
        numel=layout.unpadded_numel,
        padded_numel=layout.padded_numel,
        shard_numel=layout.shard_numel,
        dtype=dtype,
        strategy=config.strategy,
        param_dtype=mp.param_dtype if mp is not None else None,
        reduce_dtype=mp.reduce_dtype if mp is not None else None,
        offload_params=config.offload_params,
        tied_param_fqns=tuple(group for group in groups if len(group) > 1),
        param_shapes=tuple(tuple(info.shape) for info, group in zip(layout.infos, groups) for _ in group),
        tensor_parallel_size=max((info.tp.mesh.size() for info in layout.infos if info.tp is not None), default=1),
        param_global_shapes=tuple(
            tuple(info.tp.shape if info.tp is not None else info.shape)
            for info, group in zip(layout.infos, groups)
            for _ in group
        ),
    )


def _param_fqns_of(params: set[nn.Parameter], fqns: dict[nn.Module, str]) -> tuple[str, ...]:
    return tuple(
        _join(prefix, name)
        for m, prefix in fqns.items()
        for name, p in m._parameters.items()
        if p is not None and p in params
    )


# ---------------------------------------------------------------------------- estimate_memory
def estimate_memory(
    module: nn.Module,
    *,
    policy: Any,
    world_size: int,
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
    mixed_precision: Optional[MixedPrecision] = None,
    optimizer: str = "adam",
    batch_example: Any = None,
    backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE,
    forward_prefetch: bool = False,
) -> MemoryEstimate:
    """Predict per-rank bytes of training ``module`` under ``fully_shard(module, policy, ...)``.

    ``module`` is unsharded and may live on the meta device; nothing is allocated and no process
    group is needed. ``optimizer`` is one of ``adam``, ``adamw``, ``sgd``, ``sgd-momentum``.
    ``batch_example`` (a tensor, a tuple of positional arguments, or a dict of keyword arguments
    for ``module.forward``, one rank's batch) adds the activations its forward saves for backward,
    measured with fake tensors (see [Note: measuring activations]). ``world_size`` is the number of
    ranks each unit is sharded over: for HYBRID_SHARD, the shard group's size. The remaining
    arguments mean what they mean to `fully_shard`. See [Note: the memory model] for what each term
    counts.
    """
    _check_estimate_args(
        module,
        policy,
        world_size,
        strategy,
        mixed_precision,
        optimizer,
        backward_prefetch,
        forward_prefetch,
        batch_example,
    )
    args = ShardConfig(
        policy=policy,
        strategy=strategy,
        mixed_precision=mixed_precision,
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
        api="estimate_memory",
    )
    base = args.unit_config(world_size)  # the rules fully_shard applies (world size 1 is NO_SHARD)
    strategy = base.strategy
    fqns = _clean_module_fqns(module)
    device = _forward_device(module)
    units: list[_UnitCost] = []
    batchnorm_units = _batchnorm_gets_own_unit(module, base)
    subs = _get_submodule_to_states(module, policy, set(), set(), batchnorm_full_precision=batchnorm_units)
    for sub in subs.values():
        for params, holders in _flat_groups(sub):  # one handle per dtype/requires_grad group
            group = SubmoduleState(sub.fqn, params, holders, sub.overrides)
            units.append(_unit_cost(group, base, world_size, fqns, device))
    plan = ShardingPlan(tuple(u.plan for u in units), world_size, 0)
    in_flight = args.units_in_flight
    breakdown, explanations = _memory_terms(units, OPTIMIZER_STATE_FACTORS[optimizer], optimizer, in_flight)
    if batch_example is not None:
        breakdown["activations"] = _activation_bytes(module, batch_example, base)
        explanations["activations"] = "saved for backward by forward(batch_example), once per storage"
    return MemoryEstimate(plan, strategy, optimizer, breakdown, explanations)


def _batchnorm_gets_own_unit(module: nn.Module, config: UnitConfig) -> bool:
    """Under low-precision compute fully_shard makes each BatchNorm a full-precision unit."""
    return config.low_precision_compute and any(
        isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()
    )


def _check_estimate_args(
    module: Any,
    policy: Any,
    world_size: Any,
    strategy: Any,
    mixed_precision: Any,
    optimizer: Any,
    backward_prefetch: Any,
    forward_prefetch: Any,
    batch_example: Any,
) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"estimate_memory argument 'module' must be an nn.Module, got {type(module).__name__}")
    sharded = [name for name, m in module.named_modules() if _get_fsdp_state(m) is not None]
    if sharded:
        raise ValueError(
            f"estimate_memory argument 'module' ({type(module).__name__}) is already sharded by fully_shard "
            f"(at '{sharded[0] or ROOT_NAME}'); pass the unsharded model (a meta-device copy is fine), or call "
            "describe() on the sharded one"
        )
    try:
        _as_policy(policy)
    except TypeError as e:
        raise TypeError(f"estimate_memory argument 'policy': {e}") from None
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"estimate_memory argument 'world_size' must be an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"estimate_memory argument 'world_size' must be at least 1, got {world_size}")
    if not isinstance(strategy, ShardingStrategy):
        raise TypeError(f"estimate_memory argument 'strategy' must be a ShardingStrategy, got {strategy!r}")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            f"estimate_memory argument 'mixed_precision' must be a MixedPrecision or None, got {mixed_precision!r}"
        )
    if not isinstance(optimizer, str) or optimizer not in OPTIMIZER_STATE_FACTORS:
        raise ValueError(
            f"estimate_memory argument 'optimizer' must be one of {sorted(OPTIMIZER_STATE_FACTORS)}, got {optimizer!r}"
        )
    if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
        raise TypeError(
            "estimate_memory argument 'backward_prefetch' must be a BackwardPrefetch or None, "
            f"got {backward_prefetch!r}"
        )
    if not isinstance(forward_prefetch, bool):
        raise TypeError(f"estimate_memory argument 'forward_prefetch' must be True or False, got {forward_prefetch!r}")
    if batch_example is not None:
        _call_args(batch_example)


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


def _unit_cost(
    sub: SubmoduleState, base: UnitConfig, world_size: int, fqns: dict[nn.Module, str], device: torch.device
) -> _UnitCost:
    config = base.with_overrides(sub.overrides)
    layout = _build_layout(sub.params, sub.holders, 0, world_size if config.sharded else 1)
    dtype = sub.params[0].dtype
    plan = _unit_plan(sub.fqn, layout, dtype, config, fqns)
    trainable = 0
    for param, info in zip(sub.params, layout.infos):
        if param.requires_grad:
            start, end = layout.shard_range(info)
            trainable += end - start
    return _UnitCost(
        plan=plan,
        is_root=sub.fqn == "",
        requires_grad=any(p.requires_grad for p in sub.params),
        trainable_shard_numel=trainable,
        compute_dtype=config.compute_dtype(dtype),
        reduce_dtype=config.reduce_dtype(dtype),
        grad_dtype=config.grad_dtype(dtype),
        needs_unsharded_buffer=config.needs_unsharded_buffer(dtype, device),
        reshard_after_forward=config.reshard_after_forward,
    )


# [Note: the memory model]
# Bytes are per rank, for rank 0: padding sits at the end of each flat parameter, so rank 0 holds
# no padding in any unit with at least world_size elements and its optimizer state is the largest.
# Terms, with P/S a unit's padded/shard numel, b its parameter dtype size, c its compute dtype size
# (MixedPrecision.param_dtype, else b) and r its reduce dtype size (reduce_dtype, else c):
# - sharded_params: sum of S*b. NO_SHARD (or world size 1) keeps the whole unit, S = P = numel.
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
#   forward prefetch, else one. The all-gather limiter is assumed to allow that many.
# - unsharded_grads: one unit's padded gradient buffer, P*c, plus its P*r reduce-dtype copy when r
#   differs from c; the largest such unit. This assumes a unit's reduction input is freed before
#   the next unit's backward allocates its buffer; a runtime that holds every reduction until the
#   end of backward has all units' buffers live at once (their sum, not the largest). On gloo there
#   is no flat buffer: autograd's per-parameter gradients reach this size only at the end of the
#   unit's backward, while the previous unit's are still being sent; the two roughly cancel.
# - activations: see [Note: measuring activations]; only with a batch_example.
# peak_bytes: the step peaks either where backward starts (activations all saved) or where it ends
# (every sharded gradient back). The runtime drops a unit's sharded gradient as soon as the user
# clears its `.grad` (`zero_grad()`, set_to_none by default), so at the start of backward there are
# none, and by its end the activations are freed: peak = sharded_params + optimizer_state +
# unsharded_params + unsharded_grads + max(activations, sharded_grads). Measured against the
# benchmark model this is within a few percent (benchmarks/README.md). upper_bound_bytes is the
# plain sum. Neither counts fragmentation, communication buffers or CPU-offload accounting.
def _memory_terms(
    units: Sequence[_UnitCost], factor: int, optimizer: str, in_flight: int
) -> tuple[dict[str, int], dict[str, str]]:
    breakdown = {
        "sharded_params": sum(u.plan.shard_bytes for u in units),
        "sharded_grads": sum(u.plan.shard_numel * _itemsize(u.grad_dtype) for u in units if u.requires_grad),
        "optimizer_state": factor * sum(u.trainable_shard_numel * _itemsize(u.plan.dtype) for u in units),
        "unsharded_params": _unsharded_param_bytes(units, in_flight),
        "unsharded_grads": max((_grad_buffer_bytes(u) for u in units if u.requires_grad), default=0),
    }
    explanations = {
        "sharded_params": "this rank's shard of every flat parameter",
        "sharded_grads": "sharded gradient of every unit with a trainable parameter",
        "optimizer_state": f"{optimizer}: {factor} x the trainable sharded parameters",
        "unsharded_params": _unsharded_param_explanation(units, in_flight),
        "unsharded_grads": "largest unit's unsharded gradient buffer (compute + reduce dtype)",
    }
    return breakdown, explanations


def _unsharded_bytes(unit: _UnitCost) -> int:
    return unit.plan.padded_numel * _itemsize(unit.compute_dtype) if unit.needs_unsharded_buffer else 0


def _in_flight_units(units: Sequence[_UnitCost], in_flight: int) -> tuple[list[_UnitCost], list[_UnitCost]]:
    """(units unsharded through the whole step, the largest FULL_SHARD units unsharded at once)."""
    with_buffer = [u for u in units if u.needs_unsharded_buffer]
    kept = [u for u in with_buffer if u.is_root or not u.reshard_after_forward]
    transient = [u for u in with_buffer if not u.is_root and u.reshard_after_forward]
    return kept, sorted(transient, key=_unsharded_bytes, reverse=True)[:in_flight]


def _unsharded_param_bytes(units: Sequence[_UnitCost], in_flight: int) -> int:
    kept, transient = _in_flight_units(units, in_flight)
    return sum(_unsharded_bytes(u) for u in (*kept, *transient))


def _unsharded_param_explanation(units: Sequence[_UnitCost], in_flight: int) -> str:
    kept, transient = _in_flight_units(units, in_flight)
    parts = ["root unit"] if any(u.is_root for u in kept) else []
    if len(kept) > len(parts):
        parts.append(f"{len(kept) - len(parts)} SHARD_GRAD_OP/NO_SHARD unit(s) kept unsharded")
    if transient:
        parts.append(f"{len(transient)} largest FULL_SHARD unit(s) in flight")
    return " + ".join(parts) or "none: full-precision NO_SHARD computes on the shard itself"


def _grad_buffer_bytes(unit: _UnitCost) -> int:
    padded = unit.plan.padded_numel
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
def _activation_bytes(module: nn.Module, batch_example: Any, config: UnitConfig) -> int:
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
            fake_module(*args, **kwargs)
    except Exception as e:
        raise RuntimeError(
            f"estimate_memory could not run {type(module).__name__}.forward(batch_example) on fake tensors "
            f"({type(e).__name__}: {e}); make the forward value-independent (no .item(), no data-dependent "
            "shapes), or leave batch_example=None and add activations yourself"
        ) from e
    return total


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


# ---------------------------------------------------------------------------- formatting
def _itemsize(dtype: torch.dtype) -> int:
    return int(dtype.itemsize)


def _human_bytes(n: int) -> str:
    """Binary units with two decimals (``1.50 KiB``); plain bytes below 1 KiB."""
    if n < 1024:
        return f"{n} B"
    exponent = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024**exponent:.2f} {('KiB', 'MiB', 'GiB', 'TiB')[exponent - 1]}"


def _dtype_name(dtype: Optional[torch.dtype]) -> str:
    return "-" if dtype is None else str(dtype).removeprefix("torch.")


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], footer: Sequence[str], right: set[int]) -> list[str]:
    """Columns aligned (numbers right, text left), a rule under the header and above the footer."""
    widths = [max(len(r[i]) for r in (headers, *rows, footer)) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    rule = "  ".join("-" * w for w in widths)
    return [line(headers).rstrip(), rule, *(line(r).rstrip() for r in rows), rule, line(footer).rstrip()]


def _format_plan(plan: ShardingPlan) -> str:
    headers = (
        "unit",
        "params",
        "numel",
        "padded",
        "shard",
        "dtype",
        "strategy",
        "param_dtype",
        "reduce_dtype",
        "offload",
        "shard bytes",
    )
    rows = [
        (
            u.fqn or ROOT_NAME,
            str(u.num_params),
            f"{u.numel:,}",
            f"{u.padded_numel:,}",
            f"{u.shard_numel:,}",
            _dtype_name(u.dtype),
            u.strategy.name,
            _dtype_name(u.param_dtype),
            _dtype_name(u.reduce_dtype),
            "yes" if u.offload_params else "no",
            _human_bytes(u.shard_bytes),
        )
        for u in plan.units
    ]
    footer = (
        "total",
        str(sum(u.num_params for u in plan.units)),
        f"{plan.numel:,}",
        f"{plan.padded_numel:,}",
        f"{plan.shard_numel:,}",
        *([""] * 5),
        _human_bytes(plan.sharded_param_bytes),
    )
    units = f"{len(plan.units)} unit{'s' if len(plan.units) != 1 else ''}"
    if plan.replicate_world_size is None:
        ranks = f"world size {plan.world_size}"
    else:
        ranks = f"HYBRID_SHARD: shard group size {plan.world_size}, replicate group size {plan.replicate_world_size}"
    if plan.tensor_parallel_size > 1:
        ranks += f", tensor parallel size {plan.tensor_parallel_size} (numels are per tensor-parallel rank)"
    lines = [f"ShardingPlan: {units}, {ranks}, rank {plan.rank}"]
    lines += _table(headers, rows, footer, right={1, 2, 3, 4, 10})
    for u in plan.units:
        for group in u.tied_param_fqns:
            lines.append(f"tied (one copy, in unit {u.fqn or ROOT_NAME}): {' = '.join(group)}")
    if plan.ignored_param_fqns:
        lines.append(f"ignored (not sharded, not counted): {', '.join(plan.ignored_param_fqns)}")
    if plan.show_params:
        lines += ["", *_format_params(plan)]
    return "\n".join(lines)


def _format_params(plan: ShardingPlan) -> list[str]:
    """One row per original parameter FQN, in flat order; a tied alias points at the first FQN."""
    rows = []
    for u in plan.units:
        first_of = {name: group[0] for group in u.tied_param_fqns for name in group[1:]}
        global_shapes = u.param_global_shapes or u.param_shapes
        for name, shape, whole in zip(u.param_fqns, u.param_shapes, global_shapes):
            numel = f"= {first_of[name]}" if name in first_of else f"{math.prod(shape):,}"
            shown = str(tuple(shape)) if tuple(whole) == tuple(shape) else f"{tuple(shape)} of {tuple(whole)}"
            rows.append((u.fqn or ROOT_NAME, name, shown, numel))
    distinct = sum(u.num_params for u in plan.units)
    footer = ("total", f"{distinct} parameters", "", f"{plan.numel:,}")
    return _table(("unit", "parameter", "shape", "numel"), rows, footer, right={3})


def _format_estimate(est: MemoryEstimate) -> str:
    rows = []
    for term in TERMS:
        if term in est.breakdown:
            n = est.breakdown[term]
            rows.append((term, f"{n:,}", _human_bytes(n), est.explanations.get(term, "")))
        else:
            rows.append((term, "-", "-", "not estimated: pass batch_example="))
    footer = (
        "peak",
        f"{est.peak_bytes:,}",
        _human_bytes(est.peak_bytes),
        "params + optimizer + unsharded + max(activations, sharded grads)",
    )
    plan = est.plan
    header = (
        f"MemoryEstimate per rank: world size {plan.world_size}, {len(plan.units)} units, "
        f"{est.strategy.name}, optimizer {est.optimizer}"
    )
    return "\n".join([header, *_table(("term", "bytes", "size", "what"), rows, footer, right={1, 2})])
