"""State dicts of every module shape torch FSDP users rely on (issue 13): a checkpoint wrapper inside a
unit, a module shared under two FQNs, keys missing on one rank, rank0_only loads, and state-dict hooks of
the model's own modules. Each test names the upstream torch test it is derived from; every comparison is
exact, against the plain (unsharded) model."""

from __future__ import annotations

import copy
from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import OddMLP
from parity import error_text as _error
from parity import same_values
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_composable import (
    FullStateDictConfig,
    ModuleWrapPolicy,
    StateDictType,
    checkpoint_wrapper,
    fully_shard,
    state_dict_type,
)

FULL, SHARDED = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT


def _full_values(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}


# ---------------------------------------------------------------------------- state dicts
class WithWrapperInside(nn.Module):
    """A unit (``body``) with a checkpoint wrapper inside it and a padded odd size."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 7), checkpoint_wrapper(nn.Linear(7, 3)), nn.Linear(3, 5))
        self.out = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x))


def wrapper_inside_unit() -> dict[str, Any]:
    torch.manual_seed(0)
    ref = WithWrapperInside()
    model = fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({nn.Sequential}))
    out: dict[str, Any] = {"full": same_values(model.state_dict(), ref.state_dict())}
    with state_dict_type(model, SHARDED):
        out["sharded"] = same_values(_full_values(model.state_dict()), ref.state_dict())
    torch.manual_seed(1)
    other = WithWrapperInside()
    model.load_state_dict(other.state_dict())
    out["loaded"] = same_values(model.state_dict(), other.state_dict())
    out["keys"] = list(ref.state_dict())
    return out


def test_checkpoint_wrapper_inside_unit_full_shapes(dist_run) -> None:
    """Upstream: test_fsdp_state_dict.py::TestFSDPStateDict::test_state_dict_with_manual_ac_wrapper and
    test_fsdp_checkpoint.py (a checkpoint wrapper inside an FSDP unit saves full, unprefixed values)."""
    for r in dist_run(2, wrapper_inside_unit):
        assert r["full"] and r["sharded"] and r["loaded"], r
        assert "body.1.weight" in r["keys"]


class SharedModule(nn.Module):
    """One Linear under two FQNs (``a`` and ``b``), and an embedding tied to a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.a = nn.Linear(6, 6)
        self.b = self.a
        self.blocks = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.b(self.a(self.emb(idx)))))


def shared_module(policy: str) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = SharedModule()
    policies = {"none": None, "linear": ModuleWrapPolicy({nn.Linear}), "seq": ModuleWrapPolicy({nn.Sequential})}
    model = fully_shard(copy.deepcopy(ref), policies[policy])
    out = {"full": same_values(model.state_dict(), ref.state_dict())}
    with state_dict_type(model, SHARDED):
        out["sharded"] = same_values(_full_values(model.state_dict()), ref.state_dict())
    torch.manual_seed(1)
    other = SharedModule()
    model.load_state_dict(other.state_dict())
    out["loaded"] = same_values(model.state_dict(), other.state_dict())
    out["still_shared"] = model.a is model.b and model.head.weight is model.emb.weight
    return out


@pytest.mark.parametrize("policy", ["none", "linear", "seq"])
def test_shared_module_under_two_fqns(dist_run, policy: str) -> None:
    """Upstream: test_fsdp_state_dict.py::TestFSDPStateDict::test_shared_module_and_shared_parameter
    (every key, full shape,
    equal to the plain model's state_dict())."""
    for r in dist_run(2, shared_module, policy):
        assert all(r.values()), r


def sharded_key_missing_on_one_rank(case: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = fully_shard(OddMLP(), ModuleWrapPolicy({nn.Sequential}))
    before = model.state_dict()
    with state_dict_type(model, SHARDED):
        sd = {k: v.clone() for k, v in model.state_dict().items()}  # the values are the faces: copy them
        torch.manual_seed(1)
        for v in sd.values():
            if isinstance(v, DTensor):
                v.to_local().normal_()  # a different checkpoint: a partial load would be visible
        if dist.get_rank() == 1:
            if case == "missing":
                del sd["l2.0.weight"]
            else:
                sd["l9.weight"] = sd["l1.weight"]
        msg = _error(lambda: model.load_state_dict(sd, strict=False))
    after = model.state_dict()
    return {
        "msg": msg,
        "unchanged_key": torch.equal(after["l2.0.weight"], before["l2.0.weight"]),
        "after": after,
    }


@pytest.mark.parametrize("case", ["missing", "extra"])
def test_sharded_load_with_key_missing_on_one_rank(dist_run, case: str) -> None:
    """Upstream: test_fsdp_state_dict.py::TestFSDPStateDict::test_full_state_dict_missing_unexpected_keys_cleaned
    (strict key checks), for SHARDED: a key some ranks lack is an error on every rank, even with strict=False, and never
    zeros loaded silently."""
    rs = dist_run(2, sharded_key_missing_on_one_rank, case)
    key = "l2.0.weight" if case == "missing" else "l9.weight"
    for r in rs:
        assert r["msg"].startswith("RuntimeError: Error(s) in loading state_dict for OddMLP"), r["msg"]
        assert f"SHARDED_STATE_DICT: key '{key}' is in the state dict on some ranks but not on ranks" in r["msg"]
        assert r["unchanged_key"] or case == "extra"  # a parameter loaded on only some ranks keeps its values
    assert same_values(rs[0]["after"], rs[1]["after"])  # the same model on every rank


def full_key_missing_on_one_rank(case: str, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = fully_shard(OddMLP(), ModuleWrapPolicy({nn.Sequential}))
    before = model.state_dict()
    torch.manual_seed(1)
    sd = OddMLP().state_dict()  # another checkpoint: a partial load would be visible
    if dist.get_rank() == world - 1:
        if case == "missing":
            del sd["l2.0.weight"]
        else:
            sd["l9.weight"] = sd["l1.weight"]
    out: dict[str, Any] = {}
    for strict in (True, False):
        msg = _error(lambda strict=strict: model.load_state_dict(sd, strict=strict))
        out[f"ours_{strict}"] = [line.strip() for line in msg.splitlines() if "FULL_STATE_DICT" in line]
        out[f"first_{strict}"] = msg.splitlines()[0]
    after = model.state_dict()
    out["unchanged_key"] = torch.equal(after["l2.0.weight"], before["l2.0.weight"])
    out["others_loaded"] = torch.equal(after["l1.weight"], sd["l1.weight"])
    out["after"] = after
    return out


@pytest.mark.parametrize("case", ["missing", "extra"])
def test_full_load_with_key_missing_on_one_rank(dist_run, case: str) -> None:
    """Upstream: test_fsdp_state_dict.py::TestFSDPStateDict::test_full_state_dict_missing_unexpected_keys_cleaned
    (strict key checks), across ranks: a FULL load where the last rank's dict lacks a key (or has an extra
    one) is an error on every rank, strict or not, naming the key and the rank; nothing is loaded on any
    rank (see [Note: a refused load writes nothing]), so every rank holds the same model."""
    rs = dist_run(2, full_key_missing_on_one_rank, case, 2)
    key = "l2.0.weight" if case == "missing" else "l9.weight"
    tc = expecttest.TestCase()
    for r in rs:
        for strict in (True, False):
            assert r[f"first_{strict}"] == "RuntimeError: Error(s) in loading state_dict for OddMLP:", r
            tc.assertEqual(
                r[f"ours_{strict}"],
                [
                    f"FULL_STATE_DICT: key '{key}' is in the state dict on some ranks but not on ranks "
                    f"{[0] if case == 'extra' else [1]}; every rank must load the same keys (each rank writes its "
                    "shard of every parameter from its own dict). It was loaded on no rank"
                ],
            )
        assert r["unchanged_key"] and not r["others_loaded"], r  # a refused load writes nothing
    assert same_values(rs[0]["after"], rs[1]["after"])  # the same model on every rank
    if case == "missing":
        tc.assertExpectedInline(
            rs[0]["ours_True"][0],
            """FULL_STATE_DICT: key 'l2.0.weight' is in the state dict on some ranks but not on ranks [1]; every rank must load the same keys (each rank writes its shard of every parameter from its own dict). It was loaded on no rank""",  # noqa: E501
        )
        return
    tc.assertExpectedInline(
        rs[0]["ours_True"][0],
        """FULL_STATE_DICT: key 'l9.weight' is in the state dict on some ranks but not on ranks [0]; every rank must load the same keys (each rank writes its shard of every parameter from its own dict). It was loaded on no rank""",  # noqa: E501
    )


def rank0_only_load() -> str:
    torch.manual_seed(0)
    model = fully_shard(OddMLP())
    config = FullStateDictConfig(rank0_only=True)
    with state_dict_type(model, FULL, config):
        sd = model.state_dict()
        return _error(lambda: model.load_state_dict(sd))


def test_rank0_only_full_state_dict_load_is_a_clear_error(dist_run) -> None:
    """Upstream: test_fsdp_state_dict.py::TestFSDPStateDict::test_state_dict_rank0_offload_save_load_flow (torch
    loads a rank0_only
    checkpoint on every rank after broadcasting it itself); loading under rank0_only is an error on every rank."""
    msgs = dist_run(2, rank0_only_load)
    assert msgs[0] == msgs[1]
    expecttest.TestCase().assertExpectedInline(
        msgs[0],
        """ValueError: load_state_dict under FULL_STATE_DICT with FullStateDictConfig(rank0_only=True) is not supported: rank0_only only applies to saving (other ranks would have nothing to load). Load with rank0_only=False and the full state dict on every rank (e.g. torch.load it on every rank, or send it with torch.distributed.broadcast_object_list), or load it into the unsharded model on rank 0 before fully_shard(..., sync_module_states=True)""",  # noqa: E501
    )


class FusedAttention(nn.Module):
    """torchtitan-style: one fused QKV weight in memory, three weights in checkpoints (split by a
    state-dict post-hook, fused again by a load pre-hook)."""

    SEEN: list[tuple[str, tuple[int, ...]]] = []

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.d = d
        self.wqkv = nn.Parameter(torch.randn(3 * d, d))
        self.proj = nn.Linear(d, d)
        self.register_state_dict_post_hook(FusedAttention._split)
        self._register_load_state_dict_pre_hook(FusedAttention._fuse)

    @staticmethod
    def _split(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        fused = state_dict.pop(prefix + "wqkv")
        FusedAttention.SEEN.append(("save", tuple(fused.shape)))
        for name, part in zip(("wq", "wk", "wv"), fused.chunk(3, dim=0)):
            state_dict[prefix + name] = part

    @staticmethod
    def _fuse(state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        parts = [state_dict.pop(prefix + name) for name in ("wq", "wk", "wv") if prefix + name in state_dict]
        if parts:
            FusedAttention.SEEN.append(("load", tuple(parts[0].shape)))
            state_dict[prefix + "wqkv"] = torch.cat(parts, dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (x @ w.t() for w in self.wqkv.chunk(3, dim=0))
        return self.proj(F.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)


class FusedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.layers = nn.ModuleList(FusedAttention() for _ in range(2))
        self.out = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def fused_qkv_hooks(policy_name: str) -> dict[str, Any]:
    FusedAttention.SEEN.clear()
    torch.manual_seed(0)
    ref = FusedModel()
    policy = ModuleWrapPolicy({FusedAttention}) if policy_name == "layers" else None
    model = fully_shard(copy.deepcopy(ref), policy)
    expected = ref.state_dict()
    FusedAttention.SEEN.clear()
    out: dict[str, Any] = {"full": same_values(model.state_dict(), expected)}
    with state_dict_type(model, SHARDED):
        sharded = model.state_dict()
        out["sharded"] = same_values(_full_values(sharded), expected)
        torch.manual_seed(1)
        other = FusedModel()
        with state_dict_type(fully_shard(other), SHARDED):
            other_sharded = other.state_dict()
        model.load_state_dict(other_sharded)
    out["sharded_load"] = same_values(model.state_dict(), other.state_dict())
    model.load_state_dict(expected)  # FULL load of the plain model's checkpoint
    out["full_load"] = same_values(model.state_dict(), expected)
    out["seen"] = sorted(set(FusedAttention.SEEN))
    x = torch.randn(3, 5)
    out["forward"] = torch.equal(model(x), ref(x))
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("policy", ["root", "layers"])
def test_submodule_state_dict_hooks_see_original_shapes(dist_run, world: int, policy: str) -> None:
    """Upstream: test/distributed/_composable/fsdp/test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess::
    test_dp_state_dict_save_load (the closest: values are DTensors of the original shapes; here state-dict hooks of the
    model's own modules see DTensors of the original shapes; torchtitan splits a fused QKV weight this way)."""
    for r in dist_run(world, fused_qkv_hooks, policy):
        assert r["full"] and r["sharded"] and r["sharded_load"] and r["full_load"] and r["forward"], r
        assert r["seen"] == [("load", (6, 6)), ("save", (18, 6))], r["seen"]
