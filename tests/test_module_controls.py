"""Per-module controls (FSDP2's ``FSDPModule`` methods as functions): explicit ``unshard`` /
``reshard``, ``is_sharded`` / ``sharded_modules``, the per-unit switches and explicit prefetch lists.
Numerics against the unsharded model on the same global batch (OddMLP: padded units), and the
collectives each control saves, counted."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Iterator

import expecttest
import pytest
import torch
import torch.distributed as dist
from harness import error_of, shared_pool
from models import Block, OddMLP, TinyGPT, gpt_batch, gpt_loss, mlp_batch, mlp_loss
from parity import error_text, local_slice
from torch import nn

from fsdp_composable import (
    FullyShardedDataParallel,
    ModuleWrapPolicy,
    ShardingStrategy,
    fully_shard,
    is_sharded,
    reshard,
    set_is_last_backward,
    set_modules_to_backward_prefetch,
    set_modules_to_forward_prefetch,
    set_requires_all_reduce,
    set_requires_gradient_sync,
    set_reshard_after_backward,
    set_reshard_after_forward,
    set_unshard_in_backward,
    sharded_modules,
    unshard,
    unshard_params,
)
from fsdp_composable._comm import _collectives

LINEAR = ModuleWrapPolicy({nn.Linear})  # OddMLP: units l1, l2.0, l2.2, l3 (42 elements: padded at 4)


@contextlib.contextmanager
def counting() -> Iterator[dict[str, int]]:
    """Count our all-gathers, reduce-scatters and all-reduces while the context is open."""
    calls = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    originals = {name: getattr(_collectives, name) for name in calls}

    def counted(name: str) -> Callable[..., Any]:
        def fn(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return fn

    for name in calls:
        setattr(_collectives, name, counted(name))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(_collectives, name, fn)


def _pair(warm_up: bool = True, **kwargs: Any) -> tuple[nn.Module, nn.Module]:
    """The reference and a sharded copy; ``warm_up``: one step without an update has run (its forward
    holds the first iteration's execution-order checks, which are all-gathers too)."""
    torch.manual_seed(0)
    ref = OddMLP()
    model = fully_shard(copy.deepcopy(ref), LINEAR, **kwargs)
    if warm_up:
        mlp_loss(model, _batch(100)[1]).backward()
        model.zero_grad(set_to_none=True)
    return ref, model


def _batch(step: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The global batch (for the reference) and this rank's slice of it."""
    batch = mlp_batch(step, 2 * dist.get_world_size())
    return batch, local_slice(batch, dist.get_rank(), dist.get_world_size())


def _shown(param: torch.Tensor) -> tuple[tuple[int, ...], str]:
    """What a module registers: the unsharded original (a Parameter) or its face (a DTensor)."""
    return tuple(param.shape), type(param).__name__


def _max_diff(ref: nn.Module, model: nn.Module) -> float:
    sd, ref_sd = model.state_dict(), ref.state_dict()
    return max((sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd)


# ---------------------------------------------------------------------------- 1. unshard / reshard
def explicit_unshard() -> dict[str, Any]:
    ref, model = _pair()
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    counts = []
    for step in range(3):
        batch, local = _batch(step)
        mlp_loss(ref, batch).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        with counting() as explicit:
            unshard(model.l1)
            pending = unshard(model.l2[0], async_op=True)
        shapes = (_shown(model.l1.weight), _shown(model.l2[0].weight))
        with counting() as forward:
            loss = mlp_loss(model, local)
        with counting() as backward:
            loss.backward()
        assert pending is not None
        pending.wait()  # the pre-forward waited already: nothing left to do
        opt.step()
        opt.zero_grad()
        counts.append((explicit["all_gather"], forward["all_gather"], backward["all_gather"], shapes))
    unshard(model.l3)
    gathered = _shown(model.l3.weight)
    reshard(model.l3)
    with counting() as after_reshard:
        model(torch.randn(2, 5))
    return {
        "counts": counts,
        "diff": _max_diff(ref, model),
        "l3": (gathered, _shown(model.l3.weight)),
        "after_reshard": after_reshard["all_gather"],
    }


@pytest.mark.parametrize("world", [2, 4])
def test_explicit_unshard_replaces_the_forward_all_gather(dist_run: Any, world: int) -> None:
    for r in dist_run(world, explicit_unshard):
        # explicit: l1 and l2.0; forward gathers only l2.2 and l3; backward all four as usual
        assert [c[:3] for c in r["counts"]] == [(2, 2, 4)] * 3
        # l1 whole right after unshard; l2.0's all-gather is in flight until its pre-forward waits
        assert r["counts"][0][3] == (((7, 5), "Parameter"), ((3, 7), "DTensor"))
        assert r["diff"] < 1e-6
        assert r["l3"] == (((1, 7), "Parameter"), ((1, 7), "DTensor"))  # full, then the face again
        assert r["after_reshard"] == 4


def unshard_refusals() -> list[str]:
    _, model = _pair()
    out = [
        error_text(lambda: unshard(model.l2)),
        error_text(lambda: unshard(model.l2[1])),
        error_text(lambda: reshard(model.l1.weight)),  # type: ignore[arg-type]
        error_text(lambda: unshard(model.l1, async_op=1)),  # type: ignore[arg-type]
    ]
    with unshard_params(model):
        out.append(error_text(lambda: unshard(model.l1)))
        out.append(error_text(lambda: model(torch.randn(2, 5))))
    model(torch.randn(2, 5)).sum().backward()  # still usable
    unshard(model.l1)
    with unshard_params(model):  # writes reach the next forward, not the buffer unshard filled before
        with torch.no_grad():
            model.l1.weight.zero_()
            model.l1.bias.zero_()
    y = model(torch.randn(2, 5))
    out.append(f"constant output: {torch.equal(y[0], y[1])}")
    return out


def test_unshard_bad_inputs(dist_run: Any) -> None:
    errors = dist_run(2, unshard_refusals)
    assert errors[0] == errors[1]  # the same on every rank
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        "\n".join(errors[0]),
        """\
ValueError: unshard: module 'l2' (Sequential) is not a sharded module (its parameters belong to an enclosing unit); call it on a module fully_shard was applied to or its policy made a unit (sharded_modules(model) lists them)
ValueError: unshard: this Tanh is not a sharded module; call it on a module fully_shard was applied to or its policy made a unit (sharded_modules(model) lists them)
TypeError: reshard expects a sharded nn.Module (one fully_shard was applied to or made a unit), got DTensor
TypeError: unshard argument 'async_op' must be True or False, got int: 1
RuntimeError: unshard of Linear 'l1' was called inside unshard_params(); leave the unshard_params context first
RuntimeError: forward of OddMLP was called inside unshard_params(); leave the unshard_params context before running forward
constant output: True""",  # noqa: E501
    )


# ---------------------------------------------------------------------------- 4. is_sharded / sharded_modules
def listing() -> dict[str, Any]:
    _, model = _pair()
    names = {id(m): n for n, m in model.named_modules()}
    wrapper = FullyShardedDataParallel(OddMLP(), auto_wrap_policy=LINEAR, use_orig_params=True)
    wnames = {id(m): n for n, m in wrapper.named_modules()}
    inner = fully_shard(nn.Sequential(fully_shard(nn.Linear(3, 3)), nn.ReLU()))  # by hand, bottom-up
    return {
        "composable": [names[id(m)] for m in sharded_modules(model)],
        "wrapper": [wnames[id(m)] for m in sharded_modules(wrapper)],
        "by_hand": [type(m).__name__ for m in sharded_modules(inner)],
        "is_sharded": [is_sharded(x) for x in (model, model.l1, model.l2, model.l2[1], wrapper, model.l1.weight, 3)],
        "fsdp_modules": len(FullyShardedDataParallel.fsdp_modules(wrapper)),
    }


def test_is_sharded_and_sharded_modules(dist_run: Any) -> None:
    (r,) = dist_run(1, listing)
    assert r["composable"] == ["", "l1", "l2.0", "l2.2", "l3"]
    prefix = "_fsdp_wrapped_module."
    assert r["wrapper"] == ["", prefix + "l1", prefix + "l2.0", prefix + "l2.2", prefix + "l3"]
    assert r["by_hand"] == ["Sequential", "Linear"]
    assert r["is_sharded"] == [True, True, False, False, True, False, False]
    assert r["fsdp_modules"] == 5  # as FSDP1: the root and every unit its policy made


# ---------------------------------------------------------------------------- 2. switches
def gradient_sync(recurse: bool) -> dict[str, Any]:
    """Two micro-batches (the first without gradient sync), one optimizer step, three times."""
    ref, model = _pair()
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    target = model if recurse else model.l1
    reduced = []
    for step in range(3):
        for micro in range(2):
            batch, local = _batch(2 * step + micro)
            mlp_loss(ref, batch).backward()
            set_requires_gradient_sync(target, micro == 1, recurse=recurse)
            with counting() as calls:
                mlp_loss(model, local).backward()
            reduced.append(calls["reduce_scatter"])
        opt_ref.step()
        opt_ref.zero_grad()
        opt.step()
        opt.zero_grad()
    return {"reduced": reduced, "diff": _max_diff(ref, model)}


@pytest.mark.parametrize("world", [2, 4])
def test_requires_gradient_sync_accumulates_locally(dist_run: Any, world: int) -> None:
    for r in dist_run(world, gradient_sync, True):
        assert r["reduced"] == [0, 4] * 3  # no communication in the first micro-batch
        assert r["diff"] < 1e-6
    for r in dist_run(world, gradient_sync, False):
        assert r["reduced"] == [3, 4] * 3  # only l1 skipped (recurse=False)
        assert r["diff"] < 1e-6


def all_reduce_switch() -> dict[str, Any]:
    """HYBRID_SHARD 2 x 2: three micro-batches, the first two without the all-reduce across replicas."""
    rank = dist.get_rank()
    shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    torch.manual_seed(0)
    ref = OddMLP()
    group = (shards[rank // 2], replicas[rank % 2])
    model = fully_shard(copy.deepcopy(ref), LINEAR, strategy=ShardingStrategy.HYBRID_SHARD, process_group=group)
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    for step in range(2):
        for micro in range(3):
            batch, local = _batch(3 * step + micro)
            mlp_loss(ref, batch).backward()
            set_requires_all_reduce(model, micro == 2)
            with counting() as counted:
                mlp_loss(model, local).backward()
            calls.append((counted["reduce_scatter"], counted["all_reduce"]))
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    return {"calls": calls, "diff": _max_diff(ref, model)}


def test_requires_all_reduce_skips_only_the_cross_replica_all_reduce(dist_run: Any) -> None:
    for r in dist_run(4, all_reduce_switch):
        assert r["calls"] == [(4, 0), (4, 0), (4, 4)] * 2
        assert r["diff"] < 1e-6


def reshard_switches() -> dict[str, Any]:
    ref, model = _pair()
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    gathers = []
    for step in range(2):
        set_reshard_after_backward(model, False)  # keep every unit whole between micro-batches
        set_reshard_after_forward(model, step == 1)
        for micro in range(2):
            if micro == 1:
                set_reshard_after_backward(model, True)  # the last micro-batch: shard again for the step
            batch, local = _batch(2 * step + micro)
            mlp_loss(ref, batch).backward()
            with counting() as forward:
                loss = mlp_loss(model, local)
            with counting() as backward:
                loss.backward()
            gathers.append((forward["all_gather"], backward["all_gather"]))
        opt_ref.step()
        opt_ref.zero_grad()
        opt.step()
        opt.zero_grad()
    refused = error_text(lambda: _step_while_unsharded(model))
    return {"gathers": gathers, "diff": _max_diff(ref, model), "refused": refused}


def _step_while_unsharded(model: nn.Module) -> None:
    set_reshard_after_backward(model, False)
    mlp_loss(model, _batch(9)[1]).backward()
    try:
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    finally:
        for unit in (model.l1, model.l2[0], model.l2[2], model.l3):
            reshard(unit)


@pytest.mark.parametrize("world", [2, 4])
def test_reshard_after_forward_and_backward(dist_run: Any, world: int) -> None:
    for r in dist_run(world, reshard_switches):
        # step 0 (kept after forward): backward gathers nothing; the second micro-batch's forward
        # finds every unit whole from the first backward. Step 1 (resharded after forward): backward
        # gathers all four again.
        assert r["gathers"] == [(4, 0), (0, 0), (4, 4), (0, 4)]
        assert r["diff"] < 1e-6
        assert r["refused"].startswith("RuntimeError") and "'l1'" in r["refused"], r["refused"]


def parameters_while_unsharded() -> dict[str, Any]:
    """What ``named_parameters()`` gives while units are left unsharded between steps: the unsharded
    originals (plain, full shape and values), as FSDP2 registers them; resharded, the same face
    objects as before (an optimizer built from them keeps stepping them), gradients shown on them."""
    ref, model = _pair()
    faces = dict(model.named_parameters())
    unshard(model.l1)
    after_unshard = dict(model.named_parameters())
    ref_params = dict(ref.named_parameters())
    l1 = [after_unshard[n] for n in ("l1.weight", "l1.bias")]
    out: dict[str, Any] = {
        "unshard": [_shown(p) for p in after_unshard.values()],
        "l1_values": all(torch.equal(p, ref_params[n]) for n, p in after_unshard.items() if n.startswith("l1.")),
        "l1_plain": all(type(p) is nn.Parameter for p in l1),
    }
    reshard(model.l1)
    out["same_faces"] = all(p is faces[n] for n, p in model.named_parameters())
    batch, local = _batch(0)
    mlp_loss(ref, batch).backward()
    set_reshard_after_backward(model, False)
    mlp_loss(model, local).backward()
    kept = list(model.named_parameters())
    out["kept"] = [(_shown(p), p.grad is None) for _, p in kept]
    for unit in (model.l1, model.l2[0], model.l2[2], model.l3):
        reshard(unit)
    out["same_faces_after_backward"] = all(p is faces[n] for n, p in model.named_parameters())
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    out["grads"] = max((g - ref_params[n].grad).abs().max().item() for n, g in grads.items())
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_parameters_of_units_left_unsharded(dist_run: Any, world: int) -> None:
    shapes = [(7, 5), (7,), (3, 7), (3,), (7, 3), (7,), (1, 7), (1,)]
    for r in dist_run(world, parameters_while_unsharded):
        assert r["unshard"] == [(s, "Parameter" if i < 2 else "DTensor") for i, s in enumerate(shapes)]
        assert r["l1_values"] and r["l1_plain"] and r["same_faces"] and r["same_faces_after_backward"]
        # kept whole after backward: every unit registers its original, whose gradient is not shown yet
        assert r["kept"] == [((s, "Parameter"), True) for s in shapes]
        assert r["grads"] < 1e-6


def embedding_unit() -> dict[str, Any]:
    torch.manual_seed(0)
    ref = TinyGPT(n_layers=2)
    model = fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({Block, nn.Embedding}))
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    set_unshard_in_backward(model.tok, False)  # an embedding's gradient needs only the indices
    set_is_last_backward(model, True)
    gathers = []
    world, rank = dist.get_world_size(), dist.get_rank()
    for step in range(2):
        batch = gpt_batch(step, 2 * world)
        gpt_loss(ref, batch).backward()
        loss = gpt_loss(model, local_slice(batch, rank, world))
        with counting() as backward:
            loss.backward()
        gathers.append(backward["all_gather"])
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    return {"gathers": gathers, "diff": _max_diff(ref, model)}


@pytest.mark.parametrize("world", [2, 4])
def test_unshard_in_backward_false_skips_the_all_gather(dist_run: Any, world: int) -> None:
    for r in dist_run(world, embedding_unit):
        assert r["gathers"] == [2, 2]  # blocks.0 and blocks.1; not tok, not the root (kept whole)
        assert r["diff"] < 1e-5


def root_resharded() -> dict[str, Any]:
    torch.manual_seed(0)
    ref = TinyGPT(n_layers=2)
    model = fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({Block}))
    world, rank = dist.get_world_size(), dist.get_rank()
    gathers = []
    for step in range(2):
        set_reshard_after_forward(model, step == 1, recurse=False)  # the root unit only
        batch = gpt_batch(step, 2 * world)
        gpt_loss(ref, batch).backward()
        loss = gpt_loss(model, local_slice(batch, rank, world))
        with counting() as backward:
            loss.backward()
        gathers.append(backward["all_gather"])
    grads = {n: p.grad for n, p in ref.named_parameters()}
    with unshard_params(model, with_grads=True):
        diff = max((p.grad - grads[n]).abs().max().item() for n, p in model.named_parameters())
    return {"gathers": gathers, "diff": diff}


@pytest.mark.parametrize("world", [2, 4])
def test_reshard_after_forward_on_the_root_unit(dist_run: Any, world: int) -> None:
    for r in dist_run(world, root_resharded):
        # step 0 (root kept whole, as by default): only the two blocks; step 1: the root unit too
        assert r["gathers"] == [2, 3]
        assert r["diff"] < 1e-5


def switch_refusals() -> list[str]:
    _, model = _pair()
    return [
        error_text(lambda: set_requires_gradient_sync(model.l2, False)),
        error_text(lambda: set_reshard_after_forward(model, 0)),  # type: ignore[arg-type]
        error_text(lambda: set_reshard_after_backward(model, True, recurse="yes")),  # type: ignore[arg-type]
        error_text(lambda: set_modules_to_forward_prefetch(model.l1, model.l2)),  # type: ignore[arg-type]
        error_text(lambda: set_modules_to_backward_prefetch(model.l3, [model.l2[2], model.l2])),
    ]


def switch_on_one_rank() -> list[str]:
    _, model = _pair()
    if dist.get_rank() == 0:
        set_requires_gradient_sync(model, False)  # the other rank reduces: the ranks disagree
    local = _batch(0)[1]
    return [error_of(lambda: mlp_loss(model, local).backward()) for _ in range(2)]


def test_switch_set_on_one_rank_is_an_error_on_every_rank() -> None:
    # the collective headers find the disagreement, with no wait to time out: the session's pool
    results = shared_pool(2).run(switch_on_one_rank, timeout=120)
    for messages in results:
        for message in messages:
            assert message.startswith("RankMismatchError: fully_shard: "), message
            assert "rank 1: backward: a reduce-scatter" in message, message


def test_switch_bad_inputs(dist_run: Any) -> None:
    errors = dist_run(2, switch_refusals)
    assert errors[0] == errors[1]
    expecttest.TestCase().assertExpectedInline(
        "\n".join(errors[0]),
        """\
ValueError: set_requires_gradient_sync: module 'l2' (Sequential) is not a sharded module (its parameters belong to an enclosing unit); call it on a module fully_shard was applied to or its policy made a unit (sharded_modules(model) lists them)
TypeError: set_reshard_after_forward argument 'reshard_after_forward' must be True or False, got int: 0
TypeError: set_reshard_after_backward argument 'recurse' must be True or False, got str: 'yes'
TypeError: set_modules_to_forward_prefetch argument 'modules' must be a list of sharded modules, got Sequential
ValueError: set_modules_to_backward_prefetch (modules[1]): module 'l2' (Sequential) is not a sharded module (its parameters belong to an enclosing unit); call it on a module fully_shard was applied to or its policy made a unit (sharded_modules(model) lists them)""",  # noqa: E501
    )


# ---------------------------------------------------------------------------- 3. explicit prefetch
def explicit_prefetch(limit: bool) -> dict[str, Any]:
    ref, model = _pair(warm_up=False, limit_all_gathers=limit, backward_prefetch=None, forward_prefetch=False)
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    set_modules_to_forward_prefetch(model.l1, [model.l2[0], model.l2[2]])  # two ahead
    set_modules_to_backward_prefetch(model.l3, [model.l2[2], model.l2[0]])
    state = fully_shard.state(model)
    logs, peaks, at_l1 = [], [], []
    gathers = [0]
    original = _collectives.all_gather

    def counted(*args: Any, **kwargs: Any) -> Any:
        gathers[0] += 1
        return original(*args, **kwargs)

    # runs after fully_shard's pre-forward of l1, which issued the listed units' all-gathers
    hook = model.l1.register_forward_pre_hook(lambda *_: at_l1.append(gathers[0]))
    _collectives.all_gather = counted  # type: ignore[assignment]
    try:
        for step in range(3):
            batch, local = _batch(step)
            mlp_loss(ref, batch).backward()
            gathers[0] = 0
            mlp_loss(model, local).backward()
            assert state.exec_order_data is not None and state.limiter is not None
            logs.append(state.exec_order_data.last_prefetch_log)
            peaks.append(state.limiter.peak)
            for o in (opt_ref, opt):
                o.step()
                o.zero_grad()
    finally:
        _collectives.all_gather = original  # type: ignore[assignment]
        hook.remove()
    return {"logs": logs, "peak": max(peaks), "diff": _max_diff(ref, model), "at_l1": at_l1}


@pytest.mark.parametrize("world", [2, 4])
def test_explicit_prefetch_lists_issue_every_unit_listed(dist_run: Any, world: int) -> None:
    """As FSDP2: every unit listed is gathered early, with the all-gather limit on or off ([Note:
    explicit prefetch lists]); the first iteration prefetches nothing in forward (the order check)."""
    for limit in (True, False):
        for r in dist_run(world, explicit_prefetch, limit):
            assert r["logs"][0] == [("backward", "l2.2"), ("backward", "l2.0")], (limit, r)
            listed = [("forward", "l2.0"), ("forward", "l2.2"), ("backward", "l2.2"), ("backward", "l2.0")]
            assert r["logs"][1] == r["logs"][2] == listed, (limit, r)
            # all-gathers issued when l1's forward starts: l1's own, then both listed units
            assert r["at_l1"][1:] == [3, 3], (limit, r)
            assert r["peak"] == 3, (limit, r)
            assert r["diff"] < 1e-6, (limit, r)


# ---------------------------------------------------------------------------- the wrapper's methods
def wrapper_controls() -> dict[str, Any]:
    torch.manual_seed(0)
    ref = OddMLP()
    model = FullyShardedDataParallel(copy.deepcopy(ref), auto_wrap_policy=LINEAR, use_orig_params=True)
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    reduced = []
    for micro in range(2):
        batch, local = _batch(micro)
        mlp_loss(ref, batch).backward()
        model.set_requires_gradient_sync(micro == 1)  # the wrapper's method, recursive
        with counting() as calls:
            mlp_loss(model, local).backward()
        reduced.append(calls["reduce_scatter"])
    for o in (opt_ref, opt):
        o.step()
        o.zero_grad()
    model.unshard()  # its own unit: the root holds no parameter of its own here, so nothing to gather
    model.reshard()
    handle = unshard(model.module.l1, async_op=True)
    assert handle is not None
    handle.wait()
    return {"reduced": reduced, "diff": _max_diff(ref, model), "l1": tuple(model.module.l1.weight.shape)}


def test_wrapper_exposes_the_controls(dist_run: Any) -> None:
    for r in dist_run(2, wrapper_controls):
        assert r["reduced"] == [0, 4]
        assert r["diff"] < 1e-6
        assert r["l1"] == (7, 5)
