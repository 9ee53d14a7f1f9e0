"""A sharded model the user drops is freed: its modules, parameters and flat buffers go with the last
reference, as an unsharded model's do (before, the registry's weak map from module to state held the
state, the state its module, so no sharded model was ever freed: a process that built models one
after another, a notebook or a test suite, kept every one of them).

Each case builds a model, uses a feature (training with AdamW, state dicts, checkpointing, a
communication hook, the wrapper class, a failed step, several modules as one unit), drops every
reference and collects: weak references to the model and to each unit's flat parameter must be dead.
"""

from __future__ import annotations

import gc
import weakref
from typing import Callable

import torch
import torch.distributed as dist
from models import Block, TinyGPT, gpt_batch, gpt_loss
from parity import local_slice
from torch import nn
from torch.distributed.algorithms._comm_hooks import default_hooks
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

import fsdp_composable as fc
from fsdp_composable import ModuleWrapPolicy, fully_shard
from fsdp_composable._common_utils import _get_fsdp_states


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return local_slice(gpt_batch(step, 4 * dist.get_world_size()), dist.get_rank(), dist.get_world_size())


def _train(model: nn.Module, steps: int = 2) -> torch.optim.Optimizer:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        gpt_loss(model, _batch(step)).backward()
        optim.step()
        optim.zero_grad()
    return optim


def _trained(model: nn.Module) -> None:
    optim = _train(model)
    model.state_dict()
    with fc.state_dict_type(model, fc.StateDictType.SHARDED_STATE_DICT):
        model.load_state_dict(model.state_dict())
    optim.load_state_dict(fc.optim_state_dict_to_load(model, optim, fc.optim_state_dict(model, optim)))
    with fc.summon_full_params(model):
        pass
    set_model_state_dict(model, get_model_state_dict(model))  # torch's own state-dict API
    model.to(torch.float64)  # a cast after sharding rebuilds the flat buffers
    _train(model, steps=1)


def _checkpointed_with_hook(model: nn.Module) -> None:
    fc.register_comm_hook(model, default_hooks.DefaultState(dist.group.WORLD), default_hooks.reduce_scatter_hook)
    _train(model)


def _trained_only(model: nn.Module) -> None:
    _train(model)


def _failed_step(model: nn.Module) -> None:
    _train(model, steps=1)
    try:
        model(torch.zeros(2, 99, dtype=torch.long))  # longer than the model's positions: raises in forward
    except Exception:  # noqa: BLE001 - the failure is the case
        pass
    _train(model, steps=1)


def _build(case: str) -> nn.Module:
    torch.manual_seed(0)
    model = TinyGPT()
    if case == "checkpoint and comm hook":
        for block in model.blocks:
            fc.checkpoint(block)
    if case == "wrapper class":
        return fc.FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    if case == "list unit":
        fully_shard(list(model.blocks), None)
        return fully_shard(model, None)
    return fully_shard(model, ModuleWrapPolicy({Block}))


CASES: dict[str, Callable[[nn.Module], None]] = {
    "trained, state dicts, summoned, cast": _trained,
    "checkpoint and comm hook": _checkpointed_with_hook,
    "wrapper class": _trained_only,
    "failed step": _failed_step,
    "list unit": _trained_only,
}


def freed() -> dict[str, list[str]]:
    """Per case: what is still alive after the model and everything made with it were dropped."""
    out: dict[str, list[str]] = {}
    for case, use in CASES.items():
        model = _build(case)
        use(model)
        refs = {"model": weakref.ref(model)}
        refs.update({f"flat parameter {i}": weakref.ref(p) for i, p in enumerate(_flats(model))})
        del model
        gc.collect()
        out[case] = sorted(name for name, ref in refs.items() if ref() is not None)
    return out


def _flats(model: nn.Module) -> list[torch.Tensor]:
    return [h.flat_param for s in _get_fsdp_states(model) for h in s.handles]


def test_a_dropped_sharded_model_is_freed(dist_run) -> None:
    for r in dist_run(2, freed):
        assert r == {case: [] for case in CASES}, r
