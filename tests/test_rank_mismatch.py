"""Ranks that disagree get an error on every rank: never a gloo abort, a hang, or silently wrong data.

Each scenario runs on a pool of 2 gloo ranks whose process group times out after a few seconds, so a
collective waiting for a rank that never comes fails fast. Before [Note: collective headers] most of
these killed a rank ("terminate called ... Received data size doesn't match expected size"): the
pool then sees a rank vanish and the test fails on its timeout.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Iterator

import expecttest
import pytest
import torch
import torch.distributed as dist
from harness import DistPool, free_port
from models import Block, TinyGPT, gpt_batch, gpt_loss
from parity import local_slice
from torch import nn

from fsdp_composable import (
    ModuleWrapPolicy,
    clip_grad_norm_,
    fully_shard,
    optim_state_dict,
    optim_state_dict_to_load,
    unshard_params,
)

TESTS = os.path.dirname(os.path.abspath(__file__))
PG_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def pool() -> Iterator[DistPool]:
    p = DistPool(2, pg_timeout_s=PG_TIMEOUT_S)
    yield p
    p.close()


def _errors(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    loss = gpt_loss(model, local_slice(gpt_batch(step, 4), dist.get_rank(), 2))
    loss.backward()
    opt.step()
    opt.zero_grad()


# ---------------------------------------------------------------------------- structure (first iteration)
def _structure(kind: str) -> str:
    torch.manual_seed(0)
    model = TinyGPT()
    policy: Any = ModuleWrapPolicy({Block})
    if dist.get_rank() == 1:
        if kind == "width":
            model.blocks[1].fc1, model.blocks[1].fc2 = nn.Linear(16, 65), nn.Linear(65, 16)
        else:  # the same number of units, other modules
            blocks0, head = model.blocks[0], model.head
            policy = lambda m: m is blocks0 or m is head  # noqa: E731
    fully_shard(model, policy)
    return _errors(lambda: gpt_loss(model, gpt_batch(0, 2)).backward())


def test_layer_of_another_width_on_one_rank(pool: DistPool) -> None:
    r0, r1 = pool.run(_structure, "width", timeout=60)
    assert r0 == r1
    expecttest.TestCase().assertExpectedInline(
        r0,
        """ExecutionOrderError: fully_shard: ranks built unit 'blocks.1' differently (position 2 of the forward in iteration 0; rank(s) [1] differ from rank 0): rank 0: unit 'blocks.1' of 3,216 elements, parameter 5: blocks.1.fc1.weight [64, 16] float32; rank 1: unit 'blocks.1' of 3,250 elements, parameter 5: blocks.1.fc1.weight [65, 16] float32. Every rank must build the same model and apply the same policy (same units, same parameter shapes and dtypes)""",  # noqa: E501
    )


def test_another_policy_with_as_many_units_on_one_rank(pool: DistPool) -> None:
    r0, r1 = pool.run(_structure, "policy", timeout=60)
    assert r0 == r1
    expecttest.TestCase().assertExpectedInline(
        r0,
        """ExecutionOrderError: fully_shard: ranks built unit '<root>' differently (position 0 of the forward in iteration 0; rank(s) [1] differ from rank 0): rank 0: unit '<root>' of 1,344 elements, parameter 4: head.weight [37, 16] float32; rank 1: unit '<root>' of 3,968 elements, parameter 4: blocks.1.ln1.weight [16] float32. Every rank must build the same model and apply the same policy (same units, same parameter shapes and dtypes)""",  # noqa: E501
    )
