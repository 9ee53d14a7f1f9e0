"""Core contract of fully_shard: FQNs, state machines, units, views, unusual forward/backward patterns."""

from __future__ import annotations

import copy

import expecttest
import pytest
import torch
import torch.distributed as dist
from models import Block, OddMLP, TinyGPT, gpt_batch, gpt_loss, mlp_batch, mlp_loss
from parity import local_slice
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_composable import FullyShardedDataParallel, ModuleWrapPolicy, ShardingStrategy, fully_shard, unshard_params
from fsdp_composable._common_utils import FSDP_FLATTENED, StateTransitionError, TrainingState, _FSDPState
from fsdp_composable._flat_param import FlatParameter, HandleTrainingState


def _fqns(m: nn.Module) -> tuple:
    return (
        type(m),
        [n for n, _ in m.named_modules()],
        [n for n, _ in m.named_parameters()],
        [n for n, _ in m.named_buffers()],
    )


def contract_checks() -> dict:
    torch.manual_seed(0)
    model = TinyGPT(tied=True)
    before = _fqns(model)
    shapes_before = [p.shape for p in model.parameters()]
    out = fully_shard(model, ModuleWrapPolicy({Block}))
    state = fully_shard.state(model)
    errors = {}
    try:
        fully_shard(model)
    except RuntimeError as e:
        errors["twice"] = str(e)
    try:
        fully_shard(model.blocks[0])
    except RuntimeError as e:
        errors["child_of_policy"] = str(e)
    plain = OddMLP()
    fully_shard(plain)
    try:
        fully_shard(plain.l2)
    except RuntimeError as e:
        errors["child_after_parent"] = str(e)
    handles = list(state.handles)
    return {
        "same_object": out is model,
        "fqns_equal": _fqns(model) == before,
        # between steps each parameter is its face: a DTensor of the original's global shape
        "same_params": [(type(p), p.shape) for p in model.parameters()]
        == [(DTensor, shape) for shape in shapes_before],
        "state_type": type(state) is _FSDPState,
        "unit_state_is_same": fully_shard.state(model.blocks[1]) is state,
        "training_state": state.training_state,
        "handle_states": {h.training_state for h in handles},
        "unit_fqns": [h.unit_fqn for h in handles],
        "flat_types": all(type(h.flat_param) is FlatParameter for h in handles),
        "flattened_marks": all(getattr(p, FSDP_FLATTENED, False) for p in model.parameters()),
        "tied": [(i.fqn, [f for _, _, f in i.holders]) for i in handles[0].layout.infos if len(i.holders) > 1],
        "errors": errors,
    }


def test_contract_and_registry(dist_run) -> None:
    r = dist_run(2, contract_checks)[0]
    assert r["same_object"] and r["fqns_equal"] and r["same_params"] and r["state_type"]
    assert r["unit_state_is_same"]
    assert r["training_state"] is TrainingState.IDLE
    assert r["handle_states"] == {HandleTrainingState.IDLE}
    assert r["unit_fqns"] == ["", "blocks.0", "blocks.1"]
    assert r["flat_types"] and r["flattened_marks"]
    # the tied embedding/head weight lives once in the lowest common ancestor's unit (the root)
    assert r["tied"] == [("tok.weight", ["tok.weight", "head.weight"])]
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        r["errors"]["twice"],
        """fully_shard was already applied to this TinyGPT (directly or as a unit of a parent's policy); apply it once per module""",  # noqa: E501
    )
    tc.assertExpectedInline(
        r["errors"]["child_of_policy"],
        """fully_shard was already applied to this Block (directly or as a unit of a parent's policy); apply it once per module""",  # noqa: E501
    )
    tc.assertExpectedInline(
        r["errors"]["child_after_parent"],
        """parameter '0.weight' of this Sequential is already managed by fully_shard applied to a parent module. Apply fully_shard bottom-up: first to the children, then to the parent (or give the parent a policy)""",  # noqa: E501
    )


def units_of(manual: bool) -> list:
    torch.manual_seed(0)
    model = TinyGPT()
    if manual:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        fully_shard(model, ModuleWrapPolicy({Block}))
    from fsdp_composable._common_utils import _get_fsdp_states

    units = []
    for s in _get_fsdp_states(model):
        prefix = next(n for n, m in model.named_modules() if m is s.module)
        for h in s.handles:
            unit = ".".join(x for x in (prefix, h.unit_fqn) if x)
            units.append((unit, [i.fqn for i in h.layout.infos], h.layout.padded_numel))
    return sorted(units)


def test_manual_nesting_gives_policy_units(dist_run) -> None:
    manual, policy = dist_run(2, units_of, True)[0], dist_run(2, units_of, False)[0]
    assert manual == policy
    assert [u[0] for u in policy] == ["", "blocks.0", "blocks.1"]


def views_and_states() -> dict:
    torch.manual_seed(0)
    model = OddMLP()
    fully_shard(model, ModuleWrapPolicy({nn.Sequential}))
    state = fully_shard.state(model)
    seen: dict[str, object] = {}

    h = next(h for h in state.handles if h.module is model.l2)

    def inside_forward(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        # a submodule in the middle of the unit: runs inside its forward, and its output's
        # gradient is computed inside the unit's backward
        seen["fwd"] = (state.training_state, h.training_state, [tuple(p.shape) for p in model.l2.parameters()])

        def in_backward(grad: torch.Tensor) -> None:
            seen["bwd"] = (state.training_state, h.training_state)

        output.register_hook(in_backward)

    model.l2[1].register_forward_hook(inside_forward)
    x, y = mlp_batch(0, 4)
    mlp_loss(model, local_slice((x, y), dist.get_rank(), dist.get_world_size())).backward()
    handles = list(state.handles)
    shard_info = []
    for h in handles:
        local = sum(p.numel() for p in h.params)
        storage = h.flat_param.untyped_storage().data_ptr()
        shard_info.append(
            (
                h.flat_param.numel(),
                h.layout.padded_numel,
                local,
                all(p.dim() == 1 for p in h.params),
                all(p.numel() == 0 or p.untyped_storage().data_ptr() == storage for p in h.params),
                all(p.grad is None or p.grad.shape == p.shape for p in h.params),
            )
        )
    illegal = ""
    try:
        handles[0].set_training_state(HandleTrainingState.BACKWARD_POST)
    except StateTransitionError as e:
        illegal = str(e)
    return {
        "seen": seen,
        "after": (state.training_state, {h.training_state for h in handles}),
        "shards": shard_info,
        "illegal": illegal,
    }


def test_state_machines_and_sharded_views(dist_run) -> None:
    results = dist_run(2, views_and_states)
    r = results[0]
    assert r["seen"]["fwd"] == (
        TrainingState.FORWARD_BACKWARD,
        HandleTrainingState.FORWARD,
        [(3, 7), (3,), (7, 3), (7,)],
    )
    assert r["seen"]["bwd"] == (TrainingState.FORWARD_BACKWARD, HandleTrainingState.BACKWARD_PRE)
    assert r["after"] == (TrainingState.IDLE, {HandleTrainingState.IDLE})
    # each parameter is padded to whole rows per rank (2 ranks): root unit l1 (7x5 -> 8x5, 7 -> 8) + l3
    # (1x7 -> 2x7, 1 -> 2) = 40 + 8 + 14 + 2 = 64; l2 (3x7 -> 4x7, 3 -> 4, 7x3 -> 8x3, 7 -> 8) = 64
    for res in results:
        assert [s[1] for s in res["shards"]] == [64, 64]
        for flat_numel, padded, local, one_d, in_shard, grad_shapes in res["shards"]:
            assert flat_numel == padded // 2 and one_d and in_shard and grad_shapes and local <= flat_numel
    assert sum(res["shards"][1][2] for res in results) == 52
    expecttest.TestCase().assertExpectedInline(
        r["illegal"],
        """HandleTrainingState of unit '<root>' cannot go from IDLE to BACKWARD_POST (allowed from IDLE: ['BACKWARD_PRE', 'FORWARD', 'SUMMON_FULL_PARAMS']). This usually means modules ran in an order fully_shard does not support; see docs/errors.md""",  # noqa: E501
    )


class TwiceAndFrozenOut(nn.Module):
    """Runs ``shared`` twice per forward and returns a nested structure with a non-grad output."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.shared = nn.Linear(6, 6)
        self.out = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> dict:
        h = self.shared(torch.tanh(self.shared(self.inp(x))))
        return {"y": self.out(h), "aux": [h.detach().sum(), "tag"]}


def unusual_patterns(strategy: str) -> list:
    torch.manual_seed(3)
    ref = TwiceAndFrozenOut()
    model = copy.deepcopy(ref)
    fully_shard(model, lambda m: isinstance(m, nn.Linear) and m.out_features == 6, strategy=ShardingStrategy[strategy])
    rank, world = dist.get_rank(), dist.get_world_size()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diffs = []
    for step in range(3):
        x, _ = mlp_batch(step, 2 * world)
        with torch.no_grad():  # an eval forward between steps must not disturb training
            model(x[:1])
        # two forwards, then one backward through both
        ref_loss = ref(x)["y"].pow(2).mean() + ref(x * 2)["y"].mean()
        ref_loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        xl = local_slice((x, x), rank, world)[0]
        out1, out2 = model(xl), model(xl * 2)
        assert out1["aux"][1] == "tag" and not out1["aux"][0].requires_grad
        loss = out1["y"].pow(2).mean() + out2["y"].mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        with unshard_params(model, writeback=False):
            diffs.append(max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())))
    state = fully_shard.state(model)
    return diffs + [state.training_state is TrainingState.IDLE]


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_module_twice_multiple_forwards_nograd_outputs(dist_run, strategy: str) -> None:
    for r in dist_run(2, unusual_patterns, strategy):
        assert r[-1] is True
        assert max(r[:-1]) < 1e-5, r


def unshard_semantics() -> dict:
    torch.manual_seed(0)
    ref = OddMLP()
    model = copy.deepcopy(ref)
    fully_shard(model, ModuleWrapPolicy({nn.Sequential}))
    out: dict[str, object] = {}
    with unshard_params(model):
        out["shapes"] = [tuple(p.shape) for p in model.parameters()] == [tuple(p.shape) for p in ref.parameters()]
        out["values"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
        with torch.no_grad():
            model.l1.bias.fill_(1.0)
    with unshard_params(model, writeback=False):
        out["written"] = bool((model.l1.bias == 1.0).all())
        with torch.no_grad():
            model.l1.bias.fill_(2.0)
    with unshard_params(model, writeback=False, rank0_only=True):
        out["rank0_shape"] = (tuple(model.l1.weight.shape), type(model.l1.weight))
        out["discarded"] = bool((model.l1.bias == 1.0).all()) if dist.get_rank() == 0 else None
    errors = []
    try:
        with unshard_params(model, rank0_only=True):
            pass
    except ValueError as e:
        errors.append(str(e))

    def call_inside(module: nn.Module, args: tuple) -> None:
        with unshard_params(model):
            pass

    h = model.l2.register_forward_pre_hook(call_inside)
    try:
        model(torch.randn(2, 5))
    except RuntimeError as e:
        errors.append(str(e))
    h.remove()
    # the failed forward must not leave the model unusable
    mlp_loss(model, mlp_batch(0, 2)).backward()
    out["errors"] = errors
    out["after_shapes"] = [tuple(p.shape) for p in model.parameters()]
    return out


def test_unshard_params_semantics(dist_run) -> None:
    r0, r1 = dist_run(2, unshard_semantics)
    assert r0["shapes"] and r0["values"] and r0["written"] and r0["discarded"]
    # rank 0 sees the full parameter; the other ranks keep their faces (global shape, DTensor)
    assert r0["rank0_shape"] == ((7, 5), nn.Parameter) and r1["rank0_shape"] == ((7, 5), DTensor)
    assert r0["after_shapes"] == [(7, 5), (7,), (3, 7), (3,), (7, 3), (7,), (1, 7), (1,)]
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        r0["errors"][0],
        """unshard_params(writeback=True, rank0_only=True) is not supported: the other ranks would not see rank 0's writes. Pass writeback=False, or rank0_only=False""",  # noqa: E501
    )
    tc.assertExpectedInline(
        r0["errors"][1],
        """unshard_params cannot be used while fully_shard(OddMLP) is in FORWARD_BACKWARD: call it outside forward/backward (and not nested in itself)""",  # noqa: E501
    )


def wrapper_surface(use_orig_params: bool) -> dict:
    torch.manual_seed(0)
    plain = TinyGPT()
    model = FullyShardedDataParallel(
        copy.deepcopy(plain), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=use_orig_params
    )
    gpt_loss(model, gpt_batch(0, 2)).backward()
    names = [n for n, _ in model.named_parameters()]
    sd = model.state_dict()
    fresh = TinyGPT()
    fresh.load_state_dict(sd, strict=True)
    model.load_state_dict(plain.state_dict(), strict=True)
    return {
        "names": names,
        "flat": [type(p) is FlatParameter for p in model.parameters()],
        "keys_equal": list(sd) == list(plain.state_dict()),
        "values_equal": all(torch.equal(sd[k], v) for k, v in plain.state_dict().items()),
        "grads": [p.grad is not None for p in model.parameters()],
        "names_after_sd": [n for n, _ in model.named_parameters()] == names,
        "getattr": model.blocks is model.module.blocks,
    }


def test_wrapper_flat_and_orig_params(dist_run) -> None:
    flat = dist_run(2, wrapper_surface, False)[0]
    assert flat["names"] == ["_flat_param", "blocks.0._flat_param", "blocks.1._flat_param"]
    assert all(flat["flat"]) and all(flat["grads"])
    assert flat["keys_equal"] and flat["values_equal"] and flat["names_after_sd"] and flat["getattr"]
    orig = dist_run(2, wrapper_surface, True)[0]
    torch.manual_seed(0)
    assert orig["names"] == [n for n, _ in TinyGPT().named_parameters()]
    assert not any(orig["flat"]) and orig["keys_equal"] and orig["values_equal"]


def test_bad_arguments_without_process_group() -> None:
    tc = expecttest.TestCase()
    with pytest.raises(RuntimeError) as e:
        fully_shard(nn.Linear(2, 2))
    tc.assertExpectedInline(
        str(e.value),
        """fully_shard needs an initialised default process group: call torch.distributed.init_process_group('gloo' or 'nccl', ...) first (torchrun sets the environment for you)""",  # noqa: E501
    )
    with pytest.raises(TypeError) as e:
        fully_shard(nn.Linear(2, 2), strategy="FULL_SHARD")
    tc.assertExpectedInline(
        str(e.value),
        """fully_shard argument 'strategy' must be a ShardingStrategy (e.g. ShardingStrategy.FULL_SHARD), got str: 'FULL_SHARD'""",  # noqa: E501
    )
    with pytest.raises(TypeError) as e:
        fully_shard(nn.Linear(2, 2), policy=3)
    tc.assertExpectedInline(
        str(e.value),
        """fully_shard argument 'policy' must be None, ModuleWrapPolicy, SizeBasedPolicy, CustomPolicy or a callable(module) -> bool, got int""",  # noqa: E501
    )
    with pytest.raises(TypeError) as e:
        fully_shard("not a module")  # type: ignore[arg-type]
    tc.assertExpectedInline(str(e.value), """fully_shard expects an nn.Module as its first argument, got str""")
    with pytest.raises(ValueError) as e:
        fully_shard.state(nn.Linear(2, 2))
    tc.assertExpectedInline(
        str(e.value),
        """fully_shard was not applied to this Linear; call fully_shard(module) first (APIs applied: none)""",
    )
