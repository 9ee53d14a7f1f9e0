"""torch's state-dict API (``torch.distributed.checkpoint.state_dict``) and DCP on a fully_shard'ed model
and its optimizer (issue 14, section 1), and ``optim.state_dict()`` in global form; the same order of
optimizer state on every rank, the FSDP1 wrapper class through that API, and the API called between a
forward and its backward."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from models import Block, TinyGPT, gpt_batch, gpt_loss
from parity import global_mean, local_slice
from parity import gpt_step as _step
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from fsdp_composable import FullyShardedDataParallel, ModuleWrapPolicy, StateDictType, fully_shard, state_dict_type

GLOBAL_BATCH = 4
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _adamw(model: nn.Module, lr: float = 0.01) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "ln" not in n]
    ids = {id(p) for p in decay}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=lr)


def _build(seed: int, lr: float = 0.01) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = fully_shard(TinyGPT(vocab=37, d=12), ModuleWrapPolicy({Block}))  # 12: shards cut rows
    return model, _adamw(model, lr)


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        batch = local_slice(gpt_batch(step, GLOBAL_BATCH), dist.get_rank(), dist.get_world_size())
        loss = gpt_loss(model, batch)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(global_mean(loss))
    return losses


def _describe(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: (type(v).__name__, tuple(v.shape)) for k, v in sd.items() if isinstance(v, torch.Tensor)}


# ---------------------------------------------------------------------------- default options + DCP
def save_with_torch_api(path: str) -> dict[str, Any]:
    model, optim = _build(0)
    _train(model, optim, range(2))
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, "dcp"))
    plain = optim.state_dict()  # never per-rank pieces under global numbers
    fc1 = optim_sd["state"]["blocks.0.fc1.weight"]
    # what was saved equals the full state, gathered another way
    full_model, full_optim = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    return {
        "model": _describe(model_sd),
        "exp_avg": (type(fc1["exp_avg"]).__name__, tuple(fc1["exp_avg"].shape), str(fc1["exp_avg"].placements)),
        "step": (type(fc1["step"]).__name__, float(fc1["step"])),
        "plain": {
            k: tuple(v["exp_avg"].shape) for k, v in plain["state"].items() if isinstance(v["exp_avg"], DTensor)
        },
        "plain_count": len(plain["state"]),
        "model_type_after": fully_shard.state(model).state_dict_type.name,
        "full_model": {k: v for k, v in full_model.items()},
        "full_optim": {k: v["exp_avg"] for k, v in full_optim["state"].items()},
        "continued": _train(model, optim, range(2, 5)),
    }


def resume_with_torch_api(path: str) -> list[float]:
    model, optim = _build(1, lr=1.0)  # other weights and lr: the checkpoint must win
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert [g["lr"] for g in optim.param_groups] == [0.01, 0.01]
    assert fully_shard.state(model).state_dict_type is StateDictType.FULL_STATE_DICT
    return _train(model, optim, range(2, 5))


def uninterrupted() -> list[float]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=37, d=12)
    optim = _adamw(model)
    losses = []
    for step in range(5):
        loss = gpt_loss(model, gpt_batch(step, GLOBAL_BATCH))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses[2:]


def test_torch_api_save_at_2_resume_at_1_2_4(dist_run, tmp_path) -> None:
    saved = dist_run(2, save_with_torch_api, str(tmp_path))[0]
    torch.manual_seed(0)
    ref = TinyGPT(vocab=37, d=12)
    assert saved["model"] == {k: ("DTensor", tuple(v.shape)) for k, v in ref.state_dict().items()}
    assert saved["exp_avg"] == ("DTensor", (48, 12), "(Shard(dim=0),)")
    assert saved["step"] == ("Tensor", 2.0)
    assert saved["plain_count"] == len(list(ref.parameters()))
    assert saved["plain"][0] == (37, 12)  # tok.weight, by number, in its full shape
    assert saved["model_type_after"] == "FULL_STATE_DICT"  # torch's call left our default alone
    assert all(saved["full_model"][k].shape == v.shape for k, v in ref.state_dict().items())
    continued = saved["continued"]
    # the sharded run follows the unsharded one (same data, same steps)
    ref_losses = uninterrupted()
    assert torch.allclose(torch.tensor(continued), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert dist_run(2, resume_with_torch_api, str(tmp_path))[0] == continued  # same world size: bit for bit
    for world in (1, 4):
        resumed = dist_run(world, resume_with_torch_api, str(tmp_path))[0]
        assert torch.allclose(torch.tensor(resumed), torch.tensor(continued), rtol=1e-5, atol=1e-6), (world, resumed)


# ---------------------------------------------------------------------------- full_state_dict=True
def full_options() -> dict[str, Any]:
    torch.manual_seed(0)
    ref = TinyGPT(vocab=37, d=12)
    ref_optim = _adamw(ref)
    model, optim = _build(0)
    for step in range(2):
        gpt_loss(ref, gpt_batch(step, GLOBAL_BATCH)).backward()
        ref_optim.step()
        ref_optim.zero_grad()
    _train(model, optim, range(2))
    msd = get_model_state_dict(model, options=FULL)
    osd = get_optimizer_state_dict(model, optim, options=FULL)
    every = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    names = {id(p): n for n, p in ref.named_parameters()}
    ref_osd = {names[id(p)]: s for p, s in ref_optim.state.items()}
    out: dict[str, Any] = {"rank": dist.get_rank(), "n_model": len(msd), "n_optim": len(osd.get("state", {}))}
    out["every_rank_full"] = all(
        type(every["state"][k][key]) is torch.Tensor and every["state"][k][key].shape == s[key].shape
        for k, s in ref_osd.items()
        for key in ("exp_avg", "exp_avg_sq")
    )
    if dist.get_rank() == 0:
        out["model_diff"] = max((msd[k] - v).abs().max().item() for k, v in ref.state_dict().items())
        out["model_types"] = {type(v).__name__ for v in msd.values()}
        out["optim_diff"] = max(
            (osd["state"][k][key] - s[key]).abs().max().item() for k, s in ref_osd.items() for key in s if key != "step"
        )
        out["shapes"] = all(osd["state"][k]["exp_avg"].shape == s["exp_avg"].shape for k, s in ref_osd.items())
        out["devices"] = {v.device.type for v in msd.values()}
    # load the full dicts back (every rank gets them, as from torch.load) into a fresh model and optimizer
    full_m = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    continued = _train(model, optim, range(2, 4))
    fresh, fresh_optim = _build(1, lr=1.0)
    set_model_state_dict(fresh, full_m, options=StateDictOptions(full_state_dict=True))
    set_optimizer_state_dict(fresh, fresh_optim, every, options=StateDictOptions(full_state_dict=True))
    out["resumed_equal"] = _train(fresh, fresh_optim, range(2, 4)) == continued
    return out


def test_torch_api_full_state_dict(dist_run) -> None:
    r0, r1 = dist_run(2, full_options)
    torch.manual_seed(0)
    n_params = len(TinyGPT(vocab=37, d=12).state_dict())
    assert (r0["n_model"], r1["n_model"]) == (n_params, 0)  # cpu_offload=True: rank 0 only
    assert r0["n_optim"] == n_params and r1["n_optim"] == 0
    assert r0["model_types"] == {"Tensor"} and r0["devices"] == {"cpu"}
    assert r0["model_diff"] < 1e-6, r0["model_diff"]
    assert r0["optim_diff"] < 1e-6 and r0["shapes"], r0["optim_diff"]
    assert r0["every_rank_full"] and r1["every_rank_full"]
    assert r0["resumed_equal"] and r1["resumed_equal"]


# ---------------------------------------------------------------------------- our own API agrees
def ours_and_torch_agree() -> bool:
    model, optim = _build(0)
    _train(model, optim, range(1))
    from fsdp_composable import optim_state_dict

    with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        ours = optim_state_dict(model, optim)
    theirs = get_optimizer_state_dict(model, optim)
    return all(
        torch.equal(ours["state"][k][key].to_local(), v.to_local())
        for k, s in theirs["state"].items()
        for key, v in s.items()
        if isinstance(v, DTensor)
    ) and set(ours["state"]) == set(theirs["state"])


def test_our_optim_state_dict_equals_torchs(dist_run) -> None:
    assert dist_run(2, ours_and_torch_agree) == [True, True]


# ---------------------------------------------------------------------------- optimizer state order
def full_optimizer_state_via_torch() -> dict[str, Any]:
    torch.manual_seed(0)
    model = fully_shard(TinyGPT(vocab=37, d=12), ModuleWrapPolicy({Block}))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)  # one group: order = first-state order
    torch.manual_seed(0)
    ref = TinyGPT(vocab=37, d=12)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for step in range(2):
        _step(model, optim, step)
        gpt_loss(ref, gpt_batch(step, 4)).backward()
        ref_optim.step()
        ref_optim.zero_grad()
    orders: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(orders, list(optim.state_dict()["state"]))
    if any(o != orders[0] for o in orders):
        return {"orders": orders}  # gathering now would post mismatched all-gathers (a gloo abort)
    osd = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    names = {id(p): n for n, p in ref.named_parameters()}
    diff = max(
        (osd["state"][names[id(p)]][key] - value).abs().max().item()
        for p, s in ref_optim.state.items()
        for key, value in s.items()
        if key != "step"
    )
    return {"orders": orders, "diff": diff}


def test_optimizer_state_dict_order_is_the_same_on_every_rank(dist_run) -> None:
    """``optim.state_dict()["state"]`` follows the order in which parameters first got state, and a
    parameter whose local shard is empty on one rank gets it later there: torch's
    ``get_optimizer_state_dict(full_state_dict=True)`` then gathered different parameters on
    different ranks at the same time (a gloo "Received data size doesn't match" abort, or silently
    swapped values where two sizes agree)."""
    for result in dist_run(2, full_optimizer_state_via_torch):
        assert all(o == result["orders"][0] for o in result["orders"]), result["orders"]
        assert result["diff"] < 1e-6, result["diff"]


# ---------------------------------------------------------------------------- the wrapper class
def _wrapped(seed: int, use_orig_params: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = FullyShardedDataParallel(
        TinyGPT(vocab=37, d=12), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=use_orig_params
    )
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def wrapper_through_torch_api(path: str, use_orig_params: bool, full: bool) -> dict[str, Any]:
    model, optim = _wrapped(0, use_orig_params)
    for step in range(2):
        _step(model, optim, step)
    options = StateDictOptions(full_state_dict=full)
    model_sd, optim_sd = get_state_dict(model, optim, options=options)
    kinds = {type(v).__name__ for v in model_sd.values()}
    keys = sorted(model_sd)
    resumed, resumed_optim = _wrapped(1, use_orig_params)  # other weights and optimizer state
    _step(resumed, resumed_optim, 7)
    if full:
        set_state_dict(resumed, resumed_optim, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    else:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        template_model, template_optim = get_state_dict(resumed, resumed_optim)
        state = {"model": template_model, "optim": template_optim}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(resumed, resumed_optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {
        "kinds": kinds,
        "keys": keys,
        "continued": [_step(model, optim, s) for s in range(2, 4)],
        "resumed": [_step(resumed, resumed_optim, s) for s in range(2, 4)],
    }


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("full", [False, True])
def test_wrapper_class_through_torch_state_dict_api(dist_run, tmp_path, use_orig_params: bool, full: bool) -> None:
    """``FullyShardedDataParallel`` (both parameter modes) through torch's get/set_state_dict, with
    default options + DCP and with ``full_state_dict=True``: resuming trains bit for bit like the
    uninterrupted run. Before: torch's tree walk named every parameter ``_fsdp_wrapped_module.<fqn>``
    ("Missing optimizer state for parameter '_fsdp_wrapped_module.pos'"), a flat-mode full load
    failed on unexpected ``_flat_param`` keys, and default options gathered full tensors on every
    rank instead of DTensors."""
    torch.manual_seed(0)
    expected_keys = sorted(TinyGPT(vocab=37, d=12).state_dict())
    for result in dist_run(2, wrapper_through_torch_api, str(tmp_path / "dcp"), use_orig_params, full):
        assert result["keys"] == expected_keys
        assert result["kinds"] == ({"Tensor"} if full else {"DTensor"})
        assert result["resumed"] == result["continued"]


# ---------------------------------------------------------------------------- optimizer step while unsharded
def torch_state_dict_between_forward_and_backward(train_on: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = fully_shard(TinyGPT(vocab=37, d=12), ModuleWrapPolicy({Block}))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    loss = gpt_loss(model, local_slice(gpt_batch(0, 4), dist.get_rank(), dist.get_world_size()))
    try:
        get_state_dict(model, optim)  # a fresh optimizer: torch steps it once to create its state
        error = ""
    except RuntimeError as e:
        error = str(e)
    out: dict[str, Any] = {
        "error": error,
        "state_shapes_ok": all(v.shape == p.shape for p, s in optim.state.items() for v in s.values() if v.dim() > 0),
    }
    if train_on:
        loss.backward()
        optim.step()
        optim.zero_grad()
        torch.manual_seed(0)
        ref = fully_shard(TinyGPT(vocab=37, d=12), ModuleWrapPolicy({Block}))
        ref_optim = torch.optim.AdamW(ref.parameters(), lr=0.01)
        _step(ref, ref_optim, 0)
        out["same"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    return out


def test_optimizer_step_while_unsharded_is_refused(dist_run) -> None:
    """torch's ``get_state_dict`` on a fresh optimizer steps it once; between a forward and its
    backward the root's parameters are unsharded, so that step created AdamW state of the full
    shapes (then "optimizer state 'exp_avg' of parameter 'pos' has shape (8, 12)" from the
    state-dict hook, and a broken optimizer). Now the first step refuses, naming the unit."""
    for r in dist_run(2, torch_state_dict_between_forward_and_backward, False):
        assert r["error"].startswith("optimizer.step() was called while the parameters of unit '<root>' are unsharded")
        assert r["state_shapes_ok"]


@pytest.mark.xfail(
    strict=True,
    reason="torch's _init_optim_state sets every group's lr to 0 and every .grad to zeros before the step we "
    "refuse, and restores neither when the step raises: the following steps change nothing (lr 0)",
)
def test_training_goes_on_after_a_refused_step_while_unsharded(dist_run) -> None:
    for r in dist_run(2, torch_state_dict_between_forward_and_backward, True):
        assert r["same"]
