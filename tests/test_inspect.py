"""describe(): golden plans at world sizes 1 and 2, HYBRID_SHARD group sizes and parameters, and its
bad input (estimate_memory(): test_memory_estimate.py)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator
from unittest import mock

import expecttest
import pytest
import torch
import torch.distributed as dist
from models import Block, TinyGPT, gpt_batch, gpt_loss
from torch import nn

from fsdp_composable import (
    CPUOffload,
    CustomPolicy,
    FullyShardedDataParallel,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    describe,
    estimate_memory,
    fully_shard,
)
from fsdp_composable._comm import _collectives

BF16 = torch.bfloat16
POLICY = ModuleWrapPolicy({Block})


def _gpt(tied: bool = False) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(tied=tied)


def _step(model: nn.Module) -> None:
    gpt_loss(model, gpt_batch(0, 2)).backward()


def _without_rank(text: str) -> str:
    return text.replace(", rank 1", ", rank 0")


# ---------------------------------------------------------------------------- describe, on the ranks
@contextlib.contextmanager
def _no_collectives() -> Iterator[None]:
    """Any collective issued inside raises (describe must not communicate)."""
    names = ["all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier", "reduce_scatter_tensor"]
    names += ["all_gather_into_tensor", "broadcast_object_list", "send", "recv"]

    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("describe() issued a collective")

    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(mock.patch.object(dist, name, fail))
        for name in ["all_gather", "reduce_scatter", "all_reduce"]:
            stack.enter_context(mock.patch.object(_collectives, name, fail))
        yield


def describe_policy_and_manual() -> dict:
    """A policy on blocks vs. fully_shard on each block then the root: the same units."""
    policy_model = fully_shard(_gpt(), POLICY)
    with _no_collectives():
        before = describe(policy_model)
    _step(policy_model)
    after = describe(policy_model)
    manual = _gpt()
    for block in manual.blocks:
        fully_shard(block)
    fully_shard(manual)
    with _no_collectives():
        manual_plan = describe(manual)
    _step(manual)
    return {
        "policy": str(before),
        "same_after_step": before == after,
        "manual": manual_plan,
        "manual_after_step": describe(manual) == manual_plan,
        "manual_blocks": describe(manual.blocks),  # FQNs relative to the module described
        "policy_units": before.units,
    }


def describe_tied_ignored_mixed_precision() -> dict:
    tied = fully_shard(_gpt(tied=True), POLICY)
    ignored = _gpt()
    fully_shard(ignored, POLICY, ignored_modules=[ignored.head])
    mp_model = _gpt()
    full_precision_ln_f = CustomPolicy(
        lambda m: isinstance(m, Block) or ({"mixed_precision": None} if m is mp_model.ln_f else False)
    )
    fully_shard(
        mp_model,
        full_precision_ln_f,
        mixed_precision=MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32),
        cpu_offload=CPUOffload(offload_params=True),
    )
    return {"tied": describe(tied), "ignored": describe(ignored), "mixed_precision": describe(mp_model)}


def test_describe_nested_policy_and_manual(dist_run) -> None:
    ranks = dist_run(2, describe_policy_and_manual)
    r = ranks[0]
    assert r["same_after_step"] and r["manual_after_step"]
    assert r["manual"].units == r["policy_units"]
    assert _without_rank(ranks[1]["policy"]) == r["policy"] and "rank 1" in ranks[1]["policy"]
    assert [u.fqn for u in r["manual_blocks"].units] == ["0", "1"]
    assert r["manual_blocks"].units[0].param_fqns[:2] == ("0.ln1.weight", "0.ln1.bias")
    expecttest.TestCase().assertExpectedInline(
        r["policy"],
        """\
ShardingPlan: 3 units, world size 2, rank 0
unit      params  numel  padded  shard  dtype    strategy    param_dtype  reduce_dtype  offload  shard bytes
--------  ------  -----  ------  -----  -------  ----------  -----------  ------------  -------  -----------
<root>         5  1,344   1,376    688  float32  FULL_SHARD  -            -             no          2.69 KiB
blocks.0      10  3,216   3,216  1,608  float32  FULL_SHARD  -            -             no          6.28 KiB
blocks.1      10  3,216   3,216  1,608  float32  FULL_SHARD  -            -             no          6.28 KiB
--------  ------  -----  ------  -----  -------  ----------  -----------  ------------  -------  -----------
total         25  7,776   7,808  3,904                                                             15.25 KiB""",
    )


def test_describe_tied_ignored_mixed_precision(dist_run) -> None:
    r = dist_run(2, describe_tied_ignored_mixed_precision)[0]
    tc = expecttest.TestCase()
    assert r["tied"].units[0].param_fqns == ("pos", "tok.weight", "head.weight", "ln_f.weight", "ln_f.bias")
    assert r["tied"].units[0].tied_param_fqns == (("tok.weight", "head.weight"),)
    tc.assertExpectedInline(
        str(r["tied"]),
        """\
ShardingPlan: 3 units, world size 2, rank 0
unit      params  numel  padded  shard  dtype    strategy    param_dtype  reduce_dtype  offload  shard bytes
--------  ------  -----  ------  -----  -------  ----------  -----------  ------------  -------  -----------
<root>         4    752     768    384  float32  FULL_SHARD  -            -             no          1.50 KiB
blocks.0      10  3,216   3,216  1,608  float32  FULL_SHARD  -            -             no          6.28 KiB
blocks.1      10  3,216   3,216  1,608  float32  FULL_SHARD  -            -             no          6.28 KiB
--------  ------  -----  ------  -----  -------  ----------  -----------  ------------  -------  -----------
total         24  7,184   7,200  3,600                                                             14.06 KiB
tied (one copy, in unit <root>): tok.weight = head.weight""",
    )
    assert r["ignored"].ignored_param_fqns == ("head.weight",)
    tc.assertExpectedInline(
        str(r["ignored"]),
        """\
ShardingPlan: 3 units, world size 2, rank 0
unit      params  numel  padded  shard  dtype    strategy    param_dtype  reduce_dtype  offload  shard bytes
--------  ------  -----  ------  -----  -------  ----------  -----------  ------------  -------  -----------
<root>         4    752     768    384  float32  FULL_SHARD  -            -             no          1.50 KiB
blocks.0      10  3,216   3,216  1,608  float32  FULL_SHARD  -            -             no          6.28 KiB
blocks.1      10  3,216   3,216  1,608  float32  FULL_SHARD  -            -             no          6.28 KiB
--------  ------  -----  ------  -----  -------  ----------  -----------  ------------  -------  -----------
total         24  7,184   7,200  3,600                                                             14.06 KiB
ignored (not sharded, not counted): head.weight""",
    )
    tc.assertExpectedInline(
        str(r["mixed_precision"]),
        """\
ShardingPlan: 4 units, world size 2, rank 0
unit      params  numel  padded  shard  dtype    strategy    param_dtype  reduce_dtype  offload  shard bytes
--------  ------  -----  ------  -----  -------  ----------  -----------  ------------  -------  -----------
<root>         3  1,312   1,344    672  float32  FULL_SHARD  bfloat16     float32       yes         2.62 KiB
blocks.0      10  3,216   3,216  1,608  float32  FULL_SHARD  bfloat16     float32       yes         6.28 KiB
blocks.1      10  3,216   3,216  1,608  float32  FULL_SHARD  bfloat16     float32       yes         6.28 KiB
ln_f           2     32      32     16  float32  FULL_SHARD  -            -             yes             64 B
--------  ------  -----  ------  -----  -------  ----------  -----------  ------------  -------  -----------
total         25  7,776   7,808  3,904                                                             15.25 KiB""",
    )


def describe_world_size_1() -> dict:
    model = fully_shard(_gpt(tied=True), POLICY)
    _step(model)
    wrapped = FullyShardedDataParallel(_gpt(tied=True), auto_wrap_policy=POLICY)
    partly = _gpt()
    fully_shard(partly.blocks[0])
    try:
        estimate_memory(partly, policy=POLICY, world_size=2)
        error = ""
    except ValueError as e:
        error = str(e)
    return {"plan": describe(model), "wrapper": describe(wrapped), "estimate_sharded_error": error}


def test_describe_world_size_1(dist_run) -> None:
    r = dist_run(1, describe_world_size_1)[0]
    # the wrapper's inner-module attribute is not part of any FQN
    assert r["wrapper"] == r["plan"]
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        str(r["plan"]),
        """\
ShardingPlan: 3 units, world size 1, rank 0
unit      params  numel  padded  shard  dtype    strategy  param_dtype  reduce_dtype  offload  shard bytes
--------  ------  -----  ------  -----  -------  --------  -----------  ------------  -------  -----------
<root>         4    752     752    752  float32  NO_SHARD  -            -             no          2.94 KiB
blocks.0      10  3,216   3,216  3,216  float32  NO_SHARD  -            -             no         12.56 KiB
blocks.1      10  3,216   3,216  3,216  float32  NO_SHARD  -            -             no         12.56 KiB
--------  ------  -----  ------  -----  -------  --------  -----------  ------------  -------  -----------
total         24  7,184   7,184  7,184                                                           28.06 KiB
tied (one copy, in unit <root>): tok.weight = head.weight""",
    )
    tc.assertExpectedInline(
        r["estimate_sharded_error"],
        """estimate_memory argument 'module' (TinyGPT) is already sharded by fully_shard (at 'blocks.0'); pass the unsharded model (a meta-device copy is fine), or call describe() on the sharded one""",  # noqa: E501
    )


def test_describe_bad_input() -> None:
    tc = expecttest.TestCase()
    with pytest.raises(ValueError) as e:
        describe(nn.Linear(2, 2))
    tc.assertExpectedInline(
        str(e.value),
        """describe() found no fully_shard state on this Linear or its submodules; call fully_shard(module, policy=...) (or wrap it in FullyShardedDataParallel) first, or use estimate_memory() to predict the plan of an unsharded module""",  # noqa: E501
    )
    with pytest.raises(TypeError) as t:
        describe("model")  # type: ignore[arg-type]
    tc.assertExpectedInline(str(t.value), """describe() expects an nn.Module, got str""")


# ---------------------------------------------------------------------------- describe: HYBRID_SHARD, params=True
def describe_hybrid_and_params() -> dict:
    """4 ranks as 2 replicas x shard groups of 2: (0, 1) and (2, 3) shard, (0, 2) and (1, 3) replicate."""
    rank = dist.get_rank()
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicate_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = (shard_groups[rank // 2], replicate_groups[rank % 2])
    model = fully_shard(_gpt(tied=True), POLICY, strategy=ShardingStrategy.HYBRID_SHARD, process_group=groups)
    with _no_collectives():
        plan = describe(model, params=True)
    _step(model)
    return {"plan": plan, "text": str(plan), "plain": str(describe(model)), "after_step": describe(model) == plan}


def test_describe_hybrid_shard_group_sizes_and_params(dist_run) -> None:
    """Under HYBRID_SHARD the header gives the shard and replicate group sizes, not a world size;
    params=True adds every unit's parameter FQNs and shapes (a tied alias points at its first FQN)."""
    ranks = dist_run(4, describe_hybrid_and_params)
    r = ranks[0]
    assert r["after_step"]  # show_params is not part of the plan's value
    assert (r["plan"].world_size, r["plan"].replicate_world_size) == (2, 2)
    assert [x["plan"].rank for x in ranks] == [0, 1, 0, 1]  # the rank in the shard group
    assert r["plain"] == r["text"].split("\n\n")[0]
    assert r["plan"].units[1].param_shapes[:3] == ((16,), (16,), (48, 16))
    expecttest.TestCase().assertExpectedInline(
        r["text"],
        """\
ShardingPlan: 3 units, HYBRID_SHARD: shard group size 2, replicate group size 2, rank 0
unit      params  numel  padded  shard  dtype    strategy      param_dtype  reduce_dtype  offload  shard bytes
--------  ------  -----  ------  -----  -------  ------------  -----------  ------------  -------  -----------
<root>         4    752     768    384  float32  HYBRID_SHARD  -            -             no          1.50 KiB
blocks.0      10  3,216   3,216  1,608  float32  HYBRID_SHARD  -            -             no          6.28 KiB
blocks.1      10  3,216   3,216  1,608  float32  HYBRID_SHARD  -            -             no          6.28 KiB
--------  ------  -----  ------  -----  -------  ------------  -----------  ------------  -------  -----------
total         24  7,184   7,200  3,600                                                               14.06 KiB
tied (one copy, in unit <root>): tok.weight = head.weight

unit      parameter                      shape            numel
--------  -----------------------------  --------  ------------
<root>    pos                            (8, 16)            128
<root>    tok.weight                     (37, 16)           592
<root>    head.weight                    (37, 16)  = tok.weight
<root>    ln_f.weight                    (16,)               16
<root>    ln_f.bias                      (16,)               16
blocks.0  blocks.0.ln1.weight            (16,)               16
blocks.0  blocks.0.ln1.bias              (16,)               16
blocks.0  blocks.0.attn.in_proj_weight   (48, 16)           768
blocks.0  blocks.0.ln2.weight            (16,)               16
blocks.0  blocks.0.ln2.bias              (16,)               16
blocks.0  blocks.0.fc1.weight            (64, 16)         1,024
blocks.0  blocks.0.fc1.bias              (64,)               64
blocks.0  blocks.0.fc2.weight            (16, 64)         1,024
blocks.0  blocks.0.fc2.bias              (16,)               16
blocks.0  blocks.0.attn.out_proj.weight  (16, 16)           256
blocks.1  blocks.1.ln1.weight            (16,)               16
blocks.1  blocks.1.ln1.bias              (16,)               16
blocks.1  blocks.1.attn.in_proj_weight   (48, 16)           768
blocks.1  blocks.1.ln2.weight            (16,)               16
blocks.1  blocks.1.ln2.bias              (16,)               16
blocks.1  blocks.1.fc1.weight            (64, 16)         1,024
blocks.1  blocks.1.fc1.bias              (64,)               64
blocks.1  blocks.1.fc2.weight            (16, 64)         1,024
blocks.1  blocks.1.fc2.bias              (16,)               16
blocks.1  blocks.1.attn.out_proj.weight  (16, 16)           256
--------  -----------------------------  --------  ------------
total     24 parameters                                   7,184""",
    )
