"""``reshard_after_forward=<int>`` (FSDP2's name): after forward a unit stays sharded over groups of k
consecutive ranks, so backward all-gathers within k ranks. See [Note: resharding to a smaller group]
in ``fsdp_composable/_init/_post_forward_group.py``.

Upstream: test/distributed/_composable/fsdp/test_fully_shard_training.py::TestFullyShard1DTrainingCore
(``reshard_after_forward`` in (True, False, 2)) and test_fully_shard_comm.py (all-gather counts).
"""

from __future__ import annotations

from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
from models import Block, OddMLP, TinyGPT, gpt_batch, gpt_loss, mlp_batch, mlp_loss
from parity import error_text, local_slice, train_side_by_side
from torch import nn

from fsdp_composable import ModuleWrapPolicy, ShardingStrategy, fully_shard
from fsdp_composable._comm import _collectives


def _gpt_parity(k: int, optim: str) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = TinyGPT()

    def shard(m: nn.Module) -> nn.Module:
        return fully_shard(m, ModuleWrapPolicy({Block}), reshard_after_forward=k)

    return train_side_by_side(ref, shard, gpt_loss, gpt_batch, per_rank_batch=2, steps=3, optim=optim)


def _mlp_parity(k: int) -> dict[str, Any]:
    torch.manual_seed(1)
    ref = OddMLP()

    def shard(m: nn.Module) -> nn.Module:
        fully_shard(m.l2, reshard_after_forward=k)  # bottom-up by hand; every unit padded
        fully_shard(m.l3, reshard_after_forward=k)
        return fully_shard(m, reshard_after_forward=k)

    return train_side_by_side(ref, shard, mlp_loss, mlp_batch, per_rank_batch=3, steps=4, optim="adamw")


@pytest.mark.parametrize("world_size, k", [(2, 1), (2, 2), (4, 2)])
def test_reshard_to_k_ranks_trains_like_the_unsharded_model(dist_run, world_size, k) -> None:
    """Parity on the same global batch (padded units, a policy and bottom-up calls); k = 1 and k = N are
    FSDP2's False and True."""
    for fn, args in ((_gpt_parity, (k, "sgd")), (_mlp_parity, (k,))):
        for r in dist_run(world_size, fn, *args):
            assert r["keys_equal"] and r["shapes_equal"], r
            assert max(abs(a - b) for a, b in zip(r["ref_losses"], r["losses"])) < 1e-5, r
            assert r["max_weight_diff"] < 1e-5, r


def _count_all_gathers(k: Any) -> dict[str, Any]:
    """The group size of every all-gather in one forward and one backward."""
    torch.manual_seed(0)
    model = fully_shard(TinyGPT(), ModuleWrapPolicy({Block}), reshard_after_forward=k)
    batch = local_slice(gpt_batch(0, 8), dist.get_rank(), dist.get_world_size())
    gpt_loss(model, batch).backward()  # the first step also checks the ranks' order of units
    real = _collectives.all_gather
    sizes: dict[str, list[int]] = {"forward": [], "backward": []}
    phase = ["forward"]

    def spy(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, *rest: Any) -> Any:
        sizes[phase[0]].append(dist.get_world_size(group))
        return real(output, shard, group, *rest)

    _collectives.all_gather = spy  # type: ignore[assignment]
    try:
        loss = gpt_loss(model, batch)
        handles = [h for h in fully_shard.state(model).handles if h.module is not model]
        kept = [
            (h._post_forward_shard.numel() if h._post_forward_shard is not None else 0, h.layout.padded_numel)
            for h in handles
        ]
        freed = all(h._unsharded is not None and h._unsharded.untyped_storage().size() == 0 for h in handles)
        phase[0] = "backward"
        loss.backward()
    finally:
        _collectives.all_gather = real  # type: ignore[assignment]
    left = [h._post_forward_shard is not None for h in handles]
    return {"sizes": sizes, "kept": kept, "freed": freed, "left": left}


def test_backward_all_gathers_run_within_k_ranks(dist_run) -> None:
    """World size 4, k = 2: the forward gathers over 4 ranks, the backward of the two blocks and of the
    root unit (resharded too, as the argument was given on the root's call) over 2; after forward each
    block holds padded/2 elements and no unsharded storage; nothing is kept after backward. With True,
    backward gathers over 4."""
    for r in dist_run(4, _count_all_gathers, 2):
        assert r["sizes"] == {"forward": [4, 4, 4], "backward": [2, 2, 2]}, r
        assert all(n == padded // 2 for n, padded in r["kept"]) and r["freed"], r
        assert r["left"] == [False, False], r
    for r in dist_run(4, _count_all_gathers, True):
        assert r["sizes"] == {"forward": [4, 4, 4], "backward": [4, 4, 4]}, r


def _bad_values() -> dict[str, str]:
    def call(**kwargs: Any) -> str:
        return error_text(lambda: fully_shard(OddMLP(), **kwargs))

    return {
        "not a divisor": call(reshard_after_forward=3),
        "too large": call(reshard_after_forward=8),
        "not FULL_SHARD": call(reshard_after_forward=2, strategy=ShardingStrategy.NO_SHARD),
        "not an int": call(reshard_after_forward=2.0),
    }


def test_bad_reshard_after_forward_ints_are_refused_on_every_rank(dist_run) -> None:
    results = dist_run(4, _bad_values)
    assert all(r == results[0] for r in results)
    tc = expecttest.TestCase()
    tc.assertExpectedInline(results[0]["not a divisor"], """ValueError: fully_shard(OddMLP): reshard_after_forward=3 must be a divisor of the shard group's size 4 (the number of consecutive ranks to stay sharded over after forward)""")  # noqa: E501
    tc.assertExpectedInline(results[0]["too large"], """ValueError: fully_shard(OddMLP): reshard_after_forward=8 must be a divisor of the shard group's size 4 (the number of consecutive ranks to stay sharded over after forward)""")  # noqa: E501
    tc.assertExpectedInline(results[0]["not FULL_SHARD"], """ValueError: fully_shard: strategy=ShardingStrategy.NO_SHARD conflicts with reshard_after_forward=2 (which means ShardingStrategy.FULL_SHARD); pass only one of them""")  # noqa: E501
    tc.assertExpectedInline(results[0]["not an int"], """ValueError: fully_shard argument 'reshard_after_forward' must be True, False or an int (the number of ranks to stay sharded over after forward), got 2.0""")  # noqa: E501


class _Twice(nn.Module):
    """A block called twice per forward; the root unit (50 elements) is padded at 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.block = nn.Linear(7, 7)
        self.out = nn.Linear(7, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.block(torch.tanh(self.block(self.inp(x))))))


def _twice_and_no_grad() -> dict[str, Any]:
    torch.manual_seed(2)
    ref = _Twice()

    def shard(m: nn.Module) -> nn.Module:
        fully_shard(m.block, reshard_after_forward=2)
        return fully_shard(m, reshard_after_forward=2)

    r: dict[str, Any] = train_side_by_side(ref, shard, mlp_loss, mlp_batch, per_rank_batch=3, steps=3, optim="sgd")
    model = shard(_Twice())
    mlp_loss(model, mlp_batch(0, 4)).backward()  # the first step also checks the ranks' order of units
    real = _collectives.all_gather
    sizes: list[int] = []

    def spy(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, *rest: Any) -> Any:
        sizes.append(dist.get_world_size(group))
        return real(output, shard, group, *rest)

    _collectives.all_gather = spy  # type: ignore[assignment]
    try:
        loss = mlp_loss(model, mlp_batch(1, 4))
        r["forward"], sizes[:] = list(sizes), []
        loss.backward()
        r["backward"], sizes[:] = list(sizes), []
        with torch.no_grad():
            model(torch.randn(2, 5))
        r["no_grad"] = list(sizes)
    finally:
        _collectives.all_gather = real  # type: ignore[assignment]
    block, root = fully_shard.state(model.block).handles[0], fully_shard.state(model).handles[0]
    r["kept_after_no_grad"] = block._post_forward_shard is not None
    r["groups_shared"] = block.post_forward_group is root.post_forward_group is not None
    return r


def test_a_unit_called_twice_gathers_again_within_k_ranks_and_no_grad_keeps_nothing(dist_run) -> None:
    """World size 4, k = 2: the block's second call in forward and its backward gather within 2 ranks,
    and so does the root unit's backward (the argument was given on the root's call) (parity on the same
    global batch); a no_grad forward reshards fully and keeps no slice; the two calls share one set of
    subgroups."""
    for r in dist_run(4, _twice_and_no_grad):
        assert max(abs(a - b) for a, b in zip(r["ref_losses"], r["losses"])) < 1e-5, r
        assert r["max_weight_diff"] < 1e-5, r
        assert r["forward"] == [4, 4, 2] and r["backward"] == [2, 2], r
        assert r["no_grad"] == [4, 4, 4] and not r["kept_after_no_grad"], r
        assert r["groups_shared"], r  # one set of subgroups for every call with the same group and k
