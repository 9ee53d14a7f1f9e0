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
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fsdp_composable import (
    FullyShardedDataParallel,
    ModuleWrapPolicy,
    ShardingStrategy,
    StateDictType,
    clip_grad_norm_,
    fully_shard,
    no_sync,
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
) -> dict[str, Any]:
    mesh = _mesh()
    ref = _plain()
    model: nn.Module = _tp(copy.deepcopy(ref), mesh)
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


def _refused(case: str) -> str:
    from torch.distributed.tensor import distribute_tensor

    mesh = _mesh()
    model = _tp(_plain(), mesh)
    try:
        if case == "hybrid":
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
    two_d = dist_run(4, _refused, "2-D")
    assert "parameter 'blocks.0.ln.weight' is a DTensor over a 2-D mesh" in two_d[0]


@pytest.mark.parametrize("case", ["no_sync", "failed_step"])
def test_2d_no_sync_accumulation_and_a_failed_step(dist_run, case: str) -> None:
    """no_sync micro-batches, and a backward that raises midway (then training goes on), keep the
    2-D model in step with the plain one. Upstream: test_fully_shard_training.py (gradient
    accumulation) and our test_recovery.py, for tensor-parallel parameters."""
    kwargs = {"accumulate": True} if case == "no_sync" else {"fail_at": 1}
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
