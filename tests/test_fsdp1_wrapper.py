# ruff: noqa: E501
"""FSDP1's wrapper methods and static methods run as written: ``apply``, ``register_comm_hook`` (torch's
default hooks and a user's), ``ignored_states``, ``_HYBRID_SHARD_ZERO2``, the state-dict and optimizer
static methods, and the rest of FSDP1's public surface. Training and gradients are compared with the
unsharded model at 2 and 4 ranks (odd sizes: every shard is padded)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import expecttest
import pytest
import torch
from harness import error_of
from models import Block, OddMLP, TinyGPT, gpt_batch, gpt_loss, mlp_batch, mlp_loss
from parity import train_side_by_side
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_composable import FullyShardedDataParallel, ModuleWrapPolicy, OptimStateKeyType


# ---------------------------------------------------------------------------- FullyShardedDataParallel.apply
def _init_weights(m: nn.Module) -> None:
    """Needs full shapes: orthogonal init of a (7, 5) matrix cannot run on a 1-D shard."""
    if isinstance(m, nn.Linear):
        torch.manual_seed(m.in_features * 100 + m.out_features)
        nn.init.orthogonal_(m.weight)
        nn.init.constant_(m.bias, 0.25)


def _apply_then_train(use_orig_params: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = OddMLP()

    def shard(m: nn.Module) -> nn.Module:
        model = FullyShardedDataParallel(
            m, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=use_orig_params
        )
        seen: list[tuple[int, ...]] = []
        assert model.apply(lambda mod: seen.extend(tuple(p.shape) for p in mod.parameters(recurse=False))) is model
        assert sorted(seen) == sorted(tuple(p.shape) for p in ref.parameters()), seen  # full shapes inside
        model.apply(_init_weights)
        return model

    ref.apply(_init_weights)
    return train_side_by_side(
        ref, shard, mlp_loss, mlp_batch, per_rank_batch=2, steps=3, optim="adamw" if use_orig_params else "sgd-flat"
    )


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("use_orig_params", [True, False])
def test_wrapper_apply_runs_on_full_parameters(
    dist_run: Callable[..., Any], world_size: int, use_orig_params: bool
) -> None:
    for r in dist_run(world_size, _apply_then_train, use_orig_params):
        assert r["keys_equal"] and r["shapes_equal"]
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-6)
        assert r["max_weight_diff"] < 1e-5


# ---------------------------------------------------------------------------- communication hooks
class _ScaleState:
    """A user's hook state: what the hook scales by, and what it saw."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.calls: list[tuple[int, int]] = []


def _scaling_hook(state: _ScaleState, grad: torch.Tensor, output: Any = None) -> None:
    import torch.distributed as dist

    state.calls.append((grad.numel(), -1 if output is None else output.numel()))
    grad.mul_(state.scale / dist.get_world_size())
    if output is None:
        dist.all_reduce(grad)
    else:
        dist.reduce_scatter_tensor(output, grad)


def _grads_with_hook(hook_name: str, strategy: str, world_size: int, accumulate: bool = False) -> dict[str, Any]:
    """One model with the hook, one plain unsharded reference: gradients after one backward, in full."""
    import torch.distributed as dist
    from torch.distributed.algorithms._comm_hooks import default_hooks

    from fsdp_composable import ShardingStrategy, unshard_params

    torch.manual_seed(0)
    ref = OddMLP()
    model = FullyShardedDataParallel(
        __import__("copy").deepcopy(ref),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        sharding_strategy=ShardingStrategy[strategy],
        use_orig_params=True,
    )
    no_shard = strategy == "NO_SHARD"
    hooks: dict[str, tuple[Any, Any]] = {
        "default": (
            default_hooks.DefaultState(dist.group.WORLD),
            default_hooks.allreduce_hook if no_shard else default_hooks.reduce_scatter_hook,
        ),
        "fp16": (default_hooks.LowPrecisionState(dist.group.WORLD), default_hooks.fp16_compress_hook),
        "bf16": (default_hooks.LowPrecisionState(dist.group.WORLD), default_hooks.bf16_compress_hook),
        "scale": (_ScaleState(3.0), _scaling_hook),
    }
    hook_state, hook = hooks[hook_name]
    model.register_comm_hook(hook_state, hook)
    rank = dist.get_rank()
    for step in range(2 if accumulate else 1):  # accumulate: the first micro-batch under no_sync
        batch = mlp_batch(step, 2 * world_size)
        mlp_loss(ref, batch).backward()
        with model.no_sync() if accumulate and step == 0 else contextlib.nullcontext():
            mlp_loss(model, (batch[0][rank * 2 : rank * 2 + 2], batch[1][rank * 2 : rank * 2 + 2])).backward()
    with unshard_params(model, with_grads=True):
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
    want = {n: p.grad for n, p in ref.named_parameters()}
    calls = hook_state.calls if isinstance(hook_state, _ScaleState) else []
    return {
        "max_diff": max((got[n] - want[n] * (3.0 if hook_name == "scale" else 1.0)).abs().max().item() for n in want),
        "calls": calls,
    }


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize(("hook", "tol"), [("default", 1e-6), ("scale", 1e-5), ("fp16", 2e-3), ("bf16", 2e-2)])
def test_comm_hooks_reduce_gradients(
    dist_run: Callable[..., Any], world_size: int, strategy: str, hook: str, tol: float
) -> None:
    for r in dist_run(world_size, _grads_with_hook, hook, strategy, world_size):
        assert r["max_diff"] < tol, r
        if hook == "scale":  # the full padded flat gradient, and the shard (or nothing under NO_SHARD)
            assert len(r["calls"]) == 4, r["calls"]  # the root unit (nothing) and l1, l2.0, l2.2, l3: 4 with params
            for full, shard in r["calls"]:
                assert (shard == -1) if strategy == "NO_SHARD" else (full == shard * world_size), r["calls"]


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_comm_hook_with_no_sync(dist_run: Callable[..., Any], strategy: str) -> None:
    """Micro-batches kept under no_sync reach the hook together with the synced one's gradient."""
    for r in dist_run(2, _grads_with_hook, "scale", strategy, 2, True):
        assert r["max_diff"] < 1e-5, r
        assert len(r["calls"]) == 4, r["calls"]  # one reduction per unit, in the synced backward only


def _comm_hook_errors() -> dict[str, str]:
    import torch.distributed as dist
    from torch.distributed.algorithms._comm_hooks import default_hooks

    from fsdp_composable import MixedPrecision

    state = default_hooks.DefaultState(dist.group.WORLD)
    out = {}
    model = FullyShardedDataParallel(OddMLP())
    out["not_callable"] = error_of(lambda: model.register_comm_hook(state, 3))
    model.register_comm_hook(state, default_hooks.reduce_scatter_hook)
    out["twice"] = error_of(lambda: model.register_comm_hook(state, default_hooks.reduce_scatter_hook))
    late = FullyShardedDataParallel(OddMLP())
    late(torch.randn(2, 5)).sum().backward()
    out["after_forward"] = error_of(lambda: late.register_comm_hook(state, default_hooks.reduce_scatter_hook))
    mp = FullyShardedDataParallel(OddMLP(), mixed_precision=MixedPrecision(reduce_dtype=torch.float16))
    out["low_precision_with_reduce_dtype"] = error_of(
        lambda: mp.register_comm_hook(state, default_hooks.bf16_compress_hook)
    )
    return out


def test_comm_hook_errors(dist_run: Callable[..., Any]) -> None:
    (errors,) = dist_run(1, _comm_hook_errors)
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        errors["not_callable"], """TypeError: register_comm_hook: the communication hook must be callable, got int"""
    )
    tc.assertExpectedInline(
        errors["twice"],
        """RuntimeError: register_comm_hook: a communication hook is already registered (unit '<root>'); register one, once""",
    )
    tc.assertExpectedInline(
        errors["after_forward"],
        """RuntimeError: register_comm_hook: register the communication hook before the first forward; this OddMLP has already run one""",
    )
    tc.assertExpectedInline(
        errors["low_precision_with_reduce_dtype"],
        """ValueError: register_comm_hook: bf16_compress_hook casts gradients itself, but unit '<root>' has MixedPrecision(reduce_dtype=torch.float16); use one of them, not both""",
    )


# ---------------------------------------------------------------------------- ignored_states
def _ignored_states_train(kind: str) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = OddMLP()

    def shard(m: nn.Module) -> nn.Module:
        states: list[Any] = [m.l2] if kind == "module" else list(m.l2.parameters())
        model = FullyShardedDataParallel(m, ignored_states=states, use_orig_params=True)
        # ignored parameters stay whole on every rank (the rest is sharded)
        assert [tuple(p.shape) for p in m.l2.parameters()] == [(3, 7), (3,), (7, 3), (7,)]
        assert isinstance(m.l1.weight, DTensor) and not any(isinstance(p, DTensor) for p in m.l2.parameters())
        return model

    r = train_side_by_side(ref, shard, mlp_loss, mlp_batch, per_rank_batch=2, steps=1, optim="sgd")
    return r


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kind", ["module", "params"])
def test_wrapper_ignored_states(dist_run: Callable[..., Any], kind: str, world_size: int) -> None:
    for r in dist_run(world_size, _ignored_states_train, kind):
        assert r["keys_equal"] and r["shapes_equal"]
        # one step: the ignored parameters' gradients are not reduced, so only the first loss is shared
        assert r["losses"][0] == pytest.approx(r["ref_losses"][0], rel=1e-6)


def _ignored_states_errors() -> dict[str, str]:
    m = OddMLP()
    return {
        "both": error_of(lambda: FullyShardedDataParallel(OddMLP(), ignored_modules=[], ignored_states=[])),
        "foreign_param": error_of(lambda: FullyShardedDataParallel(m, ignored_states=[nn.Parameter(torch.ones(2))])),
        "not_list": error_of(lambda: FullyShardedDataParallel(m, ignored_states=m.l1)),
    }


def test_wrapper_ignored_states_errors(dist_run: Callable[..., Any]) -> None:
    (errors,) = dist_run(1, _ignored_states_errors)
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        errors["both"],
        """ValueError: FullyShardedDataParallel argument 'ignored_states' and 'ignored_modules' were both given; pass one""",
    )
    tc.assertExpectedInline(
        errors["foreign_param"],
        "",  # FSDP1 takes parameters outside the module too (they are not its own: nothing to ignore)
    )
    tc.assertExpectedInline(
        errors["not_list"],
        """TypeError: FullyShardedDataParallel argument 'ignored_states' must be a list of parameters and/or modules, got Linear""",
    )


# ---------------------------------------------------------------------------- state-dict and optimizer static methods
def _static_methods(world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    from fsdp_composable import FullStateDictConfig, StateDictType

    fsdp = FullyShardedDataParallel
    torch.manual_seed(0)
    ref = OddMLP()
    model = fsdp(__import__("copy").deepcopy(ref), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=True)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    rank = dist.get_rank()
    for step in range(2):
        batch = mlp_batch(step, 2 * world_size)
        mlp_loss(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mlp_loss(model, (batch[0][rank * 2 : rank * 2 + 2], batch[1][rank * 2 : rank * 2 + 2])).backward()
        opt.step()
        opt.zero_grad()
    out: dict[str, Any] = {}
    # set_state_dict_type: persistent until changed, returns the previous settings
    before = fsdp.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
    out["previous"] = (before.state_dict_type.name, type(before.state_dict_config).__name__)
    out["now"] = fsdp.get_state_dict_type(model).state_dict_type.name
    out["sharded_values"] = sorted({type(v).__name__ for v in model.state_dict().values()})
    fsdp.set_state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False))
    out["full_values"] = sorted({type(v).__name__ for v in model.state_dict().values()})
    # full_optim_state_dict (rank 0 only by default) -> rekey by position -> loads into the plain optimizer
    full = fsdp.full_optim_state_dict(model, opt)
    out["full_on_rank"] = bool(full)
    if rank == 0:
        plain = fsdp.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, ref)
        ref_sd = ref_opt.state_dict()
        out["rekeyed_equal"] = (
            all(
                torch.allclose(plain["state"][i][k], ref_sd["state"][i][k], atol=1e-6)
                for i in ref_sd["state"]
                for k in ("exp_avg", "exp_avg_sq")
            )
            and plain["param_groups"][0]["params"] == ref_sd["param_groups"][0]["params"]
        )
        back = fsdp.rekey_optim_state_dict(plain, OptimStateKeyType.PARAM_NAME, ref)
        out["roundtrip"] = list(back["state"]) == list(full["state"])
    # scatter_full_optim_state_dict: rank 0's plain dict, a fresh model and optimizer on every rank
    fresh = fsdp(OddMLP(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=True)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    osd = ref_opt.state_dict() if rank == 0 else None
    fresh_opt.load_state_dict(fsdp.scatter_full_optim_state_dict(osd, fresh, optim=fresh_opt))
    full_everywhere = fsdp.full_optim_state_dict(fresh, fresh_opt, rank0_only=False)
    mine = fsdp.full_optim_state_dict(model, opt, rank0_only=False)
    out["scatter_equal"] = all(
        torch.allclose(full_everywhere["state"][n][k], mine["state"][n][k], atol=1e-6)
        for n in mine["state"]
        for k in ("exp_avg", "exp_avg_sq")
    )
    # shard_full_optim_state_dict and the sharded pair
    again = fsdp(OddMLP(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=True)
    again_opt = torch.optim.Adam(again.parameters(), lr=0.01)
    again_opt.load_state_dict(fsdp.shard_full_optim_state_dict(mine, again, optim=again_opt))
    sharded = fsdp.sharded_optim_state_dict(model, opt)
    out["sharded_types"] = sorted({type(v).__name__ for s in sharded["state"].values() for v in s.values()})
    again_opt.load_state_dict(fsdp.flatten_sharded_optim_state_dict(sharded, again, again_opt))
    reread = fsdp.full_optim_state_dict(again, again_opt, rank0_only=False)
    out["sharded_roundtrip"] = all(
        torch.equal(reread["state"][n][k], mine["state"][n][k]) for n in mine["state"] for k in ("exp_avg",)
    )
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_wrapper_state_dict_static_methods(dist_run: Callable[..., Any], world_size: int) -> None:
    results = dist_run(world_size, _static_methods, world_size)
    for rank, r in enumerate(results):
        assert r["previous"] == ("FULL_STATE_DICT", "FullStateDictConfig")
        assert r["now"] == "SHARDED_STATE_DICT"
        assert r["sharded_values"] == ["DTensor"] and r["full_values"] == ["Tensor"]
        assert r["full_on_rank"] == (rank == 0)
        assert r["scatter_equal"] and r["sharded_roundtrip"]
        assert r["sharded_types"] == ["DTensor", "Tensor"]
    assert results[0]["rekeyed_equal"] and results[0]["roundtrip"]


# ---------------------------------------------------------------------------- _HYBRID_SHARD_ZERO2
def _hybrid_zero2(strategy: str) -> dict[str, Any]:
    import torch.distributed as dist

    from fsdp_composable import ShardingStrategy

    rank = dist.get_rank()
    shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = (shards[rank // 2], replicas[rank % 2])
    torch.manual_seed(0)
    ref = TinyGPT()
    kept_after_forward: list[bool] = []

    def shard(m: nn.Module) -> nn.Module:
        model = FullyShardedDataParallel(
            m,
            process_group=group,
            sharding_strategy=ShardingStrategy[strategy],
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            use_orig_params=True,
        )
        handles = [h for h in model._fsdp_state.handles if h.unit_fqn]

        def record(*_: Any) -> None:
            kept_after_forward.append(all(h.is_unsharded for h in handles))

        model.register_forward_hook(record)
        return model

    out = train_side_by_side(ref, shard, gpt_loss, gpt_batch, per_rank_batch=2, steps=3, optim="adamw")
    out["kept_after_forward"] = kept_after_forward
    return out


@pytest.mark.parametrize("strategy", ["_HYBRID_SHARD_ZERO2", "HYBRID_SHARD"])
def test_hybrid_shard_zero2(dist_run: Callable[..., Any], strategy: str) -> None:
    """2 x 2: shard within {0,1} and {2,3}, replicate across; ZERO2 keeps the blocks unsharded after forward."""
    for r in dist_run(4, _hybrid_zero2, strategy):
        assert r["keys_equal"] and r["shapes_equal"]
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-6)
        assert r["max_weight_diff"] < 1e-4
        assert r["kept_after_forward"] == [strategy == "_HYBRID_SHARD_ZERO2"] * 3


# ---------------------------------------------------------------------------- FSDP1's public surface
def _surface() -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    from fsdp_composable import ShardingStrategy

    public = sorted(n for n in set(dir(TorchFSDP)) - set(dir(nn.Module)) if not n.startswith("_"))
    model = FullyShardedDataParallel(OddMLP(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    torch_model = TorchFSDP(OddMLP(), device_id=torch.device("cpu"))
    attributes = sorted(
        n for n in vars(torch_model) if not n.startswith("_") and n not in vars(nn.Module()) and n not in ("training",)
    )
    return {
        "methods": public,
        "missing_methods": [n for n in public if not hasattr(FullyShardedDataParallel, n)],
        "attributes": attributes,
        "missing_attributes": [n for n in attributes if not hasattr(model, n)],
        "strategy": model.sharding_strategy is ShardingStrategy.NO_SHARD,  # one rank: nothing to shard
        "is_root": model.check_is_root(),
        "fsdp_modules": [type(m).__name__ for m in FullyShardedDataParallel.fsdp_modules(model)],
        "buffers": [n for n, _ in FullyShardedDataParallel(nn.BatchNorm1d(3)).named_buffers()],
    }


def test_wrapper_has_fsdp1_public_surface(dist_run: Callable[..., Any]) -> None:
    (r,) = dist_run(1, _surface)
    assert r["methods"], "torch's list is empty: the test would prove nothing"
    assert r["missing_methods"] == [], r["methods"]
    assert r["missing_attributes"] == [], r["attributes"]
    assert r["strategy"] and r["is_root"]
    assert r["fsdp_modules"] == ["FullyShardedDataParallel", "Linear", "Linear", "Linear", "Linear"]  # every unit
    assert r["buffers"] == ["running_mean", "running_var", "num_batches_tracked"]


def _unsupported_keywords() -> dict[str, str]:
    model = FullyShardedDataParallel(OddMLP(), use_orig_params=True)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    fsdp = FullyShardedDataParallel
    return {
        "optim_input": error_of(lambda: fsdp.full_optim_state_dict(model, optim, optim_input=list(model.parameters()))),
        "named_optimizer": error_of(lambda: fsdp.optim_state_dict_to_load(model, optim, {}, is_named_optimizer=True)),
        "group": error_of(lambda: fsdp.optim_state_dict(model, optim, group=object())),
        "optim_config": error_of(
            lambda: fsdp.set_state_dict_type(
                model, __import__("fsdp_composable").StateDictType.FULL_STATE_DICT, None, _RankZeroOnly()
            )
        ),
    }


class _RankZeroOnly:
    """Like torch's FullOptimStateDictConfig(rank0_only=True)."""

    offload_to_cpu = False
    rank0_only = True


def test_wrapper_unsupported_fsdp1_keywords(dist_run: Callable[..., Any]) -> None:
    (errors,) = dist_run(1, _unsupported_keywords)
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        errors["optim_input"],
        """ValueError: full_optim_state_dict: optim_input (deprecated in torch FSDP1) is not supported; pass optim=<the optimizer>""",
    )
    tc.assertExpectedInline(
        errors["named_optimizer"],
        """ValueError: FullyShardedDataParallel.optim_state_dict_to_load: is_named_optimizer is not supported (the model's own process groups and a plain torch.optim.Optimizer are used); leave it out""",
    )
    tc.assertExpectedInline(
        errors["group"],
        """ValueError: FullyShardedDataParallel.optim_state_dict: group is not supported (the model's own process groups and a plain torch.optim.Optimizer are used); leave it out""",
    )
    tc.assertExpectedInline(
        errors["optim_config"],
        "",  # followed by optimizer state dicts, as FSDP1 does (tests/test_fsdp1_port_first_save.py)
    )


# ---------------------------------------------------------------------------- summon_full_params on a plain module
def _summon_on_plain_module() -> dict[str, Any]:
    """FSDP1's static call on a module that only contains wrappers (two roots, flat-parameter mode)."""
    import copy

    fsdp = FullyShardedDataParallel
    torch.manual_seed(0)
    ref = OddMLP()
    inner = copy.deepcopy(ref)
    holder = nn.Sequential(fsdp(inner.l1), nn.ReLU(), fsdp(inner.l2), nn.ReLU(), fsdp(inner.l3))
    ref_holder = nn.Sequential(ref.l1, nn.ReLU(), ref.l2, nn.ReLU(), ref.l3)
    expected = dict(ref_holder.named_parameters())

    def params() -> dict[str, nn.Parameter]:  # a plain parent's names keep the wrapper's prefix, as in FSDP1
        return {n.replace("_fsdp_wrapped_module.", ""): p for n, p in holder.named_parameters()}

    out: dict[str, Any] = {"outside": sorted(params())}
    with fsdp.summon_full_params(holder):
        inside = params()
        out["inside_equal"] = list(inside) == list(expected) and all(
            torch.equal(p, expected[n]) for n, p in inside.items()
        )
        with torch.no_grad():
            for p in inside.values():
                p.mul_(2)  # written back on exit
    with torch.no_grad():
        for p in ref_holder.parameters():
            p.mul_(2)
    x = mlp_batch(0, 3)[0]
    with torch.no_grad():
        out["forward_equal"] = torch.allclose(holder(x), ref_holder(x), atol=1e-6)
    with fsdp.summon_full_params(holder, writeback=False):
        out["written_back"] = all(torch.equal(p, expected[n]) for n, p in params().items())
    return out


def test_summon_full_params_on_a_plain_module(dist_run: Callable[..., Any]) -> None:
    for r in dist_run(2, _summon_on_plain_module):
        assert r["outside"] == ["0._flat_param", "2._flat_param", "4._flat_param"]  # sharded between the calls
        assert r["inside_equal"] and r["written_back"] and r["forward_equal"]
