"""2-D parallelism: tensor-parallel blocks (``parallelize_module`` over ``mesh["tp"]``) sharded with
``fully_shard(..., process_group=mesh["dp"])`` on 4 gloo ranks (2 x 2), against the unsharded model
(issue 14, section 2).

Upstream references: test/distributed/_composable/fsdp/test_fully_shard_training.py::
TestFullyShard2DTraining::test_train_parity_2d_mlp and
test/distributed/_composable/test_composability/test_2d_composability.py::TestFullyShard2DTraining.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fsdp_composable import (
    FullStateDictConfig,
    FullyShardedDataParallel,
    ModuleWrapPolicy,
    ShardingStrategy,
    StateDictType,
    checkpoint,
    clip_grad_norm_,
    fully_shard,
    init_optim_state,
    no_sync,
    optim_state_dict,
    optim_state_dict_to_load,
    state_dict_type,
)

D, H = 6, 10  # H / tp = 5 rows per tensor-parallel rank; flat sizes need padding over 2 dp ranks
STEPS = 4
PER_DP_RANK = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.ln(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(D, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _plain(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().double()


def _tp(model: Net, mesh: DeviceMesh) -> Net:
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], PLAN)
    return model


def _shard(model: nn.Module, mesh: DeviceMesh, **kwargs: Any) -> nn.Module:
    return fully_shard(model, policy=ModuleWrapPolicy({Block}), process_group=mesh["dp"], **kwargs)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    n = PER_DP_RANK * 2
    return torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g, dtype=torch.float64)


def _local(batch: tuple[torch.Tensor, torch.Tensor], mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
    d = mesh["dp"].get_local_rank()
    return batch[0][d * PER_DP_RANK : (d + 1) * PER_DP_RANK], batch[1][d * PER_DP_RANK : (d + 1) * PER_DP_RANK]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def _raise(*args: Any) -> None:
    raise RuntimeError("injected")


def _full_values(state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: _whole(v) for k, v in state_dict.items()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _train_2d(
    clip: Optional[float] = None,
    wrapper: bool = False,
    strategy: Any = None,
    accumulate: bool = False,
    fail_at: Optional[int] = None,
    recompute: bool = False,
) -> dict[str, Any]:
    mesh = _mesh()
    ref = _plain()
    model: nn.Module = _tp(copy.deepcopy(ref), mesh)
    if recompute:  # activation checkpointing first, as the composable APIs are meant to stack
        for block in model.blocks:
            checkpoint(block)
    kwargs = {} if strategy is None else {"strategy": strategy}
    if wrapper:
        model = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_mesh=mesh["dp"], use_orig_params=True
        )
    else:
        model = _shard(model, mesh, **kwargs)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    losses, ref_losses, norms, ref_norms = [], [], [], []
    for step in range(STEPS):
        batch = _batch(step)
        loss_ref = _loss(ref, batch)
        loss_ref.backward()
        if fail_at == step:  # a step that fails in backward, on every rank, is dropped whole
            hook = model.blocks[0].up.register_full_backward_hook(_raise)
            with pytest.raises(RuntimeError, match="injected"):
                _loss(model, _local(batch, mesh)).backward()
            hook.remove()
        x, y = _local(batch, mesh)
        if accumulate:  # two micro-batches, the first without communication
            with no_sync(model):
                first = _loss(model, (x[:1], y[:1])) / 2
                first.backward()
            second = _loss(model, (x[1:], y[1:])) / 2
            second.backward()
            loss = (first + second).detach()
        else:
            loss = _loss(model, (x, y))
            loss.backward()
        if clip is not None:
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
            norm = model.clip_grad_norm_(clip) if wrapper else clip_grad_norm_(model, clip)
            norms.append(float(norm))
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        ref_losses.append(float(loss_ref))
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh["dp"].get_group())
        losses.append(float(total) / 2)
    with state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full = model.state_dict()
    kinds = {k: (type(v).__name__, tuple(v.placements) if isinstance(v, DTensor) else None) for k, v in full.items()}
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "norms": norms,
        "ref_norms": ref_norms,
        "weights_diff": _max_diff(_full_values(full), ref.state_dict()),
        "kinds": kinds,
    }


@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP])
def test_2d_training_matches_the_unsharded_model(dist_run, strategy: ShardingStrategy) -> None:
    """Losses and final weights of TP(2) x FSDP(2) equal the plain model's on the same global batch.
    Upstream: test_fully_shard_training.py::TestFullyShard2DTraining::test_train_parity_2d_mlp."""
    results = dist_run(4, _train_2d, strategy=strategy)
    for r in results:
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-12, abs=1e-12)
        assert r["weights_diff"] < 1e-10
    kinds = results[0]["kinds"]
    assert kinds["blocks.0.up.weight"] == ("DTensor", (Shard(0),))
    assert kinds["blocks.0.down.weight"] == ("DTensor", (Shard(1),))
    assert kinds["blocks.0.down.bias"] == ("DTensor", (Replicate(),))
    assert kinds["inp.weight"] == ("Tensor", None)


def test_2d_clip_grad_norm_is_the_global_norm(dist_run) -> None:
    """clip_grad_norm_ on a 2-D model counts tensor-parallel shards once and replicated parameters
    once: the same norm as the plain model, on every rank (computed in float32, as torch FSDP does,
    so equal to float32 precision)."""
    results = dist_run(4, _train_2d, clip=0.05)
    for r in results:
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-6)
        assert r["norms"] == results[0]["norms"]
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-6)
        assert r["weights_diff"] < 1e-6


def test_2d_wrapper_class_with_the_data_parallel_mesh(dist_run) -> None:
    """``FullyShardedDataParallel(model, device_mesh=mesh["dp"])`` over tensor-parallel blocks."""
    results = dist_run(4, _train_2d, clip=0.05, wrapper=True)
    for r in results:
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-6)
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-6)
        assert r["weights_diff"] < 1e-6


def _describe_2d() -> dict[str, Any]:
    from fsdp_composable import describe, estimate_memory

    mesh = _mesh()
    plain = _plain()
    model = _shard(_tp(copy.deepcopy(plain), mesh), mesh)
    plan = describe(model, params=True)
    block = next(u for u in plan.units if u.fqn == "blocks.0")
    estimate = estimate_memory(_tp(copy.deepcopy(plain), mesh), policy=ModuleWrapPolicy({Block}), world_size=2)
    return {
        "text": str(plan),
        "tp": plan.tensor_parallel_size,
        "block_numel": block.numel,
        "estimate_units": [(u.fqn, u.numel, u.shard_numel) for u in estimate.plan.units],
        "plan_units": [(u.fqn, u.numel, u.shard_numel) for u in plan.units],
    }


def test_2d_describe_and_estimate_memory_count_per_tensor_parallel_rank(dist_run) -> None:
    """describe() reports the tensor-parallel size and per-TP-rank numels with local and global
    shapes; estimate_memory() of the parallelized (unsharded) model predicts the same plan."""
    r = dist_run(4, _describe_2d)[0]
    ln, up, down = 2 * D, H * D + H, D * H + D  # up: Colwise halves weight and bias; down: Rowwise halves weight
    assert r["tp"] == 2
    assert r["block_numel"] == ln + up // 2 + (D * H) // 2 + D
    assert r["estimate_units"] == r["plan_units"]
    assert "tensor parallel size 2 (numels are per tensor-parallel rank)" in r["text"]
    assert "blocks.0.up.weight     (5, 6) of (10, 6)" in r["text"] or "(5, 6) of (10, 6)" in r["text"]
    assert down == D * H + D


def _mixed_precision_2d() -> dict[str, Any]:
    from fsdp_composable import MixedPrecision, unshard_params

    mesh = _mesh()
    ref = _plain()  # float64: the compute dtype of the sharded float32 model below
    model = _shard(
        _tp(copy.deepcopy(ref).float(), mesh), mesh, mixed_precision=MixedPrecision(param_dtype=torch.float64)
    )
    batch = _batch(0)
    ref_loss = _loss(ref, batch)
    ref_loss.backward()
    x, y = _local(batch, mesh)
    loss = _loss(model, (x.float(), y.float()))
    loss.backward()
    total = loss.detach().double()
    dist.all_reduce(total, group=mesh["dp"].get_group())
    with unshard_params(model, with_grads=True):
        grads = {n: _whole(p.grad) for n, p in model.named_parameters()}
        values = {n: _whole(p.detach()) for n, p in model.named_parameters()}
    ref_grads = {n: p.grad.float() for n, p in ref.named_parameters()}
    return {
        "loss": float(total) / 2,
        "ref_loss": float(ref_loss),
        "loss_dtype": loss.dtype,
        "grad_diff": _max_diff(grads, ref_grads),
        "grad_dtypes": {g.dtype for g in grads.values()},
        "value_diff": _max_diff(values, {n: p.float() for n, p in ref.state_dict().items()}),
    }


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.clone()


def test_2d_mixed_precision_computes_in_param_dtype(dist_run) -> None:
    """MixedPrecision(param_dtype=float64) over float32 tensor-parallel parameters: the forward runs in
    float64 (the loss equals the float64 plain model's) and the gradients come back in float32,
    equal to the float64 gradients rounded."""
    for r in dist_run(4, _mixed_precision_2d):
        assert r["loss_dtype"] == torch.float64
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6)
        assert r["grad_dtypes"] == {torch.float32}
        assert r["grad_diff"] < 1e-6
        assert r["value_diff"] == 0.0


def _no_shard_2d() -> dict[str, Any]:
    return _train_2d(strategy=ShardingStrategy.NO_SHARD)


def test_2d_no_shard_matches_the_unsharded_model(dist_run) -> None:
    """NO_SHARD over mesh["dp"] with tensor-parallel blocks: gradients all-reduced over dp only."""
    for r in dist_run(4, _no_shard_2d):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-12, abs=1e-12)
        assert r["weights_diff"] < 1e-10


def _faces_2d_both() -> dict[str, dict[str, Any]]:
    mesh = _mesh()  # one process group setup for both strategies
    return {s.name: _faces_2d(mesh, s) for s in (ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD)}


def _faces_2d(mesh: DeviceMesh, strategy: ShardingStrategy) -> dict[str, Any]:
    """Between steps every tensor-parallel parameter, its gradient and its optimizer state are DTensors
    over the (dp, tp) mesh whose full values are the plain model's; writes through them reach the shard."""
    ref = _plain()
    model = _shard(_tp(copy.deepcopy(ref), mesh), mesh, strategy=strategy)
    opt_ref, opt = _adamw(ref), _adamw(model)
    ref_params = dict(ref.named_parameters())

    def diff(values: dict[str, torch.Tensor], of: Any = lambda p: p.detach()) -> float:
        return max(float((of(p).full_tensor() - values[n]).abs().max()) for n, p in _tp_faces(model, values).items())

    batch = _batch(0)
    _loss(ref, batch).backward()
    _loss(model, _local(batch, mesh)).backward()
    grads = diff({n: p.grad for n, p in ref_params.items()}, of=lambda p: p.grad)
    opt_ref.step()
    opt.step()
    params = diff({n: p.detach() for n, p in ref_params.items()})
    state = {n: opt_ref.state[p]["exp_avg"] for n, p in ref_params.items()}
    exp_avg = diff(state, of=lambda p: opt.state[p]["exp_avg"])
    layout = {
        n: (p.device_mesh.ndim, str(tuple(p.placements)), tuple(p.shape), p.numel(), str(tuple(p.grad.placements)))
        for n, p in _tp_faces(model, ref_params).items()
        if n.startswith("blocks.0.")
    }
    with torch.no_grad():  # an in-place write through a face lands in the unit's shard
        model.blocks[0].up.weight.mul_(0.5)
        ref.blocks[0].up.weight.mul_(0.5)
    opt_ref.zero_grad()
    opt.zero_grad()
    losses = _train_steps(model, opt, mesh, range(1, 3))
    ref_losses = _ref_run(range(1, 3), ref, opt_ref)[2]
    return {
        "grads": grads,
        "params": params,
        "exp_avg": exp_avg,
        "layout": layout,
        "losses": losses,
        "ref_losses": ref_losses,
    }


def _tp_faces(model: nn.Module, names: dict[str, Any]) -> dict[str, DTensor]:
    """The model's tensor-parallel parameters (those of the blocks' up and down layers) by name."""
    return {n: p for n, p in model.named_parameters() if n in names and (".up." in n or ".down." in n)}


def test_2d_parameters_gradients_and_optimizer_state_are_2d_dtensors(dist_run) -> None:
    """torch FSDP2's 2-D layout between steps (FULL_SHARD and NO_SHARD): ``full_tensor()`` of each
    tensor-parallel parameter, its gradient and its AdamW state is the plain model's (rows of 5 per TP
    rank split 3 + 2 over dp: uneven); an in-place write through a parameter trains on as the plain
    model does."""
    for by_strategy in dist_run(4, _faces_2d_both):
        for strategy, r in by_strategy.items():
            dp = "Replicate()" if strategy == "NO_SHARD" else None
            assert r["grads"] < 1e-12 and r["params"] < 1e-12 and r["exp_avg"] < 1e-12, (strategy, r)
            assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-12, abs=1e-12)
            layout = r["layout"]
            up = (2, f"({dp or '_StridedShard(dim=0, sf=2)'}, Shard(dim=0))", (10, 6), 60)
            assert layout["blocks.0.up.weight"][:4] == up, strategy
            assert layout["blocks.0.down.weight"][:4] == (2, f"({dp or 'Shard(dim=0)'}, Shard(dim=1))", (6, 10), 60)
            assert layout["blocks.0.down.bias"][:4] == (2, f"({dp or 'Shard(dim=0)'}, Replicate())", (6,), 6)
            for _, placements, _, _, grad_placements in layout.values():
                assert grad_placements == placements


def _refused(case: str) -> str:
    from torch.distributed.tensor import distribute_tensor

    mesh = _mesh()
    model = _tp(_plain(), mesh)
    try:
        if case == "flat":
            FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_mesh=mesh["dp"])
        elif case == "hybrid":
            fully_shard(
                model,
                policy=ModuleWrapPolicy({Block}),
                strategy=ShardingStrategy.HYBRID_SHARD,
                process_group=(mesh["dp"].get_group(), mesh["tp"].get_group()),
            )
        else:
            block = model.blocks[0]
            weight = distribute_tensor(block.ln.weight.detach(), mesh, [Replicate(), Replicate()])
            block.ln.weight = nn.Parameter(weight)
            _shard(model, mesh)
    except ValueError as e:
        return str(e)
    return "no error"


def test_2d_refuses_what_it_cannot_shard(dist_run) -> None:
    """HYBRID_SHARD with tensor parallelism (a 3-D layout) and DTensor parameters over a 2-D mesh are
    clear errors naming the parameter, the same on every rank."""
    hybrid = dist_run(4, _refused, "hybrid")
    assert all(m == hybrid[0] for m in hybrid)
    assert "parameter 'blocks.1.up.weight' is tensor-parallel and the unit uses HYBRID_SHARD" in hybrid[0]
    flat = dist_run(4, _refused, "flat")
    assert flat[0] == (
        "FullyShardedDataParallel(use_orig_params=False) cannot shard tensor-parallel (DTensor) parameter "
        "'blocks.0.up.weight': pass use_orig_params=True, or use fully_shard (see docs/two_d.md)"
    )
    two_d = dist_run(4, _refused, "2-D")
    assert "parameter 'blocks.0.ln.weight' is a DTensor over a 2-D mesh" in two_d[0]


@pytest.mark.parametrize("case", ["no_sync", "failed_step", "checkpoint"])
def test_2d_no_sync_accumulation_and_a_failed_step(dist_run, case: str) -> None:
    """no_sync micro-batches, a backward that raises midway (then training goes on), and activation
    checkpointing of the tensor-parallel blocks keep the 2-D model in step with the plain one.
    Upstream: test_fully_shard_training.py (gradient accumulation, activation checkpointing) and our
    test_recovery.py, for tensor-parallel parameters."""
    kwargs = {"no_sync": {"accumulate": True}, "failed_step": {"fail_at": 1}, "checkpoint": {"recompute": True}}[case]
    for r in dist_run(4, _train_2d, **kwargs):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-10, abs=1e-12)
        assert r["weights_diff"] < 1e-9


def _reset_2d() -> dict[str, Any]:
    mesh = _mesh()
    model = _shard(_tp(_plain(), mesh), mesh)
    torch.manual_seed(1000 + dist.get_rank())  # different seeds: the ranks must still agree
    model.apply(lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None)
    with state_dict_type(model, StateDictType.FULL_STATE_DICT):
        values = _full_values(model.state_dict())
    loss = _loss(model, _local(_batch(0), mesh))
    loss.backward()
    return {"values": values, "loss_finite": bool(torch.isfinite(loss))}


def test_2d_reset_parameters_after_sharding(dist_run) -> None:
    """reset_parameters() on tensor-parallel Linear modules after fully_shard: drawn on the full
    (global-shape) DTensor, so within kaiming's bound for the real fan-in, and the same on every rank."""
    results = dist_run(4, _reset_2d)
    first = results[0]["values"]
    for r in results:
        assert r["loss_finite"]
        assert [k for k in first if not torch.equal(r["values"][k], first[k])] == []
    bound = 1 / D**0.5  # nn.Linear(D, H): weight and bias uniform in [-1/sqrt(fan_in), 1/sqrt(fan_in)]
    assert float(first["blocks.0.up.weight"].abs().max()) <= bound
    assert float(first["blocks.0.up.bias"].abs().max()) <= bound
    assert not torch.equal(first["blocks.0.up.weight"], _plain().state_dict()["blocks.0.up.weight"])


# ---------------------------------------------------------------------------- 2-D state dicts (issue 14, section 2)
# [Note: 2-D state-dict values] in fsdp_composable/_comm/_tensor_parallel.py. Upstream:
# test/distributed/_composable/test_composability/test_2d_composability.py::TestNew2dParallelStateDict
# (test_fsdp_2d_extension, test_2d_state_dict / test_fsdp_state_dict_with_activation_checkpoint ...) and
# test/distributed/checkpoint/e2e/test_e2e_save_and_load.py (2-D save, load at another mesh).
SAVE_AT = 2  # steps before the checkpoint
GLOBAL = PER_DP_RANK * 2


def _mesh_of_shape(dp: int, tp: int) -> DeviceMesh:
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def _dp_slice(batch: tuple[torch.Tensor, torch.Tensor], dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = GLOBAL // dp
    return batch[0][dp_rank * n : (dp_rank + 1) * n], batch[1][dp_rank * n : (dp_rank + 1) * n]


def _adamw(model: nn.Module, lr: float = 0.01) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int, dp_rank: int, dp: int, dp_group: Any) -> float:
    loss = _loss(model, _dp_slice(_batch(step), dp_rank, dp))
    loss.backward()
    optim.step()
    optim.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total, group=dp_group)
    return float(total) / dp


def _ref_run(steps: range, model: Optional[Net] = None, optim: Any = None) -> tuple[Net, Any, list[float]]:
    """The unsharded model trained on the global batches."""
    model = model if model is not None else _plain()
    optim = optim if optim is not None else _adamw(model)
    losses = []
    for step in steps:
        loss = _loss(model, _batch(step))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(float(loss.detach()))
    return model, optim, losses


def _built_2d(mesh: DeviceMesh, seed: int = 0, lr: float = 0.01) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _shard(_tp(_plain(seed), mesh), mesh)
    return model, _adamw(model, lr)


def _train_steps(model: nn.Module, optim: Any, mesh: DeviceMesh, steps: range) -> list[float]:
    dp = mesh["dp"]
    return [_step(model, optim, s, dp.get_local_rank(), dp.size(), dp.get_group()) for s in steps]


def _ref_optim_state(ref: Net, ref_optim: Any) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in ref.named_parameters()}
    return {names[id(p)]: s for p, s in ref_optim.state.items()}


def _optim_diff(osd_state: dict[str, Any], ref_state: dict[str, dict[str, torch.Tensor]]) -> float:
    assert set(osd_state) == set(ref_state), (sorted(osd_state), sorted(ref_state))
    worst = 0.0
    for fqn, s in ref_state.items():
        for key, ref_value in s.items():
            value = osd_state[fqn][key]
            value = value.full_tensor() if isinstance(value, DTensor) else value
            assert value.shape == ref_value.shape, (fqn, key, value.shape, ref_value.shape)
            worst = max(worst, float((value.double() - ref_value.double()).abs().max()))
    return worst


def _layout(sd: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (type(v).__name__, tuple(v.shape), v.device_mesh.ndim, str(tuple(v.placements)))
        if isinstance(v, DTensor)
        else (type(v).__name__, tuple(v.shape))
        for k, v in sd.items()
    }


def sharded_and_full_round_trips() -> dict[str, Any]:
    mesh = _mesh()
    ref, _, _ = _ref_run(range(SAVE_AT))
    model, optim = _built_2d(mesh)
    _train_steps(model, optim, mesh, range(SAVE_AT))
    out: dict[str, Any] = {}
    with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = model.state_dict()
    out["sharded_layout"] = _layout(sharded)
    with state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full_dt = model.state_dict()
    truth = _full_values(full_dt)  # the trained values (training parity is pinned above)
    out["ref_diff"] = _max_diff(truth, ref.state_dict())
    out["sharded_diff"] = _max_diff(_full_values(sharded), truth)
    # the local tensors are exactly the 2-D chunks DTensor itself would give (so DCP writes the right offsets)
    out["distributed_equal"] = all(
        torch.equal(
            v.to_local(), distribute_tensor(truth[k], v.device_mesh, v.placements, src_data_rank=None).to_local()
        )
        for k, v in sharded.items()
        if isinstance(v, DTensor)
    )
    plain_full = {k: v.clone() for k, v in truth.items()}
    with state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        local = model.state_dict()  # flat shards of tensor-parallel local tensors: the same mesh only

    def loaded(kind: StateDictType, sd: dict[str, Any]) -> float:
        fresh, _ = _built_2d(mesh, seed=1)
        with state_dict_type(fresh, kind):
            result = fresh.load_state_dict(sd, strict=True)
        assert not result.missing_keys and not result.unexpected_keys, result
        with state_dict_type(fresh, StateDictType.FULL_STATE_DICT):
            return _max_diff(_full_values(fresh.state_dict()), truth)

    mesh2 = next(v.device_mesh for v in sharded.values() if isinstance(v, DTensor) and v.device_mesh.ndim == 2)
    other = {  # the same values, other placements (a checkpoint resharded by hand)
        k: distribute_tensor(_full_values({k: v})[k], mesh2, [Replicate(), Shard(1 if v.dim() > 1 else 0)])
        if isinstance(v, DTensor) and v.device_mesh.ndim == 2
        else v
        for k, v in sharded.items()
    }
    out["load"] = {
        "sharded": loaded(StateDictType.SHARDED_STATE_DICT, sharded),
        "sharded_other_placements": loaded(StateDictType.SHARDED_STATE_DICT, other),
        "sharded_plain_full": loaded(StateDictType.SHARDED_STATE_DICT, plain_full),
        "full_dtensors": loaded(StateDictType.FULL_STATE_DICT, full_dt),
        "full_plain": loaded(StateDictType.FULL_STATE_DICT, plain_full),
        "local": loaded(StateDictType.LOCAL_STATE_DICT, local),
    }
    return out


def test_2d_sharded_state_dict_and_loads(dist_run) -> None:
    """SHARDED gives each tensor-parallel parameter as a DTensor of the global shape over the (dp, tp)
    mesh with both placements, whose ``full_tensor()`` is the unsharded model's value; it loads back,
    as do the same values in other placements, plain full tensors, FULL's DTensors and LOCAL's shards."""
    results = dist_run(4, sharded_and_full_round_trips)
    layout = results[0]["sharded_layout"]
    assert layout["blocks.0.up.weight"] == ("DTensor", (H, D), 2, "(_StridedShard(dim=0, sf=2), Shard(dim=0))")
    assert layout["blocks.0.up.bias"] == ("DTensor", (H,), 2, "(_StridedShard(dim=0, sf=2), Shard(dim=0))")
    assert layout["blocks.0.down.weight"] == ("DTensor", (D, H), 2, "(Shard(dim=0), Shard(dim=1))")
    assert layout["blocks.0.down.bias"] == ("DTensor", (D,), 2, "(Shard(dim=0), Replicate())")
    assert layout["blocks.0.ln.weight"] == ("DTensor", (D,), 1, "(Shard(dim=0),)")
    assert layout["inp.weight"] == ("DTensor", (D, 3), 1, "(Shard(dim=0),)")
    for r in results:
        assert r["ref_diff"] < 1e-12
        assert r["sharded_diff"] == 0.0
        assert r["distributed_equal"]
        assert r["load"] == {k: 0.0 for k in r["load"]}, r["load"]


def optimizer_state_round_trips() -> dict[str, Any]:
    mesh = _mesh()
    ref, ref_optim, _ = _ref_run(range(SAVE_AT))
    model, optim = _built_2d(mesh)
    _train_steps(model, optim, mesh, range(SAVE_AT))
    ref_state = _ref_optim_state(ref, ref_optim)
    out: dict[str, Any] = {}
    with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = optim_state_dict(model, optim)
    full = optim_state_dict(model, optim)  # FULL: as the model's FULL state dict gives the parameters
    with state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
        rank0 = optim_state_dict(model, optim)
    # torch's own call: the same global form, numbered; it hands out the live state tensors (as for any
    # model: the faces' state is torch's own), so the dict is copied to outlive the steps below
    hooked = copy.deepcopy(optim.state_dict())
    out["sharded_layout"] = {k: _layout(v) for k, v in sharded["state"].items()}
    out["full_layout"] = {k: _layout(v) for k, v in full["state"].items()}
    out["rank0_layout"] = {k: _layout(v) for k, v in rank0.get("state", {}).items()}
    names = [n for n, _ in model.named_parameters()]
    out["hooked_equal"] = all(
        torch.equal(v.to_local(), sharded["state"][names[i]][key].to_local())
        for i, s in hooked["state"].items()
        for key, v in s.items()
        if isinstance(v, DTensor)
    )
    out["ref_diff"] = {
        "sharded": _optim_diff(sharded["state"], ref_state),
        "full": _optim_diff(full["state"], ref_state),
        "hooked": _optim_diff({names[i]: s for i, s in hooked["state"].items()}, ref_state),
    }
    if dist.get_rank() == 0:
        out["ref_diff"]["rank0"] = _optim_diff(rank0["state"], ref_state)
    # each form loads into a fresh model and optimizer that then train exactly like the uninterrupted run
    with state_dict_type(model, StateDictType.FULL_STATE_DICT):
        weights = model.state_dict()
    continued = _train_steps(model, optim, mesh, range(SAVE_AT, SAVE_AT + 2))
    resumed = {}
    for name, osd, kind in (
        ("sharded", sharded, StateDictType.SHARDED_STATE_DICT),
        ("full", full, StateDictType.FULL_STATE_DICT),
        ("hooked", hooked, None),
    ):
        fresh, fresh_optim = _built_2d(mesh, seed=1, lr=1.0)
        fresh.load_state_dict(weights)
        if kind is None:
            init_optim_state(fresh_optim)
            fresh_optim.load_state_dict(osd)
        else:
            with state_dict_type(fresh, kind):
                fresh_optim.load_state_dict(optim_state_dict_to_load(fresh, fresh_optim, osd))
        resumed[name] = _train_steps(fresh, fresh_optim, mesh, range(SAVE_AT, SAVE_AT + 2)) == continued
    out["resumed"] = resumed
    return out


def test_2d_optimizer_state_dicts(dist_run) -> None:
    """AdamW state of tensor-parallel parameters: SHARDED (ours and ``optim.state_dict()``) as 2-D
    DTensors of the global shape, FULL as the model's FULL state dict (DTensor full over dp; plain
    with rank0_only), all equal to the unsharded optimizer's, and each loads back and trains on
    exactly like the uninterrupted run."""
    results = dist_run(4, optimizer_state_round_trips)
    r0 = results[0]
    up, down_b = r0["sharded_layout"]["blocks.0.up.weight"], r0["sharded_layout"]["blocks.1.down.bias"]
    assert up["exp_avg"] == ("DTensor", (H, D), 2, "(_StridedShard(dim=0, sf=2), Shard(dim=0))")
    assert down_b["exp_avg_sq"] == ("DTensor", (D,), 2, "(Shard(dim=0), Replicate())")
    assert up["step"] == ("Tensor", ())
    assert r0["full_layout"]["blocks.0.down.weight"]["exp_avg"] == ("DTensor", (D, H), 1, "(Shard(dim=1),)")
    assert r0["full_layout"]["inp.weight"]["exp_avg"] == ("Tensor", (D, 3))
    assert r0["rank0_layout"]["blocks.0.down.weight"]["exp_avg"] == ("Tensor", (D, H))
    assert results[1]["rank0_layout"] == {}
    for r in results:
        assert max(r["ref_diff"].values()) < 1e-12, r["ref_diff"]
        assert r["hooked_equal"]
        assert r["resumed"] == {"sharded": True, "full": True, "hooked": True}


# ---------------------------------------------------------------------------- torch's API + DCP across mesh sizes
FULL_OPTIONS = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _resume_target(dp: int, tp: int) -> tuple[nn.Module, torch.optim.Optimizer, Any, int, int]:
    """A fresh model at the (dp, tp) mesh (other weights and learning rate: the checkpoint must win);
    ``tp == 0``: no tensor parallelism, fully_shard over the whole world."""
    if tp == 0:
        model = fully_shard(_plain(1), policy=ModuleWrapPolicy({Block}))
        return model, _adamw(model, lr=1.0), None, dist.get_rank(), dist.get_world_size()
    mesh = _mesh_of_shape(dp, tp)
    model, optim = _built_2d(mesh, seed=1, lr=1.0)
    return model, optim, mesh["dp"].get_group(), mesh["dp"].get_local_rank(), dp


def save_2d_with_torch_api(path: str) -> dict[str, Any]:
    mesh = _mesh()
    model, optim = _built_2d(mesh)
    _train_steps(model, optim, mesh, range(SAVE_AT))
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    full_model, full_optim = get_state_dict(model, optim, options=FULL_OPTIONS)
    out: dict[str, Any] = {
        "model_layout": _layout(model_sd),
        "optim_layout": _layout(optim_sd["state"]["blocks.0.up.weight"]),
        "full_model": full_model,
        "full_optim": full_optim.get("state", {}),
    }
    with state_dict_type(model, StateDictType.FULL_STATE_DICT):
        out["truth"] = _full_values(model.state_dict())
    out["continued"] = _train_steps(model, optim, mesh, range(SAVE_AT, SAVE_AT + 2))
    return out


def resume_2d_with_torch_api(path: str, dp: int, tp: int) -> list[float]:
    model, optim, group, dp_rank, dp_size = _resume_target(dp, tp)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert [g["lr"] for g in optim.param_groups] == [0.01]
    return [_step(model, optim, s, dp_rank, dp_size, group) for s in range(SAVE_AT, SAVE_AT + 2)]


def test_2d_torch_api_dcp_save_and_resume_at_other_meshes(dist_run, tmp_path) -> None:
    """``get_state_dict`` + ``dcp.save`` at (dp=2, tp=2); ``set_state_dict`` + ``dcp.load`` at (2, 2),
    (1, 2) on 2 ranks, (4, 1) and without tensor parallelism on 4 ranks: the resumed run trains like
    the uninterrupted one, AdamW state included. ``full_state_dict=True, cpu_offload=True`` gives plain
    full tensors on rank 0 equal to the unsharded model's. Upstream: test/distributed/checkpoint/e2e/
    test_e2e_save_and_load.py::TestE2ESaveAndLoad (2-D) and test_2d_composability.py."""
    path = str(tmp_path / "dcp")
    saved = dist_run(4, save_2d_with_torch_api, path)
    r0 = saved[0]
    strided = ("DTensor", (H, D), 2, "(_StridedShard(dim=0, sf=2), Shard(dim=0))")
    assert r0["model_layout"]["blocks.1.up.weight"] == strided
    assert r0["optim_layout"]["exp_avg"] == strided
    # the uninterrupted unsharded run
    ref, ref_optim, _ = _ref_run(range(SAVE_AT))
    # full_state_dict=True, cpu_offload=True: plain tensors on rank 0 only, the unsharded model's values
    assert {type(v) for v in r0["full_model"].values()} == {torch.Tensor}
    assert _max_diff(r0["full_model"], r0["truth"]) == 0.0
    assert _max_diff(r0["full_model"], ref.state_dict()) < 1e-12
    assert all(not r["full_model"] and not r["full_optim"] for r in saved[1:])
    assert {type(v) for s in r0["full_optim"].values() for v in s.values()} == {torch.Tensor}
    assert _optim_diff(r0["full_optim"], _ref_optim_state(ref, ref_optim)) < 1e-12
    _, _, ref_continued = _ref_run(range(SAVE_AT, SAVE_AT + 2), ref, ref_optim)
    continued = r0["continued"]
    assert continued == pytest.approx(ref_continued, rel=1e-12, abs=1e-12)
    assert dist_run(4, resume_2d_with_torch_api, path, 2, 2)[0] == continued  # same mesh: bit for bit
    for world, dp, tp in ((2, 1, 2), (4, 4, 1), (4, 4, 0)):
        resumed = dist_run(world, resume_2d_with_torch_api, path, dp, tp)
        for r in resumed:
            assert r == pytest.approx(continued, rel=1e-12, abs=1e-12), (dp, tp, r, continued)


SEQ = 4


def _sequence_parallel_2d() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import SequenceParallel

    mesh = _mesh()
    torch.manual_seed(0)
    ref = nn.Sequential(Block(), Block()).double()
    model = copy.deepcopy(ref)
    plan = {
        "ln": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    }
    for block in model:
        parallelize_module(block, mesh["tp"], plan)
    _shard(model, mesh)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    d, t = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    per_tp = SEQ // 2
    losses, ref_losses = [], []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(2 * PER_DP_RANK, SEQ, D, generator=g, dtype=torch.float64)
        y = torch.randn(2 * PER_DP_RANK, SEQ, D, generator=g, dtype=torch.float64)
        ref_loss = (ref(x) - y).pow(2).mean()
        ref_loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        rows = slice(d * PER_DP_RANK, (d + 1) * PER_DP_RANK)
        cols = slice(t * per_tp, (t + 1) * per_tp)  # this tensor-parallel rank's sequence chunk
        out = model(x[rows, cols])
        loss = (out - y[rows, cols]).pow(2).sum() / (PER_DP_RANK * SEQ * D)  # its part of the dp-local mean
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # sum over tp of the parts, over dp of the means
        losses.append(float(total) / 2)
        ref_losses.append(float(ref_loss))
    with state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full = _full_values(model.state_dict())
    return {"losses": losses, "ref_losses": ref_losses, "weights_diff": _max_diff(full, ref.state_dict())}


def test_2d_sequence_parallel_norms(dist_run) -> None:
    """SequenceParallel LayerNorms between Colwise/Rowwise linears (torchtitan's plan): the norms'
    gradients arrive Partial over the tensor-parallel group and are summed before the data-parallel
    reduction. Upstream: test_fully_shard_training.py::TestFullyShard2DTraining (sequence parallel)."""
    for r in dist_run(4, _sequence_parallel_2d):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-10)
        assert r["weights_diff"] < 1e-9


def _low_precision_grads_2d() -> dict[str, Any]:
    from fsdp_composable import MixedPrecision

    mesh = _mesh()
    ref = _plain()
    mp = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32, keep_low_precision_grads=True)
    model = _shard(_tp(copy.deepcopy(ref), mesh), mesh, mixed_precision=mp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = _batch(0)
    _loss(ref, batch).backward()
    _loss(model, _local(batch, mesh)).backward()
    dtypes = {n: p.grad.dtype for n, p in model.named_parameters() if p.grad is not None}
    norm = float(clip_grad_norm_(model, 1e9))
    opt.step()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
    return {"dtypes": set(dtypes.values()), "norm": norm, "ref_norm": ref_norm}


def test_2d_keep_low_precision_grads(dist_run) -> None:
    """keep_low_precision_grads with tensor-parallel parameters: ``.grad`` stays in the reduce dtype
    (a DTensor over the 1-D slice), the global norm counts it, and the optimizer steps."""
    for r in dist_run(4, _low_precision_grads_2d):
        assert r["dtypes"] == {torch.float32}
        assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5)
