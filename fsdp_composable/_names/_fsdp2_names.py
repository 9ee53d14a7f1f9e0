"""FSDP2's argument names for `fully_shard`: ``mesh``, ``reshard_after_forward``, ``mp_policy``,
``offload_policy``, ``ignored_params`` (and ``shard_placement_fn``), mapped to ours.

[Note: FSDP2 names]
- ``mesh``: ``process_group`` (which already takes a DeviceMesh); a 2-D ``(replicate, shard)`` mesh
  means HYBRID_SHARD, as in FSDP2 (HSDP).
- ``reshard_after_forward``: True is FULL_SHARD (HYBRID_SHARD on a 2-D mesh), False is SHARD_GRAD_OP.
  It decides the strategy when ``strategy`` is left at its default, FULL_SHARD (an explicit
  ``strategy=FULL_SHARD`` cannot be told apart from the default, so it yields too); any other
  explicit ``strategy`` that disagrees is an error. An int k (FSDP2 resharding to a smaller group)
  is FULL_SHARD that reshards to groups of k ranks after forward (see [Note: resharding to a
  smaller group] in `_post_forward_group`); not with a 2-D mesh.
- ``mp_policy``: FSDP2's MixedPrecisionPolicy maps field by field onto `MixedPrecision`
  (``cast_forward_inputs`` casts each unit's inputs, ``output_dtype`` the call's module's outputs);
  ``offload_policy``: CPUOffloadPolicy is
  ``CPUOffload(offload_params=True)``, the base OffloadPolicy is no offload.
- ``ignored_params``: the modules all of whose parameters are listed are ignored whole (as
  ``ignored_modules``: their buffers too); every other listed parameter is ignored by itself: it
  stays a plain local parameter, in no flat parameter, never all-gathered, its gradient never
  reduced (FSDP2's rule), while its module's other parameters are sharded.
- ``shard_placement_fn``: accepted when it returns None or ``Shard(0)`` (FSDP2's default) for every
  parameter; any other placement is an error naming the parameter and what to use instead.
Recognised by duck typing (class name and fields): the package does not import torch FSDP.
Passing both our name and FSDP2's for the same thing is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
from torch import nn

from fsdp_composable._flat_param import FSDP_FLATTENED
from fsdp_composable.api import CPUOffload, MixedPrecision, ShardingStrategy

__all__: list[str] = []


@dataclass(frozen=True)
class OurArgs:
    """The arguments of ours that FSDP2's names map to, after mapping."""

    process_group: Any
    strategy: ShardingStrategy
    mixed_precision: Optional[MixedPrecision]
    cpu_offload: Optional[CPUOffload]
    ignored_modules: Optional[Iterable[nn.Module]]
    reshard_after_forward_ranks: Optional[int] = None
    # parameters ignored one by one (their module's other parameters are sharded)
    ignored_params: tuple[nn.Parameter, ...] = ()


def _both(ours: str, theirs: str) -> ValueError:
    return ValueError(
        f"fully_shard got both {ours}= and {theirs}= (FSDP2's name for it); pass only one of them"
    )


def map_fsdp2_names(
    module: nn.Module,
    args: OurArgs,
    *,
    mesh: Any,
    reshard_after_forward: Any,
    mp_policy: Any,
    offload_policy: Any,
    ignored_params: Any,
    shard_placement_fn: Any,
) -> OurArgs:
    """Our arguments with FSDP2's names folded in; ``args`` unchanged when none is given."""
    process_group, strategy = args.process_group, args.strategy
    if shard_placement_fn is not None:
        _check_placements(module, shard_placement_fn, ignored_params)
    if mesh is not None:
        from torch.distributed.device_mesh import DeviceMesh

        if process_group is not None:
            raise _both("process_group", "mesh")
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"fully_shard argument 'mesh' must be a DeviceMesh, got {type(mesh).__name__}")
        if mesh.ndim not in (1, 2):
            raise ValueError(
                f"fully_shard argument 'mesh' must be 1-D (shard) or 2-D (replicate, shard), got a {mesh.ndim}-D "
                "DeviceMesh; slice or flatten it"
            )
        process_group = mesh
    strategy = implied_strategy(strategy, mesh, reshard_after_forward)
    ignored_modules, single = split_ignored_params(module, args.ignored_modules, ignored_params)
    return OurArgs(
        process_group,
        strategy,
        _mixed_precision(args.mixed_precision, mp_policy),
        _cpu_offload(args.cpu_offload, offload_policy),
        ignored_modules,
        reshard_after_forward_ranks=post_forward_ranks(reshard_after_forward),
        ignored_params=(*args.ignored_params, *single),
    )


def post_forward_ranks(reshard_after_forward: Any) -> Optional[int]:
    """FSDP2's int: the group size to reshard to after forward (checked against the group at init)."""
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        return reshard_after_forward
    return None


def _check_placements(module: nn.Module, fn: Any, ignored_params: Any) -> None:
    """``shard_placement_fn`` is accepted when it asks for the default (None or Shard(0)) for every
    parameter it would shard: a flat parameter shards by element, never on another dimension."""
    if not callable(fn):
        raise TypeError(f"fully_shard argument 'shard_placement_fn' must be callable, got {type(fn).__name__}")
    skip = {id(p) for p in ignored_params or ()}
    for fqn, param in module.named_parameters():
        if id(param) in skip or getattr(param, FSDP_FLATTENED, False):
            continue
        placement = fn(param)
        if placement is None or (type(placement).__name__ == "Shard" and getattr(placement, "dim", None) == 0):
            continue
        raise ValueError(
            f"fully_shard: shard_placement_fn returns {placement!r} for parameter '{fqn}', but flat parameters "
            "are sharded by element, not on a dimension (the SHARDED state dict gives Shard(0) DTensors). Leave "
            "shard_placement_fn out; to keep the parameter whole on every rank pass it in ignored_params; to "
            "shard it on a dimension use tensor parallelism (parallelize_module on a 2-D mesh) before fully_shard"
        )


def implied_strategy(
    strategy: ShardingStrategy, mesh: Any, reshard_after_forward: Any, api: str = "fully_shard"
) -> ShardingStrategy:
    """The strategy ``reshard_after_forward`` (and a 2-D ``mesh``) imply over ``strategy``; ``api`` names
    the caller in messages (`estimate_memory` takes the same argument)."""
    hybrid = mesh is not None and mesh.ndim == 2
    given = reshard_after_forward
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise ValueError(
            f"{api} argument 'reshard_after_forward' must be True, False or an int (the number of ranks "
            f"to stay sharded over after forward), got {reshard_after_forward!r}"
        )
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        if hybrid:
            raise ValueError(
                f"fully_shard: reshard_after_forward={reshard_after_forward} (an int) is not supported with a 2-D "
                "mesh (HYBRID_SHARD); pass a 1-D mesh, or True/False"
            )
        reshard_after_forward = True  # FULL_SHARD; the group size is resolved at init (`_post_forward_group`)
    if hybrid and reshard_after_forward is False:
        raise ValueError(
            "fully_shard: a 2-D mesh (HYBRID_SHARD) with reshard_after_forward=False is not supported; keep "
            "reshard_after_forward=True or pass a 1-D mesh with strategy=ShardingStrategy.SHARD_GRAD_OP"
        )
    if hybrid:
        implied, why = ShardingStrategy.HYBRID_SHARD, "a 2-D mesh"
    elif reshard_after_forward is None:
        return strategy
    elif reshard_after_forward:
        implied, why = ShardingStrategy.FULL_SHARD, f"reshard_after_forward={given!r}"
    else:
        implied, why = ShardingStrategy.SHARD_GRAD_OP, "reshard_after_forward=False"
    if strategy not in (ShardingStrategy.FULL_SHARD, implied):
        raise ValueError(
            f"{api}: strategy=ShardingStrategy.{strategy.name} conflicts with {why} (which means "
            f"ShardingStrategy.{implied.name}); pass only one of them"
        )
    return implied


def _mixed_precision(ours: Optional[MixedPrecision], mp_policy: Any) -> Optional[MixedPrecision]:
    if mp_policy is None:
        return ours
    if ours is not None:
        raise _both("mixed_precision", "mp_policy")
    if isinstance(mp_policy, MixedPrecision):
        return mp_policy
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    if type(mp_policy).__name__ != "MixedPrecisionPolicy" or not all(hasattr(mp_policy, f) for f in fields):
        raise TypeError(
            "fully_shard argument 'mp_policy' must be FSDP2's MixedPrecisionPolicy (or our MixedPrecision; "
            f"better: mixed_precision=MixedPrecision(...)), got {type(mp_policy).__name__}"
        )
    if mp_policy.param_dtype is None and mp_policy.reduce_dtype is None and mp_policy.output_dtype is None:
        return None
    return MixedPrecision(
        param_dtype=mp_policy.param_dtype,
        reduce_dtype=mp_policy.reduce_dtype,
        cast_forward_inputs=bool(mp_policy.cast_forward_inputs),
        output_dtype=mp_policy.output_dtype,
    )


def _cpu_offload(ours: Optional[CPUOffload], offload_policy: Any) -> Optional[CPUOffload]:
    if offload_policy is None:
        return ours
    if ours is not None:
        raise _both("cpu_offload", "offload_policy")
    if isinstance(offload_policy, CPUOffload):
        return offload_policy
    name = type(offload_policy).__name__
    if name == "CPUOffloadPolicy":
        return CPUOffload(offload_params=True)
    if name == "OffloadPolicy":
        return None
    raise TypeError(
        "fully_shard argument 'offload_policy' must be FSDP2's CPUOffloadPolicy or OffloadPolicy (better: "
        f"cpu_offload=CPUOffload(offload_params=True)), got {name}"
    )


def split_ignored_params(
    module: nn.Module, ours: Optional[Iterable[nn.Module]], ignored_params: Any
) -> tuple[Optional[Iterable[nn.Module]], tuple[nn.Parameter, ...]]:
    """``ignored_params`` as (ignored modules, parameters ignored one by one): the outermost modules
    all of whose parameters are listed are ignored whole; the rest are ignored by themselves."""
    if ignored_params is None:
        return ours, ()
    if ours is not None:
        raise _both("ignored_modules", "ignored_params")
    if isinstance(ignored_params, torch.Tensor) or not isinstance(ignored_params, Iterable):
        raise TypeError(
            "fully_shard argument 'ignored_params' must be a set of parameters (or ignored_modules=[...]), "
            f"got {type(ignored_params).__name__}"
        )
    given = list(ignored_params)
    not_tensors = sorted({type(p).__name__ for p in given if not isinstance(p, torch.Tensor)})
    if not_tensors:
        raise TypeError(
            "fully_shard argument 'ignored_params' must hold parameters (or pass modules as "
            f"ignored_modules=[...]), got {', '.join(not_tensors)}"
        )
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    # a superset is fine, as in FSDP2: one set of every ignored parameter may be given to every call
    wanted = {id(p): p for p in given if id(p) in names}
    if not wanted:
        return ours, ()
    if set(wanted) == set(names):
        raise ValueError(
            "fully_shard argument 'ignored_params' holds every parameter of the module: nothing would be "
            "sharded; do not call fully_shard on it"
        )
    # the outermost modules all of whose parameters are ignored, and which own one of them
    chosen: list[nn.Module] = []
    covered: set[int] = set()
    for sub in module.modules():
        params = {id(p) for p in sub.parameters()}
        if not params or not params <= set(wanted) or params <= covered or sub is module:
            continue
        chosen.append(sub)
        covered |= params
    single = tuple(wanted[i] for i in sorted(set(wanted) - covered, key=lambda i: names[i]))
    return chosen, single
