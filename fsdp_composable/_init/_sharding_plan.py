"""The results of `describe` and `estimate_memory` (`UnitPlan`, `ShardingPlan`, `MemoryEstimate`), how a
unit's plan is read from its layout and config, and the tables their ``str()`` prints."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import nn

from fsdp_composable._config import UnitConfig
from fsdp_composable._flat_param import FlatLayout
from fsdp_composable.api import ShardingStrategy

__all__ = ["MemoryEstimate", "ShardingPlan", "UnitPlan"]

ROOT_NAME = "<root>"

TERMS = (
    "sharded_params",
    "sharded_grads",
    "optimizer_state",
    "optimizer_step",
    "unsharded_params",
    "unsharded_grads",
    "activations",
    "output_and_loss",
)
# terms measured from a batch_example (shown as "not estimated" without one)
BATCH_TERMS = ("activations", "output_and_loss")
# terms that only apply to some calls: shown only when estimated (post_forward_shards: reshard_after_forward=<int>)
OPTIONAL_TERMS = ("post_forward_shards",)


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
    to bytes (``activations`` and ``output_and_loss`` only when a ``batch_example`` was given), and
    ``post_forward_shards`` with ``reshard_after_forward=<int>``; ``explanations`` says what each term
    counted. ``unsharded_at_backward_start`` is the part of ``unsharded_params`` still unsharded
    where backward starts (the units kept unsharded after their forward). ``str()`` is a breakdown
    table.
    """

    plan: ShardingPlan
    strategy: ShardingStrategy
    optimizer: str
    breakdown: dict[str, int]
    explanations: dict[str, str]
    unsharded_at_backward_start: int = 0

    @property
    def sharded_param_bytes(self) -> int:
        return self.breakdown["sharded_params"]

    @property
    def moments(self) -> dict[str, int]:
        """The bytes alive at each moment of a step where it can peak (see [Note: the memory model]):
        ``loss`` (the loss and its backward, before any unit's), ``backward`` (units in flight, every
        activation still saved), ``backward_end`` (every sharded gradient back) and
        ``optimizer_step``."""
        b = self.breakdown
        held = b["sharded_params"] + b["optimizer_state"]
        saved = b.get("activations", 0) + b.get("post_forward_shards", 0)
        in_flight = b["unsharded_params"] + b["unsharded_grads"]
        return {
            "loss": held + self.unsharded_at_backward_start + saved + b.get("output_and_loss", 0),
            "backward": held + in_flight + saved + b.get("subclass_compute", 0),
            "backward_end": held + in_flight + b["sharded_grads"],
            "optimizer_step": held + b["sharded_grads"] + b.get("optimizer_step", 0),
        }

    @property
    def peak_moment(self) -> str:
        """The moment of `moments` with the most bytes (the first of equal ones)."""
        moments = self.moments
        return max(moments, key=lambda m: moments[m])

    @property
    def peak_bytes(self) -> int:
        """The largest of `moments`: the step's predicted peak (see [Note: the memory model])."""
        return max(self.moments.values())

    @property
    def upper_bound_bytes(self) -> int:
        """The sum of every term, as if all were live at the same instant."""
        return sum(self.breakdown.values())

    def __str__(self) -> str:
        return _format_estimate(self)


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


def _term_row(est: MemoryEstimate, term: str) -> tuple[str, str, str, str]:
    n = est.breakdown[term]
    return (term, f"{n:,}", _human_bytes(n), est.explanations.get(term, ""))


def _format_estimate(est: MemoryEstimate) -> str:
    rows = [
        _term_row(est, term) if term in est.breakdown else (term, "-", "-", "not estimated: pass batch_example=")
        for term in TERMS
        if term in est.breakdown or term in BATCH_TERMS
    ]
    rows += [_term_row(est, term) for term in OPTIONAL_TERMS if term in est.breakdown]
    slices = " + post-forward shards" if "post_forward_shards" in est.breakdown else ""
    what = {
        "loss": f"where backward starts: params + optimizer + units kept unsharded + activations{slices} + loss",
        "backward": f"in backward: params + optimizer + unsharded + activations{slices}",
        "backward_end": "where backward ends: params + optimizer + unsharded + sharded grads",
        "optimizer_step": "in the optimizer step: params + optimizer + sharded grads + its temporaries",
    }
    footer = ("peak", f"{est.peak_bytes:,}", _human_bytes(est.peak_bytes), what[est.peak_moment])
    plan = est.plan
    header = (
        f"MemoryEstimate per rank: world size {plan.world_size}, {len(plan.units)} units, "
        f"{est.strategy.name}, optimizer {est.optimizer}"
    )
    return "\n".join([header, *_table(("term", "bytes", "size", "what"), rows, footer, right={1, 2})])
