# ruff: noqa: E501
"""FSDP1 code run as written: torch's auto-wrap policies, checkpoint-wrapper keywords, the wrapper's
remaining methods and static methods, and communication hooks.

Torch FSDP1 is the baseline for which modules become units (built on a 1-rank gloo group); training
is compared with the unsharded model at 2 and 4 ranks (odd sizes: every shard is padded)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import expecttest
import pytest
import torch
from harness import error_of
from models import Block, OddMLP, TinyGPT, gpt_batch, gpt_loss, mlp_batch, mlp_loss
from parity import train_side_by_side
from torch import nn

from fsdp_composable import (
    CheckpointImpl,
    CheckpointWrapper,
    FullyShardedDataParallel,
    ModuleWrapPolicy,
    OptimStateKeyType,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    describe,
    fully_shard,
)


class SubBlock(Block):
    """A subclass of a policy's class: FSDP1's class policies match it (``isinstance``)."""


class Stack(nn.Module):
    """Odd sizes, nesting, a MultiheadAttention (size-based policies keep it a leaf), a subclass."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 16)
        self.body = nn.Sequential(Block(16), SubBlock(16), nn.Sequential(nn.Linear(16, 9), nn.Tanh()))
        self.heads = nn.ModuleList([nn.Linear(9, 3), nn.Linear(9, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(self.inp(x).unsqueeze(1)).squeeze(1)
        return self.heads[0](h).sum(-1, keepdim=True) + self.heads[1](h)


def _stack_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _user_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    """A user's function with FSDP1's signature."""
    return recurse or (nonwrapped_numel >= 150 and not isinstance(module, nn.ModuleList))


def _torch_policies() -> dict[str, Any]:
    """Torch's policies (import inside: only the test uses torch.distributed.fsdp)."""
    from torch.distributed.fsdp import wrap

    return {
        "transformer": functools.partial(wrap.transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        "size_300": functools.partial(wrap.size_based_auto_wrap_policy, min_num_params=300),
        "size_100": functools.partial(wrap.size_based_auto_wrap_policy, min_num_params=100),
        "size_no_leaf": functools.partial(
            wrap.size_based_auto_wrap_policy, min_num_params=300, force_leaf_modules=set()
        ),
        "size_exclude": functools.partial(
            wrap.size_based_auto_wrap_policy, min_num_params=100, exclude_wrap_modules={nn.Sequential, Block}
        ),
        "lambda": functools.partial(wrap.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear)),
        "module_wrap": wrap.ModuleWrapPolicy({Block, nn.LayerNorm}),
        "custom": wrap.CustomPolicy(lambda m: isinstance(m, (nn.LayerNorm, nn.MultiheadAttention))),
        "always": wrap.always_wrap_policy,
        "user": _user_policy,
    }


POLICIES = [
    "transformer",
    "size_300",
    "size_100",
    "size_no_leaf",
    "size_exclude",
    "lambda",
    "module_wrap",
    "custom",
    "always",
    "user",
]


def _torch_fsdp1_units(model: nn.Module, policy: Any) -> set[str]:
    """The modules torch FSDP1 wraps that manage parameters, by the wrapped model's FQNs."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    wrapped = TorchFSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    names = {
        name.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "")
        for name, m in wrapped.named_modules()
        if isinstance(m, TorchFSDP) and m._flat_param is not None
    }
    return names - {""}


def _our_units(model: nn.Module) -> set[str]:
    return {u.fqn for u in describe(model).units} - {""}


def _units_vs_torch(name: str) -> dict[str, Any]:
    policy = _torch_policies()[name]
    out = {}
    for label, make in (("stack", Stack), ("gpt", lambda: TinyGPT(n_layers=2))):
        torch.manual_seed(0)
        expected = _torch_fsdp1_units(make(), policy)
        composable = _our_units(fully_shard(make(), policy))
        wrapper = _our_units(FullyShardedDataParallel(make(), auto_wrap_policy=policy))
        out[label] = (sorted(expected), sorted(composable), sorted(wrapper))
    return out


@pytest.mark.parametrize("name", POLICIES)
def test_torch_policies_pick_fsdp1_units(dist_run: Callable[..., Any], name: str) -> None:
    """Each torch policy gives the units torch FSDP1 wraps, through fully_shard and the wrapper."""
    (result,) = dist_run(1, _units_vs_torch, name)
    for label, (expected, composable, wrapper) in result.items():
        assert expected, f"{name}/{label}: FSDP1 wrapped nothing, the comparison would prove nothing"
        assert composable == expected, (name, label)
        assert wrapper == expected, (name, label)


def _train_with_torch_policy(name: str, wrapper: bool) -> dict[str, Any]:
    policy = _torch_policies()[name]
    torch.manual_seed(0)
    ref = OddMLP() if name == "lambda" else Stack()
    if wrapper:
        shard: Callable[[nn.Module], nn.Module] = lambda m: FullyShardedDataParallel(  # noqa: E731
            m, auto_wrap_policy=policy, use_orig_params=True
        )
    else:
        shard = functools.partial(fully_shard, policy=policy)
    loss, batch = (mlp_loss, mlp_batch) if name == "lambda" else (_stack_loss, _stack_batch)
    return train_side_by_side(ref, shard, loss, batch, per_rank_batch=2, steps=3, optim="adamw")


def _stack_batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randn(global_batch, 5, generator=g), torch.randn(global_batch, 1, generator=g)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(("name", "wrapper"), [("size_100", False), ("lambda", True), ("custom", True)])
def test_torch_policies_train_like_unsharded(
    dist_run: Callable[..., Any], world_size: int, name: str, wrapper: bool
) -> None:
    for r in dist_run(world_size, _train_with_torch_policy, name, wrapper):
        assert r["keys_equal"] and r["shapes_equal"]
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-6)
        assert r["max_weight_diff"] < 1e-4


def _gpt_with_size_policy() -> list[float]:
    torch.manual_seed(0)
    ref = TinyGPT(n_layers=2)
    policy = _torch_policies()["size_300"]
    r = train_side_by_side(ref, functools.partial(fully_shard, policy=policy), gpt_loss, gpt_batch, 2, 2, "adamw")
    assert r["max_weight_diff"] < 1e-4, r
    return r["losses"]


def test_torch_size_policy_on_gpt_trains(dist_run: Callable[..., Any]) -> None:
    dist_run(2, _gpt_with_size_policy)


def _bad_torch_policies() -> dict[str, str]:
    from torch.distributed.fsdp import wrap

    def bad_keyword(m: nn.Module) -> Any:
        return {"limit_all_gathers": False} if isinstance(m, nn.Linear) else False

    return {
        "custom_bad_key": error_of(lambda: fully_shard(OddMLP(), wrap.CustomPolicy(bad_keyword))),
        "custom_bad_return": error_of(lambda: fully_shard(OddMLP(), wrap.CustomPolicy(lambda m: 1))),
    }


def test_torch_policy_errors(dist_run: Callable[..., Any]) -> None:
    (errors,) = dist_run(1, _bad_torch_policies)
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        errors["custom_bad_key"],
        """ValueError: torch CustomPolicy returned the keyword 'limit_all_gathers' for module 'l1', which cannot differ per unit here; per-unit keywords: ['mixed_precision', 'sharding_strategy', 'strategy'] (set the others on the call)""",
    )
    tc.assertExpectedInline(
        errors["custom_bad_return"],
        """ValueError: torch CustomPolicy's function returned int for module 'l1'; return a bool or a dict of keyword overrides""",
    )


# ---------------------------------------------------------------------------- activation checkpointing
def _torch_impl(name: str) -> Any:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl

    return CheckpointImpl[name]


def _checkpointed_gpt_trains(how: str) -> dict[str, Any]:
    """FSDP1's activation-checkpointing code, as written, then sharding with torch's block policy."""
    from torch.distributed.fsdp import wrap

    torch.manual_seed(0)
    ref = TinyGPT(n_layers=2)

    def shard(model: nn.Module) -> nn.Module:
        wrapper_fn = functools.partial(checkpoint_wrapper, checkpoint_impl=_torch_impl("NO_REENTRANT"))
        if how == "check_fn":
            apply_activation_checkpointing(
                model, checkpoint_wrapper_fn=wrapper_fn, check_fn=lambda m: isinstance(m, Block)
            )
        else:
            policy = functools.partial(wrap.transformer_auto_wrap_policy, transformer_layer_cls={Block})
            apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper_fn, auto_wrap_policy=policy)
        assert [type(b).__name__ for b in model.blocks] == ["CheckpointWrapper"] * 2
        return fully_shard(model, ModuleWrapPolicy({Block}))

    return train_side_by_side(ref, shard, gpt_loss, gpt_batch, per_rank_batch=2, steps=2, optim="adamw")


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("how", ["check_fn", "auto_wrap_policy"])
def test_fsdp1_activation_checkpointing_trains(dist_run: Callable[..., Any], world_size: int, how: str) -> None:
    for r in dist_run(world_size, _checkpointed_gpt_trains, how):
        assert r["keys_equal"] and r["shapes_equal"]
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-6)
        assert r["max_weight_diff"] < 1e-4


def test_checkpoint_wrapper_fsdp1_keywords() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    for impl in (CheckpointImpl.NO_REENTRANT, _torch_impl("NO_REENTRANT")):
        wrapped = checkpoint_wrapper(plain, checkpoint_impl=impl, preserve_rng_state=True)
        assert isinstance(wrapped, CheckpointWrapper) and wrapped.checkpoint_impl is CheckpointImpl.NO_REENTRANT
        x = torch.randn(5, 3)
        torch.manual_seed(1)
        wrapped(x).sum().backward()
        got = [p.grad.clone() for p in plain.parameters()]
        plain.zero_grad()
        torch.manual_seed(1)
        plain(x).sum().backward()
        assert all(torch.equal(a, p.grad) for a, p in zip(got, plain.parameters()))
        plain.zero_grad()
    tc = expecttest.TestCase()
    lin = nn.Linear(2, 2)
    tc.assertExpectedInline(
        error_of(lambda: checkpoint_wrapper(lin, checkpoint_impl=_torch_impl("REENTRANT"))),
        """ValueError: CheckpointWrapper(checkpoint_impl=CheckpointImpl.REENTRANT) is not supported: reentrant checkpointing recomputes the forward inside a nested backward that fully_shard's backward hooks cannot see. Use CheckpointImpl.NO_REENTRANT (the default).""",
    )
    tc.assertExpectedInline(
        error_of(lambda: checkpoint_wrapper(lin, CheckpointImpl.REENTRANT)),
        """ValueError: CheckpointWrapper(checkpoint_impl=CheckpointImpl.REENTRANT) is not supported: reentrant checkpointing recomputes the forward inside a nested backward that fully_shard's backward hooks cannot see. Use CheckpointImpl.NO_REENTRANT (the default).""",
    )
    tc.assertExpectedInline(
        error_of(lambda: checkpoint_wrapper(lin, checkpoint_impl="NO_REENTRANT")),
        """TypeError: CheckpointWrapper argument 'checkpoint_impl' must be CheckpointImpl.NO_REENTRANT, got 'NO_REENTRANT'""",
    )
    tc.assertExpectedInline(
        error_of(lambda: checkpoint_wrapper(lin, checkpoint_fn=torch.utils.checkpoint.checkpoint)),
        """ValueError: CheckpointWrapper argument 'checkpoint_fn' is not supported: the wrapper always runs torch.utils.checkpoint.checkpoint(use_reentrant=False); pass its options as keywords (preserve_rng_state, context_fn, determinism_check, debug), or use the composable checkpoint(module)""",
    )
    tc.assertExpectedInline(
        error_of(lambda: checkpoint_wrapper(lin, offload_to_cpu=True)),
        """TypeError: CheckpointWrapper got unexpected keyword arguments ['offload_to_cpu']; the options of torch.utils.checkpoint.checkpoint it passes on are ['preserve_rng_state', 'context_fn', 'determinism_check', 'debug']""",
    )


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
        assert m.l1.weight.dim() == 1
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
        "one_param": error_of(lambda: FullyShardedDataParallel(m, ignored_states=[m.l2[0].weight])),
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
        errors["one_param"],
        """ValueError: FullyShardedDataParallel ignores whole modules (ignored_modules=[...]), not single parameters: it holds 'l2.0.weight' but not every parameter of the module that holds it; list that module in ignored_modules, or move the parameter into a module of its own""",
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
    assert r["fsdp_modules"] == ["FullyShardedDataParallel"]
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
        """ValueError: set_state_dict_type: optim_state_dict_config.rank0_only=True differs from the state_dict_config's (False); optimizer state dicts follow the model's state_dict_config here, so pass optim_state_dict_config=None and set the option in state_dict_config""",
    )


def _estimate_with_torch_policy() -> tuple[list[str], list[str]]:
    from fsdp_composable import estimate_memory

    policy = _torch_policies()["size_100"]
    estimate = estimate_memory(Stack(), policy=policy, world_size=2)
    return sorted(u.fqn for u in estimate.plan.units), sorted(_torch_fsdp1_units(Stack(), policy) | {""})


def test_estimate_memory_takes_torch_policies(dist_run: Callable[..., Any]) -> None:
    (result,) = dist_run(1, _estimate_with_torch_policy)
    assert result[0] == result[1], result


def _torch_custom_overrides() -> list[tuple[str, str, Any]]:
    """torch's CustomPolicy may set torch's ShardingStrategy and MixedPrecision per unit."""
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp import wrap

    def per_unit(m: nn.Module) -> Any:
        if m is model.l1:
            return {"sharding_strategy": TorchStrategy.SHARD_GRAD_OP}
        if m is model.l3:
            return {"mixed_precision": TorchMixedPrecision(param_dtype=torch.bfloat16)}
        return False

    model = OddMLP()
    fully_shard(model, wrap.CustomPolicy(per_unit))
    return [(u.fqn, u.strategy.name, str(u.param_dtype)) for u in describe(model).units]


def test_torch_custom_policy_overrides(dist_run: Callable[..., Any]) -> None:
    for units in dist_run(2, _torch_custom_overrides):
        assert units == [
            ("", "FULL_SHARD", "None"),
            ("l1", "SHARD_GRAD_OP", "None"),
            ("l3", "FULL_SHARD", "torch.bfloat16"),
        ], units
