"""The first save of a script ported from torch FSDP1, as written: torch's ``FullStateDictConfig()`` with
``FullOptimStateDictConfig()`` (whose defaults differ: the optimizer state offloaded, the model's not),
``fsdp_modules(model)`` after an auto-wrap policy, ``scatter_full_optim_state_dict`` without ``optim``.
Each checked against the unsharded model and its optimizer on the same batches."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist
from models import OddMLP, mlp_batch, mlp_loss
from torch import nn
from torch.distributed.fsdp import FullOptimStateDictConfig as TorchFullOptim
from torch.distributed.fsdp import FullStateDictConfig as TorchFull
from torch.distributed.fsdp import StateDictType as TorchType

from fsdp_composable import FullyShardedDataParallel as FSDP
from fsdp_composable import ModuleWrapPolicy, OptimStateKeyType

POLICY = ModuleWrapPolicy({nn.Linear})


def _trained(flat: bool) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer]:
    """The wrapper (FSDP1's default flat parameters, or not) and the plain model after two Adam steps."""
    torch.manual_seed(0)
    ref = OddMLP()
    model = FSDP(copy.deepcopy(ref), auto_wrap_policy=POLICY, use_orig_params=not flat)
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=0.01), torch.optim.Adam(ref.parameters(), lr=0.01)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(2):
        batch = mlp_batch(step, 2 * world)
        for m, o, b in ((model, opt, tuple(t[rank * 2 : rank * 2 + 2] for t in batch)), (ref, ref_opt, batch)):
            mlp_loss(m, b).backward()  # type: ignore[arg-type]
            o.step()
            o.zero_grad()
    return model, opt, ref, ref_opt


def _optim_diff(osd: dict[str, Any], ref: nn.Module, ref_opt: torch.optim.Optimizer) -> float:
    names = [n for n, _ in ref.named_parameters()]
    ref_state = ref_opt.state_dict()["state"]
    return max(
        float((osd["state"][names[i]][k] - ref_state[i][k]).abs().max())
        for i in ref_state
        for k in ("exp_avg", "exp_avg_sq")
    )


def first_save(how: str) -> dict[str, Any]:
    model, opt, ref, ref_opt = _trained(flat=True)
    optim_config = TorchFullOptim(rank0_only=True)  # observable on the CPU, unlike offload_to_cpu
    if how == "defaults":  # torch's defaults: offload_to_cpu False (model) and True (optimizer)
        FSDP.set_state_dict_type(model, TorchType.FULL_STATE_DICT, TorchFull(), TorchFullOptim())
        sd, osd = model.state_dict(), FSDP.optim_state_dict(model, opt)
        settings = FSDP.get_state_dict_type(model).optim_state_dict_config
    elif how == "set":
        FSDP.set_state_dict_type(model, TorchType.FULL_STATE_DICT, TorchFull(), optim_config)
        sd, osd = model.state_dict(), FSDP.optim_state_dict(model, opt)
        settings = FSDP.get_state_dict_type(model).optim_state_dict_config
    else:
        with FSDP.state_dict_type(model, TorchType.FULL_STATE_DICT, TorchFull(), optim_config):
            sd, osd = model.state_dict(), FSDP.optim_state_dict(model, opt)
        settings = None
    ref_sd = ref.state_dict()
    out: dict[str, Any] = {
        "model_keys": sorted(sd) == sorted(ref_sd),
        "model_diff": max(float((sd[k] - ref_sd[k]).abs().max()) for k in ref_sd),
        "optim_keys": sorted(osd),
        "settings": repr(settings),
    }
    if osd:
        out["optim_diff"] = _optim_diff(osd, ref, ref_opt)
    # after the context (or the setting), plain saves are back to / stay as set
    out["after"] = sorted(FSDP.optim_state_dict(model, opt))
    return out


def test_fsdp1_default_configs_mix(dist_run: Callable[..., Any]) -> None:
    for r in dist_run(2, first_save, "defaults"):
        assert r["model_keys"] and r["model_diff"] < 1e-6, r
        assert r["optim_keys"] == ["param_groups", "state"] and r["optim_diff"] < 1e-6, r
        assert r["settings"] == "FullStateDictConfig(offload_to_cpu=True, rank0_only=False)", r


def test_fsdp1_optim_config_followed(dist_run: Callable[..., Any]) -> None:
    for how in ("set", "context"):
        for rank, r in enumerate(dist_run(2, first_save, how)):
            # the model's config (every rank) and the optimizer's (rank 0 only) each followed
            assert r["model_keys"] and r["model_diff"] < 1e-6, (how, r)
            assert r["optim_keys"] == (["param_groups", "state"] if rank == 0 else []), (how, r)
            if rank == 0:
                assert r["optim_diff"] < 1e-6, (how, r)
            if how == "set":
                assert r["settings"] == "FullStateDictConfig(offload_to_cpu=True, rank0_only=True)", r
                assert r["after"] == r["optim_keys"], r
            else:
                assert r["after"] == ["param_groups", "state"], r


def units_listed() -> dict[str, Any]:
    model = FSDP(OddMLP(), auto_wrap_policy=POLICY)
    names = {id(m): n for n, m in model.named_modules()}
    nested = FSDP(nn.Sequential(FSDP(nn.Linear(3, 3)), nn.Linear(3, 3)))
    return {
        "all": [names[id(m)] for m in FSDP.fsdp_modules(model)],
        "roots": [names[id(m)] for m in FSDP.fsdp_modules(model, root_only=True)],
        "nested": [type(m).__name__ for m in FSDP.fsdp_modules(nested)],
        "nested_roots": len(FSDP.fsdp_modules(nested, root_only=True)),
    }


def test_fsdp_modules_lists_every_unit(dist_run: Callable[..., Any]) -> None:
    for r in dist_run(2, units_listed):
        w = "_fsdp_wrapped_module."
        # FSDP1 lists the root and one wrapper per Linear, in this order
        assert r["all"] == ["", w + "l1", w + "l2.0", w + "l2.2", w + "l3"], r
        assert r["roots"] == [""], r
        assert r["nested"] == ["FullyShardedDataParallel", "FullyShardedDataParallel"], r
        assert r["nested_roots"] == 1, r


def scatter_without_optim(flat: bool) -> float:
    """Rank 0's plain optimizer state dict, scattered to a fresh wrapper without ``optim=`` and loaded
    into an optimizer built over ``model.parameters()``: its full state equals the plain optimizer's."""
    _, _, ref, ref_opt = _trained(flat)
    fresh = FSDP(OddMLP(), auto_wrap_policy=POLICY, use_orig_params=not flat)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    by_name = FSDP.rekey_optim_state_dict(ref_opt.state_dict(), OptimStateKeyType.PARAM_NAME, ref)
    # keyed by FQN, as full_optim_state_dict gives it (FSDP1's flat parameters have no plain positions)
    osd = by_name if dist.get_rank() == 0 else None
    fresh_opt.load_state_dict(FSDP.scatter_full_optim_state_dict(osd, fresh))
    full = FSDP.full_optim_state_dict(fresh, fresh_opt, rank0_only=False)
    other = FSDP(OddMLP(), auto_wrap_policy=POLICY, use_orig_params=not flat)
    other_opt = torch.optim.Adam(other.parameters(), lr=0.01)
    other_opt.load_state_dict(FSDP.shard_full_optim_state_dict(by_name, other))  # FSDP1: optim optional too
    again = FSDP.full_optim_state_dict(other, other_opt, rank0_only=False)
    return max(_optim_diff(full, ref, ref_opt), _optim_diff(again, ref, ref_opt))


def test_scatter_full_optim_state_dict_without_optim(dist_run: Callable[..., Any]) -> None:
    for flat in (False, True):
        for diff in dist_run(2, scatter_without_optim, flat):
            assert diff < 1e-6, (flat, diff)
