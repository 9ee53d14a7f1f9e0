"""More paths of rank-major flat shards with 0-dim, short and zero-size parameters (the models and
helpers are `test_rank_major_adversary`'s): the wrapper's flat parameters and communication hooks,
gradient norms, frozen, mixed-dtype and list units, meta-device init, bf16 parameters, ranks whose
reductions start from different places, and zero-size parameters in SHARDED state dicts."""

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
from test_rank_major_adversary import (
    POLICY,
    SHARDED,
    ScalarNet,
    adam_steps,
    batch,
    direct_units,
    loss_of,
    max_diff,
    osd_diff,
    pair,
    param_diff,
    ref_osd,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_composable import (
    FullyShardedDataParallel,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    clip_grad_norm_,
    fully_shard,
    init_optim_state,
    no_sync,
    state_dict_type,
    unshard_params,
)


# ---------------------------------------------------------------------------- the wrapper's flat parameters
def flat_optimizer_state(direct: bool) -> dict[str, float]:
    """``use_orig_params=False``: Adam over the rank-major flat parameters; the optimizer's own state
    dict (the flat state as a padded flat DTensor), gathered whole, loads into a fresh wrapper's
    optimizer, which trains on next to the unsharded model; the FQN-keyed one loads into another
    wrapper's optimizer (``optim_state_dict_to_load``) as the same flat state."""
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

    model, fresh, by_name = wrap(), wrap(), wrap()
    opt_ref, opt = torch.optim.Adam(ref.parameters(), lr=0.05), torch.optim.Adam(model.parameters(), lr=0.05)
    adam_steps(ref, model, range(2), (opt_ref, opt))
    osd = FullyShardedDataParallel.optim_state_dict(model, opt)
    by_fqn = osd_diff(osd, ref_osd(ref, opt_ref))
    raw = opt.state_dict()
    whole = {
        k: {key: v.full_tensor() if hasattr(v, "full_tensor") else v for key, v in s.items()}
        for k, s in raw["state"].items()
    }
    fresh.load_state_dict(model.state_dict())
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.05)
    init_optim_state(fresh_opt)  # installs the hook that takes the global form back
    fresh_opt.load_state_dict({**raw, "state": whole})
    named_opt = torch.optim.Adam(by_name.parameters(), lr=0.05)
    named_opt.load_state_dict(FullyShardedDataParallel.optim_state_dict_to_load(by_name, named_opt, osd))
    pairs = zip(fresh.parameters(), by_name.parameters())
    named = max(
        (fresh_opt.state[a][k] - named_opt.state[b][k]).abs().max().item()
        for a, b in pairs
        for k in ("exp_avg", "exp_avg_sq")
    )
    adam_steps(ref, fresh, range(2, 4), (opt_ref, fresh_opt))
    return {"by_fqn": by_fqn, "named": named, "trained": param_diff(fresh, ref)}


def test_flat_parameter_optimizer_state_loads_whole(dist_run: Callable[..., Any]) -> None:
    """Fails if the padded flat state is read as param-major (it is every rank's shard in turn)."""
    for direct in (True, False):
        for r in dist_run(4, flat_optimizer_state, direct):
            assert r["by_fqn"] < 1e-12 and r["named"] < 1e-12 and r["trained"] < 1e-10, (direct, r)


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
    return max_diff(got, {n: p.grad for n, p in ref.named_parameters()})


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
        elif how == "hybrid":  # HYBRID_SHARD: shard groups of 2, replicated twice
            model = fully_shard(copy.deepcopy(ref), POLICY, mesh=init_device_mesh("cpu", (2, world // 2)))
        else:
            model = fully_shard(copy.deepcopy(ref), POLICY)
        b = batch(0, 2 * world)
        loss_of(ref, b).backward()
        loss_of(model, local_slice(b, rank, world)).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    if how in ("ours", "hybrid"):
        got = clip_grad_norm_(model, 0.05)
    elif how == "flat":
        got = model.clip_grad_norm_(0.05)
    else:
        got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    with unshard_params(model, with_grads=True):
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    want_grads = {n: p.grad for n, p in ref.named_parameters()}
    return {"norm": abs(got.item() - want.item()), "grads": max_diff(grads, want_grads)}


@pytest.mark.parametrize("how", ["ours", "torch", "flat", "hybrid"])
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
        adam_steps(ref, model, range(3), (opts[0], opts[1]))
    return param_diff(model, ref)


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
    return param_diff(model, ref)


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
    return max_diff(got, want)


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
    return max_diff(got, {n: p.grad for n, p in ref.named_parameters()})


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
    return {"shapes": shapes == want or (shapes, want), "values": param_diff(model, ref)}


def test_zero_size_parameters_shard_as_torch_chunk(dist_run: Callable[..., Any], tmp_path: Any) -> None:
    assert dist_run(2, hollow_sharded, str(tmp_path), True) == [{"shapes": True, "values": 0.0}] * 2
    assert dist_run(4, hollow_sharded, str(tmp_path), False) == [{"shapes": True, "values": 0.0}] * 4


# ---------------------------------------------------------------------------- torch's state-dict API
def torch_api_round_trip(direct: bool, full: bool) -> dict[str, float]:
    """``get_state_dict`` (full tensors, or DTensors) equals the unsharded model's and torch Adam's
    state; ``set_state_dict`` of it into a model and optimizer of other values trains on in parity."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    ref, model = pair(direct)
    _, other = pair(direct)
    opts = (torch.optim.Adam(ref.parameters(), lr=0.05), torch.optim.Adam(model.parameters(), lr=0.05))
    adam_steps(ref, model, range(2), opts)
    options = StateDictOptions(full_state_dict=full)
    model_sd, optim_sd = get_state_dict(model, opts[1], options=options)
    whole = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model_sd.items()}
    got = {"model": max_diff(whole, dict(ref.state_dict())), "optim": osd_diff(optim_sd, ref_osd(ref, opts[0]))}
    other_opt = torch.optim.Adam(other.parameters(), lr=0.5)
    set_state_dict(other, other_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    adam_steps(ref, other, range(2, 4), (opts[0], other_opt))
    got["trained"] = param_diff(other, ref)
    return got


@pytest.mark.parametrize("full", [True, False])
def test_torch_state_dict_api_with_scalar_and_short_parameters(dist_run: Callable[..., Any], full: bool) -> None:
    for direct in (True, False):
        for r in dist_run(4, torch_api_round_trip, direct, full):
            assert r["model"] < 1e-12 and r["optim"] < 1e-12 and r["trained"] < 1e-10, (full, direct, r)
