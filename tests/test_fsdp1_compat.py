# ruff: noqa: E501
"""FSDP1 code run as written: torch's auto-wrap policies and FSDP1's activation-checkpointing
keywords (the wrapper's methods and static methods: tests/test_fsdp1_wrapper.py).

Torch FSDP1 is the baseline for which modules become units (built on a 1-rank gloo group); training
is compared with the unsharded model at 2 and 4 ranks (odd sizes: every shard is padded)."""

from __future__ import annotations

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
        h = self.inp(x)
        # two different tokens: over one, attention's softmax is constant, so the query and key weights
        # get only rounding noise as gradient, which AdamW turns into full steps of a sign that depends
        # on the summation order (the sharded and unsharded runs then differ by lr per step)
        h = self.body(torch.stack([h, h.flip(-1)], dim=1)).mean(1)
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
    from torch.distributed.fsdp import MixedPrecision, wrap

    def bad_keyword(m: nn.Module) -> Any:
        return {"limit_all_gathers": False} if isinstance(m, nn.Linear) else False

    model = OddMLP()

    def ignoring_nothing(m: nn.Module) -> Any:  # torch's MixedPrecision with a field we cannot honour
        return {"mixed_precision": MixedPrecision(_module_classes_to_ignore=())} if m is model.l3 else False

    return {
        "custom_bad_key": error_of(lambda: fully_shard(OddMLP(), wrap.CustomPolicy(bad_keyword))),
        "custom_bad_return": error_of(lambda: fully_shard(OddMLP(), wrap.CustomPolicy(lambda m: 1))),
        "custom_mp_classes_to_ignore": error_of(lambda: fully_shard(model, wrap.CustomPolicy(ignoring_nothing))),
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
    tc.assertExpectedInline(
        errors["custom_mp_classes_to_ignore"],
        """ValueError: torch CustomPolicy's mixed_precision for module 'l3': torch.distributed.fsdp.MixedPrecision(_module_classes_to_ignore=()) has no equivalent: every BatchNorm module (and only those) gets its own full-precision unit here; leave _module_classes_to_ignore at its default (a CustomPolicy can give other modules units with mixed_precision=None)""",
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


# ---------------------------------------------------------------------------- torch's enums and configs
def _fsdp1_script(names: Any) -> dict[str, Any]:
    """A typical FSDP1 script with its enums, configs and policy from ``names`` (torch.distributed.fsdp
    or fsdp_composable): FULL_SHARD, fp16 compute, BACKWARD_POST, then a rank-0 FULL state dict saved
    and a FULL state dict loaded. The reference: fp32 master weights, an fp16 copy computes the global
    batch (as tests/test_mixed_precision.py)."""
    import copy

    import torch.distributed as dist
    import torch.distributed.fsdp as torch_fsdp
    from parity import global_mean, local_slice
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

    fsdp = FullyShardedDataParallel
    torch.manual_seed(0)
    master = TinyGPT()
    model = fsdp(
        copy.deepcopy(master),
        sharding_strategy=names.ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=TorchModuleWrapPolicy({Block}),
        mixed_precision=names.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32),
        backward_prefetch=names.BackwardPrefetch.BACKWARD_POST,
        cpu_offload=names.CPUOffload(offload_params=False),
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    opt_ref, opt = torch.optim.SGD(master.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {"losses": [], "ref_losses": []}
    for step in range(3):
        batch = gpt_batch(step, 2 * world)
        low = copy.deepcopy(master).to(torch.float16)
        gpt_loss(low, batch).backward()
        for p, q in zip(master.parameters(), low.parameters()):
            p.grad = q.grad.float()  # type: ignore[union-attr]
        opt_ref.step()
        opt_ref.zero_grad()
        out["ref_losses"].append(gpt_loss(low, batch).item())
        loss = gpt_loss(model, local_slice(batch, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(global_mean(loss.float()))
    out["settings"] = (model.sharding_strategy, model.mixed_precision, model.backward_prefetch, model.cpu_offload)
    save = names.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    optim_save = torch_fsdp.FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with fsdp.state_dict_type(model, names.StateDictType.FULL_STATE_DICT, save, optim_save):
        saved = model.state_dict()
    out["saved_keys"] = list(saved)
    ref_sd = master.state_dict()
    out["saved_diff"] = max(((v - ref_sd[k]).abs().max().item() for k, v in saved.items()), default=-1.0)
    # load: a fresh model's full state dict into the trained one, then read back
    torch.manual_seed(1)
    fresh = TinyGPT().state_dict()
    fsdp.set_state_dict_type(model, names.StateDictType.FULL_STATE_DICT, names.FullStateDictConfig())
    out["set_type"] = fsdp.get_state_dict_type(model).state_dict_type
    model.load_state_dict(fresh)
    reread = model.state_dict()
    out["loaded"] = list(reread) == list(fresh) and all(torch.equal(reread[k], v) for k, v in fresh.items())
    return out


def _fsdp1_script_both() -> tuple[dict[str, Any], dict[str, Any]]:
    import torch.distributed.fsdp as torch_names

    import fsdp_composable as our_names

    return _fsdp1_script(torch_names), _fsdp1_script(our_names)


def test_fsdp1_script_with_torch_enums_and_configs(dist_run: Callable[..., Any]) -> None:
    from fsdp_composable import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy, StateDictType

    for rank, (theirs, ours) in enumerate(dist_run(2, _fsdp1_script_both)):
        # torch's objects arrive as ours, field by field
        assert theirs["settings"] == (
            ShardingStrategy.FULL_SHARD,
            MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32),
            BackwardPrefetch.BACKWARD_POST,
            CPUOffload(offload_params=False),
        )
        assert theirs["set_type"] is StateDictType.FULL_STATE_DICT
        # the same run as with our classes, exactly, and like the unsharded fp16 model
        assert theirs["losses"] == ours["losses"]
        torch.testing.assert_close(theirs["losses"], theirs["ref_losses"], rtol=5e-3, atol=5e-3)
        assert theirs["saved_keys"] == (list(TinyGPT().state_dict()) if rank == 0 else [])
        assert theirs["saved_diff"] < 5e-3 if rank == 0 else theirs["saved_diff"] == -1.0
        assert theirs["loaded"]
