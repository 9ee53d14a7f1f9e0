"""``reshard_after_forward=<int>``: after forward a unit stays sharded over a smaller group of ranks.

[Note: resharding to a smaller group]
FSDP2's ``reshard_after_forward=k`` (an int) trades memory for communication: after forward each
unit keeps 1/k of its unsharded parameters instead of 1/N, so the backward all-gather runs within a
group of k consecutive ranks (e.g. one node) instead of all N. As in FSDP2, ``k == 1`` means
``False`` (SHARD_GRAD_OP: nothing is freed after forward) and ``k == N`` means ``True``
(FULL_SHARD); otherwise k must divide N (``ValueError`` naming the module otherwise), and the
call is FULL_SHARD with a 1-D group. `init_post_forward_groups` creates the N/k groups of
consecutive ranks of the shard group with ``dist.new_group``, every rank creating all of them in the
same order (as ``new_group`` requires), and gives each FULL_SHARD unit of the call its rank's group.
The groups are made once per (shard group, k) and kept in the registry next to the group's other
record, so the per-block calls of a bottom-up model share them instead of creating N/k groups each.

The handle does the rest (`FlatParamHandle.reshard_to_post_forward_group`): post-forward copies
this rank's k-group slice of the padded unsharded flat parameter (the padded size is a multiple of N,
hence of k) and frees the unsharded storage; the next unshard (backward's, or a second forward call
of the unit) all-gathers those slices within the k-group into the unsharded buffer, which the
ordinary reshard then frees, the kept slice with it. Every reshard that is not post-forward's
(``no_grad`` forwards, the end of a step, an aborted step) drops the slice, and so do the start of
every root forward and an explicit ``unshard(module)``: a forward whose output was dropped leaves its
slices behind, and an optimizer step or a ``load_state_dict`` may change the shards after it. So the
next step starts from the shards. The root unit is resharded after forward only when the argument was given
(`reshard_root_if_given`), as in FSDP2.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch.distributed as dist
from torch import nn

from fsdp_composable._common_utils import _FSDPState
from fsdp_composable._composable_state import subgroup
from fsdp_composable._config import ShardConfig
from fsdp_composable.api import ShardingStrategy

__all__ = ["init_post_forward_groups", "reshard_root_if_given", "resolve_post_forward_ranks"]


def resolve_post_forward_ranks(module: nn.Module, args: ShardConfig, world_size: int) -> ShardConfig:
    """``args`` with an int ``reshard_after_forward`` resolved against the shard group's size: 1 is
    SHARD_GRAD_OP, ``world_size`` plain FULL_SHARD, any other divisor stays; raises before any collective
    (``args.api`` names the caller: `estimate_memory` resolves it the same way)."""
    k = args.reshard_after_forward_ranks
    if k is None:
        return args
    if args.strategy is not ShardingStrategy.FULL_SHARD:
        raise ValueError(
            f"{args.api}({type(module).__name__}): reshard_after_forward={k} (an int) needs "
            f"strategy=ShardingStrategy.FULL_SHARD with a 1-D process group, not {args.strategy.name}"
        )
    if k < 1 or k > world_size or world_size % k:
        raise ValueError(
            f"{args.api}({type(module).__name__}): reshard_after_forward={k} must be a divisor of the shard "
            f"group's size {world_size} (the number of consecutive ranks to stay sharded over after forward)"
        )
    if k == 1:
        return dataclasses.replace(args, strategy=ShardingStrategy.SHARD_GRAD_OP, reshard_after_forward_ranks=None)
    if k == world_size:
        return dataclasses.replace(args, reshard_after_forward_ranks=None)
    return args


def init_post_forward_groups(state: _FSDPState, k: Optional[int]) -> None:
    """Create the k-rank groups (every rank, all of them, in order) and give this rank's to each
    FULL_SHARD unit of ``state``."""
    if k is None:
        return
    mine = subgroup(state.process_group, k, lambda: _new_groups(state.process_group, k, state.rank))
    for handle in state.handles:
        if handle.config.reshards_to_post_forward_group and handle.layout.world_size > 1:
            handle.post_forward_group = mine


def reshard_root_if_given(state: _FSDPState, given: Union[bool, int, None]) -> None:
    """``reshard_after_forward`` given (True, or an int that still reshards) reshards the call's own
    unit after forward even when it is the model's root, as FSDP2 does; left out (None), the root unit
    stays unsharded after forward, since backward needs it first."""
    if given is None or given is False:
        return
    for handle in state.handles:
        if handle.module is state.module and handle.config.reshard_after_forward:
            handle.switches.reshard_after_forward = True  # as set_reshard_after_forward(unit, True) does


def _new_groups(group: dist.ProcessGroup, k: int, rank: int) -> dist.ProcessGroup:
    """Every group of k consecutive ranks of ``group`` (``new_group`` is called by every rank for
    every group), and the one holding ``rank``."""
    ranks = dist.get_process_group_ranks(group)
    mine: Optional[dist.ProcessGroup] = None
    for start in range(0, len(ranks), k):
        new = dist.new_group(ranks[start : start + k])
        if start <= rank < start + k:
            mine = new
    assert mine is not None
    return mine
