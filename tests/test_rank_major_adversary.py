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
    FullyShardedDataParallel,
    LocalStateDictConfig,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    StateDictType,
    _rank_major,
    clip_grad_norm_,
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


def _pair(direct: bool, **kwargs: Any) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = ScalarNet().double()
    with direct_units(direct):
        model = fully_shard(copy.deepcopy(ref), POLICY, **kwargs)
        # a layout decides `direct` when first used: one step with no optimizer, its gradients dropped
        world = dist.get_world_size()
        loss_of(model, local_slice(batch(99, 2 * world), dist.get_rank(), world)).backward()
    model.zero_grad(set_to_none=True)
    return ref, model


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    with unshard_params(model, writeback=False):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b), (list(a), list(b))
    return max(((a[k] - b[k]).abs().max().item() if a[k].numel() else 0.0) for k in a)


# ---------------------------------------------------------------------------- training
def train(direct: bool, how: str) -> float:
    """Adam on the same global batches; ``how``: the sharding options and micro-batching."""
    world, rank = dist.get_world_size(), dist.get_rank()
    kwargs: dict[str, Any] = {
        "full": {},
        "grad_op": {"strategy": ShardingStrategy.SHARD_GRAD_OP},
        "post_forward_2": {"reshard_after_forward": 2},
        "no_sync": {},
        "hybrid": {"mesh": init_device_mesh("cpu", (2, world // 2))},
        "hybrid_no_sync": {"mesh": init_device_mesh("cpu", (2, world // 2))},
        "mixed": {"mixed_precision": MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float64)},
    }[how]
    ref, model = _pair(direct, **kwargs)
    opt_ref, opt = torch.optim.Adam(ref.parameters(), lr=0.05), torch.optim.Adam(model.parameters(), lr=0.05)
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
    return _diff(_full(model), {n: p.detach() for n, p in ref.named_parameters()})


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("how", ["full", "grad_op", "post_forward_2", "no_sync", "hybrid", "hybrid_no_sync", "mixed"])
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
    ref, model = _pair(direct)
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
def _adam_steps(ref: nn.Module, model: nn.Module, steps: range, opts: tuple[Any, Any]) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    for step in steps:
        b = batch(step, 2 * world)
        loss_of(ref, b).backward()
        loss_of(model, local_slice(b, rank, world)).backward()
        for o in opts:
            o.step()
            o.zero_grad()


def _ref_osd(ref: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in ref.named_parameters()}
    return {names[id(p)]: s for p, s in opt.state.items()}


def _osd_diff(osd: dict[str, Any], want: dict[str, dict[str, torch.Tensor]]) -> float:
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
    ref, model = _pair(direct)
    opts = (torch.optim.Adam(ref.parameters(), lr=0.05), torch.optim.Adam(model.parameters(), lr=0.05))
    _adam_steps(ref, model, range(2), opts)
    with state_dict_type(model, SHARDED):
        sd = {"model": model.state_dict(), "optim": optim_state_dict(model, opts[1])}
        sharded_diff = _osd_diff(sd["optim"], _ref_osd(ref, opts[0]))
        model_diff = _diff({k: v.full_tensor() for k, v in sd["model"].items()}, dict(ref.state_dict()))
        dcp.save(sd, checkpoint_id=os.path.join(path, f"dcp{dist.get_world_size()}"))
    full_model, full_osd = model.state_dict(), optim_state_dict(model, opts[1])
    if dist.get_rank() == 0:
        torch.save({"model": ref.state_dict(), "optim": opts[0].state_dict()}, os.path.join(path, "ref.pt"))
    dist.barrier()
    return {
        "sharded_model": model_diff,
        "sharded_optim": sharded_diff,
        "full_model": _diff(dict(full_model), dict(ref.state_dict())),
        "full_optim": _osd_diff(full_osd, _ref_osd(ref, opts[0])),
    }


def load_sharded(path: str, saved_world: int, direct: bool) -> dict[str, float]:
    """Load the SHARDED checkpoint into a model of other values at this world size; two more Adam
    steps next to the unsharded model that continues from the same state."""
    ref, model = _pair(direct)
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
    loaded = _diff(_full(model), {n: p.detach() for n, p in ref.named_parameters()})
    _adam_steps(ref, model, range(2, 4), opts)
    return {"loaded": loaded, "trained": _diff(_full(model), {n: p.detach() for n, p in ref.named_parameters()})}


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
    ref, model = _pair(direct)
    _, other = _pair(direct)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    with state_dict_type(model, LOCAL, LocalStateDictConfig()):
        sd = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in model.state_dict().items()}
    with state_dict_type(other, LOCAL):
        other.load_state_dict(sd)
    return _diff(_full(other), {n: p.detach() for n, p in ref.named_parameters()})


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
    ref, model = _pair(direct)
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
    return _diff(_full(model), {n: p.detach() for n, p in ref.named_parameters()})


def test_edits_of_scalar_values_and_grads_inside_unshard_params_are_written_back(dist_run: Callable[..., Any]) -> None:
    """Fails if the written-back shard takes a 0-dim value or gradient from another copy than the
    one the parameter views, or a short weight's row from another rank's chunk."""
    for direct in (True, False):
        for diff in dist_run(4, edit_inside_unshard_params, direct):
            assert diff < 1e-12, (direct, diff)


# ---------------------------------------------------------------------------- the wrapper's flat parameters
def flat_optimizer_state(direct: bool) -> dict[str, float]:
    """``use_orig_params=False``: Adam over the rank-major flat parameters; the optimizer's own state
    dict (the flat state as a padded flat DTensor), gathered whole, loads into a fresh wrapper's
    optimizer, which trains on next to the unsharded model."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    ref = ScalarNet().double()

    def wrap() -> nn.Module:
        with direct_units(direct):
            model = FullyShardedDataParallel(copy.deepcopy(ref), auto_wrap_policy=POLICY, use_orig_params=False)
            b = local_slice(batch(99, 2 * world), rank, world)
            loss_of(model, b).backward()  # the layouts decide `direct` here; the gradients are dropped
        model.zero_grad(set_to_none=True)
        return model

    model, fresh = wrap(), wrap()
    opt_ref, opt = torch.optim.Adam(ref.parameters(), lr=0.05), torch.optim.Adam(model.parameters(), lr=0.05)
    _adam_steps(ref, model, range(2), (opt_ref, opt))
    osd = FullyShardedDataParallel.optim_state_dict(model, opt)
    by_fqn = _osd_diff(osd, _ref_osd(ref, opt_ref))
    raw = opt.state_dict()
    whole = {
        k: {key: v.full_tensor() if hasattr(v, "full_tensor") else v for key, v in s.items()}
        for k, s in raw["state"].items()
    }
    fresh.load_state_dict(model.state_dict())
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.05)
    init_optim_state(fresh_opt)  # installs the hook that takes the global form back
    fresh_opt.load_state_dict({**raw, "state": whole})
    _adam_steps(ref, fresh, range(2, 4), (opt_ref, fresh_opt))
    return {"by_fqn": by_fqn, "trained": _diff(_full(fresh), {n: p.detach() for n, p in ref.named_parameters()})}


def test_flat_parameter_optimizer_state_loads_whole(dist_run: Callable[..., Any]) -> None:
    """Fails if the padded flat state is read as param-major (it is every rank's shard in turn)."""
    for direct in (True, False):
        for r in dist_run(4, flat_optimizer_state, direct):
            assert r["by_fqn"] < 1e-12 and r["trained"] < 1e-10, (direct, r)


# ---------------------------------------------------------------------------- FSDP1 communication hooks
def grads_with_hook(hook_name: str, direct: bool) -> float:
    """The wrapper's ``register_comm_hook`` gets the rank-major flat gradient (a 0-dim gradient in
    every rank's chunk): torch's hooks reduce it to the unsharded model's gradients."""
    from torch.distributed.algorithms._comm_hooks import default_hooks

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    ref = ScalarNet().double()
    with direct_units(direct):
        model = FullyShardedDataParallel(copy.deepcopy(ref), auto_wrap_policy=POLICY, use_orig_params=True)
        group = dist.group.WORLD
        if hook_name == "default":
            model.register_comm_hook(default_hooks.DefaultState(group), default_hooks.reduce_scatter_hook)
        else:
            model.register_comm_hook(default_hooks.LowPrecisionState(group), default_hooks.fp16_compress_hook)
        for step in range(2):  # the first under no_sync: the kept sum reaches the hook with the second
            b = batch(step, 2 * world)
            loss_of(ref, b).backward()
            with no_sync(model) if step == 0 else contextlib.nullcontext():
                loss_of(model, local_slice(b, rank, world)).backward()
    with unshard_params(model, with_grads=True):
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
    return _diff(got, {n: p.grad for n, p in ref.named_parameters()})


@pytest.mark.parametrize("hook,tol", [("default", 1e-12), ("fp16", 2e-3)])
def test_comm_hooks_reduce_scalar_and_short_gradients(dist_run: Callable[..., Any], hook: str, tol: float) -> None:
    for direct in (True, False):
        for diff in dist_run(4, grads_with_hook, hook, direct):
            assert diff < tol, (hook, direct, diff)


# ---------------------------------------------------------------------------- gradient norms
def clipped(direct: bool, how: str) -> dict[str, float]:
    """``clip_grad_norm_`` (ours, torch's routed one, the wrapper's flat parameters) next to torch's on
    the unsharded model: the same norm, and the same clipped gradients."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    ref = ScalarNet().double()
    with direct_units(direct):
        if how == "flat":
            model = FullyShardedDataParallel(copy.deepcopy(ref), auto_wrap_policy=POLICY, use_orig_params=False)
        else:
            model = fully_shard(copy.deepcopy(ref), POLICY)
        b = batch(0, 2 * world)
        loss_of(ref, b).backward()
        loss_of(model, local_slice(b, rank, world)).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    if how == "ours":
        got = clip_grad_norm_(model, 0.05)
    elif how == "flat":
        got = model.clip_grad_norm_(0.05)
    else:
        got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    with unshard_params(model, with_grads=True):
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    want_grads = {n: p.grad for n, p in ref.named_parameters()}
    return {"norm": abs(got.item() - want.item()), "grads": _diff(grads, want_grads)}


@pytest.mark.parametrize("how", ["ours", "torch", "flat"])
def test_clip_grad_norm_counts_a_scalar_gradient_once(dist_run: Callable[..., Any], how: str) -> None:
    """Every rank's shard holds a 0-dim parameter's gradient: summing the shards over the ranks counts
    it once per rank unless the norm takes it from one rank only."""
    for direct in (True, False):
        for r in dist_run(4, clipped, direct, how):
            assert r["norm"] < 1e-7 and r["grads"] < 1e-7, (how, direct, r)  # the norm is float32


# ---------------------------------------------------------------------------- units of other shapes
class MixedScalars(ScalarNet):
    """The root unit adds a frozen 0-dim parameter and a float32 0-dim parameter (a model in float64)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Parameter(torch.tensor(1.25), requires_grad=False)
        self.low = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.frozen + self.low.double()


def other_units(direct: bool, how: str) -> float:
    """SGD next to the unsharded model: frozen and float32 0-dim parameters beside float64 ones
    ("mixed"), or ``gate`` and ``head`` as one unit (``fully_shard([gate, head])``, "list")."""
    torch.manual_seed(0)
    ref: nn.Module = MixedScalars().double() if how == "mixed" else ScalarNet().double()
    if how == "mixed":
        ref.low.data = ref.low.data.float()
    model = copy.deepcopy(ref)
    with direct_units(direct):
        if how == "list":
            fully_shard([model.gate, model.head])
            fully_shard(model)
        else:
            fully_shard(model, POLICY)
        trainable = [[p for p in m.parameters() if p.requires_grad] for m in (ref, model)]
        opts = [torch.optim.SGD(ps, lr=0.1, momentum=0.9) for ps in trainable]
        _adam_steps(ref, model, range(3), (opts[0], opts[1]))
    return _diff(_full(model), {n: p.detach() for n, p in ref.named_parameters()})


@pytest.mark.parametrize("how", ["mixed", "list"])
def test_frozen_mixed_dtype_and_list_units_with_scalars_train_alike(dist_run: Callable[..., Any], how: str) -> None:
    for direct in (True, False):
        for diff in dist_run(4, other_units, direct, how):
            assert diff < 1e-6, (how, direct, diff)  # float32 values round


def meta_init(direct: bool) -> float:
    """Built on the meta device, sharded, ``to_empty`` and each module's ``reset_parameters`` (the
    0-dim ``gate.g`` too) under one seed: the plain model's values on every rank."""
    with torch.device("meta"):
        model = ScalarNet()
    with direct_units(direct):
        fully_shard(model, POLICY)
    model.to_empty(device="cpu")
    torch.manual_seed(7)
    for m in model.modules():
        if callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()  # type: ignore[operator]
    ref = ScalarNet()
    torch.manual_seed(7)
    for m in ref.modules():
        if callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()  # type: ignore[operator]
    return _diff(_full(model), {n: p.detach() for n, p in ref.named_parameters()})


def test_meta_init_resets_scalar_and_short_parameters(dist_run: Callable[..., Any]) -> None:
    for direct in (True, False):
        assert dist_run(4, meta_init, direct) == [0.0] * 4


# ---------------------------------------------------------------------------- mixed precision
def bf16_grads(direct: bool) -> float:
    """bf16 parameters, float32 reduction: each rank's bf16 gradient of a bf16 copy of the model, cast
    to float32 and averaged over the ranks, is what every sharded gradient becomes."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    ref = ScalarNet()
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with direct_units(direct):
        model = fully_shard(copy.deepcopy(ref), POLICY, mixed_precision=mp)
        x, y = (t.float() for t in local_slice(batch(0, 2 * world), rank, world))
        F.mse_loss(model(x).float(), y).backward()
    low = copy.deepcopy(ref).bfloat16()
    F.mse_loss(low(x.bfloat16()).float(), y).backward()
    want = {}
    for n, p in low.named_parameters():
        g = p.grad.float() / world
        dist.all_reduce(g)
        want[n] = g
    with unshard_params(model, with_grads=True):
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
    return _diff(got, want)


def test_bf16_parameters_reduce_scalar_gradients_in_float32(dist_run: Callable[..., Any]) -> None:
    for direct in (True, False):
        for diff in dist_run(4, bf16_grads, direct):
            assert diff < 1e-6, (direct, diff)


# ---------------------------------------------------------------------------- ranks on different paths
class OneWeight(nn.Module):
    """``a``: a unit of one (5, 5) weight (both orders are one tensor; at 4 ranks rank 2's chunk is
    half padding, rank 3's all padding); the root: ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(5, 5, bias=False))
        self.b = nn.Linear(5, 1)
        self.detach_a = False  # `a` runs but gets no gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(torch.tanh(h.detach() if self.detach_a else h))


def uneven_no_sync(direct: bool) -> float:
    """SHARD_GRAD_OP (no collective in a ``no_sync`` micro-batch): ``a`` gets a gradient on rank 0
    only in the first micro-batch, so at the synced backward rank 0 sends its kept flat gradient
    while the others send autograd's gradients: the two must cut the same messages. The result is
    the unsharded model's sum."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    ref = OneWeight().double()
    with direct_units(direct):
        grad_op = ShardingStrategy.SHARD_GRAD_OP
        model = fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({nn.Sequential}), strategy=grad_op)
        extra, b = batch(50, 2 * world), batch(0, 2 * world)
        with no_sync(model):
            model.detach_a = rank != 0
            loss_of(model, local_slice(extra, rank, world)).backward()
        model.detach_a = False
        loss_of(model, local_slice(b, rank, world)).backward()
    for r in range(world):
        ref.detach_a = r != 0
        (loss_of(ref, local_slice(extra, r, world)) / world).backward()
    ref.detach_a = False
    loss_of(ref, b).backward()
    with unshard_params(model, with_grads=True):
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
    return _diff(got, {n: p.grad for n, p in ref.named_parameters()})


def test_a_rank_with_kept_no_sync_gradients_reduces_with_ranks_without(dist_run: Callable[..., Any]) -> None:
    """Before the fix a direct one-parameter unit sent its kept sum as one message per peer and
    autograd's gradient as rows and padding: gloo aborted ("Received data size doesn't match")."""
    for direct in (True, False):
        for diff in dist_run(4, uneven_no_sync, direct):
            assert diff < 1e-12, (direct, diff)


# ---------------------------------------------------------------------------- zero-size parameters
class Hollow(nn.Module):
    """Zero-size parameters with rows ((3, 0): torch.chunk gives each of 2 ranks rows of it) and
    without ((0, 3)), beside a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.cols = nn.Parameter(torch.zeros(3, 0))
        self.rows = nn.Parameter(torch.zeros(0, 3))
        self.lin = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.cols.sum() + self.rows.sum()


def hollow_sharded(path: str, save: bool) -> dict[str, Any]:
    """SHARDED values are ``Shard(0)`` DTensors whose local shapes are torch.chunk's, and DCP saves
    them at one world size and loads them at another."""
    torch.manual_seed(0 if save else 1)
    model = fully_shard(Hollow().double())
    rank, world = dist.get_rank(), dist.get_world_size()
    with state_dict_type(model, SHARDED):
        sd = model.state_dict()
        shapes = {k: tuple(v.to_local().shape) for k, v in sd.items()}
        if save:
            dcp.save(sd, checkpoint_id=os.path.join(path, "hollow"))
        else:
            dcp.load(sd, checkpoint_id=os.path.join(path, "hollow"))
            model.load_state_dict(sd)
    torch.manual_seed(0)
    ref = Hollow().double()
    want = {k: tuple((list(v.chunk(world)) + [v[:0]] * world)[rank].shape) for k, v in ref.state_dict().items()}
    return {"shapes": shapes == want or (shapes, want), "values": _diff(_full(model), dict(ref.named_parameters()))}


def test_zero_size_parameters_shard_as_torch_chunk(dist_run: Callable[..., Any], tmp_path: Any) -> None:
    assert dist_run(2, hollow_sharded, str(tmp_path), True) == [{"shapes": True, "values": 0.0}] * 2
    assert dist_run(4, hollow_sharded, str(tmp_path), False) == [{"shapes": True, "values": 0.0}] * 4
