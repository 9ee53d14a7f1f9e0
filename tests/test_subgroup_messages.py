"""Disagreements on a process group that is not the world name the ranks by their global rank.

Two models, each sharded over its own pair of ranks of a 4-rank world ({0, 1} and {2, 3}): what goes
wrong on global rank 3 must be reported as rank 3 to rank 2 (its group rank 1 would point the user at
the wrong process's log).
"""

from __future__ import annotations

import expecttest
import torch
import torch.distributed as dist
from harness import error_of
from models import Block, TinyGPT, gpt_batch, gpt_loss
from parity import local_slice
from torch import nn

from fsdp_composable import ModuleWrapPolicy, fully_shard


def _pair() -> dist.ProcessGroup:
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    return groups[dist.get_rank() // 2]


def _rank3_differs(kind: str) -> str:
    group = _pair()
    torch.manual_seed(0)
    model = TinyGPT()
    if kind == "width" and dist.get_rank() == 3:
        model.blocks[1].fc1, model.blocks[1].fc2 = nn.Linear(16, 65), nn.Linear(65, 16)
    fully_shard(model, ModuleWrapPolicy({Block}), process_group=group)
    batch = local_slice(gpt_batch(0, 4), dist.get_rank() % 2, 2)
    if kind == "raises":  # past the first iteration's order check, so the headers find it
        gpt_loss(model, batch).backward()
        batch = local_slice(gpt_batch(1, 4), dist.get_rank() % 2, 2)
        if dist.get_rank() == 3:

            def fail(module: nn.Module, args: object) -> None:
                raise ValueError("rank 3 fails in blocks.1")

            model.blocks[1].register_forward_pre_hook(fail)
    return error_of(lambda: gpt_loss(model, batch).backward())


def test_a_unit_built_differently_on_global_rank_3(dist_run) -> None:
    results = dist_run(4, _rank3_differs, "width")
    assert results[:2] == ["", ""] and results[2] == results[3], results
    expecttest.TestCase().assertExpectedInline(results[2], """ExecutionOrderError: fully_shard: ranks built unit 'blocks.1' differently (position 2 of the forward in iteration 0; rank(s) [3] differ from rank 2): rank 2: unit 'blocks.1' of 3,216 elements, parameter 5: blocks.1.fc1.weight [64, 16] float32; rank 3: unit 'blocks.1' of 3,266 elements, parameter 5: blocks.1.fc1.weight [65, 16] float32. Every rank must build the same model and apply the same policy (same units, same parameter shapes and dtypes)""")  # noqa: E501


def test_global_rank_3_raising_in_forward(dist_run) -> None:
    results = dist_run(4, _rank3_differs, "raises")
    assert results[:2] == ["", ""] and results[3] == "ValueError: rank 3 fails in blocks.1", results
    expecttest.TestCase().assertExpectedInline(results[2], """RankMismatchError: fully_shard: the all-gather of unit 'blocks.1' was not run: rank(s) [3] raised an exception in this step and left it (rank 2: backward: an all-gather of 3,216 float32 elements (step 2); rank 3: left step 2 (it raised an exception there)). Every rank abandons the step; the next one can run. See the failing rank's log for its exception""")  # noqa: E501
