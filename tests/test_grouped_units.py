"""FSDP2's ``fully_shard([m1, m2])`` (several modules as one unit) is refused with an error that says
what to do instead, on every rank and before anything changes; the alternatives it names (one call
per module, bottom-up, then the root) train in parity with the unsharded model.

Upstream: test/distributed/_composable/fsdp/test_fully_shard_training.py (``fully_shard`` on a list of
modules) for the FSDP2 behaviour this deliberately does not offer.
"""

from __future__ import annotations

from typing import Any

import expecttest
import pytest
import torch
from models import TinyGPT, gpt_batch, gpt_loss
from parity import error_text, train_side_by_side
from torch import nn

from fsdp_composable import describe, fully_shard


def _refused_then_per_module() -> dict[str, Any]:
    torch.manual_seed(0)
    ref = TinyGPT()
    model = TinyGPT()
    r: dict[str, Any] = {"list": error_text(lambda: fully_shard([model.tok, model.head]))}
    r["untouched"] = all(getattr(m, "_fsdp_to_empty_states", None) is None for m in model.modules())

    def shard(m: nn.Module) -> nn.Module:
        fully_shard(m.tok)  # the alternative: each module its own unit, then the root
        fully_shard(m.head)
        for block in m.blocks:
            fully_shard(block)
        return fully_shard(m)

    r.update(train_side_by_side(ref, shard, gpt_loss, gpt_batch, per_rank_batch=2, steps=3, optim="adamw"))
    sharded = shard(TinyGPT())
    r["units"] = [u.fqn for u in describe(sharded).units]
    return r


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_list_of_modules_is_refused_and_one_call_per_module_trains_in_parity(dist_run, world_size) -> None:
    results = dist_run(world_size, _refused_then_per_module)
    for r in results:
        assert r["list"] == results[0]["list"] and r["untouched"], r
        assert r["keys_equal"] and r["shapes_equal"], r
        assert max(abs(a - b) for a, b in zip(r["ref_losses"], r["losses"])) < 1e-5, r
        assert r["max_weight_diff"] < 1e-5, r
        assert r["units"] == ["", "tok", "blocks.0", "blocks.1", "head"], r
    expecttest.TestCase().assertExpectedInline(results[0]["list"], """TypeError: fully_shard got a list of 2 modules (Embedding, Linear), not one module: sharding several modules as one unit (FSDP2's fully_shard([m1, m2])) is not supported. Call fully_shard on each of them (each becomes its own unit), or leave them to an enclosing call (their parameters join its unit)""")  # noqa: E501
