"""``fully_shard([m1, m2])``: several modules as one unit (FSDP2's list form). The members' parameters
are one flat parameter, gathered once per forward and once per backward and reduced once, whether the
members are the two ends of a model (embedding and head, tied or not) or two sibling blocks; the
model trains in parity with the unsharded one, and its state dict, optimizer state dict and
`describe` name every parameter by its own FQN.

Upstream: test/distributed/_composable/fsdp/test_fully_shard_training.py (``fully_shard`` on a list of
modules) for the FSDP2 behaviour this follows.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import expecttest
import pytest
import torch
import torch.distributed as dist
from models import TinyGPT, gpt_batch, gpt_loss
from parity import error_text, local_slice, same_values, train_side_by_side
from torch import nn

from fsdp_composable import (
    StateDictType,
    describe,
    fully_shard,
    optim_state_dict,
    set_unshard_in_backward,
    state_dict_type,
)
from fsdp_composable._comm import _collectives


def _ends(m: nn.Module) -> nn.Module:
    """[embedding, head] as one unit, each block its own, then the root."""
    fully_shard([m.tok, m.head])
    for block in m.blocks:
        fully_shard(block)
    return fully_shard(m)


def _siblings(m: nn.Module) -> nn.Module:
    """The two blocks as one unit, then the root."""
    fully_shard([m.blocks[0], m.blocks[1]])
    return fully_shard(m)


_LAYOUTS: dict[str, Callable[[nn.Module], nn.Module]] = {"ends": _ends, "siblings": _siblings}


def _count_group_gathers(model: nn.Module, group_numel: int, batch: Any) -> tuple[int, int]:
    """All-gathers of the grouped unit's flat parameter in one forward and in one backward."""
    sizes: list[int] = []
    real = _collectives.all_gather

    def spy(out: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sizes.append(out.numel())
        return real(out, *args, **kwargs)

    _collectives.all_gather = spy  # type: ignore[assignment]
    try:
        loss = gpt_loss(model, batch)
        forward = sizes.count(group_numel)
        loss.backward()
    finally:
        _collectives.all_gather = real  # type: ignore[assignment]
    return forward, sizes.count(group_numel) - forward


def _grouped(layout: str, tied: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = TinyGPT(tied=tied, d=14)  # 37 rows: padded to whole rows per rank
    shard = _LAYOUTS[layout]
    r: dict[str, Any] = train_side_by_side(ref, shard, gpt_loss, gpt_batch, per_rank_batch=2, steps=3, optim="adamw")
    model = shard(copy.deepcopy(ref))
    first = model.tok if layout == "ends" else model.blocks[0]
    group = fully_shard.state(first).handles[0]
    r["members"] = [type(m).__name__ for m in group.members]
    r["padded"] = group.layout.padded_numel != group.layout.unpadded_numel
    batch = local_slice(gpt_batch(0, 2 * dist.get_world_size()), dist.get_rank(), dist.get_world_size())
    r["gathers"] = [_count_group_gathers(model, group.layout.padded_numel, batch) for _ in range(2)]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt.step()
    osd = optim_state_dict(model, opt)
    r["optim_keys"] = sorted(osd["state"]) == sorted(n for n, _ in ref.named_parameters())
    # FULL state dict round trip: another model's values in, the same values out, loadable back
    other = TinyGPT(tied=tied, d=14)
    model.load_state_dict(other.state_dict())
    r["round_trip"] = same_values(model.state_dict(), other.state_dict())
    plain = TinyGPT(tied=tied, d=14)
    plain.load_state_dict(model.state_dict(), strict=True)
    r["into_plain"] = same_values(plain.state_dict(), other.state_dict())
    loss_model, loss_plain = gpt_loss(model, batch).item(), gpt_loss(plain, batch).item()
    r["after_load"] = abs(loss_model - loss_plain)  # each rank's own batch: the same model computes the same
    r["units"] = [(u.fqn, u.param_fqns) for u in describe(model).units]
    return r


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("layout,tied", [("ends", False), ("ends", True), ("siblings", False)])
def test_several_modules_as_one_unit_train_in_parity(dist_run, world_size: int, layout: str, tied: bool) -> None:
    results = dist_run(world_size, _grouped, layout, tied)
    for r in results:
        assert r["keys_equal"] and r["shapes_equal"], r
        assert max(abs(a - b) for a, b in zip(r["ref_losses"], r["losses"])) < 1e-5, r
        assert r["max_weight_diff"] < 1e-5, r
        assert r["gathers"] == [(1, 1), (1, 1)], r  # one all-gather per phase for the whole group
        assert r["optim_keys"] and r["round_trip"] and r["into_plain"], r
        assert r["after_load"] < 1e-5, r
        if world_size == 4:  # rows 4 ranks do not divide: every rank's chunk padded to whole rows
            assert r["padded"], r
    units = dict(results[0]["units"])
    if layout == "ends":
        assert results[0]["members"] == ["Embedding", "Linear"]
        assert list(units) == ["", "tok", "blocks.0", "blocks.1"], units
        assert units["tok"] == ("tok.weight", "head.weight"), units
    else:
        assert results[0]["members"] == ["Block", "Block"]
        assert list(units) == ["", "blocks.0"], units
        assert {n.split(".")[1] for n in units["blocks.0"]} == {"0", "1"}, units


def _sharded_and_local(tied: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model, other = _ends(TinyGPT(tied=tied)), _ends(TinyGPT(tied=tied))
    with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = model.state_dict()
    r: dict[str, Any] = {"keys": list(sd) == list(TinyGPT(tied=tied).state_dict())}
    with state_dict_type(other, StateDictType.SHARDED_STATE_DICT):
        other.load_state_dict(sd)
    r["sharded_round_trip"] = same_values(other.state_dict(), model.state_dict())
    with state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        r["local"] = error_text(model.state_dict)
    r["full_after"] = same_values(other.state_dict(), model.state_dict())
    return r


def test_sharded_state_dict_round_trips_and_local_is_refused(dist_run) -> None:
    results = dist_run(2, _sharded_and_local, True)
    for r in results:
        assert r["keys"] and r["sharded_round_trip"] and r["full_after"], r
    expecttest.TestCase().assertExpectedInline(results[0]["local"], """ValueError: LOCAL_STATE_DICT cannot save or load the unit fully_shard made of several modules (Embedding, Linear): its flat shard has no single module to be keyed under. Use FULL_STATE_DICT or SHARDED_STATE_DICT""")  # noqa: E501


class _Skippable(nn.Module):
    """``b`` runs only when asked: a unit [a, b] whose second member may not run."""

    def __init__(self) -> None:
        super().__init__()
        # 42 + 49 elements: padded at 2 and 4 ranks
        self.a, self.mid, self.b = nn.Linear(5, 7), nn.Linear(7, 7), nn.Linear(7, 7, bias=False)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.mid(torch.relu(self.a(x)))
        return self.b(h) if use_b else h


def _member_skipped() -> dict[str, Any]:
    torch.manual_seed(0)
    ref = _Skippable()
    model = copy.deepcopy(ref)
    fully_shard([model.a, model.b])
    fully_shard(model)
    handle = fully_shard.state(model.a).handles[0]
    set_unshard_in_backward(model.b, False)  # a per-module control reaches the unit through any member
    switched = handle.switches.unshard_in_backward is False
    set_unshard_in_backward(model.b, True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    rank, world = dist.get_rank(), dist.get_world_size()
    diffs = []
    for step, use_b in enumerate([False, True, False]):
        x = torch.randn(2 * world, 5, generator=torch.Generator().manual_seed(step))
        ref(x, use_b).square().mean().backward()
        model(x[2 * rank : 2 * rank + 2], use_b).square().mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        diffs.append(not handle.is_unsharded)  # the root's post-forward resharded what b left
    sd, ref_sd = model.state_dict(), ref.state_dict()
    diff = max((sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd)
    padded = handle.layout.padded_numel > handle.layout.unpadded_numel == 91
    return {"switched": switched, "resharded": diffs, "diff": diff, "padded": padded}


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_member_that_does_not_run_is_finished_by_the_root(dist_run, world_size: int) -> None:
    for r in dist_run(world_size, _member_skipped):
        assert r["padded"] and r["switched"] and r["resharded"] == [True, True, True] and r["diff"] < 1e-6, r


def _bad_lists() -> dict[str, str]:
    m = TinyGPT()
    r = {
        "policy": error_text(lambda: fully_shard([m.tok, m.head], policy=lambda _: True)),
        "twice": error_text(lambda: fully_shard([m.tok, m.tok])),
        "nested": error_text(lambda: fully_shard([m.blocks, m.blocks[0]])),
        "empty": error_text(lambda: fully_shard([])),
    }
    fully_shard([m.tok, m.head])  # no enclosing fully_shard: forward says what to do
    r["no_root"] = error_text(lambda: m.tok(torch.zeros(2, dtype=torch.long)))
    return r


def test_bad_lists_of_modules_are_refused_on_every_rank(dist_run) -> None:
    results = dist_run(2, _bad_lists)
    assert results[0] == results[1]
    tc = expecttest.TestCase()
    r = results[0]
    tc.assertExpectedInline(r["policy"], """ValueError: fully_shard got a list of modules (Embedding, Linear) and a policy: a list is one unit, so it takes no policy. Call fully_shard on the submodules that should be units of their own first""")  # noqa: E501
    tc.assertExpectedInline(r["twice"], """ValueError: fully_shard got the same module twice in its list (Embedding, Embedding); list each module once""")  # noqa: E501
    tc.assertExpectedInline(r["nested"], """ValueError: fully_shard got a list (ModuleList, Block) where module 1 (Block) is inside module 0 (ModuleList); list only modules that do not contain each other (the outer one's unit already holds the inner one's parameters)""")  # noqa: E501
    tc.assertExpectedInline(r["empty"], """TypeError: fully_shard expects an nn.Module or a non-empty list of them, got a list of nothing""")  # noqa: E501
    tc.assertExpectedInline(r["no_root"], """RuntimeError: the unit fully_shard made of several modules (Embedding, Linear) ran forward without an enclosing fully_shard: apply fully_shard to a module that contains all of them (e.g. the whole model) before the first forward, and call that module""")  # noqa: E501
