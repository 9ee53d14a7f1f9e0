"""Behaviours torch FSDP users rely on (issue 13): unshard_params writeback, writes and casts after
sharding, sizes, and meta-device init. Each test names the upstream torch test it is derived from;
every comparison is exact, against the plain (unsharded) model."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from typing import Any

import expecttest
import pytest
import torch
import torch.nn.functional as F
from models import Block, OddMLP, TinyGPT
from parity import error_text as _error
from parity import same_values
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_composable import (
    FullyShardedDataParallel,
    MixedPrecision,
    ModuleWrapPolicy,
    describe,
    fully_shard,
    unshard_params,
)


# ---------------------------------------------------------------------------- unshard_params writeback
def _mlp_pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    ref = OddMLP()
    return ref, fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({nn.Sequential}))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(4, 5, generator=g), torch.randn(4, 1, generator=g)


def unshard_writeback() -> dict[str, Any]:
    ref, model = _mlp_pair()
    out: dict[str, Any] = {}
    with unshard_params(model, with_grads=True):
        out["grads_none_before_backward"] = all(p.grad is None for p in model.parameters())
        model.l1.weight.data = torch.full((7, 5), 0.5)  # assignment
        with torch.no_grad():
            model.l2[0].bias.copy_(torch.arange(3.0))  # in place
    with torch.no_grad():
        ref.l1.weight.data = torch.full((7, 5), 0.5)
        ref.l2[0].bias.copy_(torch.arange(3.0))
    out["edits_persist"] = same_values(model.state_dict(), ref.state_dict())
    x, y = _batch()
    F.mse_loss(model(x), y).backward()  # the same batch on every rank: the mean gradient is ref's
    F.mse_loss(ref(x), y).backward()
    with unshard_params(model, with_grads=True):
        out["grads_full"] = all(
            p.grad is not None and torch.equal(p.grad, r.grad) for p, r in zip(model.parameters(), ref.parameters())
        )
        model.l1.weight.grad.mul_(2)  # in place
        model.l3.bias.grad = torch.full((1,), 3.0)  # assignment
    ref.l1.weight.grad.mul_(2)
    ref.l3.bias.grad = torch.full((1,), 3.0)
    with unshard_params(model, with_grads=True):
        out["grad_edits_persist"] = all(
            torch.equal(p.grad, r.grad) for p, r in zip(model.parameters(), ref.parameters())
        )
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    out["step_sees_edits"] = same_values(model.state_dict(), ref.state_dict())
    return out


def test_unshard_params_writeback_and_grads(dist_run) -> None:
    """Upstream: test_fsdp_unshard_params.py::TestUnshardParams::test_unshard_params_writeback and
    ::test_unshard_params_param_data (p.data = t and in-place writes persist), ::test_with_grads_none_grads (None
    before any backward) and ::test_with_grads_core (full gradients)."""
    for r in dist_run(2, unshard_writeback):
        assert all(r.values()), r


def unshard_low_precision_grads() -> dict[str, Any]:
    torch.manual_seed(0)
    mp = MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True)
    model = fully_shard(OddMLP(), ModuleWrapPolicy({nn.Sequential}), mixed_precision=mp)
    x, y = _batch()
    F.mse_loss(model(x).float(), y).backward()
    # a parameter with no element on this rank has an empty local gradient (as FSDP2)
    local = {n: p.grad.clone() for n, p in model.named_parameters() if p.numel() > 0}
    empty = [n for n, p in model.named_parameters() if p.numel() == 0]
    with unshard_params(model, with_grads=True):
        dtypes = {str(p.grad.dtype) for p in model.parameters()}
        shapes_ok = all(p.grad.shape == p.shape for p in model.parameters())
    after = {n: p.grad for n, p in model.named_parameters()}
    return {
        "dtypes": sorted(dtypes),
        "shapes_ok": shapes_ok,
        "unchanged": all(after[n].dtype == torch.bfloat16 and torch.equal(after[n], local[n]) for n in local)
        and all(after[n].numel() == 0 and after[n].dtype == torch.bfloat16 for n in empty),
    }


def test_unshard_params_with_grads_keep_low_precision_grads(dist_run) -> None:
    """Upstream: test_fsdp_unshard_params.py::TestUnshardParams::test_with_grads_core (with mixed
    precision): full-precision full gradients inside, the low-precision sharded gradients unchanged after."""
    for r in dist_run(2, unshard_low_precision_grads):
        assert r == {"dtypes": ["torch.float32"], "shapes_ok": True, "unchanged": True}, r


def unshard_submodule_flat_mode() -> dict[str, Any]:
    torch.manual_seed(0)
    ref = TinyGPT()
    wrapper = FullyShardedDataParallel(copy.deepcopy(ref), auto_wrap_policy=ModuleWrapPolicy({Block}))
    block = wrapper.module.blocks[0]
    flat_before = [n for n, _ in block.named_parameters()]
    with unshard_params(block):
        inside = {n: p.detach().clone() for n, p in block.named_parameters()}
        tok = wrapper.module.tok.weight  # other units stay sharded (a face: this rank's rows only)
        root_sharded = tok.dim() == 1 or (isinstance(tok, DTensor) and tok.to_local().shape[0] < tok.shape[0])
    expected = dict(ref.blocks[0].named_parameters())
    return {
        "flat_before": flat_before,
        "orig_inside": list(inside) == list(expected) and all(torch.equal(inside[n], expected[n]) for n in inside),
        "flat_after": [n for n, _ in block.named_parameters()] == flat_before,
        "root_sharded": root_sharded,
    }


def test_unshard_params_on_submodule_of_flat_wrapper(dist_run) -> None:
    """Upstream: test_fsdp_unshard_params.py::TestUnshardParams::test_unshard_submodule (unsharding one nested unit
    exposes its
    original parameters with full values; the rest stay sharded)."""
    for r in dist_run(2, unshard_submodule_flat_mode):
        assert r["flat_before"] == ["_flat_param"], r
        assert r["orig_inside"] and r["flat_after"] and r["root_sharded"], r


# ---------------------------------------------------------------------------- edits after sharding
def casts_after_sharding() -> dict[str, bool]:
    out = {}
    x, _ = _batch()
    for name, cast in {
        "half": lambda m: m.half(),
        "double": lambda m: m.double(),
        "bfloat16": lambda m: m.bfloat16(),
        "to_dtype": lambda m: m.to(torch.float16),
    }.items():
        ref, model = _mlp_pair()
        cast(ref)
        cast(model)
        dtype = next(ref.parameters()).dtype
        out[name] = torch.equal(model(x.to(dtype)), ref(x.to(dtype)))
    return out


def test_cast_after_sharding_computes_in_the_new_dtype(dist_run) -> None:
    """Upstream: FSDP1 and FSDP2 cast the sharded parameters. ``.half()``/``.double()``/``.bfloat16()``/
    ``.to(dtype)`` after fully_shard: the next forward computes exactly as the plain model cast alike
    (training, gradients and mixed precision: test_casts_after_sharding.py)."""
    for r in dist_run(2, casts_after_sharding):
        assert r == {"half": True, "double": True, "bfloat16": True, "to_dtype": True}, r


def edits_after_sharding() -> dict[str, str]:
    x, y = _batch()
    out = {}

    _, model = _mlp_pair()
    model.l2[0].weight = nn.Parameter(torch.zeros(3, 7))
    out["replaced"] = _error(lambda: model(x))
    _, model = _mlp_pair()
    model.extra = nn.Linear(2, 2)
    out["added"] = _error(lambda: model(x))
    _, model = _mlp_pair()
    model.l3.weight.data = torch.zeros(5)  # a DTensor face does not take it: refused, undone
    out["data_assigned"] = _error(lambda: model(x))
    out["data_assigned_usable_after"] = str(model(x).shape == (4, 1))
    return out


def test_params_replaced_or_added_after_sharding(dist_run) -> None:
    """Upstream: test_fsdp_misc.py (FSDP1 checks parameters are unchanged since construction); parameters
    added, replaced or with .data reassigned after fully_shard: an error at the next forward naming the FQN."""
    r = dist_run(2, edits_after_sharding)[0]
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        r["replaced"],
        """ModelEditedAfterShardingError: parameter 'l2.0.weight' was replaced after fully_shard (its module now registers a new Parameter), so the units no longer manage it and each rank would train its own copy. Build the model completely (new parameters, tied weights, swapped submodules) before calling fully_shard, or assign values in place inside `with unshard_params(model, writeback=True):`""",  # noqa: E501
    )
    tc.assertExpectedInline(
        r["added"],
        """ModelEditedAfterShardingError: parameter 'extra.weight' (Linear) was added or replaced after fully_shard, so no unit manages it and each rank would train its own copy. Add parameters and submodules before calling fully_shard, or put the new module in ignored_modules of a fully_shard call made after adding it""",  # noqa: E501
    )
    tc.assertExpectedInline(
        r["data_assigned"],
        """ModelEditedAfterShardingError: parameter 'l3.weight' had its .data replaced after fully_shard (p.data = t). Between steps a parameter is a DTensor viewing this rank's shard, which such an assignment does not write. Write values in place (p.copy_(t) with a DTensor t, p.to_local().copy_(...)), inside `with unshard_params(model, writeback=True):` (p.data = t there), or with load_state_dict. The assignment was undone""",  # noqa: E501
    )
    assert r["data_assigned_usable_after"] == "True"


def reset_inside_unshard_params() -> bool:
    ref, model = _mlp_pair()
    with unshard_params(model):
        torch.manual_seed(5)  # the same seed on every rank: every rank draws the same values
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
    torch.manual_seed(5)
    for m in ref.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    return same_values(model.state_dict(), ref.state_dict())


def test_reset_parameters_after_sharding(dist_run) -> None:
    """Upstream: test_fsdp_meta.py::TestFSDPWithMetaDevice::test_simple_model_with_meta_device_reset_params
    (reset_parameters on full parameters). Re-initialising after sharding is supported inside
    ``unshard_params(writeback=True)``, seeded alike on every rank: exactly the plain reset."""
    assert dist_run(2, reset_inside_unshard_params) == [True, True]


class TiedToIgnored(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(9, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 9, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(idx))))


def tied_to_ignored() -> str:
    torch.manual_seed(0)
    model = TiedToIgnored()
    return _error(lambda: fully_shard(model, ignored_modules=[model.emb]))


def test_param_tied_to_ignored_module(dist_run) -> None:
    """Upstream: test_fsdp_ignored_modules.py (FSDP1 ignores a parameter shared with an ignored module
    everywhere, so each rank trains its own copy): refused while sharding, on every rank, naming both
    FQNs (more cases: test_ignored_modules.py)."""
    for r in dist_run(2, tied_to_ignored):
        assert r.startswith(
            "ValueError: fully_shard argument 'ignored_modules': parameter 'head.weight' is tied to 'emb.weight'"
        ), r


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor
    ids: torch.Tensor


@dataclasses.dataclass(frozen=True)
class FrozenInputs:
    x: torch.Tensor
    ids: torch.Tensor


class TakesDataclass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.seen: list[tuple[str, str]] = []

    def forward(self, inp: Any) -> torch.Tensor:
        self.seen.append((str(inp.x.dtype), str(inp.ids.dtype)))
        return self.lin(inp.x)


def dataclass_inputs() -> dict[str, Any]:
    model = fully_shard(TakesDataclass(), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    out: dict[str, Any] = {}
    for cls in (Inputs, FrozenInputs):
        inp = cls(torch.randn(4, 3), torch.arange(4))
        y = model(inp)
        out[cls.__name__] = (y.dtype, inp.x.dtype)  # the caller's instance is not modified
    out["seen"] = model.seen
    return out


def test_mixed_precision_casts_dataclass_inputs(dist_run) -> None:
    """Upstream: test/distributed/fsdp/test_utils.py::TestUtils::test_apply_to_tensors (dataclasses, frozen too),
    which FSDP's
    MixedPrecision input casting uses: floating tensors inside dataclass inputs are cast, integers are not."""
    r = dist_run(1, dataclass_inputs)[0]
    assert r["Inputs"] == r["FrozenInputs"] == (torch.bfloat16, torch.float32), r
    assert r["seen"] == [("torch.bfloat16", "torch.int64")] * 2, r


# ---------------------------------------------------------------------------- sizes
def sizes() -> dict[str, int]:
    torch.manual_seed(0)
    ref = TinyGPT()
    model = fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({Block}))
    plan = describe(model)
    return {
        "plain": sum(p.numel() for p in ref.parameters()),
        "numel": sum(p.numel() for p in model.parameters()),
        "local": sum(p.to_local().numel() for p in model.parameters()),
        "plan_numel": plan.numel,
        "plan_shard": plan.shard_numel,
        "inside_unshard": _numel_inside(model),
    }


def _numel_inside(model: nn.Module) -> int:
    with unshard_params(model, writeback=False):
        return sum(p.numel() for p in model.parameters())


def test_sizes_between_steps(dist_run) -> None:
    """Upstream: test/distributed/_composable/fsdp/test_fully_shard_init.py (FSDP2 parameters are DTensors of
    the global shape). Ours too: ``sum(p.numel())`` is the model's total on every rank, as ``describe``
    says; ``p.to_local()`` is this rank's shard."""
    rs = dist_run(2, sizes)
    plain = rs[0]["plain"]
    assert sum(r["local"] for r in rs) == plain  # each element held on exactly one rank
    for r in rs:
        assert r["plan_numel"] == r["inside_unshard"] == r["numel"] == plain
        assert r["local"] <= r["plan_shard"] < plain


# ---------------------------------------------------------------------------- meta-device init
class MyLinear(nn.Linear):
    def reset_parameters(self) -> None:
        torch.manual_seed(42)
        with torch.no_grad():
            nn.init.xavier_uniform_(self.weight, 1.0)  # depends on the full shape


class MyBuffer(nn.Module):
    def __init__(self, device: Any = None) -> None:
        super().__init__()
        self.register_buffer("buf", torch.empty(3, 3, device=device))

    def reset_parameters(self) -> None:
        torch.manual_seed(42)
        nn.init.xavier_uniform_(self.buf, 0.5)


class MetaModel(nn.Module):
    def __init__(self, device: Any = None) -> None:
        super().__init__()
        self.lin1 = MyLinear(2, 2, bias=False, device=device)
        self.lin2 = MyLinear(2, 2, bias=False, device=device)
        self.buf_mod = MyBuffer(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.lin1(x)) + self.buf_mod.buf.sum()


def _to_empty_then_reset(m: nn.Module) -> None:
    m.to_empty(device="cpu", recurse=False)
    m.reset_parameters()


def meta_init(kind: str, policy_name: str) -> dict[str, Any]:
    ref = MetaModel()
    for m in ref.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    model = MetaModel(device="meta")
    policy = ModuleWrapPolicy({MyLinear}) if policy_name == "linear" else None
    fully_shard(model, policy, param_init_fn=_to_empty_then_reset if kind == "fn" else None)
    out = {
        "no_meta": not any(t.is_meta for t in [*model.parameters(), *model.buffers()]),
        "init_equal": same_values(model.state_dict(), ref.state_dict()),
    }
    x = torch.randn(10, 2, generator=torch.Generator().manual_seed(3))  # the same batch on every rank
    for m in (model, ref):
        m(x).sum().backward()
        torch.optim.SGD(m.parameters(), lr=1e-3).step()
    out["step_equal"] = same_values(model.state_dict(), ref.state_dict())
    return out


@pytest.mark.parametrize("kind", ["fn", "default"])
@pytest.mark.parametrize("policy", ["root", "linear"])
def test_meta_init_per_module(dist_run, kind: str, policy: str) -> None:
    """Upstream: test_fsdp_meta.py::TestFSDPWithMetaDevice::test_simple_model_with_meta_device_reset_params
    (param_init_fn is called per module, so ``to_empty(recurse=False); reset_parameters()`` works) and
    ::test_simple_model_with_meta_device_default_init (a buffer-only meta module is materialised too)."""
    for r in dist_run(2, meta_init, kind, policy):
        assert all(r.values()), r


# ---------------------------------------------------------------------------- dependencies
def test_numpy_is_declared() -> None:
    """torch.distributed's object collectives (all_gather_object, used by DCP planning and by our SHARDED
    key check) convert through numpy, so it is a runtime dependency."""
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")) as f:
        deps = re.search(r"^dependencies = \[(.*)\]$", f.read(), re.MULTILINE)
    assert deps is not None and '"numpy>=' in deps.group(1), deps
