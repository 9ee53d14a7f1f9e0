"""Optimizer state dicts: keyed by FQN with full shapes (FULL) or DTensors (SHARDED, via DCP), resuming
training exactly, at other world sizes, across parameter modes, and the errors for bad inputs."""

from __future__ import annotations

import copy
import os
from typing import Any

import expecttest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from models import Block, TinyGPT, gpt_batch, gpt_loss
from parity import global_mean, local_slice
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_composable import (
    FullyShardedDataParallel,
    ModuleWrapPolicy,
    StateDictType,
    fully_shard,
    init_optim_state,
    optim_state_dict,
    optim_state_dict_to_load,
    state_dict_type,
)

SHARDED = StateDictType.SHARDED_STATE_DICT
GLOBAL_BATCH = 4


def _adam(model: nn.Module, lr: float = 0.01) -> torch.optim.Optimizer:
    """Two param groups drawn from one unit (blocks.0): its matrices decay, everything else does not."""
    decay = [p for n, p in model.named_parameters() if n.startswith("blocks.0.") and n.endswith("proj_weight")]
    decay += [p for n, p in model.named_parameters() if n.startswith("blocks.0.fc") and n.endswith("weight")]
    ids = {id(p) for p in decay}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return torch.optim.Adam(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "lr": lr / 2, "betas": (0.8, 0.9)}], lr=lr
    )


def _build(seed: int, lr: float = 0.01) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = fully_shard(TinyGPT(), ModuleWrapPolicy({Block}))
    return model, _adam(model, lr)


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = gpt_loss(model, local_slice(gpt_batch(step, GLOBAL_BATCH), dist.get_rank(), dist.get_world_size()))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(global_mean(loss))
    return losses


# ---------------------------------------------------------------------------- FULL
def full_resume(path: str) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = TinyGPT()
    ref_optim = _adam(ref)
    model, optim = _build(0)
    for step in range(2):
        gpt_loss(ref, gpt_batch(step, GLOBAL_BATCH)).backward()
        ref_optim.step()
        ref_optim.zero_grad()
    _train(model, optim, range(2))
    osd = optim_state_dict(model, optim)
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "optim": osd}, os.path.join(path, "full.pt"))
    else:
        model.state_dict()  # a collective
    dist.barrier()
    ref_fqn = {id(p): n for n, p in ref.named_parameters()}
    ref_osd = {ref_fqn[id(p)]: s for p, s in ref_optim.state.items()}
    continued = _train(model, optim, range(2, 4))

    fresh, fresh_optim = _build(1, lr=1.0)  # other values and hyperparameters: the checkpoint must win
    ck = torch.load(os.path.join(path, "full.pt"), weights_only=True)
    fresh.load_state_dict(ck["model"])
    fresh_optim.load_state_dict(optim_state_dict_to_load(fresh, fresh_optim, ck["optim"]))
    return {
        "state_keys": list(osd["state"]) == [f for g in osd["param_groups"] for f in g["params"]],
        "group_fqns": osd["param_groups"][0]["params"],
        "hyper": [(g["lr"], g["weight_decay"], g["betas"]) for g in osd["param_groups"]],
        "shapes": all(osd["state"][k]["exp_avg"].shape == s["exp_avg"].shape for k, s in ref_osd.items()),
        "max_diff": max(
            (osd["state"][k][key] - s[key]).abs().max().item() for k, s in ref_osd.items() for key in s if key != "step"
        ),
        "steps": {float(s["step"]) for s in osd["state"].values()},
        "loaded_hyper": [(g["lr"], g["betas"]) for g in fresh_optim.param_groups],
        "continued": continued,
        "resumed": _train(fresh, fresh_optim, range(2, 4)),
    }


def test_full_optim_state_dict_resumes(dist_run, tmp_path) -> None:
    for r in dist_run(2, full_resume, str(tmp_path)):
        assert r["state_keys"] and r["shapes"]
        assert r["group_fqns"] == [
            "blocks.0.attn.in_proj_weight",
            "blocks.0.fc1.weight",
            "blocks.0.fc2.weight",
        ]
        assert r["hyper"] == [(0.01, 0.1, (0.9, 0.999)), (0.005, 0, (0.8, 0.9))]
        assert r["max_diff"] < 1e-6, r["max_diff"]  # gathered state equals the unsharded optimizer's
        assert r["steps"] == {2.0}
        assert r["loaded_hyper"] == [(0.01, (0.9, 0.999)), (0.005, (0.8, 0.9))]
        assert r["resumed"] == r["continued"]


# ---------------------------------------------------------------------------- SHARDED / DCP
def sharded_save(path: str) -> dict[str, Any]:
    model, optim = _build(0)
    _train(model, optim, range(2))
    with state_dict_type(model, SHARDED):
        osd = optim_state_dict(model, optim)
        dcp.save({"model": model.state_dict(), "optim": osd}, checkpoint_id=os.path.join(path, "dcp"))
    state = osd["state"]["blocks.0.fc1.weight"]
    return {
        "exp_avg": (type(state["exp_avg"]).__name__, tuple(state["exp_avg"].shape), str(state["exp_avg"].placements)),
        "step": type(state["step"]).__name__,
        "continued": _train(model, optim, range(2, 4)),
    }


def sharded_resume(path: str) -> list[float]:
    model, optim = _build(1, lr=1.0)
    init_optim_state(optim)
    with state_dict_type(model, SHARDED):
        sd = {"model": model.state_dict(), "optim": optim_state_dict(model, optim)}
        dcp.load(sd, checkpoint_id=os.path.join(path, "dcp"))
        model.load_state_dict(sd["model"])
        optim.load_state_dict(optim_state_dict_to_load(model, optim, sd["optim"]))
    assert [g["lr"] for g in optim.param_groups] == [0.01, 0.005]
    return _train(model, optim, range(2, 4))


def test_sharded_optim_state_dict_resumes_at_any_world_size(dist_run, tmp_path) -> None:
    saved = dist_run(2, sharded_save, str(tmp_path))
    assert saved[0]["exp_avg"] == ("DTensor", (64, 16), "(Shard(dim=0),)")
    assert saved[0]["step"] == "Tensor"
    continued = saved[0]["continued"]
    assert dist_run(2, sharded_resume, str(tmp_path))[0] == continued  # same world size: bit for bit
    for world in (1, 4):
        resumed = dist_run(world, sharded_resume, str(tmp_path))[0]
        assert torch.allclose(torch.tensor(resumed), torch.tensor(continued), rtol=1e-5, atol=1e-6), (world, resumed)


# ---------------------------------------------------------------------------- flat parameters
def flat_and_orig_agree() -> dict[str, Any]:
    torch.manual_seed(0)
    ref = TinyGPT()
    wrapper = FullyShardedDataParallel(copy.deepcopy(ref), auto_wrap_policy=ModuleWrapPolicy({Block}))
    composable = fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({Block}))
    w_optim = torch.optim.Adam(wrapper.parameters(), lr=0.01)
    c_optim = torch.optim.Adam(composable.parameters(), lr=0.01)
    _train(wrapper, w_optim, range(2))
    _train(composable, c_optim, range(2))
    w_osd = FullyShardedDataParallel.optim_state_dict(wrapper, w_optim)
    c_osd = optim_state_dict(composable, c_optim)
    same = set(w_osd["state"]) == set(c_osd["state"]) and all(
        torch.allclose(w_osd["state"][k][key], v, atol=1e-7) for k, s in c_osd["state"].items() for key, v in s.items()
    )
    # the composable (original-parameter) checkpoint loads into a fresh wrapper's flat-parameter optimizer
    torch.manual_seed(1)
    other = FullyShardedDataParallel(TinyGPT(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    other_optim = torch.optim.Adam(other.parameters(), lr=0.5)
    other.load_state_dict(composable.state_dict())
    other_optim.load_state_dict(FullyShardedDataParallel.optim_state_dict_to_load(other, other_optim, c_osd))
    back = FullyShardedDataParallel.optim_state_dict(other, other_optim)
    roundtrip = all(
        torch.equal(back["state"][k][key], v) for k, s in c_osd["state"].items() for key, v in s.items()
    ) and set(back["param_groups"][0]["params"]) == set(c_osd["param_groups"][0]["params"])
    with FullyShardedDataParallel.state_dict_type(other, SHARDED):
        sharded = other.state_dict()
    return {
        "same": same,
        "roundtrip": roundtrip,
        "sharded_keys": list(sharded) == list(ref.state_dict())
        and all(isinstance(v, DTensor) for v in sharded.values()),
        "flat_params": sum(type(p).__name__ == "FlatParameter" for p in other.parameters()),
        "continue": _train(other, other_optim, range(2, 3)) == _train(composable, c_optim, range(2, 3)),
    }


def test_flat_parameter_mode_speaks_fqns(dist_run) -> None:
    for r in dist_run(2, flat_and_orig_agree):
        assert r == {"same": True, "roundtrip": True, "sharded_keys": True, "flat_params": 3, "continue": True}, r


# ---------------------------------------------------------------------------- errors
def _moved(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The param groups with the first group's last parameter moved to the second group."""
    first, second = dict(groups[0]), dict(groups[1])
    first["params"], second["params"] = first["params"][:-1], [*second["params"], first["params"][-1]]
    return [first, second, *groups[2:]]


def optim_errors() -> dict[str, str]:
    model, optim = _build(0)
    _train(model, optim, range(1))
    osd = optim_state_dict(model, optim)
    errors = {}
    cases = {
        "unknown": lambda: optim_state_dict_to_load(
            model, optim, {**osd, "state": {**osd["state"], "blocks.0.nope": {}}}
        ),
        "groups": lambda: optim_state_dict_to_load(model, optim, {**osd, "param_groups": _moved(osd["param_groups"])}),
        "n_groups": lambda: optim_state_dict_to_load(model, optim, {**osd, "param_groups": osd["param_groups"][:1]}),
        "not_osd": lambda: optim_state_dict_to_load(model, optim, [1, 2]),  # type: ignore[arg-type]
        "not_optim": lambda: optim_state_dict(model, "adam"),  # type: ignore[arg-type]
        "foreign": lambda: optim_state_dict(model, torch.optim.SGD([nn.Parameter(torch.zeros(2, 3))], lr=0.1)),
    }
    for name, call in cases.items():
        try:
            call()
        except (TypeError, ValueError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    with state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        try:
            optim_state_dict(model, optim)
        except ValueError as e:
            errors["local"] = f"{type(e).__name__}: {e}"
    return errors


def test_optim_state_dict_errors(dist_run) -> None:
    e = dist_run(1, optim_errors)[0]
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        e["unknown"],
        """ValueError: the optimizer state dict has state for ['blocks.0.nope'], which the optimizer does not hold (unknown FQNs, or parameters left out of it); load a checkpoint of the same model and param groups""",  # noqa: E501
    )
    tc.assertExpectedInline(
        e["groups"],
        """ValueError: param group 0 differs from every param group of the checkpoint; against the closest, group 0: parameters only in the optimizer: ['blocks.0.fc2.weight'], only in the checkpoint: []. Build the optimizer with the same param groups (listed in any order)""",  # noqa: E501
    )
    tc.assertExpectedInline(
        e["n_groups"],
        """ValueError: the checkpoint has 1 param groups but the optimizer has 2; build the optimizer with the same param groups as the one that was saved""",  # noqa: E501
    )
    tc.assertExpectedInline(
        e["not_osd"],
        """TypeError: optim_state_dict_to_load argument 'optim_state_dict' must be a dict with 'state' and 'param_groups', as optim_state_dict returns; got list""",  # noqa: E501
    )
    tc.assertExpectedInline(
        e["not_optim"], """TypeError: optim_state_dict argument 'optim' must be a torch.optim.Optimizer, got str"""
    )
    tc.assertExpectedInline(
        e["foreign"],
        """ValueError: optimizer parameter #0 (shape (2, 3)) is not a parameter of this module; build the optimizer from module.parameters() after fully_shard, and pass the same module here""",  # noqa: E501
    )
    tc.assertExpectedInline(
        e["local"],
        """ValueError: optim_state_dict does not support StateDictType.LOCAL_STATE_DICT; use FULL_STATE_DICT (full tensors) or SHARDED_STATE_DICT (DTensors for torch.distributed.checkpoint)""",  # noqa: E501
    )


# ---------------------------------------------------------------------------- issue 13: tied weights, orders
class _SharedAcrossUnits(nn.Module):
    """A weight tied between two units' modules: it belongs to their common ancestor's unit, and the
    module that registers it first in traversal order (``dec``) is not the one defined first."""

    def __init__(self) -> None:
        super().__init__()
        self.dec = nn.Sequential(Block(8), nn.Linear(8, 11, bias=False))
        self.enc = nn.Embedding(11, 8)
        self.enc.weight = self.dec[1].weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.dec(self.enc(idx))


def tied_names() -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    torch.manual_seed(0)
    models = {
        "tied_gpt": fully_shard(TinyGPT(tied=True), ModuleWrapPolicy({Block})),
        "shared": fully_shard(_SharedAcrossUnits(), ModuleWrapPolicy({Block})),
    }
    out = {}
    for name, model in models.items():
        optim = torch.optim.Adam(model.parameters(), lr=0.01)
        model(torch.randint(0, 11, (2, 8))).sum().backward()
        optim.step()
        names = [n for n, _ in model.named_parameters()]
        ours = optim_state_dict(model, optim)
        theirs = get_optimizer_state_dict(model, optim)
        out[name] = (names, list(ours["state"]), list(theirs["state"]), ours["param_groups"][0]["params"])
    return out


def test_tied_weight_optimizer_state_is_keyed_by_named_parameters(dist_run) -> None:
    """Issue 13: the optimizer state of a tied weight is keyed by the FQN named_parameters() gives it
    (upstream: test_fsdp_optim_state.py, test_optim_state_dict_nested / the name-based rekeying of
    test_rekey_optim_state_dict_to_names), and torch's get_optimizer_state_dict uses the same key."""
    for world in (1, 2):
        for name, (names, ours, theirs, group) in dist_run(world, tied_names)[0].items():
            assert sorted(ours) == sorted(names) == sorted(theirs) == sorted(group), (world, name, ours, names)


def orders(path: str) -> dict[str, Any]:
    """Save from fully_shard with a policy, each rank listing the parameters in another order; load
    into the wrapper's flat parameters and into fully_shard without a policy, other orders again."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = TinyGPT()
    ref_optim = torch.optim.Adam(ref.parameters(), lr=0.01)
    model = fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({Block}))
    params = list(model.parameters())
    optim = torch.optim.Adam(params[::-1] if rank % 2 else params[rank:] + params[:rank], lr=0.01)
    for step in range(2):
        gpt_loss(ref, gpt_batch(step, GLOBAL_BATCH)).backward()
        ref_optim.step()
        ref_optim.zero_grad()
    _train(model, optim, range(2))
    osd = optim_state_dict(model, optim)
    names = {id(p): n for n, p in ref.named_parameters()}
    ref_osd = {names[id(p)]: s for p, s in ref_optim.state.items()}
    out: dict[str, Any] = {
        "saved": max((osd["state"][k][key] - s[key]).abs().max().item() for k, s in ref_osd.items() for key in s)
    }
    with state_dict_type(model, SHARDED):
        sharded = optim_state_dict(model, optim)
        dcp.save({"optim": sharded}, checkpoint_id=os.path.join(path, "orders"))
    continued = _train(model, optim, range(2, 4))
    # the wrapper (flat parameters) and a policy-less fully_shard, each rank in yet another order
    wrapper = FullyShardedDataParallel(copy.deepcopy(ref), auto_wrap_policy=ModuleWrapPolicy({Block}))
    w_optim = torch.optim.Adam(list(wrapper.parameters())[:: -1 if rank % 2 == 0 else 1], lr=0.5)
    whole = fully_shard(copy.deepcopy(ref))
    whole_params = list(whole.parameters())
    h_optim = torch.optim.Adam(whole_params[rank:] + whole_params[:rank], lr=0.5)
    init_optim_state(h_optim)
    with state_dict_type(whole, SHARDED):
        template = {"optim": optim_state_dict(whole, h_optim)}
        dcp.load(template, checkpoint_id=os.path.join(path, "orders"))
        h_optim.load_state_dict(optim_state_dict_to_load(whole, h_optim, template["optim"]))
    w_optim.load_state_dict(FullyShardedDataParallel.optim_state_dict_to_load(wrapper, w_optim, osd))
    back = optim_state_dict(whole, h_optim)
    out["whole"] = max((back["state"][k][key] - s[key]).abs().max().item() for k, s in ref_osd.items() for key in s)
    back = FullyShardedDataParallel.optim_state_dict(wrapper, w_optim)
    out["wrapper"] = max((back["state"][k][key] - s[key]).abs().max().item() for k, s in ref_osd.items() for key in s)
    out["continued"] = continued
    return out


def test_optimizer_state_between_wrappings_with_per_rank_orders(dist_run, tmp_path) -> None:
    """Issue 13: converting optimizer state between different wrappings when ranks list the optimizer's
    parameters in different orders is correct, never a process abort (upstream: test_fsdp_optim_state.py,
    test_shard_full_optim_state_dict_nested and test_use_orig_params, which rekey between wrappings)."""
    for world in (2, 4):
        for r in dist_run(world, orders, str(tmp_path / str(world))):
            assert r["saved"] < 1e-6 and r["whole"] < 1e-6 and r["wrapper"] < 1e-6, (world, r)
