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

from typing import Any, Callable, Optional, Union

import torch.distributed as dist
from torch import nn

from fsdp_composable._common_utils import _get_fsdp_state, _get_fsdp_states
from fsdp_composable._config import ShardConfig, UnitConfig
from fsdp_composable._init._memory_model import (
    OPTIMIZER_STATE_FACTORS,
    _call_args,
    _forward_bytes,
    _forward_device,
    _memory_terms,
    _subclass_compute_bytes,
    _unit_cost,
    _UnitCost,
    _unsharded_at_backward_start,
)
from fsdp_composable._init._post_forward_group import resolve_post_forward_ranks
from fsdp_composable._init._sharding_plan import ROOT_NAME, MemoryEstimate, ShardingPlan, UnitPlan, _join, _unit_plan
from fsdp_composable._init._wrap_utils import SubmoduleState, _as_policy, _flat_groups, _get_submodule_to_states
from fsdp_composable._names._fsdp2_names import implied_strategy, post_forward_ranks
from fsdp_composable._state._state_dict_utils import _clean_module_fqns
from fsdp_composable.api import BackwardPrefetch, MixedPrecision, ShardingStrategy

__all__ = ["MemoryEstimate", "ShardingPlan", "UnitPlan", "describe", "estimate_memory"]


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
    forward_prefetch: Optional[bool] = None,
    reshard_after_forward: Union[bool, int, None] = None,
    loss_fn: Optional[Callable[[Any], Any]] = None,
) -> MemoryEstimate:
    """Predict per-rank bytes of training ``module`` under ``fully_shard(module, policy, ...)``.

    ``module`` is unsharded and may live on the meta device; nothing is allocated and no process
    group is needed. ``optimizer`` is one of ``adam``, ``adamw``, ``sgd``, ``sgd-momentum``.
    ``batch_example`` (a tensor, a tuple of positional arguments, or a dict of keyword arguments
    for ``module.forward``, one rank's batch) adds the activations its forward saves for backward,
    measured with fake tensors (see [Note: measuring activations]). ``world_size`` is the number of
    ranks each unit is sharded over: for HYBRID_SHARD, the shard group's size. The remaining
    arguments mean what they mean to `fully_shard` (``reshard_after_forward``: FSDP2's name, True,
    False or an int k that divides ``world_size``; an int adds the ``post_forward_shards`` term).
    ``loss_fn`` (with ``batch_example``): called on the forward's output, returns the loss (a closure
    over the targets, e.g. ``lambda logits: F.cross_entropy(logits.flatten(0, 1), targets.flatten())``);
    the ``output_and_loss`` term then measures the loss's tensors and its backward down to the output's
    gradient (see [Note: measuring the loss]); without it, that term is the output's gradient alone.
    See [Note: the memory model] for what each term counts.
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
        reshard_after_forward,
        loss_fn,
    )
    args = ShardConfig(
        policy=policy,
        strategy=implied_strategy(strategy, None, reshard_after_forward, api="estimate_memory"),
        mixed_precision=mixed_precision,
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
        api="estimate_memory",
        reshard_after_forward_ranks=post_forward_ranks(reshard_after_forward),
    )
    args = resolve_post_forward_ranks(module, args, world_size)  # k: 1 is SHARD_GRAD_OP, world_size FULL_SHARD
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
            units.append(_unit_cost(group, base, world_size, fqns, device, args.reshard_after_forward_ranks))
    plan = ShardingPlan(tuple(u.plan for u in units), world_size, 0)
    in_flight = args.units_in_flight
    breakdown, explanations = _memory_terms(units, optimizer, in_flight)
    if batch_example is not None:
        breakdown["activations"], breakdown["output_and_loss"] = _forward_bytes(module, batch_example, base, loss_fn)
        explanations["activations"] = "saved for backward by forward(batch_example), once per storage"
        explanations["output_and_loss"] = (
            "loss_fn(output) and its backward down to the output's gradient, at their peak"
            if loss_fn is not None
            else "the output's gradient (pass loss_fn= to measure the loss's tensors too)"
        )
    extension_compute = _subclass_compute_bytes([p for sub in subs.values() for p in sub.params])
    if extension_compute:
        breakdown["subclass_compute"] = extension_compute
        explanations["subclass_compute"] = (
            "computing through the largest tensor-subclass parameter (a linear's forward and backward)"
        )
    kept = _unsharded_at_backward_start(units)
    return MemoryEstimate(plan, strategy, optimizer, breakdown, explanations, unsharded_at_backward_start=kept)


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
    reshard_after_forward: Any,
    loss_fn: Any,
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
    if forward_prefetch is not None and not isinstance(forward_prefetch, bool):
        raise TypeError(
            f"estimate_memory argument 'forward_prefetch' must be True, False or None, got {forward_prefetch!r}"
        )
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, int):  # bool is an int
        raise TypeError(
            "estimate_memory argument 'reshard_after_forward' must be True, False, an int (the number of ranks "
            f"to stay sharded over after forward) or None, got {reshard_after_forward!r}"
        )
    if batch_example is not None:
        _call_args(batch_example)
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"estimate_memory argument 'loss_fn' must be callable or None, got {type(loss_fn).__name__}")
    if loss_fn is not None and batch_example is None:
        raise ValueError("estimate_memory argument 'loss_fn' needs batch_example= (the forward whose output it takes)")
