"""estimate_memory(..., reshard_after_forward=<int>): the slices units keep between forward and backward
(the ``post_forward_shards`` term), by hand and against what the runtime keeps; an int that means
True or False is estimated as FULL_SHARD or SHARD_GRAD_OP. See [Note: the memory model] and
[Note: resharding to a smaller group]. The whole step's peak: test_memory_estimate_peak.py."""

from __future__ import annotations

from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
from models import Block, TinyGPT, Toy, gpt_batch, gpt_loss
from parity import local_slice
from torch import nn

from fsdp_composable import (
    CustomPolicy,
    MemoryEstimate,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    estimate_memory,
    fully_shard,
)
from fsdp_composable._common_utils import _get_fsdp_states

BF16 = torch.bfloat16
POLICY = ModuleWrapPolicy({Block})


LINEARS = ModuleWrapPolicy({nn.Linear})
BATCH = torch.zeros(4, 3)


def _estimate(**kwargs: Any) -> MemoryEstimate:
    kwargs.setdefault("policy", LINEARS)
    kwargs.setdefault("world_size", 4)
    return estimate_memory(Toy(), **kwargs)


def test_post_forward_shards_by_hand() -> None:
    # world size 4: root 3 -> 4; a 8x3 + 8 = 32; b 8x5 + 8 = 48; c 4x7 + 4 = 32 (padded to whole rows per rank)
    est = _estimate(reshard_after_forward=2, batch_example=BATCH)
    assert [u.padded_numel for u in est.plan.units] == [4, 32, 48, 32]
    assert est.strategy is ShardingStrategy.FULL_SHARD
    # every non-root unit keeps half its padded flat parameter from its forward to its backward; the
    # root's half is gone at the peak (its backward comes first and gathers it again)
    assert est.breakdown["post_forward_shards"] == (32 + 48 + 32) // 2 * 4
    full = _estimate(batch_example=BATCH)
    assert {k: v for k, v in est.breakdown.items() if k != "post_forward_shards"} == full.breakdown
    b = est.breakdown
    held = b["sharded_params"] + b["optimizer_state"] + b["unsharded_params"] + b["unsharded_grads"]
    # they pile up through forward beside the activations: both are alive where backward starts
    assert est.peak_bytes == held + b["activations"] + b["post_forward_shards"] == full.peak_bytes + 224
    assert est.upper_bound_bytes == sum(b.values())
    expecttest.TestCase().assertExpectedInline(
        str(est),
        """\
MemoryEstimate per rank: world size 4, 4 units, FULL_SHARD, optimizer adam
term                 bytes      size  what
-------------------  -----  --------  -----------------------------------------------------------------------------------
sharded_params         116     116 B  this rank's shard of every flat parameter
sharded_grads          116     116 B  sharded gradient of every unit with a trainable parameter
optimizer_state        232     232 B  adam: 2 x the trainable sharded parameters
optimizer_step         116     116 B  adam step's foreach temporaries: 1 x the trainable sharded parameters
unsharded_params       528     528 B  root unit + 2 largest FULL_SHARD unit(s) in flight + 1 gathered before its copy-out
unsharded_grads        192     192 B  largest unit's unsharded gradient buffer (compute + reduce dtype)
activations            288     288 B  saved for backward by forward(batch_example), once per storage
output_and_loss         16      16 B  the output's gradient (pass loss_fn= to measure the loss's tensors too)
post_forward_shards    224     224 B  1/2 of every non-root FULL_SHARD unit, kept from forward to backward
-------------------  -----  --------  -----------------------------------------------------------------------------------
peak                 1,580  1.54 KiB  in backward: params + optimizer + unsharded + activations + post-forward shards""",  # noqa: E501
    )
    # kept in the compute dtype: the slice is cut from the gathered (cast) parameters
    low = _estimate(reshard_after_forward=2, mixed_precision=MixedPrecision(param_dtype=BF16))
    assert low.breakdown["post_forward_shards"] == (32 + 48 + 32) // 2 * 2


def test_int_that_means_true_or_false_and_per_unit_strategies() -> None:
    # 1 is False (SHARD_GRAD_OP), the world size is True (FULL_SHARD): no slice is kept
    assert _estimate(reshard_after_forward=1) == _estimate(strategy=ShardingStrategy.SHARD_GRAD_OP)
    assert _estimate(reshard_after_forward=1).strategy is ShardingStrategy.SHARD_GRAD_OP
    assert _estimate(reshard_after_forward=4) == _estimate()
    assert _estimate(reshard_after_forward=False) == _estimate(strategy=ShardingStrategy.SHARD_GRAD_OP)
    assert _estimate(reshard_after_forward=True) == _estimate()
    assert _estimate(world_size=2, reshard_after_forward=2) == _estimate(world_size=2)
    assert "post_forward_shards" not in _estimate(reshard_after_forward=4).breakdown
    # a unit a CustomPolicy makes SHARD_GRAD_OP stays unsharded after forward, as the runtime keeps it:
    # no slice for b (48), which the kept unsharded units count whole instead
    policy = CustomPolicy(
        lambda m: ({"strategy": ShardingStrategy.SHARD_GRAD_OP} if m.out_features == 7 else True)
        if isinstance(m, nn.Linear)
        else False
    )
    mixed = _estimate(policy=policy, reshard_after_forward=2)
    assert mixed.breakdown["post_forward_shards"] == (32 + 32) // 2 * 4
    assert mixed.explanations["unsharded_params"].startswith("root unit + 1 SHARD_GRAD_OP/NO_SHARD unit(s) kept")


def test_reshard_after_forward_bad_arguments() -> None:
    messages = {}
    cases = {
        "type": lambda: _estimate(reshard_after_forward="2"),
        "not a divisor": lambda: _estimate(reshard_after_forward=3),
        "too large": lambda: _estimate(world_size=2, reshard_after_forward=4),
        "conflicting strategy": lambda: _estimate(strategy=ShardingStrategy.NO_SHARD, reshard_after_forward=2),
    }
    for name, call in cases.items():
        with pytest.raises((TypeError, ValueError)) as e:
            call()
        messages[name] = f"{type(e.value).__name__}: {e.value}"
    expecttest.TestCase().assertExpectedInline(
        "\n".join(f"{k}: {v}" for k, v in messages.items()),
        """\
type: TypeError: estimate_memory argument 'reshard_after_forward' must be True, False, an int (the number of ranks to stay sharded over after forward) or None, got '2'
not a divisor: ValueError: estimate_memory(Toy): reshard_after_forward=3 must be a divisor of the shard group's size 4 (the number of consecutive ranks to stay sharded over after forward)
too large: ValueError: estimate_memory(Toy): reshard_after_forward=4 must be a divisor of the shard group's size 2 (the number of consecutive ranks to stay sharded over after forward)
conflicting strategy: ValueError: estimate_memory: strategy=ShardingStrategy.NO_SHARD conflicts with reshard_after_forward=2 (which means ShardingStrategy.FULL_SHARD); pass only one of them""",  # noqa: E501
    )


# ---------------------------------------------------------------------------- against the runtime
def kept_after_forward(k: int, param_dtype: Any) -> dict[str, Any]:
    """The estimate's term and what the units hold between forward and backward, on this rank."""
    mp = MixedPrecision(param_dtype=param_dtype) if param_dtype is not None else None
    torch.manual_seed(0)
    model = TinyGPT(n_layers=3)
    world_size = dist.get_world_size()
    est = estimate_memory(model, policy=POLICY, world_size=world_size, mixed_precision=mp, reshard_after_forward=k)
    fully_shard(model, POLICY, mixed_precision=mp, reshard_after_forward=k)
    handles = [h for s in _get_fsdp_states(model) for h in s.handles if h.module is not model]
    batch = local_slice(gpt_batch(0, 2 * world_size), dist.get_rank(), world_size)
    out = {}
    for step in range(2):
        loss = gpt_loss(model, batch)
        slices = [h._post_forward_shard for h in handles]
        out[f"step {step}"] = {
            "slice bytes": sum(s.numel() * s.element_size() for s in slices if s is not None),
            "slices": sum(s is not None for s in slices),
            "unsharded": sum(h.is_unsharded for h in handles),
        }
        loss.backward()
        model.zero_grad(set_to_none=True)
    out["estimate"] = est.breakdown.get("post_forward_shards")
    out["strategy"] = est.strategy.name
    return out


@pytest.mark.parametrize("param_dtype", [None, BF16])
def test_post_forward_shards_match_the_runtime_at_world_size_4(dist_run, param_dtype: Any) -> None:
    """reshard_after_forward=2 on 4 ranks: after each forward the three blocks (3,216 elements each,
    3,216 padded) hold half their flat parameter, in the compute dtype, and nothing unsharded; the
    estimate's term is those bytes."""
    size = 4 if param_dtype is None else 2
    for rank, r in enumerate(dist_run(4, kept_after_forward, 2, param_dtype)):
        kept = {"slice bytes": 3 * 3216 // 2 * size, "slices": 3, "unsharded": 0}
        assert r == {"step 0": kept, "step 1": kept, "estimate": 3 * 3216 // 2 * size, "strategy": "FULL_SHARD"}, rank


def test_int_at_world_size_2_is_what_the_runtime_does(dist_run) -> None:
    """On 2 ranks 2 is FULL_SHARD (no slice, every block resharded) and 1 is SHARD_GRAD_OP (every block
    kept unsharded): the estimate has no post_forward_shards term for either."""
    full = {"slice bytes": 0, "slices": 0, "unsharded": 0}
    for r in dist_run(2, kept_after_forward, 2, None):
        assert r == {"step 0": full, "step 1": full, "estimate": None, "strategy": "FULL_SHARD"}
    kept = {"slice bytes": 0, "slices": 0, "unsharded": 3}
    for r in dist_run(2, kept_after_forward, 1, None):
        assert r == {"step 0": kept, "step 1": kept, "estimate": None, "strategy": "SHARD_GRAD_OP"}
