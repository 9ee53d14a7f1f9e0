"""What a real training script mixes in: accumulation, clipping, ignored modules, meta init, state sync,
extra forward methods, recovery after a failed step."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from models import Block, OddMLP, TinyGPT, gpt_batch, gpt_loss, mlp_batch, mlp_loss
from parity import local_slice
from torch import nn

from fsdp_composable import (
    ModuleWrapPolicy,
    ShardingStrategy,
    clip_grad_norm_,
    fully_shard,
    no_sync,
    register_fsdp_forward_method,
    unshard_params,
)
from fsdp_composable._common_utils import TrainingState


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    with unshard_params(model, with_grads=True, writeback=False):
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def accumulation(strategy: str, use_no_sync: bool) -> float:
    """Two micro-batches accumulated == one step on both (each loss halved)."""
    torch.manual_seed(0)
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    fully_shard(model, ModuleWrapPolicy({Block}), strategy=ShardingStrategy[strategy])
    rank, world = dist.get_rank(), dist.get_world_size()
    b0, b1 = gpt_batch(0, 2 * world), gpt_batch(1, 2 * world)
    (0.5 * gpt_loss(ref, b0) + 0.5 * gpt_loss(ref, b1)).backward()
    if use_no_sync:
        with no_sync(model):
            (0.5 * gpt_loss(model, local_slice(b0, rank, world))).backward()
    else:
        (0.5 * gpt_loss(model, local_slice(b0, rank, world))).backward()
    (0.5 * gpt_loss(model, local_slice(b1, rank, world))).backward()
    grads = _full_grads(model)
    return max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("use_no_sync", [True, False])
def test_gradient_accumulation(dist_run, strategy: str, use_no_sync: bool) -> None:
    assert max(dist_run(2, accumulation, strategy, use_no_sync)) < 1e-6


def clipping(norm_type: float) -> tuple[float, float, float]:
    torch.manual_seed(0)
    ref = nn.Sequential(OddMLP(), nn.Linear(1, 3))
    model = copy.deepcopy(ref)
    # ignored module: its gradient is local and whole, and still counts in the norm
    fully_shard(model, lambda m: isinstance(m, nn.Sequential) and m is not model, ignored_modules=[model[1]])
    rank, world = dist.get_rank(), dist.get_world_size()
    x, _ = mlp_batch(0, 4 * world)
    ref(x).pow(2).mean().backward()
    model(local_slice((x, x), rank, world)[0]).pow(2).mean().backward()
    # the ignored module's gradient is not reduced by fully_shard: average it like DDP would
    for p in model[1].parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, norm_type=norm_type).item()
    norm = clip_grad_norm_(model, 0.1, norm_type=norm_type).item()
    grads = _full_grads(model)
    diff = max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
    return norm, ref_norm, diff


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norm_matches_unsharded(dist_run, norm_type: float) -> None:
    results = dist_run(4, clipping, norm_type)
    for norm, ref_norm, diff in results:
        assert norm == results[0][0], "every rank must see the same norm"
        assert abs(norm - ref_norm) < 1e-5 * max(1.0, ref_norm)
        assert diff < 1e-6


INITIALISED: list[torch.Tensor] = []


def init_unit(unit: nn.Module) -> None:
    """param_init_fn: materialise the unit's own meta tensors (deeper units are already done)."""
    for m in unit.modules():
        if any(t.is_meta for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]):
            m.to_empty(device="cpu", recurse=False)
            with torch.no_grad():
                for p in m.parameters(recurse=False):
                    p.normal_(0.0, 0.02)
                    INITIALISED.append(p.detach().clone())


def ignored_and_meta(sync: bool) -> dict:
    torch.manual_seed(dist.get_rank())  # different seeds per rank before sync
    with torch.device("meta"):
        model = TinyGPT(tied=True)
    model.ln_f.to_empty(device="cpu")  # ignored: fully_shard leaves it alone, so the user initialises it
    model.ln_f.reset_parameters()
    fully_shard(
        model, ModuleWrapPolicy({Block}), sync_module_states=sync, ignored_modules=[model.ln_f], param_init_fn=init_unit
    )
    # every full value must be one of the tensors rank 0 initialised (true only if ranks were synced)
    obj = [INITIALISED[:]]
    dist.broadcast_object_list(obj, src=0)
    INITIALISED.clear()
    full = {k: v for k, v in model.state_dict().items() if not k.startswith("ln_f.")}
    return {
        "identical": all(any(t.shape == v.shape and torch.equal(t, v) for t in obj[0]) for v in full.values()),
        "tied": model.head.weight is model.tok.weight,
        "ln_f_whole": tuple(model.ln_f.weight.shape) == (16,),
        "no_meta": not any(p.is_meta for p in model.parameters()),
    }


def test_meta_init_sync_and_ignored(dist_run) -> None:
    synced = dist_run(2, ignored_and_meta, True)[0]
    assert synced == {"identical": True, "tied": True, "ln_f_whole": True, "no_meta": True}
    unsynced = dist_run(2, ignored_and_meta, False)[0]
    assert unsynced["identical"] is False and unsynced["no_meta"]


class WithGenerate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def generate(self, x: torch.Tensor) -> tuple:
        return (tuple(self.lin.weight.shape), type(self.lin.weight).__name__), self.lin(x)


def extra_forward_method() -> tuple:
    torch.manual_seed(0)
    ref = WithGenerate()
    model = fully_shard(copy.deepcopy(ref))
    register_fsdp_forward_method(model, "generate")
    with torch.no_grad():  # generation: nothing to backpropagate, so everything reshards at the end
        shape, out = model.generate(torch.ones(2, 4))
    after = (tuple(model.lin.weight.shape), type(model.lin.weight).__name__)
    return shape, torch.allclose(out, ref(torch.ones(2, 4))), after


def test_register_fsdp_forward_method(dist_run) -> None:
    shape, close, after = dist_run(2, extra_forward_method)[0]
    # the unsharded original inside the method, the face (sharded, global shape) after it
    assert shape == ((4, 4), "Parameter") and close and after == ((4, 4), "DTensor")


def recovery() -> dict:
    torch.manual_seed(0)
    ref = OddMLP()
    model = copy.deepcopy(ref)
    fully_shard(model, ModuleWrapPolicy({nn.Sequential}))
    rank, world = dist.get_rank(), dist.get_world_size()
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    fail = {"forward": True, "backward": False}

    def boom_forward(module: nn.Module, args: tuple) -> None:
        if fail["forward"]:
            raise ValueError("injected forward failure")

    def boom_backward(grad: torch.Tensor) -> None:
        if fail["backward"]:
            raise ValueError("injected backward failure")

    model.l3.register_forward_pre_hook(boom_forward)
    caught = []
    batch = mlp_batch(0, 2 * world)
    try:
        mlp_loss(model, local_slice(batch, rank, world))
    except ValueError as e:
        caught.append(str(e))
    fail.update(forward=False, backward=True)
    out = model(local_slice(batch, rank, world)[0])
    out.register_hook(boom_backward)
    try:
        out.pow(2).mean().backward()
    except ValueError as e:
        caught.append(str(e))
    opt.zero_grad()
    fail["backward"] = False
    state = fully_shard.state(model)
    after_failures = state.training_state is TrainingState.IDLE or state.final_callback_queued
    for step in range(2):  # training goes on and matches the reference
        batch = mlp_batch(step, 2 * world)
        mlp_loss(ref, batch).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        mlp_loss(model, local_slice(batch, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    with unshard_params(model, writeback=False):
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return {"caught": caught, "after_failures": after_failures, "diff": diff, "idle": state.training_state}


def test_recovery_after_failed_forward_and_backward(dist_run) -> None:
    for r in dist_run(2, recovery):
        assert r["caught"] == ["injected forward failure", "injected backward failure"]
        assert r["after_failures"] and r["idle"] is TrainingState.IDLE
        assert r["diff"] < 1e-6


def ignored_materialised_by_init() -> bool:
    with torch.device("meta"):
        model = TinyGPT()
    # init_unit materialises every meta module under the unit, the ignored ln_f included (new objects)
    fully_shard(model, ModuleWrapPolicy({Block}), ignored_modules=[model.ln_f], param_init_fn=init_unit)
    INITIALISED.clear()
    return fully_shard.state(model).ignored_params == set(model.ln_f.parameters())


def test_ignored_parameters_follow_initialisation(dist_run) -> None:
    assert dist_run(2, ignored_materialised_by_init) == [True, True]
