"""Property tests: random module trees x policies x strategies train exactly like the unsharded model.

[Note: why specs, not modules]
Workers are separate processes, so a drawn model cannot be handed to them. Hypothesis draws a small,
picklable `ModelSpec` here; every rank (and the reference inside it) builds the same module tree
from it with the spec's seed. The spec prints in a failure report, and `build_model(spec)` rebuilds
the failing model in a plain Python session.

The number of examples per world size comes from ``FSDP_PROPERTY_EXAMPLES`` (see docs/soak.md);
the fault soak (`test_random_faults_*`) from ``FSDP_FAULT_EXAMPLES``.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st
from parity import global_mean
from torch import nn

from fsdp_composable import (
    CustomPolicy,
    ModuleWrapPolicy,
    ShardingStrategy,
    SizeBasedPolicy,
    estimate_memory,
    fully_shard,
)

EXAMPLES = int(os.environ.get("FSDP_PROPERTY_EXAMPLES", "6"))
FAULT_EXAMPLES = int(os.environ.get("FSDP_FAULT_EXAMPLES", "4"))
# "0" skips shrinking: a soak then reports the first failing spec as drawn, without the minutes that
# shrinking spends restarting the worker pool after each failing candidate.
SHRINK = os.environ.get("FSDP_PROPERTY_SHRINK", "1") != "0"
GLOBAL_BATCH = 8  # divisible by every world size we test
TOL = 1e-5
POLICIES = ("none", "wrap_container", "wrap_leaf", "size", "lambda", "custom_mixed")
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


# ---------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class LeafSpec:
    hidden: int  # odd or even: unit sizes rarely divide the world size, so shards are padded
    bias: bool
    frozen: str  # "none", "l1" (first weight frozen) or "all" (every parameter of the leaf)
    buffer: bool  # a float buffer added to the output
    calls: int  # how many times the parent calls it per forward


@dataclass(frozen=True)
class BufferSpec:
    """A submodule with buffers and no parameters."""


@dataclass(frozen=True)
class ContainerSpec:
    children: tuple[Union[LeafSpec, BufferSpec, ContainerSpec], ...]
    residual: bool


@dataclass(frozen=True)
class ModelSpec:
    seed: int
    width: int
    dtype: str
    body: ContainerSpec
    tie: Optional[tuple[int, int]]  # pre-order leaf indices whose `gain` (and `l1.weight` if shapes match) are tied
    stem: bool  # a trainable Linear before the body: then every unit's inputs require grad
    policy: str
    min_num_params: int
    strategy: str
    steps: int
    # odd steps leave every leaf's `gain` out of the loss: its `.grad` stays None while its unit's
    # other parameters get one (a partial-use loss), and between steps an in-place write reaches the shards
    partial: bool = False


# ---------------------------------------------------------------------------- modules built from specs
class Leaf(nn.Module):
    def __init__(self, width: int, spec: LeafSpec) -> None:
        super().__init__()
        self.l1 = nn.Linear(width, spec.hidden, bias=spec.bias)
        self.l2 = nn.Linear(spec.hidden, width, bias=spec.bias)
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(width))
        self.shift: Optional[torch.Tensor]
        self.register_buffer("shift", 0.1 * torch.randn(width) if spec.buffer else None)
        self.use_gain = True  # False: this step's loss does not use `gain` (ModelSpec.partial)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.l2(torch.tanh(self.l1(x)))
        y = y * self.gain if self.use_gain else y
        return y if self.shift is None else y + self.shift


class BufferOnly(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("scale", 1 + 0.1 * torch.randn(width))
        self.register_buffer("bias", 0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.bias


class Container(nn.Module):
    def __init__(self, width: int, spec: ContainerSpec) -> None:
        super().__init__()
        self.residual = spec.residual
        self.skip: Optional[nn.Module] = None  # a fault: this rank's forward leaves out that child
        self.calls: list[int] = []
        for i, child in enumerate(spec.children):
            self.add_module(f"c{i}", _build_node(width, child))
            self.calls.append(child.calls if isinstance(child, LeafSpec) else 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for child, calls in zip(self.children(), self.calls):
            if child is self.skip:
                continue
            for _ in range(calls):
                x = x + torch.tanh(child(x)) if self.residual else child(x)
        return x


class Root(nn.Module):
    """Always has a trainable head, so every model has a loss with a gradient."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.stem = nn.Linear(spec.width, spec.width) if spec.stem else None
        self.body = Container(spec.width, spec.body)
        self.head = nn.Linear(spec.width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x if self.stem is None else self.stem(x)))


def _build_node(width: int, spec: Union[LeafSpec, BufferSpec, ContainerSpec]) -> nn.Module:
    if isinstance(spec, LeafSpec):
        return Leaf(width, spec)
    if isinstance(spec, BufferSpec):
        return BufferOnly(width)
    return Container(width, spec)


def _leaf_specs(spec: ContainerSpec) -> list[LeafSpec]:
    out: list[LeafSpec] = []
    for child in spec.children:
        if isinstance(child, LeafSpec):
            out.append(child)
        elif isinstance(child, ContainerSpec):
            out.extend(_leaf_specs(child))
    return out


def build_model(spec: ModelSpec) -> nn.Module:
    """The unsharded model of ``spec``: the same parameters on every rank and in every process."""
    torch.manual_seed(spec.seed)
    model = Root(spec)
    leaves = [m for m in model.modules() if isinstance(m, Leaf)]
    if spec.tie is not None:
        a, b = leaves[spec.tie[0]], leaves[spec.tie[1]]
        b.gain = a.gain
        if a.l1.weight.shape == b.l1.weight.shape:
            b.l1.weight = a.l1.weight
    for leaf, leaf_spec in zip(leaves, _leaf_specs(spec.body)):
        if leaf_spec.frozen == "l1":
            leaf.l1.weight.requires_grad_(False)
        elif leaf_spec.frozen == "all":
            leaf.requires_grad_(False)
    return model.to(getattr(torch, spec.dtype))


def build_policy(spec: ModelSpec) -> Any:
    if spec.policy == "wrap_container":
        return ModuleWrapPolicy({Container})
    if spec.policy == "wrap_leaf":
        return ModuleWrapPolicy({Leaf, BufferOnly})  # BufferOnly: a unit module without parameters
    if spec.policy == "size":
        return SizeBasedPolicy(spec.min_num_params)
    if spec.policy == "lambda":
        return lambda m: isinstance(m, nn.Linear) and m.out_features % 2 == 1
    if spec.policy == "custom_mixed":
        return CustomPolicy(_mixed_strategies)
    return None


def _mixed_strategies(module: nn.Module) -> Union[bool, dict[str, Any]]:
    """Leaves with an odd hidden width get NO_SHARD; containers keep the call's strategy."""
    if isinstance(module, Leaf):
        return {"strategy": ShardingStrategy.NO_SHARD} if module.l1.out_features % 2 else True
    return isinstance(module, Container)


# ---------------------------------------------------------------------------- hypothesis strategies
def _leaf() -> st.SearchStrategy[LeafSpec]:
    return st.builds(
        LeafSpec,
        hidden=st.integers(1, 9),
        bias=st.booleans(),
        frozen=st.sampled_from(["none", "none", "l1", "all"]),
        buffer=st.booleans(),
        calls=st.sampled_from([1, 1, 2]),
    )


def _container(depth: int) -> st.SearchStrategy[ContainerSpec]:
    options: list[st.SearchStrategy[Any]] = [_leaf(), _leaf(), st.just(BufferSpec())]
    if depth > 1:
        options.append(_container(depth - 1))
    return st.builds(ContainerSpec, children=_children(options), residual=st.booleans())


def _children(options: list[st.SearchStrategy[Any]]) -> st.SearchStrategy[tuple[Any, ...]]:
    return st.lists(st.one_of(options), min_size=1, max_size=3).map(tuple)


@st.composite
def model_specs(draw: Callable[[st.SearchStrategy[Any]], Any]) -> ModelSpec:
    depth = draw(st.integers(1, 3))
    body = draw(_container(depth))
    n_leaves = len(_leaf_specs(body))
    tie = None
    if n_leaves >= 2 and draw(st.booleans()):
        a = draw(st.integers(0, n_leaves - 2))
        tie = (a, draw(st.integers(a + 1, n_leaves - 1)))
    # without a stem the first unit's inputs need no grad; a leaf called twice there has a call
    # without a post-backward trigger (the pattern of test_unit_shapes_and_calls.test_unit_called_twice)
    stem = draw(st.booleans())
    return ModelSpec(
        seed=draw(st.integers(0, 2**16)),
        width=draw(st.sampled_from([3, 5, 7])),
        dtype=draw(st.sampled_from(["float32", "float32", "float64"])),
        body=body,
        tie=tie,
        stem=stem,
        policy=draw(st.sampled_from(POLICIES)),
        min_num_params=draw(st.integers(1, 60)),
        strategy=draw(st.sampled_from(STRATEGIES)),
        steps=draw(st.integers(2, 3)),
        partial=draw(st.booleans()),
    )


# ---------------------------------------------------------------------------- run on every rank
def _batch(spec: ModelSpec, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed * 31 + step)
    dtype = getattr(torch, spec.dtype)
    x = torch.randn(GLOBAL_BATCH, spec.width, generator=g, dtype=dtype)
    return x, torch.randn(GLOBAL_BATCH, 2, generator=g, dtype=dtype)


def _partial_use(spec: ModelSpec, step: int, ref: nn.Module, model: nn.Module) -> None:
    """``spec.partial``: odd steps leave every `gain` out of the loss, and every step first writes the
    same elementwise update in place on both models (the faces write it into the shards)."""
    if not spec.partial:
        return
    for m in (*ref.modules(), *model.modules()):
        if isinstance(m, Leaf):
            m.use_gain = step % 2 == 0
    with torch.no_grad():
        for p in (*ref.parameters(), *model.parameters()):
            if p.requires_grad:
                p.mul_(0.5).add_(0.01)


def train_and_compare(spec: ModelSpec) -> dict[str, Any]:
    """Train the spec's model sharded and unsharded side by side; report what differs."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = build_model(spec)
    frozen = {n for n, p in ref.named_parameters(remove_duplicate=False) if not p.requires_grad}
    initial = {k: v.clone() for k, v in ref.state_dict().items()}
    model = fully_shard(copy.deepcopy(ref), build_policy(spec), strategy=ShardingStrategy[spec.strategy])
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    per = GLOBAL_BATCH // world
    ref_losses, losses, frozen_grads = [], [], []
    for step in range(spec.steps):
        x, y = _batch(spec, step)
        _partial_use(spec, step, ref, model)
        loss_ref = F.mse_loss(ref(x), y)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        loss = F.mse_loss(model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per])
        loss.backward()
        frozen_grads += [n for n, p in model.named_parameters() if n in frozen and p.grad is not None]
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss_ref.item())
        losses.append(global_mean(loss))
    sd, ref_sd = model.state_dict(), ref.state_dict()
    return {
        "ref_losses": ref_losses,
        "losses": losses,
        "keys": list(sd),
        "ref_keys": list(ref_sd),
        "meta_diff": [
            k for k in ref_sd if k in sd and (sd[k].shape, sd[k].dtype) != (ref_sd[k].shape, ref_sd[k].dtype)
        ],
        "value_diff": {k: (sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd if k in sd and sd[k].numel()},
        "frozen_changed": sorted(k for k in frozen if k in sd and not torch.equal(sd[k], initial[k])),
        "frozen_grads": sorted(set(frozen_grads)),
        "units": len(fully_shard.state(model).handles),
    }


# ---------------------------------------------------------------------------- checks in the test process
def _check(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        assert r["keys"] == r["ref_keys"], (rank, r["keys"], r["ref_keys"])
        assert not r["meta_diff"], (rank, "shape/dtype differs", r["meta_diff"])
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=TOL, atol=TOL)
        worst = max(r["value_diff"].items(), key=lambda kv: kv[1], default=("", 0.0))
        assert worst[1] <= TOL, (rank, "final state dict differs", worst)
        assert not r["frozen_changed"], (rank, "frozen parameters changed", r["frozen_changed"])
        assert not r["frozen_grads"], (rank, "frozen parameters got a .grad", r["frozen_grads"])
    assert all(r["losses"] == results[0]["losses"] for r in results), "ranks disagree on the global loss"


_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    phases=tuple(Phase) if SHRINK else (Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# One test per world size (not parametrize): derandomize seeds by the test's source, so each gets
# its own sequence of models instead of the same one three times.
@_SETTINGS
@given(spec=model_specs())
def test_random_models_world_size_1(dist_run: Callable[..., list[Any]], spec: ModelSpec) -> None:
    _check(dist_run(1, train_and_compare, spec))


@_SETTINGS
@given(spec=model_specs())
def test_random_models_world_size_2(dist_run: Callable[..., list[Any]], spec: ModelSpec) -> None:
    _check(dist_run(2, train_and_compare, spec))


@_SETTINGS
@given(spec=model_specs())
def test_random_models_world_size_4(dist_run: Callable[..., list[Any]], spec: ModelSpec) -> None:
    _check(dist_run(4, train_and_compare, spec))


def test_specs_build_the_intended_trees() -> None:
    """The generator really produces what the properties are about (guards against a vacuous test)."""
    spec = ModelSpec(
        seed=0,
        width=5,
        dtype="float64",
        body=ContainerSpec(
            (
                LeafSpec(3, True, "l1", True, 2),
                BufferSpec(),
                ContainerSpec((LeafSpec(3, False, "all", False, 1),), True),
            ),
            False,
        ),
        tie=(0, 1),
        stem=True,
        policy="wrap_leaf",
        min_num_params=1,
        strategy="FULL_SHARD",
        steps=2,
    )
    model = build_model(spec)
    leaves = [m for m in model.modules() if isinstance(m, Leaf)]
    assert leaves[0].gain is leaves[1].gain and leaves[0].l1.weight is leaves[1].l1.weight
    assert not leaves[0].l1.weight.requires_grad and not leaves[1].l2.weight.requires_grad
    assert leaves[0].l2.weight.requires_grad and leaves[0].gain.requires_grad is False  # tied into an "all" leaf
    assert [n for n, _ in model.named_buffers()] == ["body.c0.shift", "body.c1.scale", "body.c1.bias"]
    assert next(model.parameters()).dtype == torch.float64
    assert model.body.calls == [2, 1, 1]


@pytest.mark.parametrize(
    "policy, units",
    [
        ("none", {"": "FULL_SHARD"}),
        ("wrap_container", {"": "FULL_SHARD", "body": "FULL_SHARD"}),
        ("wrap_leaf", {"": "FULL_SHARD", "body.c0": "FULL_SHARD"}),  # the buffer-only body.c1 gets no unit
        ("size", {"": "FULL_SHARD", "body.c0.l1": "FULL_SHARD", "body.c0.l2": "FULL_SHARD", "head": "FULL_SHARD"}),
        ("lambda", {"": "FULL_SHARD", "body.c0.l1": "FULL_SHARD", "body.c0.l2": "FULL_SHARD"}),
        ("custom_mixed", {"": "FULL_SHARD", "body.c0": "NO_SHARD"}),  # body: nothing left once c0 is a unit
    ],
)
def test_policies_pick_the_intended_units(policy: str, units: dict[str, str]) -> None:
    """Each policy name means what the generator assumes (planned without a process group)."""
    leaf = LeafSpec(hidden=3, bias=True, frozen="none", buffer=False, calls=1)
    body = ContainerSpec((leaf, BufferSpec()), residual=False)
    spec = ModelSpec(0, 3, "float32", body, None, False, policy, 5, "FULL_SHARD", 2)
    plan = estimate_memory(build_model(spec), policy=build_policy(spec), world_size=2).plan
    assert {u.fqn: u.strategy.name for u in plan.units} == units


# ---------------------------------------------------------------------------- fault soak
# [Note: fault soak]
# A random model (as above) at 2 or 4 ranks trains for a few steps; in one step after the first a
# fault strikes: one rank raises alone ("raise_alone"), every rank raises, each at its own random
# point ("all_raise"), or one rank's forward leaves out a unit ("diverge", a data-dependent branch).
# Every rank catches what it gets and trains on. The properties: nothing aborts or hangs (the pool
# gets every rank's result), every rank gets an error in the faulted step and in no other, and the
# final model equals the unsharded one trained on every step but the faulted one. Faults strike in
# forward (a unit's forward pre-hook, or the loss), and also surface in backward (a "diverge" found by
# the backward's first collective): a failed backward's gradients are dropped whole. SIGKILL is tested
# by tests/dead_rank_job.py (forward and state_dict()), not here: a killed rank takes a pool worker.
FAULT_KINDS = ("raise_alone", "all_raise", "diverge")


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    step: int  # the faulted step, >= 1 (after the first iteration's checks)
    rank: int  # the rank that raises alone or diverges (mod the world size)
    points: tuple[int, ...]  # per rank: the leaf (pre-order) whose forward pre-hook raises (-1: in the loss)


class InjectedFault(Exception):
    """The exception a fault raises (not a RuntimeError, so it is never mistaken for ours)."""


@st.composite
def fault_specs(draw: Callable[[st.SearchStrategy[Any]], Any]) -> tuple[ModelSpec, FaultSpec, int]:
    spec = draw(model_specs())
    spec = ModelSpec(**{**spec.__dict__, "steps": 3})
    world = draw(st.sampled_from([2, 2, 4]))
    n_leaves = len(_leaf_specs(spec.body))
    assume(n_leaves > 0)  # a fault needs a leaf to strike in
    fault = FaultSpec(
        kind=draw(st.sampled_from(FAULT_KINDS)),
        step=draw(st.integers(1, spec.steps - 1)),
        rank=draw(st.integers(0, world - 1)),
        # -1 (the loss, outside fully_shard's hooks) is left out: see docs/soak.md, "Known limits"
        points=tuple(draw(st.integers(0, n_leaves - 1)) for _ in range(world)),
    )
    return spec, fault, world


def _unit_children(model: nn.Module) -> list[tuple[Container, nn.Module]]:
    """(parent, child) for every child of a Container that owns a unit of its own."""
    from fsdp_composable._common_utils import _get_fsdp_state

    out = []
    for parent in model.modules():
        if isinstance(parent, Container):
            for child in parent.children():
                state = _get_fsdp_state(child)
                if state is not None and state.module is child and any(h.module is child for h in state.handles):
                    out.append((parent, child))
    return out


def train_with_fault(spec: ModelSpec, fault: FaultSpec) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = build_model(spec)
    model = fully_shard(copy.deepcopy(ref), build_policy(spec), strategy=ShardingStrategy[spec.strategy])
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    leaves = [m for m in model.modules() if isinstance(m, Leaf)]
    armed = {"now": False}
    mine = fault.points[rank]
    raises = fault.kind == "all_raise" or (fault.kind == "raise_alone" and rank == fault.rank)

    def hook(module: nn.Module, args: Any) -> None:
        if armed["now"]:
            armed["now"] = False
            raise InjectedFault(f"fault on rank {rank}")

    if raises and mine >= 0:
        leaves[mine].register_forward_pre_hook(hook)
    skippable = _unit_children(model)
    per = GLOBAL_BATCH // world
    errors: dict[int, str] = {}
    in_backward: list[int] = []
    for step in range(spec.steps):
        x, y = _batch(spec, step)
        faulted = step == fault.step
        if step != fault.step:
            F.mse_loss(ref(x), y).backward()
            opt_ref.step()
            opt_ref.zero_grad()
        armed["now"] = faulted and raises and mine >= 0
        if faulted and fault.kind == "diverge" and rank == fault.rank and skippable:
            parent, child = skippable[mine % len(skippable)]
            parent.skip = child
        try:
            loss = F.mse_loss(model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per])
            if faulted and raises and mine < 0:
                raise InjectedFault(f"fault in the loss on rank {rank}")
        except Exception as e:  # noqa: BLE001 - the fault, or our error about another rank's
            errors[step] = f"{type(e).__name__}: {e}"
            opt.zero_grad()
            continue
        finally:
            for parent, _ in skippable:
                parent.skip = None
        try:
            loss.backward()
        except Exception as e:  # noqa: BLE001
            errors[step] = f"{type(e).__name__}: {e}"
            in_backward.append(step)
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
    sd, ref_sd = model.state_dict(), ref.state_dict()
    return {
        "errors": errors,
        "in_backward": in_backward,
        "diverged": fault.kind == "diverge" and bool(skippable),
        "value_diff": max((sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd if sd[k].numel()),
    }


def _check_fault(results: list[dict[str, Any]], fault: FaultSpec) -> None:
    if fault.kind == "diverge" and not results[0]["diverged"]:
        return  # no unit to leave out: nothing happened (checked to be error-free below)
    for rank, r in enumerate(results):
        assert list(r["errors"]) == [fault.step], (rank, "errors in other steps, or none", r["errors"])
        for message in r["errors"].values():
            assert "InjectedFault" in message or "fully_shard" in message, (rank, message)
    for rank, r in enumerate(results):
        assert r["value_diff"] <= TOL, (rank, "the faulted step left a trace", r["value_diff"], r["in_backward"])


_FAULT_SETTINGS = settings(
    max_examples=FAULT_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),  # no shrinking: each failure restarts a pool
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@_FAULT_SETTINGS
@given(drawn=fault_specs())
def test_random_faults(dist_run: Callable[..., list[Any]], drawn: tuple[ModelSpec, FaultSpec, int]) -> None:
    spec, fault, world = drawn
    _check_fault(dist_run(world, train_with_fault, spec, fault, timeout=120), fault)
