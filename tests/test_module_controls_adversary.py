"""Per-module controls on paths the behaviour tests do not take: an explicit ``unshard`` followed by
state-dict loads, optimizer steps, gradient clipping or a failing forward; prefetch lists naming
odd targets; switches combined with ``no_sync`` and toggled between forward and backward; async
unshard handles waited twice, never, or after ``reshard``. Numerics against the unsharded model on
the same global batch (OddMLP: padded units) at 2 and 4 ranks."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from models import OddMLP, mlp_batch, mlp_loss
from parity import error_text, local_slice
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_composable import (
    CPUOffload,
    FullyShardedDataParallel,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    apply_activation_checkpointing,
    clip_grad_norm_,
    fully_shard,
    no_sync,
    optim_state_dict,
    reshard,
    set_modules_to_backward_prefetch,
    set_modules_to_forward_prefetch,
    set_requires_gradient_sync,
    set_reshard_after_backward,
    set_reshard_after_forward,
    unshard,
)

LINEAR = ModuleWrapPolicy({nn.Linear})
UNITS = ("l1", "l2.0", "l2.2", "l3")


def _pair(**kwargs: Any) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = OddMLP()
    return ref, fully_shard(copy.deepcopy(ref), LINEAR, **kwargs)


def _batch(step: int) -> tuple[Any, Any]:
    batch = mlp_batch(step, 2 * dist.get_world_size())
    return batch, local_slice(batch, dist.get_rank(), dist.get_world_size())


def _is_face(param: torch.Tensor) -> bool:
    """Whether the module registers the sharded face (a DTensor), not the unsharded original."""
    return isinstance(param, DTensor)


def _diff(ref: nn.Module, model: nn.Module) -> float:
    sd, ref_sd = model.state_dict(), ref.state_dict()
    return max((sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd)


def _out_diff(ref: nn.Module, model: nn.Module, step: int = 50) -> float:
    batch, local = _batch(step)
    with torch.no_grad():
        want = local_slice((ref(batch[0]), batch[1]), dist.get_rank(), dist.get_world_size())[0]
        return (model(local[0]) - want).abs().max().item()


def _units(model: nn.Module) -> list[nn.Module]:
    return [model.get_submodule(n) for n in UNITS]


# ---------------------------------------------------------------------------- left unsharded, then the shard is written
def load_while_unsharded(how: str) -> dict[str, Any]:
    """A unit left unsharded (explicit unshard / reshard_after_backward=False), then load_state_dict:
    the next forward must use the loaded values, not the unsharded copy gathered before the load."""
    ref, model = _pair()
    if how == "unshard":
        unshard(model.l1)
        pending = unshard(model.l2[0], async_op=True)  # still in flight at the load
    else:
        set_reshard_after_backward(model, False)
        batch, local = _batch(0)
        mlp_loss(ref, batch).backward()  # its gradient stays in both for the first step below
        mlp_loss(model, local).backward()
        set_reshard_after_backward(model, True)
        pending = None
    torch.manual_seed(5)
    new = OddMLP().state_dict()
    ref.load_state_dict(new)
    model.load_state_dict(new)
    if pending is not None:
        pending.wait()  # after the load resharded it: nothing left to do
    out = _out_diff(ref, model)
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        batch, local = _batch(step + 1)
        mlp_loss(ref, batch).backward()
        mlp_loss(model, local).backward()
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    return {"out": out, "diff": _diff(ref, model), "faces": [_is_face(u.weight) for u in _units(model)]}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("how", ["unshard", "kept_after_backward"])
def test_load_state_dict_reaches_a_unit_left_unsharded(dist_run: Any, world: int, how: str) -> None:
    for r in dist_run(world, load_while_unsharded, how):
        assert r["out"] < 1e-6, r  # was the pre-load values: a silent wrong forward
        assert r["diff"] < 1e-6
        assert all(r["faces"])  # resharded (the DTensor faces again) after the step


def step_while_unsharded() -> dict[str, Any]:
    """A later optimizer step (not the first) on a unit left unsharded: refused, naming the unit, on
    every rank; after reshard(unit) the same step goes through and matches the reference."""
    ref, model = _pair()
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    errors = []
    for step in range(3):
        batch, local = _batch(step)
        mlp_loss(ref, batch).backward()
        if step == 2:
            set_reshard_after_backward(model.l3, False)
        mlp_loss(model, local).backward()
        if step == 1:
            unshard(model.l2[0])
        errors.append(error_text(opt.step))
        if errors[-1] != "no error":
            for unit in _units(model):
                reshard(unit)  # a no-op on the units already sharded
            opt.step()
        opt_ref.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    return {"errors": errors, "diff": _diff(ref, model)}


@pytest.mark.parametrize("world", [2, 4])
def test_a_later_optimizer_step_refuses_a_unit_left_unsharded(dist_run: Any, world: int) -> None:
    results = dist_run(world, step_while_unsharded)
    for r in results:
        assert r["errors"] == results[0]["errors"]  # the same on every rank
        assert r["diff"] < 1e-6  # no step was lost
    errors = results[0]["errors"]
    assert errors[0] == "no error"
    assert errors[1].startswith("RuntimeError: optimizer.step() was called while the parameters of unit 'l2.0' ")
    assert "after unshard(module)" in errors[1] and "Call reshard(module)" in errors[1], errors[1]
    assert errors[2].startswith("RuntimeError: optimizer.step() was called while the parameters of unit 'l3' ")


# ---------------------------------------------------------------------------- attacks that hold (pinned)
def _train(
    ref: nn.Module, model: nn.Module, steps: range, micro: int = 1, between: Any = None, opts: Any = None
) -> None:
    """``opts``: the two optimizers, built earlier (while every unit was sharded); None: build them now."""
    opt_ref, opt = opts or (torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1))
    for step in steps:
        for m in range(micro):
            batch, local = _batch(micro * step + m)
            mlp_loss(ref, batch).backward()
            loss = mlp_loss(model, local)
            if between is not None:
                between(m)
            loss.backward()
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()


def odd_prefetch_lists() -> dict[str, Any]:
    """Prefetch lists naming the unit itself, a duplicate, an earlier unit (already run), the root,
    and a unit of another root: accepted (as FSDP2 does), harmless, every unit sharded after a step."""
    ref, model = _pair()
    other_ref, other = _pair()
    set_modules_to_forward_prefetch(model.l1, [model.l1, model.l2[0], model.l2[0]])
    set_modules_to_forward_prefetch(model.l3, [model.l1, model, other.l1])
    set_modules_to_backward_prefetch(model.l2[0], [model.l3, model.l2[0]])  # already run in backward
    set_modules_to_backward_prefetch(model.l3, [other.l2[2], model.l2[2], model.l2[2]])
    _train(ref, model, range(3))
    _train(other_ref, other, range(2))
    return {
        "diff": (_diff(ref, model), _diff(other_ref, other)),
        "faces": [_is_face(u.weight) for m in (model, other) for u in _units(m)],
    }


@pytest.mark.parametrize("world", [2, 4])
def test_odd_prefetch_lists_are_harmless(dist_run: Any, world: int) -> None:
    for r in dist_run(world, odd_prefetch_lists):
        assert max(r["diff"]) < 1e-6
        assert r["faces"] == [True] * 8


def gradient_sync_mixes() -> dict[str, Any]:
    """set_requires_gradient_sync(False) for two micro-batches (one inside no_sync) then True; and the
    switches flipped between a forward and its backward: the accumulated step equals the reference's."""
    ref, model = _pair()
    set_requires_gradient_sync(model, False)

    def third_syncs(m: int) -> None:
        set_requires_gradient_sync(model, m == 2)

    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        for m in range(3):
            batch, local = _batch(3 * step + m)
            mlp_loss(ref, batch).backward()
            third_syncs(m)
            with no_sync(model) if m == 1 else contextlib.nullcontext():
                mlp_loss(model, local).backward()
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    first = _diff(ref, model)

    def flip(m: int) -> None:  # between forward and backward
        set_requires_gradient_sync(model, m == 1)
        set_reshard_after_backward(model.l2[0], m == 1)

    _train(ref, model, range(2, 4), micro=2, between=flip)
    return {"diff": (first, _diff(ref, model)), "clip": clip_grad_norm_(model, 1e9).item()}


@pytest.mark.parametrize("world", [2, 4])
def test_gradient_sync_switch_with_no_sync_and_mid_step_flips(dist_run: Any, world: int) -> None:
    for r in dist_run(world, gradient_sync_mixes):
        assert max(r["diff"]) < 1e-6


def async_handles_and_failures() -> dict[str, Any]:
    """Handles waited twice, after reshard, never; an explicit unshard before a forward that raises:
    the next steps match the reference, and nothing stays unsharded."""
    ref, model = _pair()
    opts = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)  # from the faces
    first = unshard(model.l1, async_op=True)
    assert first is not None
    first.wait()
    first.wait()
    late = unshard(model.l2[0], async_op=True)
    assert late is not None
    reshard(model.l2[0])
    late.wait()
    unshard(model.l3, async_op=True)  # never waited: its pre-forward does
    _train(ref, model, range(1), opts=opts)
    unshard(model.l1)
    unshard(model.l2[2], async_op=True)
    failed = error_text(lambda: model(torch.randn(2, 6)))  # wrong width: l1's forward raises
    _train(ref, model, range(1, 3), opts=opts)
    return {"failed": failed, "diff": _diff(ref, model), "faces": [_is_face(u.weight) for u in _units(model)]}


@pytest.mark.parametrize("world", [2, 4])
def test_async_handles_and_a_failing_forward_after_unshard(dist_run: Any, world: int) -> None:
    for r in dist_run(world, async_handles_and_failures):
        assert r["failed"].startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied"), r["failed"]
        assert r["diff"] < 1e-6
        assert r["faces"] == [True] * 4


# ---------------------------------------------------------------------------- the controls with other features
def _single() -> Any:
    """This rank alone: the replicate group of a HYBRID_SHARD model sharded over every rank."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates each
    return groups[dist.get_rank()]


def _build(config: str) -> nn.Module:
    torch.manual_seed(0)
    model = OddMLP()
    if config == "wrapper_flat" or config == "wrapper_orig":
        return FullyShardedDataParallel(model, auto_wrap_policy=LINEAR, use_orig_params=config == "wrapper_orig")
    if config == "checkpointing":
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Linear))
    kwargs: dict[str, Any] = {
        "mixed_precision": {"mixed_precision": MixedPrecision(param_dtype=torch.float64)},
        "shard_grad_op": {"strategy": ShardingStrategy.SHARD_GRAD_OP},
        "hybrid": {"strategy": ShardingStrategy.HYBRID_SHARD, "process_group": (dist.group.WORLD, _single())},
        "offload": {"cpu_offload": CPUOffload(offload_params=True)},
    }.get(config, {})
    return fully_shard(model, LINEAR, **kwargs)


def with_and_without_controls(config: str) -> dict[str, Any]:
    """The same training with the controls (explicit unshard, gradient sync off for the first of two
    micro-batches, units kept whole between them, a load_state_dict while l1 is unsharded) and without:
    the same parameters."""
    results = []
    for controlled in (False, True):
        model = _build(config)
        units = (
            [model.get_submodule(n) for n in ("l1", "l2.0", "l2.2", "l3")]
            if "wrapper" not in config
            else [model.module.get_submodule(n) for n in ("l1", "l2.0", "l2.2", "l3")]
        )
        units = [u.get_submodule("_checkpoint_wrapped_module") if config == "checkpointing" else u for u in units]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            for m in range(2):
                if controlled:
                    set_requires_gradient_sync(model, m == 1)
                    set_reshard_after_backward(model, m == 1)
                    set_reshard_after_forward(units[2], m == 0)
                    if m == 0:
                        unshard(units[0])
                        unshard(units[1], async_op=True)
                mlp_loss(model, _batch(2 * step + m)[1]).backward()
            opt.step()
            opt.zero_grad()
            if controlled:  # after zero_grad: resharding must not show the cleared gradient again
                unshard(units[0])
            sd = model.state_dict()
            model.load_state_dict({k: v * 0.5 for k, v in sd.items()})
        results.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    plain, controlled_sd = results
    return {"diff": max((plain[k] - controlled_sd[k]).abs().max().item() for k in plain), "keys": len(plain)}


CONFIGS = ["plain", "mixed_precision", "shard_grad_op", "hybrid", "offload", "checkpointing"]
CONFIGS += ["wrapper_flat", "wrapper_orig"]


@pytest.mark.parametrize("config", CONFIGS)
def test_controls_with_other_features(dist_run: Any, config: str) -> None:
    for r in dist_run(2, with_and_without_controls, config):
        assert r["diff"] < 1e-6 and r["keys"] == 8, r


def cleared_then_resharded() -> dict[str, Any]:
    """zero_grad(), then unshard + reshard (or a load while unsharded) before the next forward: the
    cleared gradient must not come back into ``.grad`` and the next step."""
    ref, model = _pair()
    _train(ref, model, range(1))
    unshard(model.l1)
    reshard(model.l1)
    shown = model.l1.weight.grad is not None
    unshard(model.l3)
    model.load_state_dict(model.state_dict())
    shown = shown or model.l3.weight.grad is not None
    _train(ref, model, range(1, 3))
    return {"shown": shown, "diff": _diff(ref, model)}


@pytest.mark.parametrize("world", [2, 4])
def test_reshard_does_not_bring_back_a_cleared_gradient(dist_run: Any, world: int) -> None:
    for r in dist_run(world, cleared_then_resharded):
        assert not r["shown"]
        assert r["diff"] < 1e-6


def clip_and_optim_state_while_unsharded() -> dict[str, Any]:
    """Explicit unshard after backward, then clip_grad_norm_ and optim_state_dict: the same norm and
    state as with every unit sharded; after reshard the step matches the reference."""
    ref, model = _pair()
    opt_ref, opt = torch.optim.Adam(ref.parameters(), lr=0.01), torch.optim.Adam(model.parameters(), lr=0.01)
    norms = []
    for step in range(2):
        batch, local = _batch(step)
        mlp_loss(ref, batch).backward()
        mlp_loss(model, local).backward()
        unshard(model.l1)
        unshard(model.l3, async_op=True)
        norms.append((clip_grad_norm_(model, 0.1).item(), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1).item()))
        if step == 1:
            saved = {k: v["exp_avg"].clone() for k, v in optim_state_dict(model, opt)["state"].items()}
        reshard(model.l1)
        reshard(model.l3)
        if step == 1:  # the same state with every unit sharded
            want = {k: v["exp_avg"] for k, v in optim_state_dict(model, opt)["state"].items()}
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    state_diff = max((saved[k] - want[k]).abs().max().item() for k in want) if len(want) == 8 else 1.0
    return {"norms": norms, "state_diff": state_diff, "diff": _diff(ref, model)}


@pytest.mark.parametrize("world", [2, 4])
def test_clip_and_optim_state_dict_while_unsharded(dist_run: Any, world: int) -> None:
    for r in dist_run(world, clip_and_optim_state_while_unsharded):
        for ours, want in r["norms"]:
            assert abs(ours - want) < 1e-5, r["norms"]
        assert r["state_diff"] < 1e-6
        assert r["diff"] < 1e-5


def another_root() -> dict[str, Any]:
    """unshard on a unit of another root (every unit of it, past the all-gather limit), then training of
    this root, then the other one's steps: both match their references and end sharded."""
    ref, model = _pair()
    other_ref, other = _pair()
    # built from the faces: an unsharded unit registers its full-shape original, which no optimizer steps
    other_opts = torch.optim.SGD(other_ref.parameters(), lr=0.1), torch.optim.SGD(other.parameters(), lr=0.1)
    for unit in _units(other):
        unshard(unit)
    _train(ref, model, range(2))
    mid = [_is_face(u.weight) for u in _units(other)]  # still whole: nothing of this root touched them
    _train(other_ref, other, range(2), opts=other_opts)
    return {
        "mid": mid,
        "diff": (_diff(ref, model), _diff(other_ref, other)),
        "end": [_is_face(u.weight) for m in (model, other) for u in _units(m)],
    }


@pytest.mark.parametrize("world", [2, 4])
def test_unshard_of_another_root(dist_run: Any, world: int) -> None:
    for r in dist_run(world, another_root):
        assert r["mid"] == [False] * 4
        assert max(r["diff"]) < 1e-6
        assert r["end"] == [True] * 8
