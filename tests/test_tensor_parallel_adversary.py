"""Adversarial paths for 2-D (tensor-parallel inside ``fully_shard``) models whose tensor-parallel parameters
are 2-D ``DTensor`` faces over the (dp, tp) mesh between steps ([Note: 2-D faces] in
fsdp_composable/_comm/_tensor_parallel.py): what a torch FSDP2 + TP (torchtitan-style) user does between
steps, each compared with the unsharded model trained on the global batch (float64, 4 gloo ranks, 2 x 2
unless said)."""

from __future__ import annotations

import copy
import io
import os
import tempfile
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_tensor_parallel import (
    PLAN,
    Block,
    D,
    H,
    Net,
    _adamw,
    _batch,
    _built_2d,
    _full_values,
    _local,
    _loss,
    _max_diff,
    _mesh,
    _mesh_of_shape,
    _optim_diff,
    _plain,
    _ref_optim_state,
    _ref_run,
    _shard,
    _step,
    _tp,
    _train_2d,
    _train_steps,
)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fsdp_composable import (
    CPUOffload,
    ModuleWrapPolicy,
    ShardingStrategy,
    StateDictType,
    clip_grad_norm_,
    fully_shard,
    init_optim_state,
    optim_state_dict,
    optim_state_dict_to_load,
    state_dict_type,
    unshard_params,
)


def _err(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares the text
        return f"{type(e).__name__}: {e}"
    return ""


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    with state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return _full_values(model.state_dict())


def _parity(model: nn.Module, optim: Any, mesh: DeviceMesh, steps: range, ref: Net, ref_optim: Any) -> dict[str, float]:
    """Train both on ``steps``; the largest loss difference and the final weights' difference."""
    losses = _train_steps(model, optim, mesh, steps)
    _, _, ref_losses = _ref_run(steps, ref, ref_optim)
    return {
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "weights": _max_diff(_full(model), ref.state_dict()),
    }


def _fresh_parity(model: nn.Module, optim: Any, mesh: DeviceMesh, steps: range, ref: Net) -> dict[str, float]:
    return _parity(model, optim, mesh, steps, ref, _adamw(ref))


def _same_on_all_ranks(values: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose value differs between ranks."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    return [k for k in values if not all(torch.equal(g[k], values[k]) for g in gathered)]


def _assert_parity(results: list[dict[str, Any]], tol: float = 1e-10) -> None:
    for r in results:
        assert r["loss"] < tol and r["weights"] < tol, r


# ---------------------------------------------------------------------------- offload, casts, meta init
def _offload() -> dict[str, float]:
    mesh = _mesh()
    model = _shard(_tp(_plain(), mesh), mesh, cpu_offload=CPUOffload(offload_params=True))
    return _fresh_parity(model, _adamw(model), mesh, range(3), _plain())


def test_2d_cpu_offload_trains_like_the_plain_model(dist_run) -> None:
    _assert_parity(dist_run(4, _offload))


def _meta_to_empty() -> dict[str, Any]:
    """FSDP2's meta recipe with TP: build on meta, parallelize, shard, ``to_empty``, then load the plain
    model's weights and train; then ``to_empty`` again and ``reset_parameters()`` under one seed."""
    mesh = _mesh()
    with torch.device("meta"):
        model = Net().double()
    _shard(_tp(model, mesh), mesh)
    model.to_empty(device="cpu")
    ref = _plain()
    out: dict[str, Any] = {"load": _err(lambda: model.load_state_dict(ref.state_dict()))}
    out["loaded"] = _max_diff(_full(model), ref.state_dict())
    out.update(_fresh_parity(model, _adamw(model), mesh, range(3), ref))
    model.to_empty(device="cpu")
    torch.manual_seed(3)
    model.apply(lambda m: m.reset_parameters() if isinstance(m, (nn.Linear, nn.LayerNorm)) else None)
    full = _full(model)
    out["reset_differs_between_ranks"] = _same_on_all_ranks(full)
    out["reset_finite"] = all(bool(torch.isfinite(v).all()) for v in full.values())
    out["reset_bound"] = float(full["blocks.0.up.weight"].abs().max()) <= 1 / D**0.5
    return out


def test_2d_meta_init_to_empty_then_load_or_reset(dist_run) -> None:
    for r in dist_run(4, _meta_to_empty):
        assert r["load"] == "" and r["loaded"] == 0.0, r
        assert r["loss"] < 1e-10 and r["weights"] < 1e-10, r
        assert r["reset_differs_between_ranks"] == [] and r["reset_finite"] and r["reset_bound"], r


def _cast(how: str) -> dict[str, Any]:
    mesh = _mesh()
    model = _shard(_tp(_plain(), mesh), mesh)
    getattr(model, how)()
    out: dict[str, Any] = {"first": _err(lambda: _loss(model, _local(_batch(0), mesh)).backward())}
    model.zero_grad()
    out["dtypes"] = {n: str(p.to_local().dtype) for n, p in model.named_parameters()}
    out["second"] = _err(lambda: _loss(model, _local(_batch(0), mesh)).backward())
    return out


def test_2d_cast_to_the_same_dtype_is_a_no_op(dist_run) -> None:
    for r in dist_run(4, _cast, "double"):
        assert r["first"] == "" and r["second"] == "", r
        assert set(r["dtypes"].values()) == {"torch.float64"}


def test_2d_refused_cast_leaves_the_whole_model_in_its_dtype(dist_run) -> None:
    for r in dist_run(4, _cast, "half"):
        # no unit adopts a cast of a model with tensor-parallel units: every one is put back
        assert "ModelEditedAfterShardingError: parameter 'inp.weight' was cast from torch.float64" in r["first"], r
        assert "tensor-parallel parameters" in r["first"] and "put back to torch.float64" in r["first"], r
        assert set(r["dtypes"].values()) == {"torch.float64"}, r["dtypes"]
        assert r["second"] == "", r["second"]


# ---------------------------------------------------------------------------- writes through the faces
def _writes() -> dict[str, Any]:
    mesh = _mesh()
    out: dict[str, Any] = {}
    # redistribute, then full_tensor
    model = _shard(_tp(_plain(), mesh), mesh)
    ref = _plain()
    worst = 0.0
    for n, p in model.named_parameters():
        if p.device_mesh.ndim == 2:
            whole = p.detach().redistribute(p.device_mesh, [Replicate(), Replicate()]).to_local()
            both = p.detach().redistribute(p.device_mesh, [Shard(0), Shard(0)]).full_tensor()
            worst = max(worst, float((whole - ref.state_dict()[n]).abs().max()), float((both - whole).abs().max()))
    out["redistribute"] = worst
    # in place through the local tensor
    with torch.no_grad():
        for p, rp in zip(model.parameters(), ref.parameters()):
            p.to_local().mul_(2.0)
            rp.mul_(2.0)
    out["to_local"] = _max_diff(_full(model), ref.state_dict())
    out["to_local_train"] = _fresh_parity(model, _adamw(model), mesh, range(2), ref)
    # p.copy_(DTensor): the same layout, and the same values replicated on the 2-D mesh
    source, ref = _shard(_tp(_plain(5), mesh), mesh), _plain(5)
    model = _shard(_tp(_plain(), mesh), mesh)
    model2 = _shard(_tp(_plain(), mesh), mesh)
    with torch.no_grad():
        for p, p2, q in zip(model.parameters(), model2.parameters(), source.parameters()):
            p.copy_(q)
            p2.copy_(q.redistribute(q.device_mesh, [Replicate()] * q.device_mesh.ndim))
    out["copy"] = _max_diff(_full(model), ref.state_dict())
    out["copy_replicated"] = _max_diff(_full(model2), ref.state_dict())
    out["copy_train"] = _fresh_parity(model2, _adamw(model2), mesh, range(2), ref)
    # nn.init on the 2-D parameters: constants, and a draw with one seed everywhere
    ref = _plain()
    with torch.no_grad():
        for (n, p), rp in zip(model.named_parameters(), ref.parameters()):
            nn.init.constant_(p, 0.01 * len(n))
            nn.init.constant_(rp, 0.01 * len(n))
    out["init_constant"] = _max_diff(_full(model), ref.state_dict())
    torch.manual_seed(11)
    for p in model.parameters():
        nn.init.normal_(p, std=0.02)
    full = _full(model)
    out["init_normal_differs_between_ranks"] = _same_on_all_ranks(full)
    out["init_normal_std"] = float(full["blocks.0.up.weight"].std())
    return out


def test_2d_redistribute_in_place_writes_copy_and_nn_init(dist_run) -> None:
    """``p.redistribute(...)``, ``p.to_local().mul_``, ``p.copy_(dtensor)`` (also from another placement) and
    ``nn.init`` on the 2-D faces reach the flat shard: the model equals and trains like the plain one."""
    for r in dist_run(4, _writes):
        assert r["redistribute"] == 0.0 and r["to_local"] == 0.0, r
        assert r["copy"] == 0.0 and r["copy_replicated"] == 0.0 and r["init_constant"] == 0.0, r
        for key in ("to_local_train", "copy_train"):
            assert r[key]["loss"] < 1e-10 and r[key]["weights"] < 1e-10, (key, r[key])
        assert r["init_normal_differs_between_ranks"] == [] and r["init_normal_std"] > 0.01, r


def _unshard_writeback() -> dict[str, Any]:
    mesh = _mesh()
    model = _shard(_tp(_plain(), mesh), mesh)
    ref = _plain()
    with unshard_params(model, writeback=True):
        kinds = {n: (type(p).__name__, tuple(p.shape)) for n, p in model.named_parameters() if ".up." in n}
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(3.0)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(3.0)
    out: dict[str, Any] = {"kinds": kinds, "written": _max_diff(_full(model), ref.state_dict())}
    out.update(_fresh_parity(model, _adamw(model), mesh, range(2), ref))
    return out


def test_2d_unshard_params_writeback(dist_run) -> None:
    """Inside ``unshard_params`` a tensor-parallel parameter is the TP DTensor (global shape, full over dp);
    in-place writes are kept."""
    for r in dist_run(4, _unshard_writeback):
        assert r["kinds"]["blocks.0.up.weight"] == ("DTensor", (H, D)), r["kinds"]
        assert r["written"] == 0.0 and r["loss"] < 1e-10 and r["weights"] < 1e-10, r


def _data_assignments() -> dict[str, str]:
    mesh = _mesh()
    model, optim = _built_2d(mesh)
    _train_steps(model, optim, mesh, range(1))
    model.blocks[0].up.weight.data = torch.zeros(H, D, dtype=torch.float64)
    out = {"data": _err(lambda: _loss(model, _local(_batch(1), mesh)).backward())}
    model.zero_grad()
    _loss(model, _local(_batch(1), mesh)).backward()
    out["grad_type"] = type(model.blocks[1].down.weight.grad).__name__
    model.blocks[1].down.weight.grad.data = torch.zeros(D, H, dtype=torch.float64)
    out["grad_data"] = _err(lambda: _loss(model, _local(_batch(2), mesh)).backward())
    return out


def test_2d_data_and_grad_data_assignment_are_refused_by_name(dist_run) -> None:
    for r in dist_run(4, _data_assignments):
        assert r["data"].startswith(
            "ModelEditedAfterShardingError: parameter 'blocks.0.up.weight' had its .data replaced after fully_shard"
        ), r
        assert r["grad_type"] == "DTensor"
        assert r["grad_data"].startswith(
            "ModelEditedAfterShardingError: the gradient of parameter 'blocks.1.down.weight' had its .data replaced"
        ), r


def _copies() -> dict[str, str]:
    mesh = _mesh()
    model = _shard(_tp(_plain(), mesh), mesh)
    return {
        "deepcopy": _err(lambda: copy.deepcopy(model)),
        "save": _err(lambda: torch.save(model, io.BytesIO())),
        "param": _err(lambda: copy.deepcopy(model.blocks[0].up.weight)),
    }


def test_2d_deepcopy_and_torch_save_are_refused(dist_run) -> None:
    for r in dist_run(4, _copies):
        assert "cannot be copied with copy.deepcopy" in r["deepcopy"] and r["save"] == r["deepcopy"], r
        assert r["param"].startswith("TypeError: fully_shard: parameter 'blocks.0.up.weight' belongs to"), r


# ---------------------------------------------------------------------------- gradients and optimizers
def _gradient_paths() -> dict[str, Any]:
    mesh = _mesh()
    out: dict[str, Any] = {}
    # two backwards (outside no_sync) without zero_grad accumulate into the 2-D gradients
    model, optim = _built_2d(mesh)
    ref = _plain()
    ref_optim = _adamw(ref)
    for s in range(2):
        _loss(model, _local(_batch(s), mesh)).backward()
        _loss(ref, _batch(s)).backward()
    out["accumulated"] = max(
        float((p.grad.full_tensor() - rp.grad).abs().max()) for p, rp in zip(model.parameters(), ref.parameters())
    )
    optim.step()
    ref_optim.step()
    # zero_grad(set_to_none=False): the zeroed 2-D gradients stay and the next backward fills them
    optim.zero_grad(set_to_none=False)
    ref_optim.zero_grad(set_to_none=False)
    out["kept"] = all(isinstance(p.grad, DTensor) and not bool(p.grad.to_local().any()) for p in model.parameters())
    for s in range(2, 4):  # p.grad replaced by a new DTensor between backward and step
        _loss(model, _local(_batch(s), mesh)).backward()
        _loss(ref, _batch(s)).backward()
        for p, rp in zip(model.parameters(), ref.parameters()):
            p.grad = p.grad * 2
            rp.grad = rp.grad * 2
        optim.step()
        ref_optim.step()
        optim.zero_grad(set_to_none=False)
        ref_optim.zero_grad(set_to_none=False)
    out["weights"] = _max_diff(_full(model), ref.state_dict())
    # AdamW(foreach=True): the 2-D faces, the other units' 1-D faces
    model = _shard(_tp(_plain(), mesh), mesh)
    foreach = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, foreach=True)
    out["foreach"] = _fresh_parity(model, foreach, mesh, range(2), _plain())
    return out


def test_2d_gradient_accumulation_zero_grad_keep_grad_assignment_and_foreach(dist_run) -> None:
    for r in dist_run(4, _gradient_paths):
        assert r["accumulated"] < 1e-12 and r["kept"] and r["weights"] < 1e-10, r
        assert r["foreach"]["loss"] < 1e-10 and r["foreach"]["weights"] < 1e-10, r


def _no_sync_strategies() -> dict[str, tuple[float, float]]:
    out = {}
    for strategy in (ShardingStrategy.NO_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        r = _train_2d(strategy=strategy, accumulate=True)
        out[strategy.name] = (max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])), r["weights_diff"])
    return out


def test_2d_no_sync_under_no_shard_and_shard_grad_op(dist_run) -> None:
    for r in dist_run(4, _no_sync_strategies):
        assert all(loss < 1e-10 and weights < 1e-10 for loss, weights in r.values()), r


def _torch_clip() -> dict[str, Any]:
    mesh = _mesh()
    model = _shard(_tp(_plain(), mesh), mesh)
    ref = _plain()
    _loss(model, _local(_batch(0), mesh)).backward()
    _loss(ref, _batch(0)).backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
    out: dict[str, Any] = {"ref": ref_norm}
    params = list(model.parameters())
    out["error"] = _err(lambda: out.__setitem__("torch", float(torch.nn.utils.clip_grad_norm_(params, 0.5))))
    out["clipped"] = max(
        float((p.grad.full_tensor() - rp.grad).abs().max()) for p, rp in zip(model.parameters(), ref.parameters())
    )
    return out


def test_2d_torch_clip_grad_norm_over_model_parameters(dist_run) -> None:
    for r in dist_run(4, _torch_clip):
        assert r["error"] == "", r["error"]
        assert r["torch"] == pytest.approx(r["ref"], rel=1e-6)
        assert r["clipped"] < 1e-6


# ---------------------------------------------------------------------------- state dicts and checkpoints
def _trained_two_steps(mesh: DeviceMesh) -> tuple[nn.Module, Any, Net, Any]:
    """A 2-D model and its optimizer, and the plain model and its optimizer, each trained two steps."""
    model, optim = _built_2d(mesh)
    ref = _plain()
    ref_optim = _adamw(ref)
    _train_steps(model, optim, mesh, range(2))
    _ref_run(range(2), ref, ref_optim)
    return model, optim, ref, ref_optim


def _optimizer_state_dict_into_fresh_optimizer() -> dict[str, Any]:
    """torch's own ``optim.state_dict()`` / ``load_state_dict`` into a fresh model and optimizer that has no
    state yet (no init_optim_state), then training on."""
    mesh = _mesh()
    model, optim, ref, ref_optim = _trained_two_steps(mesh)
    saved_optim, saved_model = copy.deepcopy(optim.state_dict()), copy.deepcopy(model.state_dict())
    fresh, fresh_optim = _built_2d(mesh, seed=1, lr=1.0)
    out: dict[str, Any] = {"model": _err(lambda: fresh.load_state_dict(saved_model))}
    out["optim"] = _err(lambda: fresh_optim.load_state_dict(saved_optim))
    out["lr"] = [g["lr"] for g in fresh_optim.param_groups]
    out.update(_parity(fresh, fresh_optim, mesh, range(2, 4), ref, ref_optim))
    return out


def test_2d_optimizer_state_dict_into_a_fresh_optimizer(dist_run) -> None:
    for r in dist_run(4, _optimizer_state_dict_into_fresh_optimizer):
        assert r["model"] == "" and r["optim"] == "" and r["lr"] == [0.01], r
        assert r["loss"] < 1e-10 and r["weights"] < 1e-10, r


def _fsdp1_sharded_dcp(path: str) -> dict[str, Any]:
    """FSDP1-style SHARDED ``model.state_dict()`` + ``optim_state_dict`` saved with ``dcp.save`` at (2, 2),
    loaded with ``dcp.load`` + ``optim_state_dict_to_load`` at (2, 2) and (4, 1)."""
    mesh = _mesh()
    model, optim, ref, ref_optim = _trained_two_steps(mesh)
    with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict(), "optim": optim_state_dict(model, optim)}, checkpoint_id=path)
    out: dict[str, Any] = {}
    for dp, tp in ((2, 2), (4, 1)):
        target = _mesh_of_shape(dp, tp)
        fresh = _shard(_tp(_plain(7), target), target)
        fresh_optim = _adamw(fresh, lr=1.0)
        init_optim_state(fresh_optim)
        with state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
            state = {"model": fresh.state_dict(), "optim": optim_state_dict(fresh, fresh_optim)}
            dcp.load(state, checkpoint_id=path)
            fresh.load_state_dict(state["model"])
            fresh_optim.load_state_dict(optim_state_dict_to_load(fresh, fresh_optim, state["optim"]))
        names = {id(p): n for n, p in fresh.named_parameters()}
        mine = {names[id(p)]: s for p, s in fresh_optim.state.items()}
        r = {"optim_state": _optim_diff(mine, _ref_optim_state(ref, ref_optim))}
        ref2 = copy.deepcopy(ref)
        ref2_optim = _adamw(ref2)
        ref2_optim.load_state_dict(copy.deepcopy(ref_optim.state_dict()))  # its own state tensors
        dp_mesh = target["dp"]
        losses = [
            _step(fresh, fresh_optim, s, dp_mesh.get_local_rank(), dp_mesh.size(), dp_mesh.get_group()) for s in (2, 3)
        ]
        ref_losses = _ref_run(range(2, 4), ref2, ref2_optim)[2]
        r["loss"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
        r["weights"] = _max_diff(_full(fresh), ref2.state_dict())
        out[f"{dp}x{tp}"] = r
    return out


def test_2d_fsdp1_style_sharded_dcp_reshards_across_meshes(dist_run) -> None:
    box = tempfile.mkdtemp()
    for r in dist_run(4, _fsdp1_sharded_dcp, os.path.join(box, "ck")):
        for key, v in r.items():
            assert v["optim_state"] < 1e-12 and v["loss"] < 1e-10 and v["weights"] < 1e-10, (key, v)


def _broadcast_from_rank0() -> dict[str, Any]:
    """torchtitan's load of a full (e.g. converted HF) checkpoint: plain tensors on rank 0 only,
    ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` (torch distributes them to the
    2-D faces' placements, _StridedShard included)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    mesh = _mesh()
    ref = _plain(3)
    model, optim = _built_2d(mesh)
    full = ref.state_dict() if dist.get_rank() == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    out: dict[str, Any] = {"set": _err(lambda: set_model_state_dict(model, full, options=options))}
    out["loaded"] = _max_diff(_full(model), ref.state_dict())
    out.update(_fresh_parity(model, optim, mesh, range(2), ref))
    return out


def test_2d_set_model_state_dict_broadcast_from_rank0(dist_run) -> None:
    for r in dist_run(4, _broadcast_from_rank0):
        assert r["set"] == "" and r["loaded"] == 0.0, r
        assert r["loss"] < 1e-10 and r["weights"] < 1e-10, r


# ---------------------------------------------------------------------------- meshes and plans
def _swapped_mesh() -> dict[str, Any]:
    """A (tp, dp) mesh (dp the inner dimension): the 2-D mesh is built from the two groups."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
    model = _shard(_tp(_plain(), mesh), mesh)
    ref = _plain()
    out: dict[str, Any] = {"placements": str(model.blocks[0].up.weight.placements)}
    out["full"] = max(float((p.full_tensor() - rp).abs().max()) for p, rp in zip(model.parameters(), ref.parameters()))
    out.update(_fresh_parity(model, _adamw(model), mesh, range(3), ref))
    return out


def test_2d_mesh_with_tensor_parallel_as_the_outer_dimension(dist_run) -> None:
    for r in dist_run(4, _swapped_mesh):
        assert r["placements"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))", r
        assert r["full"] == 0.0 and r["loss"] < 1e-10 and r["weights"] < 1e-10, r


def _int_reshard() -> dict[str, Any]:
    """``reshard_after_forward=2`` over a dp group of 4 (tp = 1)."""
    mesh = _mesh_of_shape(4, 1)
    model = fully_shard(
        _tp(_plain(), mesh), policy=ModuleWrapPolicy({Block}), process_group=mesh["dp"], reshard_after_forward=2
    )
    return _fresh_parity(model, _adamw(model), mesh, range(3), _plain())


def test_2d_reshard_after_forward_int(dist_run) -> None:
    _assert_parity(dist_run(4, _int_reshard))


class EmbNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(D)
        self.out = nn.Linear(D, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return self.out(self.norm(h))


def _root_plan() -> dict[str, Any]:
    """torchtitan's root plan: a RowwiseParallel embedding (vocab 7: 4 + 3 rows over tp, 2 + 2 and 2 + 1 over
    dp) and a ColwiseParallel output of 3 features (2 + 1 over tp: 1 + 1 and 1 + 0 over dp, an empty face)
    in the root unit, next to a plain LayerNorm."""
    mesh = _mesh()
    torch.manual_seed(0)
    ref = EmbNet().double()
    model = copy.deepcopy(ref)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], PLAN)
    root_plan = {"emb": RowwiseParallel(input_layouts=Replicate()), "out": ColwiseParallel(output_layouts=Replicate())}
    parallelize_module(model, mesh["tp"], root_plan)
    fully_shard(model, policy=ModuleWrapPolicy({Block}), process_group=mesh["dp"])
    out: dict[str, Any] = {"out_local": tuple(model.out.weight.to_local().shape)}
    opt, ref_opt = _adamw(model), _adamw(ref)
    d = mesh["dp"].get_local_rank()
    losses, ref_losses = [], []
    for s in range(3):
        g = torch.Generator().manual_seed(s)
        idx = torch.randint(0, 7, (4, 5), generator=g)
        y = torch.randn(4, 5, 3, generator=g, dtype=torch.float64)
        ref_loss = torch.nn.functional.mse_loss(ref(idx), y)
        ref_loss.backward()
        loss = torch.nn.functional.mse_loss(model(idx[2 * d : 2 * d + 2]), y[2 * d : 2 * d + 2])
        loss.backward()
        if s == 0:
            pairs = zip(model.parameters(), ref.parameters())
            out["grads"] = max(float((p.grad.full_tensor() - rp.grad).abs().max()) for p, rp in pairs)
            out["norm"] = float(clip_grad_norm_(model, 1e9))
            out["ref_norm"] = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh["dp"].get_group())
        losses.append(float(total) / 2)
        ref_losses.append(float(ref_loss))
    out["loss"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
    out["weights"] = _max_diff(_full(model), ref.state_dict())
    with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = model.state_dict()
    out["sharded"] = max(float((v.full_tensor() - ref.state_dict()[k]).abs().max()) for k, v in sharded.items())
    return out


def test_2d_torchtitan_root_plan_with_uneven_and_empty_faces(dist_run) -> None:
    results = dist_run(4, _root_plan)
    assert [r["out_local"] for r in results] == [(1, D), (1, D), (1, D), (0, D)]
    for r in results:
        assert r["grads"] < 1e-12 and r["loss"] < 1e-10 and r["weights"] < 1e-10 and r["sharded"] < 1e-10, r
        assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-6)
