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


def _full_values(state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in state_dict.items()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _train_2d(clip: Optional[float] = None, wrapper: bool = False, strategy: Any = None) -> dict[str, Any]:
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
        loss = _loss(model, _local(batch, mesh))
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
