"""The adversary's cases for tensor-subclass parameters that define their own all-gather (FSDP2's
extension protocol, [Note: extension parameters] in ``_flat/_extensions``): paths `test_extensions`
does not take, each checked against the unsharded model (float8's reference runs each rank's slice
on its own and averages, as in `test_extensions`).

Passing cases: mixed precision, SHARD_GRAD_OP, ``reshard_after_forward=False``/``=2``, HYBRID_SHARD,
activation checkpointing, gradient accumulation (``no_sync``, ``set_requires_gradient_sync``, or
neither), torch's and our ``clip_grad_norm_``, torchao's precomputed float8 scales, two forwards per
step, an exception in forward, a forward under ``no_grad``, freezing a float8 weight between steps,
world size 1, an NF4 weight in the root unit, and the state-dict round trips that stay
sharded (``load_state_dict(model.state_dict())``, torch.distributed.checkpoint, ``get/set_model_state_dict``,
SHARDED_STATE_DICT, the optimizer's state dict).

Faults found here, fixed since (each test failed before its fix): the FULL state dict kept extension
parameters as sharded DTensors aliasing the live parameters, so the unsharded model could not load it
and full tensors could not be loaded back; ``summon_full_params`` left them sharded; the FULL optimizer
state dict kept their states sharded; ``model.to(torch.bfloat16)`` of an NF4 model and an NF4 weight
whose scales do not split over the ranks failed with raw errors naming no parameter.
"""

from __future__ import annotations

import copy
import importlib.util
import tempfile
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from parity import global_mean
from test_extensions import Float8Block, Int8Block, Int8Gathered, LoRALinear, QLoRABlock, _batch, _whole
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp_composable as fc
from fsdp_composable import MixedPrecision, ModuleWrapPolicy, ShardingStrategy, fully_shard

needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="torchao is not installed (the [torchao] extra)"
)

Built = tuple[nn.Module, nn.Module, Callable[..., Any], bool, type]


# ---------------------------------------------------------------- models
# each: (reference, the copy to shard, batch maker, whether the reference runs per rank, unit type)
def _int8(seed: int = 0) -> Built:
    torch.manual_seed(seed)
    ref = nn.Sequential(Int8Block(), Int8Block(), nn.Linear(32, 4))
    model = copy.deepcopy(ref)
    for block in model[:2]:
        for lin in (block.up, block.down):
            lin.weight = nn.Parameter(Int8Gathered(lin.weight.detach().clone()))
    return ref, model, _batch(32, 4), False, Int8Block


def _fp8(seed: int = 0) -> Built:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(seed)
    ref = nn.Sequential(Float8Block(), Float8Block(), nn.Linear(64, 8))
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(ref, config=config, module_filter_fn=lambda m, fqn: fqn != "2")
    return ref, copy.deepcopy(ref), _batch(64, 8), True, Float8Block


def _nf4(seed: int = 0) -> Built:
    torch.manual_seed(seed)
    ref = nn.Sequential(QLoRABlock(), QLoRABlock(), nn.Linear(256, 8))
    return ref, copy.deepcopy(ref), _batch(256, 8), False, QLoRABlock


MODELS: dict[str, Callable[..., Built]] = {"int8": _int8, "fp8": _fp8, "nf4": _nf4}


def _sharded(kind: str, seed: int = 0, **kwargs: Any) -> Built:
    ref, model, batch, per_rank, unit = MODELS[kind](seed)
    fully_shard(model, ModuleWrapPolicy({unit}), **kwargs)
    return ref, model, batch, per_rank, unit


def _train(
    model: nn.Module,
    ref: nn.Module,
    make_batch: Any,
    per_rank_ref: bool,
    steps: int = 2,
    micro: int = 1,
    no_sync: str = "",
    clip: Any = None,
) -> list[tuple[float, float, Any]]:
    """(reference loss, sharded loss, (reference norm, sharded norm) or None) per step, AdamW on both;
    ``micro`` micro-batches per step, the first ones without gradient sync if asked: ``no_sync="ctx"``
    under ``no_sync(model)``, ``"flag"`` with ``set_requires_gradient_sync(model, False)``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    out = []
    for step in range(steps):
        x, y = make_batch(step, world)
        loss_ref = loss = torch.zeros(())
        for m in range(micro):
            xm, ym = x.chunk(micro)[m], y.chunk(micro)[m]
            if per_rank_ref:
                loss_ref = sum(F.mse_loss(ref(a), b) / world for a, b in zip(xm.chunk(world), ym.chunk(world)))
            else:
                loss_ref = F.mse_loss(ref(xm), ym)
            (loss_ref / micro).backward()
            loss = F.mse_loss(model(xm.chunk(world)[rank]), ym.chunk(world)[rank])
            last = m == micro - 1
            if no_sync == "ctx" and not last:
                with fc.no_sync(model):
                    (loss / micro).backward()
            else:
                if no_sync == "flag":
                    fc.set_requires_gradient_sync(model, last)
                (loss / micro).backward()
        norms = None
        if clip is not None:
            norm_ref = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 0.1)
            norms = (float(norm_ref), float(clip(model)))
        opt_ref.step()
        opt_ref.zero_grad()
        opt.step()
        opt.zero_grad()
        out.append((float(loss_ref.detach()), global_mean(loss.detach()), norms))
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    t = _whole(t) if isinstance(t, DTensor) else t
    return t.get_original_weight() if type(t).__name__ == "NF4Tensor" else t  # type: ignore[operator]


def _diff(model: nn.Module, ref: nn.Module) -> float:
    """The largest difference of any parameter (NF4: of the dequantized weights)."""
    return max(
        (_full(p).float() - _full(ref.get_parameter(n)).float()).abs().max().item() for n, p in model.named_parameters()
    )


def _parity(kind: str, **kwargs: Any) -> dict[str, Any]:
    ref, model, batch, per_rank, _ = _sharded(kind, **kwargs)
    return {"losses": _train(model, ref, batch, per_rank), "diff": _diff(model, ref)}


def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the text on every rank
        return f"{type(e).__name__}: {e}"
    return ""


# AdamW's first steps move every element by about lr whatever its gradient's size, so where a gradient
# element is near zero the rounding of the sum (another order of reduction, another CPU's kernels)
# shows in the parameter at 1e-5 (AVX2 machines: up to 4e-5); a wrong gradient moves it by ~lr = 1e-2
ADAM_DIFF = 1e-4


def _check_parity(r: dict[str, Any], tol: float = 1e-5, diff: float = ADAM_DIFF, trained: bool = True) -> None:
    for a, b, _ in r["losses"]:
        assert abs(a - b) <= tol * abs(a), r["losses"]
    if trained:  # from the start, on one batch, the loss goes down
        assert r["losses"][-1][1] < r["losses"][0][1], r["losses"]
    assert r["diff"] <= diff, r["diff"]


# ---------------------------------------------------------------- passing cases, 2 ranks
def strategies_and_schedules() -> dict[str, Any]:
    out = {
        "shard_grad_op": _parity("int8", strategy=ShardingStrategy.SHARD_GRAD_OP),
        "no_reshard_after_forward": _parity("int8", reshard_after_forward=False),
    }
    for kind in ("nf4", "fp8"):  # checkpointing: backward recomputes the forward, which gathers again
        ref, model, batch, per_rank, unit = MODELS[kind]()
        for block in model[:2]:
            fc.checkpoint(block)
        fully_shard(model, ModuleWrapPolicy({unit}))
        out[f"checkpoint_{kind}"] = {"losses": _train(model, ref, batch, per_rank), "diff": _diff(model, ref)}
    for kind, no_sync in (("int8", "ctx"), ("int8", ""), ("fp8", "ctx"), ("fp8", "flag")):  # 2 micro-batches a step
        ref, model, batch, per_rank, _ = _sharded(kind)
        losses = _train(model, ref, batch, per_rank, micro=2, no_sync=no_sync)
        out[f"accumulate_{kind}_{no_sync or 'sync'}"] = {"losses": losses, "diff": _diff(model, ref)}
    return out


@needs_torchao
def test_strategies_checkpointing_and_accumulation_train_like_the_unsharded_model(dist_run) -> None:
    for r in dist_run(2, strategies_and_schedules):
        for name, case in r.items():
            assert isinstance(case, dict), (name, case)
            _check_parity(case)


def mixed_precision() -> dict[str, Any]:
    out = {}
    for kind in ("int8", "fp8"):
        ref, model, batch, per_rank, _ = _sharded(kind, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
        rank, world = dist.get_rank(), dist.get_world_size()
        x, y = batch(0, world)
        F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        weight = model[0].up.weight
        dtypes = (str(weight.dtype), str(weight.grad.dtype), type(weight.grad).__name__, str(weight.grad.placements))
        model.zero_grad()
        out[kind] = {"losses": _train(model, ref, batch, per_rank, steps=3), "dtypes": dtypes}
    return out


@needs_torchao
def test_mixed_precision_bf16_keeps_float32_faces_and_gradients(dist_run) -> None:
    for r in dist_run(2, mixed_precision):
        for kind, case in r.items():
            assert case["dtypes"] == ("torch.float32", "torch.float32", "DTensor", "(Shard(dim=0),)"), (kind, case)
            losses = case["losses"]
            assert abs(losses[0][0] - losses[0][1]) < 2e-2 * losses[0][0], (kind, losses)  # bf16 compute
            assert losses[-1][1] < 0.8 * losses[0][1], (kind, losses)


def float8_recipes() -> dict[str, Any]:
    """torch's and our clip_grad_norm_ over float8 faces; torchao's precomputed scales (torchtitan's
    recipe: one all-reduce of every weight's amax after the optimizer step); two forwards per step."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    out: dict[str, Any] = {}
    for kind in ("fp8", "int8"):
        for name, clip in (
            ("torch", lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)),
            ("ours", lambda m: fc.clip_grad_norm_(m, 0.1)),
        ):
            ref, model, batch, per_rank, _ = _sharded(kind)
            out[f"clip_{kind}_{name}"] = {
                "losses": _train(model, ref, batch, per_rank, clip=clip),
                "diff": _diff(model, ref),
            }
    rank, world = dist.get_rank(), dist.get_world_size()
    for name in ("precomputed_scales", "two_forwards"):
        ref, model, batch, per_rank, _ = _sharded("fp8")
        opt_ref, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(model.parameters(), lr=1e-2)
        if name == "precomputed_scales":
            precompute_float8_dynamic_scale_for_fsdp(model)
        losses = []
        for step in range(2):
            x, y = batch(step, world)
            xs = [x] if name == "precomputed_scales" else [x, x.flip(0)]  # the unit is gathered twice in forward
            loss_ref = sum(
                F.mse_loss(ref(a.chunk(world)[r]), y.chunk(world)[r]) / world for a in xs for r in range(world)
            )
            loss_ref.backward()
            loss = sum(F.mse_loss(model(a.chunk(world)[rank]), y.chunk(world)[rank]) for a in xs)
            loss.backward()
            for o in (opt_ref, opt):
                o.step()
                o.zero_grad()
            if name == "precomputed_scales":
                precompute_float8_dynamic_scale_for_fsdp(model)
            losses.append((float(loss_ref.detach()), global_mean(loss.detach()), None))
        scales = sum(getattr(p._local_tensor, "_precomputed_scale", None) is not None for p in model.parameters())
        out[name] = {"losses": losses, "diff": _diff(model, ref), "scales": scales}
    return out


@needs_torchao
def test_float8_clip_grad_norm_precomputed_scales_and_two_forwards(dist_run) -> None:
    for r in dist_run(2, float8_recipes):
        for name, case in r.items():
            _check_parity(case)
            if name.startswith("clip"):
                for _, _, (norm_ref, norm) in case["losses"]:
                    assert abs(norm_ref - norm) < 1e-5 * norm_ref, (name, case["losses"])
        assert r["precomputed_scales"]["scales"] == 4, r["precomputed_scales"]  # every float8 weight


def recoveries() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for kind in ("fp8", "nf4"):
        # an exception inside a unit's forward, then training goes on
        ref, model, batch, per_rank, _ = _sharded(kind)
        _train(model, ref, batch, per_rank, steps=1)

        def boom(x: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom")

        model[1].forward = boom
        x, _ = batch(0, world)
        raised = _error(lambda m=model, x=x: m(x.chunk(world)[rank]))
        del model[1].forward
        out[f"exception_{kind}"] = {
            "raised": raised,
            "losses": _train(model, ref, batch, per_rank),
            "diff": _diff(model, ref),
        }
        if kind == "nf4":  # a forward under no_grad (evaluation) before the first step (the same path for fp8)
            ref, model, batch, per_rank, _ = _sharded(kind)
            with torch.no_grad():
                model(x.chunk(world)[rank])
            out[f"no_grad_first_{kind}"] = {"losses": _train(model, ref, batch, per_rank), "diff": _diff(model, ref)}
    # freezing a float8 weight between steps
    ref, model, batch, per_rank, _ = _sharded("fp8")
    first = _train(model, ref, batch, per_rank, steps=1)
    ref[0].up.weight.requires_grad_(False)
    model[0].up.weight.requires_grad_(False)
    before = _whole(model[0].up.weight).clone()
    losses = first + _train(model, ref, batch, per_rank, steps=2)
    frozen = torch.equal(before, _whole(model[0].up.weight)) and model[0].up.weight.grad is None
    out["freeze_fp8"] = {"losses": losses, "diff": _diff(model, ref), "frozen": frozen}
    # QLoRA whose root unit holds an NF4 weight (the head), and one with no policy (everything in the root)
    torch.manual_seed(0)
    ref = nn.Sequential(QLoRABlock(), LoRALinear(256, 128))
    model = copy.deepcopy(ref)
    fully_shard(model, ModuleWrapPolicy({QLoRABlock}))
    out["nf4_in_root"] = {"losses": _train(model, ref, _batch(256, 128), False), "diff": _diff(model, ref)}
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(256, 256), LoRALinear(256, 256), nn.Linear(256, 8))
    model = copy.deepcopy(ref)
    fully_shard(model)
    out["nf4_one_unit"] = {"losses": _train(model, ref, _batch(256, 8), False), "diff": _diff(model, ref)}
    return out


@needs_torchao
def test_exception_no_grad_freeze_and_root_nf4_train_like_the_unsharded_model(dist_run) -> None:
    for r in dist_run(2, recoveries):
        for name, case in r.items():
            if name.startswith("exception"):
                assert case["raised"] == "ValueError: boom", case
            if name == "freeze_fp8":
                assert case["frozen"], case
            _check_parity(case, trained=not name.startswith("exception"))


def sharded_round_trips() -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    out: dict[str, Any] = {}
    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    for kind in ("fp8", "nf4"):
        ref, model, batch, per_rank, _ = _sharded(kind)
        _train(model, ref, batch, per_rank, steps=1)
        _, fresh, *_ = _sharded(kind, seed=5)
        keys = fresh.load_state_dict(model.state_dict())
        out[f"load_state_dict_{kind}"] = (list(keys.missing_keys), list(keys.unexpected_keys), _diff(fresh, model))
        # DCP through SHARDED, as documented: a FULL dict holds the whole NF4Tensor, which DCP pickles and
        # torch's weights_only load refuses (torchao does not allowlist it)
        with fc.state_dict_type(model, fc.StateDictType.SHARDED_STATE_DICT):
            dcp.save(model.state_dict(), checkpoint_id=f"{path[0]}/{kind}")
        _, fresh, *_ = _sharded(kind, seed=5)
        with fc.state_dict_type(fresh, fc.StateDictType.SHARDED_STATE_DICT):
            loaded = fresh.state_dict()
            dcp.load(loaded, checkpoint_id=f"{path[0]}/{kind}")
            fresh.load_state_dict(loaded)
        out[f"dcp_{kind}"] = _diff(fresh, model)
        _, fresh, *_ = _sharded(kind, seed=5)
        set_model_state_dict(fresh, get_model_state_dict(model))
        out[f"set_model_state_dict_{kind}"] = _diff(fresh, model)
        _, fresh, *_ = _sharded(kind, seed=5)
        with fc.state_dict_type(model, fc.StateDictType.SHARDED_STATE_DICT):
            sd = model.state_dict()
        with fc.state_dict_type(fresh, fc.StateDictType.SHARDED_STATE_DICT):
            fresh.load_state_dict(sd)
        out[f"sharded_state_dict_{kind}"] = _diff(fresh, model)
    # the optimizer's own state dict, and ours, load back; training goes on like the reference
    ref, model, batch, per_rank, _ = _sharded("fp8")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch(0, world)
    F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    opt.step()
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    osd = fc.optim_state_dict(model, opt)
    opt.load_state_dict(fc.optim_state_dict_to_load(model, opt, osd))
    out["optim_state_dict"] = sorted(osd["state"])
    out["deepcopy"] = _error(lambda: copy.deepcopy(model))
    return out


@needs_torchao
def test_sharded_state_dict_round_trips_and_torch_dcp(dist_run) -> None:
    for r in dist_run(2, sharded_round_trips):
        for kind in ("fp8", "nf4"):
            assert r[f"load_state_dict_{kind}"] == ([], [], 0.0), r
            for how in ("dcp", "set_model_state_dict", "sharded_state_dict"):
                assert r[f"{how}_{kind}"] == 0.0, (how, kind, r)
        assert r["optim_state_dict"] == [
            "0.down.weight",
            "0.up.weight",
            "1.down.weight",
            "1.up.weight",
            "2.bias",
            "2.weight",
        ]
        assert r["deepcopy"].startswith(
            "TypeError: fully_shard: the state of 'Sequential' belongs to a model sharded"
        ), r


def world_of_one() -> dict[str, Any]:
    return {kind: _parity(kind) for kind in ("int8", "nf4")}  # float8 would import torchao's float8 here too


@needs_torchao
def test_world_size_one(dist_run) -> None:
    for case in dist_run(1, world_of_one)[0].values():
        _check_parity(case, tol=0, diff=0)


# ---------------------------------------------------------------- passing cases, 4 ranks
def four_ranks() -> dict[str, Any]:
    r = dist.get_rank()
    shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = (shards[r // 2], replicas[r % 2])
    out = {
        f"hybrid_{kind}": _parity(kind, strategy=ShardingStrategy.HYBRID_SHARD, process_group=group)
        for kind in ("nf4", "fp8")
    }
    out["reshard_after_forward_2_int8"] = _parity("int8", reshard_after_forward=2)
    return out


@needs_torchao
def test_hybrid_shard_and_reshard_to_two_on_four_ranks(dist_run) -> None:
    for r in dist_run(4, four_ranks):
        for case in r.values():
            _check_parity(case)


# ---------------------------------------------------------------- faults
def full_state_dict() -> dict[str, Any]:
    out: dict[str, Any] = {}
    ref, model, batch, per_rank, _ = _sharded("fp8")
    _train(model, ref, batch, per_rank, steps=1)
    sd = model.state_dict()  # FULL by default
    out["types"] = {k: type(v).__name__ for k, v in sd.items()}
    saved = sd["0.up.weight"]
    before = (_whole(saved) if isinstance(saved, DTensor) else saved).clone()
    _train(model, ref, batch, per_rank, steps=1)  # the optimizer steps the live parameters in place
    out["unchanged_after_a_step"] = torch.equal(before, _whole(saved) if isinstance(saved, DTensor) else saved)
    out["plain_load"] = _error(lambda: MODELS["fp8"](5)[0].load_state_dict(sd))
    return out


@needs_torchao
def test_full_state_dict_holds_full_copies_of_extension_parameters(dist_run) -> None:
    for r in dist_run(2, full_state_dict):
        assert r["types"]["2.weight"] == "Tensor"  # the plain parameters are full tensors
        assert r["unchanged_after_a_step"], "the saved state dict changed when the model trained on"
        assert r["types"]["0.up.weight"] != "DTensor", r["types"]
        assert r["plain_load"] == "", r["plain_load"]


def load_full_tensors() -> dict[str, str]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    out = {}
    for kind in ("fp8", "nf4"):
        ref, model, batch, per_rank, _ = _sharded(kind)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # full subclass tensors
        assert type(full["0.up.weight"]) is not DTensor
        _, fresh, *_ = _sharded(kind, seed=5)
        out[kind] = _error(lambda m=fresh, sd=full: m.load_state_dict(sd))
        if not out[kind]:
            out[kind] = "" if _diff(fresh, model) == 0 else f"loaded values differ by {_diff(fresh, model)}"
    return out


@needs_torchao
def test_full_tensors_load_into_extension_parameters(dist_run) -> None:
    for r in dist_run(2, load_full_tensors):
        assert r == {"fp8": "", "nf4": ""}, r


def summon_and_optim_state() -> dict[str, Any]:
    ref, model, batch, per_rank, _ = _sharded("fp8")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch(0, world)
    F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    opt.step()
    before = _whole(model.get_parameter("0.up.weight"))
    with fc.summon_full_params(model):
        inside = {n: type(p).__name__ for n, p in model.named_parameters()}
        whole = model.get_parameter("0.up.weight")
        same = torch.equal(whole.detach(), before)
        with torch.no_grad():
            whole.mul_(0.5)  # written back on exit
    halved = torch.equal(_whole(model.get_parameter("0.up.weight")), before * 0.5)
    osd = fc.optim_state_dict(model, opt)
    states = {k: type(s["exp_avg"]).__name__ for k, s in osd["state"].items()}
    # the FULL optimizer state loads back into a fresh optimizer in the faces' layout
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fresh.load_state_dict(fc.optim_state_dict_to_load(model, fresh, osd))
    faces = [p for p in model.parameters() if p in opt.state]
    loaded = all(
        isinstance(fresh.state[p]["exp_avg"], DTensor)
        and fresh.state[p]["exp_avg"].placements == p.placements
        and torch.equal(_whole(fresh.state[p]["exp_avg"]), _whole(opt.state[p]["exp_avg"]))
        for p in faces
    )
    return {"summon": inside, "same": same, "halved": halved, "optim": states, "loaded": loaded}


@needs_torchao
def test_summon_full_params_gives_full_extension_parameters(dist_run) -> None:
    for r in dist_run(2, summon_and_optim_state):
        assert r["summon"]["2.weight"] != "DTensor", r
        assert r["summon"]["0.up.weight"] != "DTensor", r["summon"]
        assert r["same"] and r["halved"], r


@needs_torchao
def test_full_optim_state_dict_gives_full_states_of_extension_parameters(dist_run) -> None:
    for r in dist_run(2, summon_and_optim_state):
        assert r["optim"]["2.weight"] == "Tensor", r
        assert r["optim"]["0.up.weight"] != "DTensor", r["optim"]
        assert r["loaded"], r


def raw_errors() -> dict[str, str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    # an NF4 model cast after a step: NF4's to(bfloat16) dequantizes, and the face's local tensor
    # no longer defines the protocol. (Cast before the first forward, it is refused by name as an edit.)
    ref, model, batch, per_rank, _ = _sharded("nf4")
    _train(model, ref, batch, per_rank, steps=1)
    model.to(torch.bfloat16)
    x, _ = batch(0, world)
    out["cast"] = _error(lambda: model(x.chunk(world)[rank].bfloat16()))
    # an NF4 weight of 64 x 256: one float32 factor for its 256 scales, which cannot split over 2 ranks
    torch.manual_seed(0)
    head = nn.Sequential(LoRALinear(256, 64))
    out["uneven_scales"] = _error(lambda: fully_shard(head))
    return out


@needs_torchao
def test_nf4_cast_and_uneven_scales_name_the_parameter(dist_run) -> None:
    results = dist_run(2, raw_errors)
    assert results[0] == results[1], results
    r = results[0]
    assert r["cast"] and r["uneven_scales"], r  # both refused, on every rank, nothing hung
    assert "'0.up.weight'" in r["cast"], r["cast"]
    assert "'0.weight'" in r["uneven_scales"], r["uneven_scales"]
