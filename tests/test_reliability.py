"""Divergence is diagnosed, not hung; failures are named; order changes warn once."""

from __future__ import annotations

import os
import re
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import expecttest
import pytest
import torch
import torch.distributed as dist
from forked_scripts import Finished, PreloadedPool
from harness import free_port
from models import Block, Branchy, TinyGPT, gpt_batch, gpt_loss
from torch import nn

from fsdp_composable import ModuleWrapPolicy, fully_shard
from fsdp_composable._common_utils import TrainingState

TESTS = os.path.dirname(os.path.abspath(__file__))


def divergent(kind: str) -> dict:
    torch.manual_seed(0)
    model = Branchy()
    fully_shard(model, lambda m: isinstance(m, nn.Linear))
    if dist.get_rank() == 1:
        model.order = [0, 2, 1] if kind == "swap" else [0, 1]
    try:
        model(torch.randn(2, 4)).sum().backward()
        message = ""
    except RuntimeError as e:
        message = str(e)
    state = fully_shard.state(model)
    return {"message": message, "idle": state.training_state is TrainingState.IDLE}


def test_divergent_order_raises_on_every_rank(dist_run) -> None:
    r0, r1 = dist_run(2, divergent, "swap", timeout=60)
    assert r0["message"] == r1["message"] and r0["idle"] and r1["idle"]
    expecttest.TestCase().assertExpectedInline(
        r0["message"],
        """fully_shard: ranks disagree on the unit to run at position 1 of the forward in iteration 0 (rank 0: 'blocks.1'; rank 1: 'blocks.2'). Every rank must run the same modules in the same order; look for data-dependent branches or modules skipped on some ranks""",  # noqa: E501
    )


def test_rank_skipping_a_unit_raises_instead_of_hanging(dist_run) -> None:
    r0, r1 = dist_run(2, divergent, "skip", timeout=60)
    assert r0["message"] == r1["message"]
    expecttest.TestCase().assertExpectedInline(
        r0["message"],
        """fully_shard: ranks disagree on the unit to run at position 2 of the forward in iteration 0 (rank 0: 'blocks.2'; rank 1: <end of forward>). Every rank must run the same modules in the same order; look for data-dependent branches or modules skipped on some ranks""",  # noqa: E501
    )


def order_change_warns_once() -> list:
    torch.manual_seed(0)
    model = Branchy()
    fully_shard(model, lambda m: isinstance(m, nn.Linear))
    model(torch.randn(2, 4)).sum().backward()
    model.order = [0, 2, 1]  # same on every rank: legitimate, but prefetching would be off
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
    return [str(w.message) for w in caught if "fully_shard" in str(w.message)]


def test_order_change_after_first_iteration_warns_once(dist_run) -> None:
    messages = dist_run(2, order_change_warns_once)[0]
    assert len(messages) == 1
    expecttest.TestCase().assertExpectedInline(
        messages[0],
        """fully_shard: in iteration 1, unit 'blocks.2' ran at forward position 1 where the first iteration ran 'blocks.1'. Prefetching follows the first iteration's order, so it may fetch the wrong unit (this is expected for eval vs train; warned once)""",  # noqa: E501
    )


@pytest.fixture(scope="module")
def servers() -> Iterator[PreloadedPool]:
    """Two interpreters that imported torch and the package already: each job's two ranks are forked
    from them (see [Note: docs examples in forked interpreters])."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(TESTS), os.environ.get("PYTHONPATH", "")]))
    with PreloadedPool(env, 2) as pool:
        yield pool


def _run_dead_rank_job(servers: PreloadedPool, *args: str) -> tuple[list[Finished], list[tuple[str, str]], float]:
    port = free_port()
    envs = [
        dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        for rank in range(2)
    ]
    script = Path(TESTS) / "dead_rank_job.py"
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as ranks:
        runs = [ranks.submit(servers.run, script, env, 120, args, out=Path(tempfile.mkdtemp())) for env in envs]
        procs = [run.result() for run in runs]
    return procs, [(p.stdout, p.stderr) for p in procs], time.monotonic() - start


def test_dead_rank_is_reported_by_the_survivor(servers: PreloadedPool) -> None:
    procs, outputs, elapsed = _run_dead_rank_job(servers)
    assert procs[1].returncode == 3
    assert procs[0].returncode not in (0, None), outputs[0]
    assert "finished without noticing" not in outputs[0][0]
    assert "fully_shard: the all-gather of unit 'blocks.1' did not complete" in outputs[0][1], outputs[0][1][-2000:]
    assert elapsed < 90


def test_rank_killed_during_state_dict_is_named_by_the_survivor(servers: PreloadedPool) -> None:
    """A rank SIGKILLed inside state_dict(): the survivor's error names state_dict() and the unit, within
    the process group timeout (15 s in the job)."""
    procs, outputs, elapsed = _run_dead_rank_job(servers, "state_dict")
    assert procs[1].returncode == -9
    assert procs[0].returncode not in (0, None), outputs[0]
    assert "finished without noticing" not in outputs[0][0]
    assert "fully_shard: the state_dict() all-gather of unit 'blocks.1' did not complete" in outputs[0][1], outputs[0][
        1
    ][-2000:]
    assert elapsed < 90


def test_rank_killed_during_optim_state_dict_is_named_by_the_survivor(servers: PreloadedPool) -> None:
    """A rank SIGKILLed inside optim_state_dict(), after the first unit's gather: the survivor gets a
    named error within the process group timeout (15 s in the job), never a hang."""
    procs, outputs, elapsed = _run_dead_rank_job(servers, "optim_state_dict")
    assert procs[1].returncode == -9
    assert procs[0].returncode not in (0, None), outputs[0]
    assert "finished without noticing" not in outputs[0][0]
    last = outputs[0][1].strip().splitlines()[-1]
    assert "CollectiveError: fully_shard: the optim_state_dict() all-gather of unit" in last, last
    assert "did not complete" in last and "optim_state_dict() is a collective" in last, last
    assert elapsed < 90


def test_rank_killed_in_the_optim_state_dict_check_is_named_by_the_survivor(servers: PreloadedPool) -> None:
    """A rank SIGKILLed inside optim_state_dict()'s first exchange (torch's all_gather_object), after the
    ranks agreed on it: the survivor's error names optim_state_dict() and its units, not only gloo's."""
    procs, outputs, elapsed = _run_dead_rank_job(servers, "optim_state_dict_check")
    assert procs[1].returncode == -9
    assert procs[0].returncode not in (0, None), outputs[0]
    assert "finished without noticing" not in outputs[0][0]
    last = outputs[0][1].strip().splitlines()[-1]
    gloo = re.search(r"did not complete: (.*)\. Another rank", last)
    assert gloo is not None, last
    expecttest.TestCase().assertExpectedInline(
        last.replace(gloo[1], "<gloo's error>"),
        """[rank0]: fsdp_composable.api.CollectiveError: fully_shard: the optim_state_dict() exchange for the optimizer state check (units '<root>', 'blocks.0', 'blocks.1') did not complete: <gloo's error>. Another rank probably died, hung, or ran different modules; check the other ranks' logs (the process group timeout bounds the wait); optim_state_dict() is a collective: it must be called on every rank""",  # noqa: E501
    )
    assert elapsed < 90


def stale_optimizers() -> dict:
    from fsdp_composable import FullyShardedDataParallel

    torch.manual_seed(0)
    batch = gpt_batch(0, 2)
    out: dict = {}
    # built before fully_shard: it holds the parameters fully_shard replaced by their faces, so its
    # first step is refused on every rank (never a silent no-op); one built after trains
    model = TinyGPT()
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    fully_shard(model, ModuleWrapPolicy({Block}))
    gpt_loss(model, batch).backward()
    try:
        early.step()
    except RuntimeError as e:
        out["early"] = str(e)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    # stepped before fully_shard: state of the full shape
    model = TinyGPT()
    adam = torch.optim.Adam(model.parameters())
    gpt_loss(model, batch).backward()
    adam.step()
    adam.zero_grad()
    fully_shard(model, ModuleWrapPolicy({Block}))
    gpt_loss(model, batch).backward()
    try:
        adam.step()
    except RuntimeError as e:
        out["stepped"] = str(e)
    # the wrapper trains flat parameters; an optimizer over the original ones would never move
    model = TinyGPT()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    gpt_loss(wrapped, batch).backward()
    try:
        sgd.step()
    except RuntimeError as e:
        out["flat"] = str(e)
    return out


def test_optimizer_built_before_fully_shard(dist_run) -> None:
    r, r1 = dist_run(2, stale_optimizers)
    assert r == r1  # refused on every rank
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        r["early"],
        """the optimizer holds parameter 'pos' as it was before fully_shard: fully_shard registers a new DTensor parameter in its place, which the optimizer would never step. Build the optimizer after fully_shard, from model.parameters(), while no step is open (a step that raised in backward stays open, its units registering these parameters, until the next forward or an entry point such as unshard_params)""",  # noqa: E501
    )
    tc.assertExpectedInline(
        r["stepped"],
        """the optimizer holds parameter 'pos' as it was before fully_shard: fully_shard registers a new DTensor parameter in its place, which the optimizer would never step. Build the optimizer after fully_shard, from model.parameters(), while no step is open (a step that raised in backward stays open, its units registering these parameters, until the next forward or an entry point such as unshard_params)""",  # noqa: E501
    )
    tc.assertExpectedInline(
        r["flat"],
        """the optimizer holds original parameter 'pos', but FullyShardedDataParallel(use_orig_params=False) trains flat parameters: build the optimizer after wrapping, from model.parameters() (or pass use_orig_params=True)""",  # noqa: E501
    )
