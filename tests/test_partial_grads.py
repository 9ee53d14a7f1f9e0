"""Which original parameters got a gradient is decided per parameter, as DDP decides it: a parameter
has a gradient if any rank's backward produced one, otherwise its ``.grad`` stays None (or unchanged
when accumulating), also when other parameters of its unit did get one. Each case trains a sharded
copy next to the unsharded model on the same global batch with AdamW (weight decay and momentum move
a parameter whose ``.grad`` is a zero tensor, so zeros instead of None show up in the weights), and
compares after every step which ``.grad`` are None. Float64, odd sizes (every unit is padded).
"native": gloo's own collectives instead of the point-to-point exchanges, the path NCCL takes (the
flat gradient reduce-scattered as it is, the flags by their own all-reduce)."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from reduction_copies import reduction_copies
from torch import nn

from fsdp_composable import (
    FullyShardedDataParallel,
    ModuleWrapPolicy,
    ShardingStrategy,
    fully_shard,
    no_sync,
    unshard_params,
)
from fsdp_composable._comm import _collectives

Use = dict[str, bool]  # what one rank's loss uses: head, aux, skip (block b), first (only block 0's output)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 6)
        self.b = nn.Linear(6, 7)  # skipped in some steps: a gets a gradient, b does not
        self.back = nn.Linear(6, 7)

    def forward(self, h: torch.Tensor, skip: bool) -> torch.Tensor:
        z = torch.tanh(self.a(h))
        return torch.tanh(self.back(z) if skip else self.b(z))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(5, 7)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(7, 3)
        self.aux = nn.Linear(7, 2)

    def forward(self, x: torch.Tensor, skip: bool) -> tuple[torch.Tensor, ...]:
        h0 = self.blocks[0](torch.tanh(self.emb(x)), skip)
        h1 = self.blocks[1](h0, skip)
        return h0, h1, self.head(h1), self.aux(h1)


def _loss(model: nn.Module, x: torch.Tensor, use: Use) -> torch.Tensor:
    h0, h1, head, aux = model(x, use.get("skip", False))
    if use.get("first"):  # only the first block's output: the root's head and the second block get nothing
        return h0.pow(2).mean()
    # neither head nor aux: every unit still runs its backward (a unit left out on some ranks only is
    # a different matter, see [Note: which parameters got a gradient])
    loss = h1.sum() * 0.0 if not (use.get("head") or use.get("aux")) else 0.0
    if use.get("head"):
        loss = loss + head.pow(2).mean()
    if use.get("aux"):
        loss = loss + aux.pow(2).mean()
    return loss  # type: ignore[return-value]


# Per step, per rank: what the loss uses. A step's micro-batches follow one another.
Schedule = list[list[Callable[[int], Use]]]
STEPS: Schedule = [
    [lambda r: {"head": True, "aux": True}],
    [lambda r: {"first": True}],  # root unit: emb has a gradient, head and aux do not
    [lambda r: {"head": r == 0, "aux": r != 0, "skip": r == 0}],  # each used on some rank only
    [lambda r: {"head": True, "skip": True}],  # aux and every block's b unused everywhere
    [lambda r: {"head": True, "aux": True}],
]
ACCUMULATE: Schedule = [
    [lambda r: {"head": True, "skip": True}, lambda r: {"aux": True}],  # b: only the second backward
    [lambda r: {"head": True, "skip": True}, lambda r: {"head": True, "skip": True}],  # aux, b: none
    [lambda r: {"first": True}, lambda r: {"aux": r == 1, "head": r == 0}],
]


def _x(step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(3 * dist.get_world_size(), 5, generator=g).double()


def _groups(strategy: str) -> Any:
    if strategy != "HYBRID_SHARD":
        return None
    rank = dist.get_rank()
    if dist.get_world_size() == 2:  # shard groups of one rank: NO_SHARD's layout, all-reduced across replicas
        shards = [dist.new_group([0]), dist.new_group([1])]
        return (shards[rank], dist.new_group([0, 1]))
    # 2 x 2: shard within {0,1} and {2,3}, replicate across {0,2} and {1,3}
    shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return (shards[rank // 2], replicas[rank % 2])


def _shard(model: nn.Module, api: str, strategy: str) -> nn.Module:
    policy = ModuleWrapPolicy({Block})
    group = _groups(strategy)
    if api == "fully_shard":
        return fully_shard(model, policy, strategy=ShardingStrategy[strategy], process_group=group)
    return FullyShardedDataParallel(
        model, process_group=group, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy[strategy],
        use_orig_params=True,
    )


def _grad_none(model: nn.Module) -> list[bool | None]:
    """Per parameter: is its ``.grad`` None (None where this rank holds none of it)."""
    return [None if p.numel() == 0 else p.grad is None for p in model.parameters()]


def train(api: str, strategy: str, schedule_name: str, accumulate: str, native: bool = False) -> dict[str, Any]:
    """``accumulate``: "plain" (one backward after another) or "no_sync" (all but the last micro-batch
    of a step inside ``no_sync``); ``native``: gloo's own collectives (see the module docstring)."""
    real = _collectives.point_to_point
    if native:
        _collectives.point_to_point = lambda group, device: False  # type: ignore[assignment]
    try:
        return _train(api, strategy, schedule_name, accumulate)
    finally:
        _collectives.point_to_point = real  # type: ignore[assignment]


def _train(api: str, strategy: str, schedule_name: str, accumulate: str) -> dict[str, Any]:
    schedule = STEPS if schedule_name == "steps" else ACCUMULATE
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = Net().double()
    model = _shard(copy.deepcopy(ref), api, strategy)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    mismatches: list[str] = []
    for step, micros in enumerate(schedule):
        for micro, use in enumerate(micros):
            x = _x(step, micro)
            n = x.shape[0] // world
            sum(_loss(ref, x[r * n : (r + 1) * n], use(r)) for r in range(world)).div(world).backward()
            local = x[rank * n : (rank + 1) * n]
            if accumulate == "no_sync" and micro < len(micros) - 1:
                with no_sync(model):
                    _loss(model, local, use(rank)).backward()
            else:
                _loss(model, local, use(rank)).backward()
        expected = [p.grad is None for p in ref.parameters()]
        got = _grad_none(model)
        names = [n for n, _ in ref.named_parameters()]
        mismatches += [f"step {step}: {names[i]}" for i, g in enumerate(got) if g is not None and g != expected[i]]
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    with unshard_params(model, writeback=False):
        diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return {"mismatches": mismatches, "diff": diff}


CASES = [
    pytest.param(1, "fully_shard", "FULL_SHARD", False, id="fully_shard-1"),
    pytest.param(2, "fully_shard", "FULL_SHARD", True, id="fully_shard-FULL_SHARD-2-native"),
    pytest.param(4, "fully_shard", "FULL_SHARD", True, id="fully_shard-FULL_SHARD-4-native"),
    pytest.param(4, "wrapper", "HYBRID_SHARD", True, id="wrapper-HYBRID_SHARD-4-native"),
    pytest.param(2, "fully_shard", "FULL_SHARD", False, id="fully_shard-FULL_SHARD-2"),
    pytest.param(4, "fully_shard", "FULL_SHARD", False, id="fully_shard-FULL_SHARD-4"),
    pytest.param(2, "fully_shard", "SHARD_GRAD_OP", False, id="fully_shard-SHARD_GRAD_OP-2"),
    pytest.param(2, "fully_shard", "NO_SHARD", False, id="fully_shard-NO_SHARD-2"),
    pytest.param(4, "fully_shard", "HYBRID_SHARD", False, id="fully_shard-HYBRID_SHARD-4"),
    pytest.param(2, "fully_shard", "HYBRID_SHARD", False, id="fully_shard-HYBRID_SHARD-1x2"),
    pytest.param(2, "wrapper", "FULL_SHARD", False, id="wrapper-FULL_SHARD-2"),
    pytest.param(4, "wrapper", "SHARD_GRAD_OP", False, id="wrapper-SHARD_GRAD_OP-4"),
    pytest.param(4, "wrapper", "NO_SHARD", False, id="wrapper-NO_SHARD-4"),
    pytest.param(4, "wrapper", "HYBRID_SHARD", False, id="wrapper-HYBRID_SHARD-4"),
]


@pytest.mark.parametrize("world,api,strategy,native", CASES)
def test_unused_parameters_of_a_used_unit_keep_grad_none(
    dist_run, world: int, api: str, strategy: str, native: bool
) -> None:
    for r in dist_run(world, train, api, strategy, "steps", "plain", native):
        assert r["mismatches"] == []
        assert r["diff"] < 1e-12


@pytest.mark.parametrize(
    "world,api,strategy,accumulate,native",
    [
        (1, "fully_shard", "FULL_SHARD", "no_sync", False),
        (2, "fully_shard", "FULL_SHARD", "no_sync", True),
        (4, "fully_shard", "HYBRID_SHARD", "no_sync", True),
        (2, "fully_shard", "FULL_SHARD", "plain", False),
        (4, "fully_shard", "FULL_SHARD", "no_sync", False),
        (2, "fully_shard", "NO_SHARD", "no_sync", False),
        (2, "wrapper", "SHARD_GRAD_OP", "no_sync", False),
        (4, "wrapper", "HYBRID_SHARD", "no_sync", False),
        (4, "fully_shard", "HYBRID_SHARD", "plain", False),
        (2, "fully_shard", "HYBRID_SHARD", "no_sync", True),  # shard groups of one rank
    ],
)
def test_accumulation_keeps_none_only_if_no_backward_touched_it(
    dist_run, world: int, api: str, strategy: str, accumulate: str, native: bool
) -> None:
    for r in dist_run(world, train, api, strategy, "accumulate", accumulate, native):
        assert r["mismatches"] == []
        assert r["diff"] < 1e-12


def _reduction_copies(strategy: str, native: bool) -> dict[str, Any]:
    """Steady-state backwards (with unused parameters, so the flags matter): the copies of a unit's
    whole gradient each reduction makes while it is issued, and its collectives."""
    real = _collectives.point_to_point
    if native:
        _collectives.point_to_point = lambda group, device: False  # type: ignore[assignment]
    try:
        torch.manual_seed(0)
        model = _shard(Net().double(), "fully_shard", strategy)
        x = _x(0, 0)[:3]
        _loss(model, x, {"head": True}).backward()  # the first iteration checks the order across ranks
        with reduction_copies() as seen:
            for use in ({"head": True, "skip": True}, {"first": True}):
                _loss(model, x, use).backward()
        handles = fully_shard.state(model).handles
        with_flags = {h.layout.shard_numel + len(h.params) for h in handles}  # a shard, then its unit's flags
        return {"copies": seen.copies, "collectives": seen.collectives, "units": len(handles), "with_flags": with_flags}
    finally:
        _collectives.point_to_point = real  # type: ignore[assignment]


@pytest.mark.parametrize(
    "world,strategy,native",
    [
        (1, "FULL_SHARD", False),  # world size 1: NO_SHARD, the flags are this rank's own
        (2, "NO_SHARD", False),  # the flags ride after the gradient, in its all-reduce
        (2, "FULL_SHARD", True),  # the flags ride at the end of every rank's chunk of the reduce-scatter
        (4, "HYBRID_SHARD", True),  # and the all-reduce across replicas takes the shard and flags whole
    ],
)
def test_reduction_copies_no_unit_sized_tensor(dist_run, world: int, strategy: str, native: bool) -> None:
    """Carrying the flags costs no copy of a unit's gradient: NO_SHARD sends the gradient buffer
    itself (alone, with no collective at all); with native collectives on the CPU the rank-major input
    autograd's gradients are concatenated into has room for them (no collective of their own)."""
    for r in dist_run(world, _reduction_copies, strategy, native):
        assert r["copies"] == []
        seen = r["collectives"]
        if strategy == "NO_SHARD" or world == 1:  # one all-reduce of the buffer (flags included) each, or none
            assert {c.split()[0] for c in seen} == ({"all_reduce"} if world > 1 else set()), seen
        else:  # every output a shard and its unit's 6 flags; across replicas, the same tensor again
            sizes = {int(c.split()[1]) for c in seen}
            assert any(c.startswith("reduce_scatter") for c in seen) and sizes <= r["with_flags"], (seen, r)
            assert all(c.startswith("reduce_scatter") for c in seen) or strategy == "HYBRID_SHARD", seen
