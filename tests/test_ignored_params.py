"""Parameters ignored one by one (FSDP2's ``ignored_params``, FSDP1's ``ignored_states``): they stay
plain local parameters, in no flat parameter, never all-gathered, their gradients not reduced, while
their modules' other parameters are sharded; every state-dict type and the optimizer state dict hold
their plain values."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from models import OddMLP, mlp_batch, mlp_loss
from parity import local_slice
from torch import nn

from fsdp_composable import (
    FullyShardedDataParallel,
    ModuleWrapPolicy,
    StateDictType,
    describe,
    fully_shard,
    optim_state_dict,
    optim_state_dict_to_load,
    state_dict_type,
    unshard_params,
)

IGNORED = "l2.0.weight"  # one parameter of a Linear whose bias stays sharded


def _grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    with unshard_params(model, with_grads=True, writeback=False):
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _shard(model: nn.Module, how: str) -> nn.Module:
    ignored = {dict(model.named_parameters())[IGNORED]}
    if how == "wrapper":
        policy = ModuleWrapPolicy({nn.Sequential})
        return FullyShardedDataParallel(model, auto_wrap_policy=policy, ignored_states=ignored, use_orig_params=True)
    return fully_shard(model, ModuleWrapPolicy({nn.Sequential}), ignored_params=ignored)


def train(how: str) -> dict[str, Any]:
    """Three SGD steps next to the unsharded model. Each step, sharded parameters get the global
    batch's mean gradient and the ignored one its own rank's only (not reduced, as in FSDP2); the
    script then averages that one itself, as it would with DDP, and the model trains like the
    reference."""
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = OddMLP()
    model = _shard(copy.deepcopy(ref), how)
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {"sharded_diff": 0.0, "ignored_diff": 0.0}
    for step in range(3):
        batch = mlp_batch(step, 2 * world)
        local_ref = copy.deepcopy(ref)  # this rank's batch only: the ignored parameter's gradient
        mlp_loss(local_ref, local_slice(batch, rank, world)).backward()
        mlp_loss(ref, batch).backward()
        mlp_loss(model, local_slice(batch, rank, world)).backward()
        grads = _grads_of(model)
        for (name, p), local in zip(ref.named_parameters(), local_ref.parameters()):
            key, want = ("ignored_diff", local.grad) if name == IGNORED else ("sharded_diff", p.grad)
            out[key] = max(out[key], (grads[name] - want).abs().max().item())
        ignored = dict(model.named_parameters())[IGNORED]
        dist.all_reduce(ignored.grad)
        ignored.grad /= world
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    sd = model.state_dict()
    out["weight_diff"] = max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    out["ignored_type"] = type(dict(model.named_parameters())[IGNORED]).__name__
    out["ignored_shape"] = tuple(dict(model.named_parameters())[IGNORED].shape)
    out["units"] = [sorted(u.param_fqns) for u in describe(model).units]
    return out


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("how", ["fully_shard", "wrapper"])
def test_ignored_param_trains_locally(dist_run: Callable[..., Any], world_size: int, how: str) -> None:
    for r in dist_run(world_size, train, how):
        assert r["sharded_diff"] < 1e-6, r
        assert r["ignored_diff"] < 1e-6, r
        assert r["weight_diff"] < 1e-6, r
        assert r["ignored_type"] == "Parameter"
        assert r["ignored_shape"] == (3, 7)
        assert all(IGNORED not in fqns for fqns in r["units"]), r["units"]
        assert any("l2.0.bias" in fqns for fqns in r["units"]), r["units"]


def state_dicts() -> dict[str, Any]:
    """Each state-dict type holds the ignored parameter's plain value (this rank's), and loads it back;
    so does the optimizer state dict."""
    torch.manual_seed(0)
    model = _shard(OddMLP(), "fully_shard")
    ignored = dict(model.named_parameters())[IGNORED]
    with torch.no_grad():
        ignored.fill_(float(dist.get_rank() + 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    mlp_loss(model, mlp_batch(0, 2)).backward()
    opt.step()
    mine = ignored.detach().clone()
    out: dict[str, Any] = {}
    for kind in StateDictType:
        with state_dict_type(model, kind):
            sd = model.state_dict()
            value = sd[IGNORED] = sd[IGNORED].clone()  # not the parameter's memory, zeroed below
            out[kind.name] = (type(value).__name__, tuple(value.shape), torch.equal(value, mine))
            with torch.no_grad():
                ignored.zero_()
            model.load_state_dict(sd)
            out[kind.name + "_loaded"] = torch.equal(ignored.detach(), mine)
    osd = optim_state_dict(model, opt)
    state = osd["state"][IGNORED]
    out["optim"] = (tuple(state["exp_avg"].shape), type(state["exp_avg"]).__name__)
    want = opt.state[ignored]["exp_avg"].clone()
    opt.state[ignored]["exp_avg"].zero_()
    opt.load_state_dict(optim_state_dict_to_load(model, opt, osd))
    out["optim_loaded"] = torch.equal(opt.state[ignored]["exp_avg"], want)
    return out


def test_ignored_param_in_every_state_dict(dist_run: Callable[..., Any]) -> None:
    for r in dist_run(2, state_dicts):
        assert r == {
            "FULL_STATE_DICT": ("Tensor", (3, 7), True),
            "FULL_STATE_DICT_loaded": True,
            "SHARDED_STATE_DICT": ("Tensor", (3, 7), True),
            "SHARDED_STATE_DICT_loaded": True,
            "LOCAL_STATE_DICT": ("Tensor", (3, 7), True),
            "LOCAL_STATE_DICT_loaded": True,
            "optim": ((3, 7), "Tensor"),
            "optim_loaded": True,
        }, r


def meta_init_and_flat_wrapper() -> dict[str, Any]:
    """On the meta device the unit's init function materialises the ignored parameter too, and it stays
    ignored (a new object); the wrapper exposing flat parameters keeps it as a plain parameter."""
    with torch.device("meta"):
        meta = OddMLP()
    fully_shard(
        meta,
        ModuleWrapPolicy({nn.Sequential}),
        ignored_params={meta.l2[0].weight},
        param_init_fn=lambda m: (m.to_empty(device="cpu", recurse=False), m.reset_parameters()),
    )
    out: dict[str, Any] = {"meta_shape": tuple(meta.l2[0].weight.shape)}
    out["meta_ignored"] = meta.l2[0].weight in fully_shard.state(meta).ignored_params
    mlp_loss(meta, mlp_batch(0, 2)).backward()
    out["meta_grad"] = tuple(meta.l2[0].weight.grad.shape)
    flat = OddMLP()
    wrapper = FullyShardedDataParallel(flat, ignored_states=[flat.l2[0].weight])
    names = [n for n, _ in wrapper.named_parameters()]
    out["flat_plain"] = [n for n in names if "flat_param" not in n]
    mlp_loss(wrapper, mlp_batch(0, 2)).backward()
    out["flat_grad"] = tuple(flat.l2[0].weight.grad.shape)
    return out


def test_ignored_param_meta_init_and_flat_wrapper(dist_run: Callable[..., Any]) -> None:
    for r in dist_run(2, meta_init_and_flat_wrapper):
        assert r == {
            "meta_shape": (3, 7),
            "meta_ignored": True,
            "meta_grad": (3, 7),
            "flat_plain": ["l2.0.weight"],
            "flat_grad": (3, 7),
        }, r
