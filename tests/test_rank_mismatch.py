"""Ranks that disagree get an error on every rank: never a gloo abort, a hang, or silently wrong data.

Each scenario runs on a pool of 2 gloo ranks whose process group times out after a few seconds, so a
collective waiting for a rank that never comes fails fast. Before [Note: collective headers] most of
these killed a rank ("terminate called ... Received data size doesn't match expected size"): the
pool then sees a rank vanish and the test fails on its timeout.
"""

from __future__ import annotations

import datetime
import os
import re
import time
from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
from harness import DistPool, error_of, shared_pool
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
def pool() -> DistPool:
    return shared_pool(2, pg_timeout_s=PG_TIMEOUT_S)


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
    return error_of(lambda: gpt_loss(model, gpt_batch(0, 2)).backward())


def test_layer_of_another_width_on_one_rank(pool: DistPool) -> None:
    r0, r1 = pool.run(_structure, "width", timeout=60)
    assert r0 == r1
    expecttest.TestCase().assertExpectedInline(
        r0,
        """ExecutionOrderError: fully_shard: ranks built unit 'blocks.1' differently (position 2 of the forward in iteration 0; rank(s) [1] differ from rank 0): rank 0: unit 'blocks.1' of 3,216 elements, parameter 5: blocks.1.fc1.weight [64, 16] float32; rank 1: unit 'blocks.1' of 3,266 elements, parameter 5: blocks.1.fc1.weight [65, 16] float32. Every rank must build the same model and apply the same policy (same units, same parameter shapes and dtypes)""",  # noqa: E501
    )


def test_another_policy_with_as_many_units_on_one_rank(pool: DistPool) -> None:
    r0, r1 = pool.run(_structure, "policy", timeout=60)
    assert r0 == r1
    expecttest.TestCase().assertExpectedInline(
        r0,
        """ExecutionOrderError: fully_shard: ranks built unit '<root>' differently (position 0 of the forward in iteration 0; rank(s) [1] differ from rank 0): rank 0: unit '<root>' of 1,376 elements, parameter 4: head.weight [37, 16] float32; rank 1: unit '<root>' of 3,984 elements, parameter 4: blocks.1.ln1.weight [16] float32. Every rank must build the same model and apply the same policy (same units, same parameter shapes and dtypes)""",  # noqa: E501
    )


# ---------------------------------------------------------------------------- one rank off the common path
def _reference(skipped: set[int], steps: int) -> dict[str, torch.Tensor]:
    """The unsharded model trained on the global batches of ``range(steps)`` minus ``skipped``."""
    torch.manual_seed(0)
    ref = TinyGPT()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(steps):
        if step not in skipped:
            gpt_loss(ref, gpt_batch(step, 4)).backward()
            opt.step()
            opt.zero_grad()
    return ref.state_dict()


def _sharded(forward_prefetch: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = fully_shard(TinyGPT(), ModuleWrapPolicy({Block}), forward_prefetch=forward_prefetch)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _max_diff(model: nn.Module, ref: dict[str, torch.Tensor]) -> float:
    sd = model.state_dict()
    return max((sd[k] - v).abs().max().item() for k, v in ref.items())


def _raise_alone(where: str) -> dict[str, Any]:
    """Rank 1 raises in step 1 (in a block's forward, or in backward) and carries on, as a training
    loop that catches errors would; rank 0 does nothing wrong."""
    rank = dist.get_rank()
    # with forward prefetch the next block's all-gather is in flight when rank 1 raises: its exchange
    # is refused on rank 1 after its payload was posted, while rank 0 completes it
    model, opt = _sharded(forward_prefetch=where == "forward with prefetch")
    fail = {"now": False}

    def forward_hook(module: nn.Module, args: Any) -> None:
        if fail["now"] and where.startswith("forward"):
            raise ValueError("a bad batch on rank 1")

    def grad_hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        # a module hook: the parameters between steps are faces, which backward never reaches
        if fail["now"] and where == "backward":
            raise ValueError("a bad gradient on rank 1")

    model.blocks[1].register_forward_pre_hook(forward_hook)
    model.blocks[0].fc1.register_full_backward_hook(grad_hook)
    errors = {}
    for step in range(4):
        fail["now"] = rank == 1 and step == 1
        message = error_of(lambda: _train_step(model, opt, step))  # noqa: B023 - called at once
        if message:
            opt.zero_grad()
            errors[step] = message
    return {"errors": errors, "diff": _max_diff(model, _reference({1}, 4))}


@pytest.mark.parametrize("where", ["forward", "forward with prefetch", "backward"])
def test_rank_raising_alone_after_first_iteration(pool: DistPool, where: str) -> None:
    """Every rank gets an error in the failed step, then all train on as if it never happened."""
    r0, r1 = pool.run(_raise_alone, where, timeout=60)
    assert list(r0["errors"]) == [1] and list(r1["errors"]) == [1], (r0, r1)
    assert "a bad" in r1["errors"][1]
    assert "rank(s) [1] raised an exception in this step and left it" in r0["errors"][1], r0
    assert r0["diff"] == r1["diff"], "the ranks hold different parameters"
    assert r0["diff"] < 1e-6, (r0, r1)


def _raise_in_loss_alone() -> dict[str, Any]:
    """Rank 1's forward completes in step 1 but its loss raises (after every forward collective), so
    it never runs that backward and goes on with step 2; rank 0 does nothing wrong."""
    rank = dist.get_rank()
    model, opt = _sharded()
    errors = {}
    for step in range(4):

        def train(step: int = step) -> None:
            idx, target = local_slice(gpt_batch(step, 4), rank, 2)
            logits = model(idx)
            if rank == 1 and step == 1:
                raise ValueError("a bad loss on rank 1")
            nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)).backward()
            opt.step()

        message = error_of(train)
        opt.zero_grad()
        if message:
            errors[step] = message
    return {"errors": errors, "diff": _max_diff(model, _reference({1}, 4))}


def test_rank_raising_after_its_forward_alone(pool: DistPool) -> None:
    """Every rank fails step 1, then all train on as if it never happened."""
    r0, r1 = pool.run(_raise_in_loss_alone, timeout=60)
    assert list(r0["errors"]) == [1] and list(r1["errors"]) == [1], (r0, r1)
    assert r1["errors"][1] == "ValueError: a bad loss on rank 1", r1
    step = int(re.findall(r"\(step (\d+)\)", r0["errors"][1])[0])
    expecttest.TestCase().assertExpectedInline(
        r0["errors"][1].replace(f"step {step}", "step N"),
        """RankMismatchError: fully_shard: the all-gather of unit 'blocks.1' was not run: rank(s) [1] raised an exception in this step and left it (rank 0: backward: an all-gather of 3,216 float32 elements (step N); rank 1: left step N (it raised an exception there)). Every rank abandons the step; the next one can run. See the failing rank's log for its exception""",  # noqa: E501
    )
    assert r0["diff"] == r1["diff"] and r0["diff"] < 1e-6, (r0, r1)


def _rank0_state_dict_then_train() -> dict[str, Any]:
    model, opt = _sharded()
    _train_step(model, opt, 0)
    if dist.get_rank() == 0:
        message = error_of(model.state_dict)
    else:
        message = error_of(lambda: _train_step(model, opt, 1))
        opt.zero_grad()
    for step in (2, 3):
        _train_step(model, opt, step)
    return {"message": message, "diff": _max_diff(model, _reference({1}, 4))}


def test_state_dict_on_one_rank_then_training(pool: DistPool) -> None:
    r0, r1 = pool.run(_rank0_state_dict_then_train, timeout=60)
    tc = expecttest.TestCase()
    # the step counts every forward this pool's process group has seen: only their difference matters
    base = min(int(n) for n in re.findall(r"\(step (\d+)\)", r0["message"]))
    for r in (r0, r1):
        r["message"] = re.sub(r"\(step (\d+)\)", lambda m: f"(step {int(m[1]) - base})", r["message"])
    tc.assertExpectedInline(
        r0["message"],
        """RankMismatchError: fully_shard: the state_dict() all-gather of unit '<root>' was not run: ranks reached different collectives (rank 0: state_dict(): an all-gather of 1,376 float32 elements (step 0); rank 1: forward: an all-gather of 1,376 float32 elements (step 1)). No rank completed it; state_dict() is a collective: it must be called on every rank. Every rank must run the same modules, steps and collective calls in the same order""",  # noqa: E501
    )
    tc.assertExpectedInline(
        r1["message"],
        """RankMismatchError: fully_shard: the all-gather of unit '<root>' was not run: ranks reached different collectives (rank 0: state_dict(): an all-gather of 1,376 float32 elements (step 0); rank 1: forward: an all-gather of 1,376 float32 elements (step 1)). No rank completed it; state_dict() is a collective: it must be called on every rank. Every rank must run the same modules, steps and collective calls in the same order""",  # noqa: E501
    )
    assert r0["diff"] < 1e-6 and r1["diff"] < 1e-6, (r0, r1)


def _extra_step() -> dict[str, Any]:
    model, opt = _sharded()
    steps = 3 if dist.get_rank() == 1 else 2
    messages = [error_of(lambda: _train_step(model, opt, step)) for step in range(steps)]  # noqa: B023
    if dist.get_rank() == 0:
        messages.append(error_of(model.state_dict))  # the end of training: save
    sd = model.state_dict()  # rank 0 tries again, rank 1 saves: the ranks are in step again
    return {"messages": messages, "sum": sum(v.double().sum().item() for v in sd.values())}


def test_one_rank_runs_an_extra_step(pool: DistPool) -> None:
    r0, r1 = pool.run(_extra_step, timeout=60)
    assert r0["messages"][:2] == ["", ""] and r1["messages"][:2] == ["", ""], (r0, r1)
    assert "rank 0: state_dict(): an all-gather" in r0["messages"][2], r0
    assert "rank 1: forward: an all-gather" in r0["messages"][2], r0
    assert "rank 0: state_dict(): an all-gather" in r1["messages"][2], r1
    assert r0["sum"] == r1["sum"]


# ---------------------------------------------------------------------------- entry points on one rank
def _entry_point_on_rank0(entry: str) -> str:
    model, opt = _sharded()
    _train_step(model, opt, 0)
    sd, osd = model.state_dict(), optim_state_dict(model, opt)
    if dist.get_rank() != 0:
        message = error_of(lambda: _train_step(model, opt, 1))
    elif entry == "load_state_dict":
        message = error_of(lambda: model.load_state_dict(sd))
    elif entry == "optim_state_dict":
        message = error_of(lambda: optim_state_dict(model, opt))
    elif entry == "optim_state_dict_to_load":
        message = error_of(lambda: optim_state_dict_to_load(model, opt, osd))
    elif entry == "clip_grad_norm_":
        message = error_of(lambda: clip_grad_norm_(model, 1.0))
    else:

        def summon() -> None:
            with unshard_params(model):
                pass

        message = error_of(summon)
    opt.zero_grad()
    _train_step(model, opt, 2)  # the ranks are in step again
    return message


@pytest.mark.parametrize(
    "entry", ["load_state_dict", "optim_state_dict", "optim_state_dict_to_load", "clip_grad_norm_", "unshard_params"]
)
def test_entry_point_on_one_rank_while_the_other_trains(pool: DistPool, entry: str) -> None:
    r0, r1 = pool.run(_entry_point_on_rank0, entry, timeout=60)
    for message in (r0, r1):
        assert f"{entry}() is a collective: it must be called on every rank" in message, message
        assert message.startswith("RankMismatchError: fully_shard: "), message


def _entry_point_alone() -> str:
    model, opt = _sharded()
    _train_step(model, opt, 0)
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        start = time.monotonic()
        message = error_of(model.state_dict)
        store.set("entry_point_alone_done", "1")
        return f"{message} after {time.monotonic() - start:.0f}s"
    # rank 1 never calls it: it waits (outside the group) until rank 0 gave up
    store.wait(["entry_point_alone_done"], datetime.timedelta(seconds=PG_TIMEOUT_S + 30))
    store.delete_key("entry_point_alone_done")
    return ""


def test_entry_point_on_one_rank_while_the_other_waits(pool: DistPool) -> None:
    r0, _ = pool.run(_entry_point_alone, timeout=60)
    pool.restart()  # rank 0's unanswered header is still queued for rank 1
    assert "state_dict() is a collective: it must be called on every rank" in r0, r0
    assert "fully_shard: the state_dict() all-gather of unit" in r0, r0
    assert float(r0.rsplit(" ", 1)[1][:-1]) < PG_TIMEOUT_S + 3, r0
