"""Rank-major flat shards ([Note: rank-major flat shards]) on the shapes that cut unevenly: 0-dim
parameters (every rank's chunk holds them whole), a unit whose only parameter is 0-dim, weights with
fewer rows than ranks (one row at four ranks), one-element biases and a zero-size parameter. Each
path is compared with the unsharded model on the same global batches, or with torch's own values."""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from parity import local_slice
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_composable import (
    CPUOffload,
    LocalStateDictConfig,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    StateDictType,
    fully_shard,
    init_optim_state,
    no_sync,
    optim_state_dict,
    optim_state_dict_to_load,
    reshard,
    set_reshard_after_backward,
    state_dict_type,
    unshard_params,
)
from fsdp_composable._comm import _collectives
from fsdp_composable._flat import _rank_major

FULL, SHARDED, LOCAL = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT


class Gate(nn.Module):
    """A unit whose only parameter is 0-dim: its one chunk is the whole value on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.tensor(0.3))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.g.uniform_(-1.0, 1.0)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.g


class ScalarNet(nn.Module):
    """The root unit: a (3, 5) weight (fewer rows than 4 ranks), a 0-dim temperature, a zero-size
    parameter; ``gate``: one 0-dim parameter; ``head``: a (1, 3) weight and a one-element bias."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(5, 3)
        self.temp = nn.Parameter(torch.tensor(0.7))
        self.empty = nn.Parameter(torch.zeros(0, 3))
        self.gate = Gate()
        self.head = nn.Sequential(nn.Linear(3, 1))

    def reset_parameters(self) -> None:  # its own parameters only, as nn.Linear's
        with torch.no_grad():
            self.temp.fill_(0.7)
            self.empty.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x) * self.temp) + self.empty.sum()
        return self.head(self.gate(h))


def batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randn(global_batch, 5, generator=g).double(), torch.randn(global_batch, 1, generator=g).double()


def loss_of(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(b[0]), b[1])


POLICY = ModuleWrapPolicy({Gate, nn.Sequential})


@contextlib.contextmanager
def direct_units(direct: bool):  # type: ignore[no-untyped-def]
    """Units built inside move their chunks directly (or through one buffer): [Note: moving chunks]."""
    before = _rank_major.DIRECT_CHUNK_NUMEL
    _rank_major.DIRECT_CHUNK_NUMEL = 0 if direct else 1 << 30
    try:
        yield
    finally:
        _rank_major.DIRECT_CHUNK_NUMEL = before


def pair(direct: bool, **kwargs: Any) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = ScalarNet().double()
    with direct_units(direct):
        model = fully_shard(copy.deepcopy(ref), POLICY, **kwargs)
        # a layout decides `direct` when first used: one step with no optimizer, its gradients dropped
        world = dist.get_world_size()
        loss_of(model, local_slice(batch(99, 2 * world), dist.get_rank(), world)).backward()
    model.zero_grad(set_to_none=True)
    return ref, model


def full_values(model: nn.Module) -> dict[str, torch.Tensor]:
    with unshard_params(model, writeback=False):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b), (list(a), list(b))
    return max(((a[k] - b[k]).abs().max().item() if a[k].numel() else 0.0) for k in a)


def param_diff(model: nn.Module, ref: nn.Module) -> float:
    """The largest difference of the sharded model's full parameters from the unsharded ``ref``'s."""
    return max_diff(full_values(model), {n: p.detach() for n, p in ref.named_parameters()})


# ---------------------------------------------------------------------------- training
def train(direct: bool, how: str) -> float:
    """Adam on the same global batches; ``how``: the sharding options and micro-batching."""
    world = dist.get_world_size()
    kwargs: dict[str, Any] = {
        "full": {},
        "native": {},
        "native_no_sync": {},
        "grad_op": {"strategy": ShardingStrategy.SHARD_GRAD_OP},
        "post_forward_2": {"reshard_after_forward": 2},
        "no_sync": {},
        "hybrid": {"mesh": init_device_mesh("cpu", (2, world // 2))},
        "hybrid_no_sync": {"mesh": init_device_mesh("cpu", (2, world // 2))},
        "offload": {"cpu_offload": CPUOffload(offload_params=True)},
        "mixed": {"mixed_precision": MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float64)},
    }[how]
    ref, model = pair(direct, **kwargs)
    opt_ref, opt = torch.optim.Adam(ref.parameters(), lr=0.05), torch.optim.Adam(model.parameters(), lr=0.05)
    with native_collectives(how.startswith("native")):
        _train_steps(ref, model, opt_ref, opt, how)
    return param_diff(model, ref)


@contextlib.contextmanager
def native_collectives(native: bool):  # type: ignore[no-untyped-def]
    """gloo's own all-gather and reduce-scatter instead of point-to-point exchanges: the path a
    native backend (NCCL) takes, a rank-major buffer copied out and a gradient copied in."""
    real = _collectives.point_to_point
    if native:
        _collectives.point_to_point = lambda group, device: False  # type: ignore[assignment]
    try:
        yield
    finally:
        _collectives.point_to_point = real  # type: ignore[assignment]


def _train_steps(ref: nn.Module, model: nn.Module, opt_ref: Any, opt: Any, how: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    for step in range(3):
        micro = 2 if how.endswith("no_sync") else 1
        for m in range(micro):
            b = batch(10 * step + m, 2 * world)
            loss_of(ref, b).backward()
            ctx = no_sync(model) if m < micro - 1 else contextlib.nullcontext()
            with ctx:
                loss_of(model, local_slice(b, rank, world)).backward()
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize(
    "how",
    ["full", "native", "native_no_sync", "grad_op", "post_forward_2", "no_sync", "hybrid", "hybrid_no_sync"]
    + ["offload", "mixed"],
)
def test_scalar_and_short_parameters_train_like_the_unsharded_model(
    dist_run: Callable[..., Any], direct: bool, how: str
) -> None:
    """Fails if a 0-dim gradient is not repeated into every rank's chunk (its average would be
    divided by the world size), or a short weight's rows land in the wrong rank's chunk."""
    for diff in dist_run(4, train, direct, how):
        assert diff < (1e-6 if how == "mixed" else 1e-10), (how, diff)  # mixed: float32 compute


# ---------------------------------------------------------------------------- writes on a unit left unsharded
def write_on_lone_scalar_unit(direct: bool) -> list[float]:
    """``gate`` (one 0-dim parameter: both orders are the same tensor) is left unsharded after
    backward; a write on it is kept by ``reshard()`` on every rank: the sharded value each rank then
    shows (every rank holds a 0-dim parameter whole) equals the written one."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ref, model = pair(direct)
    set_reshard_after_backward(model, False)
    loss_of(model, local_slice(batch(0, 2 * world), rank, world)).backward()
    with torch.no_grad():
        model.gate.g.mul_(0.5)
        model.temp.mul_(0.5)
    reshard(model.gate)
    reshard(model)
    return [model.gate.g.item(), model.temp.item()]


@pytest.mark.parametrize("direct", [True, False])
def test_write_on_a_lone_scalar_unit_left_unsharded_is_kept_on_every_rank(
    dist_run: Callable[..., Any], direct: bool
) -> None:
    assert dist_run(2, write_on_lone_scalar_unit, direct) == [pytest.approx([0.15, 0.35])] * 2


# ---------------------------------------------------------------------------- checkpoints
def adam_steps(ref: nn.Module, model: nn.Module, steps: range, opts: tuple[Any, Any]) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    for step in steps:
        b = batch(step, 2 * world)
        loss_of(ref, b).backward()
        loss_of(model, local_slice(b, rank, world)).backward()
        for o in opts:
            o.step()
            o.zero_grad()


def ref_osd(ref: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in ref.named_parameters()}
    return {names[id(p)]: s for p, s in opt.state.items()}


def osd_diff(osd: dict[str, Any], want: dict[str, dict[str, torch.Tensor]]) -> float:
    assert sorted(osd["state"]) == sorted(want), (sorted(osd["state"]), sorted(want))
    out = 0.0
    for fqn, state in want.items():
        for key in ("exp_avg", "exp_avg_sq"):
            got = osd["state"][fqn][key]
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            assert got.shape == state[key].shape, (fqn, key, got.shape)
            if got.numel():
                out = max(out, (got - state[key]).abs().max().item())
    return out


def save_sharded(path: str, direct: bool) -> dict[str, float]:
    """Two Adam steps next to the unsharded model; the SHARDED model and optimizer state dicts (DCP)
    and the FULL ones (rank 0 saves them): each compared with the unsharded model's and torch Adam's."""
    ref, model = pair(direct)
    opts = (torch.optim.Adam(ref.parameters(), lr=0.05), torch.optim.Adam(model.parameters(), lr=0.05))
    adam_steps(ref, model, range(2), opts)
    with state_dict_type(model, SHARDED):
        sd = {"model": model.state_dict(), "optim": optim_state_dict(model, opts[1])}
        sharded_diff = osd_diff(sd["optim"], ref_osd(ref, opts[0]))
        model_diff = max_diff({k: v.full_tensor() for k, v in sd["model"].items()}, dict(ref.state_dict()))
        dcp.save(sd, checkpoint_id=os.path.join(path, f"dcp{dist.get_world_size()}"))
    full_model, full_osd = model.state_dict(), optim_state_dict(model, opts[1])
    if dist.get_rank() == 0:
        torch.save({"model": ref.state_dict(), "optim": opts[0].state_dict()}, os.path.join(path, "ref.pt"))
    dist.barrier()
    return {
        "sharded_model": model_diff,
        "sharded_optim": sharded_diff,
        "full_model": max_diff(dict(full_model), dict(ref.state_dict())),
        "full_optim": osd_diff(full_osd, ref_osd(ref, opts[0])),
    }


def load_sharded(path: str, saved_world: int, direct: bool) -> dict[str, float]:
    """Load the SHARDED checkpoint into a model of other values at this world size; two more Adam
    steps next to the unsharded model that continues from the same state."""
    ref, model = pair(direct)
    opts = (torch.optim.Adam(ref.parameters(), lr=0.05), torch.optim.Adam(model.parameters(), lr=0.05))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    init_optim_state(opts[1])
    saved = torch.load(os.path.join(path, "ref.pt"), weights_only=True)
    ref.load_state_dict(saved["model"])
    opts[0].load_state_dict(saved["optim"])
    with state_dict_type(model, SHARDED):
        sd = {"model": model.state_dict(), "optim": optim_state_dict(model, opts[1])}
        dcp.load(sd, checkpoint_id=os.path.join(path, f"dcp{saved_world}"))
        model.load_state_dict(sd["model"])
        opts[1].load_state_dict(optim_state_dict_to_load(model, opts[1], sd["optim"]))
    loaded = param_diff(model, ref)
    adam_steps(ref, model, range(2, 4), opts)
    return {"loaded": loaded, "trained": param_diff(model, ref)}


@pytest.mark.parametrize("direct", [True, False])
def test_scalar_and_short_parameters_checkpoint_across_world_sizes(
    dist_run: Callable[..., Any], tmp_path: Any, direct: bool
) -> None:
    """SHARDED and FULL model and Adam states equal the unsharded model's and torch Adam's; DCP
    saved at 2 ranks loads at 4 and the reverse, and training continues in parity. Fails if a
    rank's chunk of a short weight or of a 0-dim value is cut from the wrong place of the shard."""
    for world in (2, 4):
        for r in dist_run(world, save_sharded, str(tmp_path), direct):
            assert max(r.values()) < 1e-12, (world, r)
        for other in (2, 4):
            for r in dist_run(other, load_sharded, str(tmp_path), world, direct):
                assert r["loaded"] < 1e-12 and r["trained"] < 1e-10, (world, other, r)


def local_round_trip(direct: bool) -> float:
    """LOCAL: this rank's rank-major shards saved, loaded into a model of other values, equal."""
    ref, model = pair(direct)
    _, other = pair(direct)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    with state_dict_type(model, LOCAL, LocalStateDictConfig()):
        sd = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in model.state_dict().items()}
    with state_dict_type(other, LOCAL):
        other.load_state_dict(sd)
    return param_diff(other, ref)


def test_local_state_dict_round_trip_with_scalar_units(dist_run: Callable[..., Any]) -> None:
    for direct in (True, False):
        assert dist_run(4, local_round_trip, direct) == [0.0] * 4


# ---------------------------------------------------------------------------- unshard_params edits
def _edit(model: nn.Module) -> None:
    """In place and by assignment, on values and gradients of the 0-dim and the short parameters."""
    with torch.no_grad():
        model.gate.g.mul_(2.0)
        model.gate.g.grad.mul_(3.0)
        model.temp.grad = torch.full_like(model.temp.grad, 0.5)
        model.temp.data = torch.full_like(model.temp, -0.25)
        model.head[0].weight.grad.add_(1.0)
        model.head[0].bias.data = torch.full_like(model.head[0].bias, 0.125)
        model.l1.weight[2].fill_(0.5)


def edit_inside_unshard_params(direct: bool) -> float:
    world, rank = dist.get_world_size(), dist.get_rank()
    ref, model = pair(direct)
    opts = (torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(2):
        b = batch(step, 2 * world)
        loss_of(ref, b).backward()
        loss_of(model, local_slice(b, rank, world)).backward()
        if step == 0:
            _edit(ref)
            with unshard_params(model, writeback=True, with_grads=True):
                _edit(model)
        for o in opts:
            o.step()
            o.zero_grad()
    return param_diff(model, ref)


def test_edits_of_scalar_values_and_grads_inside_unshard_params_are_written_back(dist_run: Callable[..., Any]) -> None:
    """Fails if the written-back shard takes a 0-dim value or gradient from another copy than the
    one the parameter views, or a short weight's row from another rank's chunk."""
    for direct in (True, False):
        for diff in dist_run(4, edit_inside_unshard_params, direct):
            assert diff < 1e-12, (direct, diff)
