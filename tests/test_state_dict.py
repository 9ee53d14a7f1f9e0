"""State dicts: `state_dict_type`, FULL (rank0_only/offload), SHARDED (DTensors, DCP across world sizes),
LOCAL (flat shards + layout check), and the standard errors for bad checkpoints."""

from __future__ import annotations

import copy
import io
import os
import weakref
from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from models import Block, OddMLP, TinyGPT
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import fsdp_composable._comm._collectives as collectives
import fsdp_composable._state._state_dict_full as sd_full
from fsdp_composable import (
    FullStateDictConfig,
    LocalStateDictConfig,
    ModuleWrapPolicy,
    ShardedStateDictConfig,
    StateDictType,
    fully_shard,
    state_dict_type,
)

FULL, SHARDED, LOCAL = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT


class ScaledMLP(OddMLP):
    """Padded units, a 0-dim parameter (replicated DTensor) and a persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.register_buffer("offset", torch.arange(3.0))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale + self.offset.sum()


def _gpt(seed: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    ref = TinyGPT(tied=True)
    return ref, fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({Block}))


def _mlp(seed: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    ref = ScaledMLP()
    with torch.no_grad():
        ref.offset.add_(seed)
    return ref, fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({nn.Sequential}))


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------- state_dict_type
def type_errors() -> dict[str, str]:
    _, model = _mlp(0)
    errors = {}
    for name, call in {
        "type": lambda: state_dict_type(model, "sharded"),  # type: ignore[arg-type]
        "config": lambda: state_dict_type(model, SHARDED, FullStateDictConfig()),
        "module": lambda: state_dict_type(object(), FULL),  # type: ignore[arg-type]
        "no_state": lambda: state_dict_type(nn.Linear(2, 2), FULL),
    }.items():
        try:
            with call():
                pass
        except (TypeError, ValueError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    state = fully_shard.state(model)
    try:
        with state_dict_type(model, LOCAL):
            with state_dict_type(model, SHARDED, ShardedStateDictConfig(offload_to_cpu=True)):
                inner = (state.state_dict_type, state.state_dict_config)
            after_inner = (state.state_dict_type, type(state.state_dict_config).__name__)
            raise KeyError("boom")
    except KeyError:
        pass
    errors["restored"] = repr((inner, after_inner, state.state_dict_type, state.state_dict_config))
    return errors


def test_state_dict_type_validates_and_restores(dist_run) -> None:
    e = dist_run(1, type_errors)[0]
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        e["type"],
        """TypeError: state_dict_type argument 'state_dict_type' must be a StateDictType (e.g. StateDictType.SHARDED_STATE_DICT), got str: 'sharded'""",  # noqa: E501
    )
    tc.assertExpectedInline(
        e["config"],
        """TypeError: state_dict_type argument 'config' must be a ShardedStateDictConfig or None for StateDictType.SHARDED_STATE_DICT, got FullStateDictConfig""",  # noqa: E501
    )
    tc.assertExpectedInline(
        e["module"], """TypeError: state_dict_type argument 'module' must be an nn.Module, got object"""
    )
    tc.assertExpectedInline(
        e["no_state"],
        """ValueError: state_dict_type: no fully_shard state on this Linear or its submodules; call fully_shard(module) first""",  # noqa: E501
    )
    tc.assertExpectedInline(
        e["restored"],
        """((<StateDictType.SHARDED_STATE_DICT: 2>, ShardedStateDictConfig(offload_to_cpu=True)), (<StateDictType.LOCAL_STATE_DICT: 3>, 'LocalStateDictConfig'), <StateDictType.FULL_STATE_DICT: 1>, None)""",  # noqa: E501
    )


def setting_after_lazy_init() -> dict[str, Any]:
    """The setting chosen before the first forward is the root's once lazy init built its context, and
    a later switch is held once, by that context, for every state under the root."""
    _, model = _gpt(0)
    units = [m for m in model.modules() if m is model or isinstance(m, Block)]
    with state_dict_type(model, SHARDED):
        with torch.no_grad():
            model(torch.zeros(1, 4, dtype=torch.long))  # lazy init inside the context
        taken_over = sorted({type(v).__name__ for v in model.state_dict().values()})
    ctx = fully_shard.state(model).ctx
    assert ctx is not None
    with state_dict_type(model.blocks[0], LOCAL):  # a unit's module: the switch is root-wide
        inside = (ctx.state_dict_type.name, sorted({type(v).__name__ for v in model.state_dict().values()}))
    return {
        "taken_over": taken_over,
        "inside": inside,
        "after": ctx.state_dict_type.name,
        "one_context": len({id(fully_shard.state(m).ctx) for m in units}),
    }


def test_state_dict_type_is_root_wide(dist_run) -> None:
    r = dist_run(2, setting_after_lazy_init)[0]
    assert r == {
        "taken_over": ["DTensor"],
        "inside": ("LOCAL_STATE_DICT", ["Tensor", "dict"]),
        "after": "FULL_STATE_DICT",
        "one_context": 1,
    }


# ---------------------------------------------------------------------------- FULL
def full_rank0_only() -> dict[str, Any]:
    ref, model = _gpt(0)
    alive: list[weakref.ref] = []
    peak = [0]
    original = sd_full._gather_full_flat

    def spy(handle: Any, shard: Any = None) -> torch.Tensor:
        peak[0] = max(peak[0], sum(r() is not None for r in alive) + 1)
        # A copy: gloo's worker thread may hold the collective's output a moment after wait().
        out = original(handle, shard).clone()
        alive.append(weakref.ref(out))
        return out

    sd_full._gather_full_flat = spy
    try:
        with state_dict_type(model, FULL, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            sd = model.state_dict()
    finally:
        sd_full._gather_full_flat = original
    default = model.state_dict()  # outside the context: FULL on every rank again
    return {
        "rank0_equal": _same(sd, ref.state_dict()) if dist.get_rank() == 0 else None,
        "len": len(sd),
        "devices": sorted({str(v.device) for v in sd.values()}),
        "gathers": len(alive),
        "peak_alive": peak[0],
        "default_equal": _same(default, ref.state_dict()),
    }


def test_full_rank0_only_offload(dist_run) -> None:
    r0, r1 = dist_run(2, full_rank0_only)
    assert r0["rank0_equal"] and r0["len"] == len(TinyGPT(tied=True).state_dict())
    assert r0["devices"] == ["cpu"]
    assert r1["len"] == 0  # non-zero ranks get an empty dict
    assert r0["gathers"] == r1["gathers"] == 3  # one per unit, on every rank (a collective)
    # The root unit stays gathered while its subtree saves (see [Note: a unit is unsharded around its
    # subtree's save and load]): the root's full flat tensor plus one block's, never two blocks'.
    assert r0["peak_alive"] == r1["peak_alive"] == 2
    assert r0["default_equal"] and r1["default_equal"]


# ---------------------------------------------------------------------------- SHARDED
def sharded_values() -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, Any] = {}
    for name, build in (("gpt", _gpt), ("mlp", _mlp)):
        ref, model = build(0)
        gathers = [0]
        original = collectives.all_gather

        def counting(*args: Any, _orig: Any = original, _count: list[int] = gathers, **kwargs: Any) -> Any:
            _count[0] += 1
            return _orig(*args, **kwargs)

        collectives.all_gather = counting  # type: ignore[assignment]
        try:
            with state_dict_type(model, SHARDED):
                sd = model.state_dict()
        finally:
            collectives.all_gather = original  # type: ignore[assignment]
        ref_sd = ref.state_dict()
        placements = {k: tuple(type(p).__name__ for p in v.placements) for k, v in sd.items()}
        rows_ok = all(
            v.to_local().shape[0] == len(torch.arange(ref_sd[k].shape[0]).chunk(world)[rank])
            if rank < len(torch.arange(ref_sd[k].shape[0]).chunk(world))
            else v.to_local().shape[0] == 0
            for k, v in sd.items()
            if isinstance(v.placements[0], Shard)
        )
        full = {k: v.full_tensor() for k, v in sd.items()}
        # load it back into a model with other values
        _, other = build(1)
        with state_dict_type(other, SHARDED):
            other.load_state_dict(sd, strict=True)
        out[name] = {
            "keys": list(sd) == list(ref_sd),
            "dtensors": all(isinstance(v, DTensor) for v in sd.values()),
            "placements": sorted(set(placements.values())),
            "scale": placements.get("scale"),
            "offset": placements.get("offset"),
            "values": all(torch.equal(full[k], ref_sd[k]) for k in ref_sd),
            "rows_ok": rows_ok,
            "gathers": gathers[0],
            "loaded": _same(other.state_dict(), ref_sd),
        }
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_state_dict_values(dist_run, world: int) -> None:
    for r in dist_run(world, sharded_values):
        for name, v in r.items():
            assert v["keys"] and v["dtensors"] and v["values"] and v["rows_ok"] and v["loaded"], (name, v)
            assert v["gathers"] == 0, "SHARDED_STATE_DICT must not all-gather a unit"
        assert r["gpt"]["placements"] == [("Shard",)]
        assert r["mlp"]["placements"] == [("Replicate",), ("Shard",)]
        assert r["mlp"]["scale"] == ("Replicate",) and r["mlp"]["offset"] == ("Replicate",)


def dcp_save(path: str) -> None:
    (ref_gpt, gpt), (ref_mlp, mlp) = _gpt(0), _mlp(0)
    with state_dict_type(gpt, SHARDED), state_dict_type(mlp, SHARDED):
        dcp.save({"gpt": gpt.state_dict(), "mlp": mlp.state_dict()}, checkpoint_id=os.path.join(path, "dcp"))
    if dist.get_rank() == 0:
        torch.save({"gpt": ref_gpt.state_dict(), "mlp": ref_mlp.state_dict()}, os.path.join(path, "expected.pt"))
    dist.barrier()


def dcp_load(path: str) -> dict[str, bool]:
    (_, gpt), (_, mlp) = _gpt(1), _mlp(1)
    with state_dict_type(gpt, SHARDED), state_dict_type(mlp, SHARDED):
        sd = {"gpt": gpt.state_dict(), "mlp": mlp.state_dict()}
        dcp.load(sd, checkpoint_id=os.path.join(path, "dcp"))
        gpt.load_state_dict(sd["gpt"])
        mlp.load_state_dict(sd["mlp"])
    expected = torch.load(os.path.join(path, "expected.pt"), weights_only=True)
    return {"gpt": _same(gpt.state_dict(), expected["gpt"]), "mlp": _same(mlp.state_dict(), expected["mlp"])}


def test_dcp_reshards_across_world_sizes(dist_run, tmp_path) -> None:
    dist_run(2, dcp_save, str(tmp_path))
    for world in (1, 2, 4):
        assert dist_run(world, dcp_load, str(tmp_path)) == [{"gpt": True, "mlp": True}] * world, world


# ---------------------------------------------------------------------------- LOCAL
def local_roundtrip() -> dict[str, Any]:
    ref, model = _gpt(0)
    with state_dict_type(model, LOCAL, LocalStateDictConfig()):
        sd = model.state_dict()
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    _, other = _gpt(1)
    with state_dict_type(other, LOCAL):
        other.load_state_dict(loaded, strict=True)
    errors = {}
    bad = dict(loaded)
    bad["blocks.1._flat_param_layout"] = {**loaded["blocks.1._flat_param_layout"], "world_size": 4}
    del bad["blocks.0._flat_param"]
    with state_dict_type(other, LOCAL):
        try:
            other.load_state_dict(bad)
        except RuntimeError as e:
            errors["layout"] = str(e)
    # saved before shards were rank-major: no "order" in the record; refused, never loaded reordered
    old = dict(loaded)
    record = loaded["blocks.1._flat_param_layout"]
    old["blocks.1._flat_param_layout"] = {k: v for k, v in record.items() if k != "order"}
    with state_dict_type(other, LOCAL):
        try:
            other.load_state_dict(old)
        except RuntimeError as e:
            errors["old"] = str(e)
    return {
        "keys": list(sd),
        "layout": sd["blocks.0._flat_param_layout"],
        "loaded": _same(other.state_dict(), ref.state_dict()),
        "errors": errors,
    }


def test_local_state_dict(dist_run) -> None:
    r0, r1 = dist_run(2, local_roundtrip)
    assert (
        r0["keys"]
        == r1["keys"]
        == [
            "blocks.0._flat_param",
            "blocks.0._flat_param_layout",
            "blocks.1._flat_param",
            "blocks.1._flat_param_layout",
            "_flat_param",  # the root unit's hook runs after its children's
            "_flat_param_layout",
        ]
    )
    assert r0["loaded"] and r1["loaded"]
    assert (r0["layout"]["rank"], r1["layout"]["rank"], r0["layout"]["world_size"]) == (0, 1, 2)
    assert r0["layout"]["fqns"][:2] == ["ln1.weight", "ln1.bias"]
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        r1["errors"]["layout"],
        """\
Error(s) in loading state_dict for TinyGPT:
	Missing key(s) in state_dict: "blocks.0._flat_param". 
	LOCAL_STATE_DICT layout mismatch for unit 'blocks.1' (key blocks.1._flat_param): the checkpoint was saved with rank=1, world_size=4, padded_numel=3216, 10 parameters, this model has rank=1, world_size=2, padded_numel=3216, 10 parameters. A local state dict only loads at the same rank, world size and policy; use SHARDED_STATE_DICT to change them.""",  # noqa: E501, W291
    )
    tc.assertExpectedInline(r1["errors"]["old"], """\
Error(s) in loading state_dict for TinyGPT:
	LOCAL_STATE_DICT of unit 'blocks.1' (key blocks.1._flat_param) was saved by an earlier version of fsdp_composable, whose flat shards hold the parameters' elements in another order: it cannot be loaded as it is. Load it with that version and save a FULL_STATE_DICT or SHARDED_STATE_DICT, which load here.""",  # noqa: E501
    )


# ---------------------------------------------------------------------------- bad checkpoints
def bad_checkpoints() -> dict[str, str]:
    _, model = _gpt(0)
    errors = {}
    for kind in (FULL, SHARDED):
        with state_dict_type(model, kind):
            good = model.state_dict()
            cases = {
                "missing": {k: v for k, v in good.items() if k != "blocks.0.fc1.weight"},
                "unexpected": {**good, "blocks.0.extra": torch.zeros(1)},
                "shape": {**good, "blocks.0.fc1.weight": torch.zeros(3, 3)},
            }
            for case, sd in cases.items():
                try:
                    model.load_state_dict(sd)
                except RuntimeError as e:
                    errors[f"{kind.name}/{case}"] = str(e)
        # a failed load leaves the parameters as they were
        errors[f"{kind.name}/intact"] = str(_same(model.state_dict(), _gpt(0)[0].state_dict()))
    return errors


def test_bad_checkpoints_name_the_fqn(dist_run) -> None:
    r0, r1 = dist_run(2, bad_checkpoints)
    tc = expecttest.TestCase()
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        assert r0[f"{kind}/intact"] == r1[f"{kind}/intact"] == "True"
        tc.assertExpectedInline(
            r0[f"{kind}/missing"],
            """\
Error(s) in loading state_dict for TinyGPT:
	Missing key(s) in state_dict: "blocks.0.fc1.weight". 
	fully_shard: the load was refused, so nothing was loaded: every parameter and buffer keeps its value on every rank (ranks that could not load: [0, 1]). Fix the state dict and load again""",  # noqa: E501, W291
        )
        tc.assertExpectedInline(
            r0[f"{kind}/unexpected"],
            """\
Error(s) in loading state_dict for TinyGPT:
	Unexpected key(s) in state_dict: "blocks.0.extra". 
	fully_shard: the load was refused, so nothing was loaded: every parameter and buffer keeps its value on every rank (ranks that could not load: [0, 1]). Fix the state dict and load again""",  # noqa: E501, W291
        )
        tc.assertExpectedInline(
            r1[f"{kind}/shape"],
            """\
Error(s) in loading state_dict for TinyGPT:
	size mismatch for blocks.0.fc1.weight: copying a param with shape torch.Size([3, 3]) from checkpoint, the shape in current model is torch.Size([64, 16]).
	fully_shard: the load was refused, so nothing was loaded: every parameter and buffer keeps its value on every rank (ranks that could not load: [0, 1]). Fix the state dict and load again""",  # noqa: E501
        )
