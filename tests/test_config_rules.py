"""The rules `_config` holds for the runtime and the memory estimator alike (see [Note: one place for
each rule]): one table of what each unit setting implies, and the call-level rules."""

from __future__ import annotations

import expecttest
import torch

from fsdp_composable import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from fsdp_composable._config import MAX_UNSHARDED_UNITS, ShardConfig, UnitConfig
from fsdp_composable._runtime._limiter_utils import _AllGatherLimiter

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CPU = torch.device("cpu")


def _name(dtype: object) -> str:
    return "-" if dtype is None else str(dtype).removeprefix("torch.")


def test_unit_rules_table() -> None:
    cases = [
        (ShardingStrategy.FULL_SHARD, None, False),
        (ShardingStrategy.HYBRID_SHARD, None, False),
        (ShardingStrategy.SHARD_GRAD_OP, None, False),
        (ShardingStrategy.NO_SHARD, None, False),
        (ShardingStrategy.NO_SHARD, MixedPrecision(param_dtype=BF16), False),
        (ShardingStrategy.NO_SHARD, None, True),
        (ShardingStrategy.FULL_SHARD, MixedPrecision(param_dtype=BF16, reduce_dtype=F32), False),
        (ShardingStrategy.FULL_SHARD, MixedPrecision(param_dtype=F16, keep_low_precision_grads=True), False),
        (ShardingStrategy.FULL_SHARD, MixedPrecision(reduce_dtype=BF16, cast_forward_inputs=True), False),
        (ShardingStrategy.FULL_SHARD, MixedPrecision(param_dtype=BF16, cast_forward_inputs=True), False),
    ]
    header = "strategy       mp                 offload  compute   reduce    grad      reshard  buffer  inputs"
    rows = [header + " root/unit"]
    for strategy, mp, offload in cases:
        c = UnitConfig(strategy, mp, offload)
        mp_text = "-" if mp is None else f"{_name(mp.param_dtype)}/{_name(mp.reduce_dtype)}"
        rows.append(
            f"{strategy.name:<14} {mp_text:<18} {offload!s:<8} {_name(c.compute_dtype(F32)):<9} "
            f"{_name(c.reduce_dtype(F32)):<9} {_name(c.grad_dtype(F32)):<9} {c.reshard_after_forward!s:<8} "
            # a CPU model: the offloaded shard is already where compute runs
            f"{c.needs_unsharded_buffer(F32, CPU)!s:<7} "
            f"{_name(c.input_dtype(is_root=True))}/{_name(c.input_dtype(is_root=False))}"
        )
    expecttest.TestCase().assertExpectedInline(
        "\n".join(rows),
        """\
strategy       mp                 offload  compute   reduce    grad      reshard  buffer  inputs root/unit
FULL_SHARD     -                  False    float32   float32   float32   True     True    -/-
HYBRID_SHARD   -                  False    float32   float32   float32   True     True    -/-
SHARD_GRAD_OP  -                  False    float32   float32   float32   False    True    -/-
NO_SHARD       -                  False    float32   float32   float32   False    False   -/-
NO_SHARD       bfloat16/-         False    bfloat16  bfloat16  float32   False    True    bfloat16/-
NO_SHARD       -                  True     float32   float32   float32   False    False   -/-
FULL_SHARD     bfloat16/float32   False    bfloat16  float32   float32   True     True    bfloat16/-
FULL_SHARD     float16/-          False    float16   float16   float16   True     True    float16/-
FULL_SHARD     -/bfloat16         False    float32   bfloat16  float32   True     True    -/-
FULL_SHARD     bfloat16/-         False    bfloat16  bfloat16  float32   True     True    bfloat16/bfloat16""",
    )


def test_offloaded_shard_on_another_device_needs_a_buffer() -> None:
    config = UnitConfig(ShardingStrategy.NO_SHARD, None, True)
    assert config.shard_device(torch.device("cuda", 0)) == CPU
    assert config.needs_unsharded_buffer(F32, torch.device("cuda", 0))
    assert not UnitConfig(ShardingStrategy.NO_SHARD, None, False).needs_unsharded_buffer(F32, torch.device("cuda", 0))


def test_call_rules() -> None:
    args = ShardConfig(strategy=ShardingStrategy.SHARD_GRAD_OP, cpu_offload=CPUOffload(offload_params=True))
    assert args.unit_config(1) == UnitConfig(ShardingStrategy.NO_SHARD, None, True)  # world size 1: NO_SHARD
    assert args.unit_config(2) == UnitConfig(ShardingStrategy.SHARD_GRAD_OP, None, True)
    # per-unit overrides; a NO_SHARD call (world size 1) stays NO_SHARD in every unit
    mp = MixedPrecision(param_dtype=BF16)
    full = {"strategy": ShardingStrategy.FULL_SHARD, "mixed_precision": mp}
    assert args.unit_config(2).with_overrides(full) == UnitConfig(ShardingStrategy.FULL_SHARD, mp, True)
    assert args.unit_config(1).with_overrides(full) == UnitConfig(ShardingStrategy.NO_SHARD, mp, True)
    # units unsharded at once: the limiter's bound with prefetching, one without
    assert ShardConfig().units_in_flight == MAX_UNSHARDED_UNITS == _AllGatherLimiter().max_units == 2
    post = BackwardPrefetch.BACKWARD_POST
    assert ShardConfig(backward_prefetch=post, forward_prefetch=False).units_in_flight == 1
    # forward_prefetch=None (the default) counts as on: the CPU prefetches, CUDA overlaps by itself
    assert ShardConfig(backward_prefetch=post).units_in_flight == 2
    assert ShardConfig(backward_prefetch=None, forward_prefetch=True).units_in_flight == 2
    assert UnitConfig(ShardingStrategy.FULL_SHARD, mp, False).low_precision_compute
    assert not UnitConfig(ShardingStrategy.FULL_SHARD, MixedPrecision(reduce_dtype=BF16), False).low_precision_compute
