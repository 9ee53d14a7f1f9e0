"""Optimizer state loaded with the same keys and shapes on every rank but other values on one rank
(each rank given another step's checkpoint, or one value changed): an error on every rank naming the
parameter, before anything is loaded; the optimizer keeps its state and training goes on."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import error_of
from models import Block, TinyGPT
from parity import train_gpt
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

from fsdp_composable import ModuleWrapPolicy, fully_shard, optim_state_dict, optim_state_dict_to_load

GLOBAL_BATCH = 4


def _snapshot(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    values = [v for s in optim.state.values() for v in s.values()]
    return [v.to_local().clone() if hasattr(v, "to_local") else v.clone() for v in values]


def load_other_values(how: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = fully_shard(TinyGPT(), ModuleWrapPolicy({Block}))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    full = how != "optimizer"
    train_gpt(model, optim, range(1), GLOBAL_BATCH)
    # optim.state_dict() holds the optimizer's live DTensors (torch's own): a checkpoint is a copy
    first = optim_state_dict(model, optim) if full else copy.deepcopy(optim.state_dict())
    train_gpt(model, optim, range(1, 2), GLOBAL_BATCH)
    second = optim_state_dict(model, optim) if full else copy.deepcopy(optim.state_dict())
    mine = first if dist.get_rank() == 0 else second  # each rank another step's checkpoint
    if how == "one value":  # the same step everywhere, one value changed on rank 1
        mine = second
        if dist.get_rank() == 1:
            mine["state"]["blocks.0.fc1.weight"]["exp_avg"] = mine["state"]["blocks.0.fc1.weight"]["exp_avg"] + 1
    before = _snapshot(optim)
    if how == "optimizer":
        message = error_of(lambda: optim.load_state_dict(mine))
    elif how == "torch":
        options = StateDictOptions(full_state_dict=True)
        message = error_of(lambda: set_optimizer_state_dict(model, optim, mine, options=options))
    else:
        message = error_of(lambda: optim.load_state_dict(optim_state_dict_to_load(model, optim, mine)))
    kept = all(torch.equal(a, b) for a, b in zip(before, _snapshot(optim)))
    train_gpt(model, optim, range(2, 3), GLOBAL_BATCH)
    return {"message": message, "kept": kept}


@pytest.mark.parametrize("how", ["optimizer", "ours", "torch", "one value"])
def test_optimizer_state_with_other_values_on_one_rank(dist_run, how) -> None:
    """optim.load_state_dict of optim.state_dict() (DTensors), optim_state_dict_to_load and torch's
    set_optimizer_state_dict of full state dicts: the same error on every rank, nothing loaded."""
    r0, r1 = dist_run(2, load_other_values, how)
    assert r0 == r1, (r0, r1)
    assert r0["kept"], r0
    assert r0["message"] == EXPECTED.format(*WHAT[how]), r0


EXPECTED = (
    "RuntimeError: fully_shard: optimizer.load_state_dict() got state for parameter '{}' with the same keys "
    "and shapes but different values on different ranks ({}): the ranks were given different checkpoints "
    "(another step's state on some rank?). Load the same checkpoint on every rank; nothing was loaded"
)
WHAT = {
    "optimizer": ("pos", "step: rank 0: 1.0, rank 1: 2.0"),  # DTensors: the step tells
    "ours": ("pos", "exp_avg differs; exp_avg_sq differs; step: rank 0: 1.0, rank 1: 2.0"),
    "torch": ("pos", "exp_avg differs; exp_avg_sq differs; step: rank 0: 1.0, rank 1: 2.0"),
    "one value": ("blocks.0.fc1.weight", "exp_avg differs"),
}
