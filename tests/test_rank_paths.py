"""Ranks that run different units after the first iteration (a data-dependent branch taken differently),
whose units have the same size: an error on every rank naming each rank's unit, never one unit's
shard exchanged for another's (silently wrong parameters) or a hang, with forward prefetch on or off.

The first iteration's order check ([Note: execution order validation]) does not run later; the
collective headers carry the unit ([Note: the unit in the header]).
"""

from __future__ import annotations

import re
from typing import Any, Optional

import expecttest
import pytest
import torch
import torch.distributed as dist
from harness import DistPool, error_of, shared_pool
from models import Branchy
from torch import nn

from fsdp_composable import fully_shard

PG_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def pool() -> DistPool:
    return shared_pool(2, pg_timeout_s=PG_TIMEOUT_S)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    model(torch.randn(2, 4, generator=g)).sum().backward()
    opt.step()
    opt.zero_grad()


def _other_path(forward_prefetch: Optional[bool]) -> dict[str, Any]:
    """Iteration 0 runs every block on both ranks; in iteration 1 rank 0 runs blocks 0 and 1, rank 1
    blocks 0 and 2; then both run every block again."""
    torch.manual_seed(0)
    model = Branchy()
    fully_shard(model, lambda m: isinstance(m, nn.Linear), forward_prefetch=forward_prefetch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0)
    model.order = [0, 1] if dist.get_rank() == 0 else [0, 2]
    message = error_of(lambda: _step(model, opt, 1))
    opt.zero_grad()
    model.order = [0, 1, 2]
    after = error_of(lambda: _step(model, opt, 2))
    total = torch.tensor([sum(v.double().sum().item() for v in model.state_dict().values())], dtype=torch.float64)
    everyone = [torch.zeros(1, dtype=torch.float64) for _ in range(2)]
    dist.all_gather(everyone, total)
    return {"message": message, "after": after, "same": bool(everyone[0] == everyone[1])}


def _run(pool: DistPool, forward_prefetch: Optional[bool]) -> tuple[str, str]:
    r0, r1 = pool.run(_other_path, forward_prefetch, timeout=60)
    assert r0["after"] == "" and r1["after"] == "", (r0, r1)  # the next step runs
    assert r0["same"] and r1["same"]
    # the step counts every forward this pool's process group has seen: only their difference matters
    base = min(int(n) for n in re.findall(r"\(step (\d+)\)", r0["message"]))
    return tuple(  # type: ignore[return-value]
        re.sub(r"\(step (\d+)\)", lambda m: f"(step {int(m[1]) - base})", r["message"]) for r in (r0, r1)
    )


def test_other_units_with_forward_prefetch(pool: DistPool) -> None:
    """Forward prefetch (the default on gloo) gathers the first iteration's next unit on both ranks, so
    the forwards agree; the backwards gather different units."""
    m0, m1 = _run(pool, None)
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        m0,
        """RankMismatchError: fully_shard: the all-gather of unit 'blocks.1' was not run: ranks reached different collectives (rank 0: backward: an all-gather of unit 'blocks.1' of 20 float32 elements (step 0); rank 1: backward: an all-gather of unit 'blocks.2' of 20 float32 elements (step 0)). No rank completed it; the ranks ran different units: look for data-dependent branches or modules skipped on some ranks (the units run in every iteration must be the same on every rank). Every rank must run the same modules, steps and collective calls in the same order""",  # noqa: E501
    )
    tc.assertExpectedInline(
        m1,
        """RankMismatchError: fully_shard: the all-gather of unit 'blocks.2' was not run: ranks reached different collectives (rank 0: backward: an all-gather of unit 'blocks.1' of 20 float32 elements (step 0); rank 1: backward: an all-gather of unit 'blocks.2' of 20 float32 elements (step 0)). No rank completed it; the ranks ran different units: look for data-dependent branches or modules skipped on some ranks (the units run in every iteration must be the same on every rank). Every rank must run the same modules, steps and collective calls in the same order""",  # noqa: E501
    )


def test_other_units_without_forward_prefetch(pool: DistPool) -> None:
    m0, m1 = _run(pool, False)
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        m0,
        """RankMismatchError: fully_shard: the all-gather of unit 'blocks.1' was not run: ranks reached different collectives (rank 0: forward: an all-gather of unit 'blocks.1' of 20 float32 elements (step 0); rank 1: forward: an all-gather of unit 'blocks.2' of 20 float32 elements (step 0)). No rank completed it; the ranks ran different units: look for data-dependent branches or modules skipped on some ranks (the units run in every iteration must be the same on every rank). Every rank must run the same modules, steps and collective calls in the same order""",  # noqa: E501
    )
    tc.assertExpectedInline(
        m1,
        """RankMismatchError: fully_shard: the all-gather of unit 'blocks.2' was not run: ranks reached different collectives (rank 0: forward: an all-gather of unit 'blocks.1' of 20 float32 elements (step 0); rank 1: forward: an all-gather of unit 'blocks.2' of 20 float32 elements (step 0)). No rank completed it; the ranks ran different units: look for data-dependent branches or modules skipped on some ranks (the units run in every iteration must be the same on every rank). Every rank must run the same modules, steps and collective calls in the same order""",  # noqa: E501
    )
