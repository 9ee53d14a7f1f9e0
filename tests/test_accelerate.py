"""DDP (directly or through accelerate's ``prepare``) around a sharded model is refused on every rank,
and the documented accelerate pattern (prepare the optimizer and dataloader, not the model; checkpoint
with DCP) trains like the unsharded model and resumes exactly."""

from __future__ import annotations

import copy
import importlib.util
import os
import tempfile
from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
from harness import error_of
from models import OddMLP, mlp_batch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_composable import ModuleWrapPolicy, fully_shard

HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None
needs_accelerate = pytest.mark.skipif(
    not HAS_ACCELERATE, reason="accelerate is not installed: pip install -e '.[accelerate]'"
)


def _sharded() -> nn.Module:
    torch.manual_seed(0)
    return fully_shard(OddMLP(), ModuleWrapPolicy({nn.Linear}))


def _step(model: nn.Module) -> float:
    x, y = mlp_batch(0, 4)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return float(loss.item())


def _ddp_errors() -> dict[str, Any]:
    model = _sharded()
    holder = nn.Sequential(model)
    out = {
        "root": error_of(lambda: DDP(model)),
        "parent": error_of(lambda: DDP(holder)),
        "unit": error_of(lambda: DDP(model.l2)),
    }
    torch.manual_seed(0)
    one_unit = fully_shard(OddMLP())
    out["inside_unit"] = error_of(lambda: DDP(one_unit.l1))
    out["usable_after"] = _step(model)  # the refused wrap left the model trainable
    torch.manual_seed(1)
    plain = DDP(nn.Linear(3, 3))  # DDP itself is untouched
    out["plain_ddp"] = type(plain).__name__
    return out


def test_ddp_around_sharded_model_is_refused_on_every_rank(dist_run: Any) -> None:
    results = dist_run(2, _ddp_errors)
    assert results[0] == {**results[1], "usable_after": results[0]["usable_after"]}, results
    assert results[0]["plain_ddp"] == "DistributedDataParallel"
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        "\n".join(f"{k}: {results[0][k]}" for k in ("root", "parent", "unit", "inside_unit")),
        """\
root: ShardedModelWrappedError: DistributedDataParallel cannot wrap a model sharded by fully_shard (this OddMLP was passed to fully_shard): fully_shard already reduce-scatters the gradients across the ranks, and DDP would mix different ranks' shards. Train the sharded model as it is, without DDP; with accelerate, pass only the optimizer, dataloaders and scheduler to accelerator.prepare (not the model); with Lightning, use fsdp_composable.lightning's strategies instead of the DDP strategy
parent: ShardedModelWrappedError: DistributedDataParallel cannot wrap a model sharded by fully_shard (its submodule '0' (OddMLP) was passed to fully_shard): fully_shard already reduce-scatters the gradients across the ranks, and DDP would mix different ranks' shards. Train the sharded model as it is, without DDP; with accelerate, pass only the optimizer, dataloaders and scheduler to accelerator.prepare (not the model); with Lightning, use fsdp_composable.lightning's strategies instead of the DDP strategy
unit: ShardedModelWrappedError: DistributedDataParallel cannot wrap a model sharded by fully_shard (this Sequential is a unit of the OddMLP passed to fully_shard): fully_shard already reduce-scatters the gradients across the ranks, and DDP would mix different ranks' shards. Train the sharded model as it is, without DDP; with accelerate, pass only the optimizer, dataloaders and scheduler to accelerator.prepare (not the model); with Lightning, use fsdp_composable.lightning's strategies instead of the DDP strategy
inside_unit: ShardedModelWrappedError: DistributedDataParallel cannot wrap a model sharded by fully_shard (this Linear's parameters belong to a fully_shard unit): fully_shard already reduce-scatters the gradients across the ranks, and DDP would mix different ranks' shards. Train the sharded model as it is, without DDP; with accelerate, pass only the optimizer, dataloaders and scheduler to accelerator.prepare (not the model); with Lightning, use fsdp_composable.lightning's strategies instead of the DDP strategy""",  # noqa: E501
    )


# --- accelerate ---------------------------------------------------------------------------------


class _Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.x, self.y = mlp_batch(7, n)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def _with_accelerator(fn: Any, *args: Any) -> Any:
    """Run ``fn(accelerator, *args)`` with a fresh Accelerator on this pool rank's process group."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    os.environ["LOCAL_RANK"] = os.environ["RANK"]
    try:
        return fn(Accelerator(cpu=True), *args)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        del os.environ["LOCAL_RANK"]


def _prepare_model_error(accelerator: Any) -> tuple[str, int]:
    return error_of(lambda: accelerator.prepare(_sharded())), accelerator.num_processes


@needs_accelerate
def test_accelerate_prepare_of_sharded_model_is_refused_on_every_rank(dist_run: Any) -> None:
    results = dist_run(2, _with_accelerator, _prepare_model_error)
    assert results[0] == results[1] and results[0][1] == 2, results
    assert results[0][0].startswith("ShardedModelWrappedError: DistributedDataParallel cannot wrap a model sharded by")


def _train(accelerator: Any, model: nn.Module, optim: Any, loader: Any, epochs: range) -> list[float]:
    losses = []
    for _ in epochs:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optim.step()
            optim.zero_grad()
            losses.append(float(loss.item()))
    return losses


def _pattern(accelerator: Any, ckpt: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from fsdp_composable import (
        StateDictType,
        init_optim_state,
        optim_state_dict,
        optim_state_dict_to_load,
        state_dict_type,
    )

    torch.manual_seed(0)
    plain = OddMLP()
    model = fully_shard(copy.deepcopy(plain), ModuleWrapPolicy({nn.Linear}))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(_Pairs(16), batch_size=4)
    optim, loader = accelerator.prepare(optim, loader)  # not the model
    first = _train(accelerator, model, optim, loader, range(1))
    with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict(), "optim": optim_state_dict(model, optim.optimizer)}, checkpoint_id=ckpt)
    rest = _train(accelerator, model, optim, loader, range(1, 2))

    # the unsharded reference on the global batch: each rank's loader yields its own 4 of every 8 samples
    ref_optim = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    data = _Pairs(16)
    ref = []
    for _ in range(2):
        for b in range(2):
            loss = nn.functional.mse_loss(plain(data.x[8 * b : 8 * b + 8]), data.y[8 * b : 8 * b + 8])
            loss.backward()
            ref_optim.step()
            ref_optim.zero_grad()
            ref.append(float(loss.item()))
    with state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full = model.state_dict()
    max_diff = max(float((full[k] - v).abs().max()) for k, v in plain.state_dict().items())

    # resume in a fresh model and optimizer from the DCP checkpoint
    torch.manual_seed(1)
    resumed = fully_shard(OddMLP(), ModuleWrapPolicy({nn.Linear}))
    resumed_optim = accelerator.prepare(torch.optim.AdamW(resumed.parameters(), lr=1e-2))
    init_optim_state(resumed_optim.optimizer)
    with state_dict_type(resumed, StateDictType.SHARDED_STATE_DICT):
        sd = {"model": resumed.state_dict(), "optim": optim_state_dict(resumed, resumed_optim.optimizer)}
        dcp.load(sd, checkpoint_id=ckpt)
        resumed.load_state_dict(sd["model"])
        resumed_optim.optimizer.load_state_dict(optim_state_dict_to_load(resumed, resumed_optim.optimizer, sd["optim"]))
    again = _train(accelerator, resumed, resumed_optim, loader, range(1, 2))
    global_losses = torch.tensor(first + rest)
    dist.all_reduce(global_losses)
    return {"losses": (global_losses / 2).tolist(), "ref": ref, "max_diff": max_diff, "rest": rest, "again": again}


@needs_accelerate
def test_accelerate_pattern_matches_unsharded_and_resumes_exactly(dist_run: Any) -> None:
    ckpt = os.path.join(tempfile.mkdtemp(), "ckpt")
    results = dist_run(2, _with_accelerator, _pattern, ckpt)
    for r in results:
        assert r["again"] == r["rest"], r  # resume equals the uninterrupted run, bit for bit
        assert r["max_diff"] < 1e-5, r
        assert r["losses"] == pytest.approx(r["ref"], abs=1e-5), r
