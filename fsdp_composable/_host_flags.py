"""Which parameters got a gradient on some rank, agreed on the host over a CPU group: no device sync.

[Note: presence flags agreed on the host]
Whether a parameter's ``.grad`` is None after backward is host state, and it must agree across ranks
([Note: which parameters got a gradient] in `_grad_presence`). Each rank's own flags are host
knowledge (autograd's ``.grad``, the accumulation hooks), so on a device other than the CPU (CUDA:
NCCL serves CUDA tensors only) they are summed as a small CPU tensor over a CPU group, and the end of
backward waits for that host collective instead of reading the device: a host wait on other ranks'
hosts, never a device synchronisation, whether or not a parameter lacked a gradient.

- The CPU group: the unit's group itself when it serves CPU tensors (``"cpu:gloo,cuda:nccl"``),
  else a companion over the same ranks on torch's default CPU backend (gloo), made once per set of
  ranks (`init_companions`, at lazy init, in the root's unit order on every rank: creating groups
  in different orders on two ranks would deadlock). It is made with ``use_local_synchronization``, so
  only the group's members take part (a model on a subgroup of the world works), and is kept in the
  registry for every later model over the same ranks (torch names such a group by its ranks alone).
- Which collectives: every reduction that carries flags (not a user's communication hook, not a unit
  alone, not a partial sum kept apart by ``set_requires_all_reduce(False)``: decided alike on every
  rank) issues its flags' all-reduce right after its gradient reduction is issued (`issue`), so the
  host collectives follow the device ones unit by unit: they can only disagree where those do.
  HYBRID_SHARD sums over the replicas second (`finish_many`: after the shard sum is known).
- Every issued flags collective is finished (`finish_many`), on the step's end and on an abandoned
  step alike: a rank whose backward fails after its last reduction was issued still takes part in
  the sum over replicas, so its peers are not left waiting for it.
On the CPU the flags ride with the gradient (no second collective) and their read is a host read
anyway, so none of this runs there (`on_host` is False).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from fsdp_composable import _collectives
from fsdp_composable._composable_state import companion_group

__all__: list[str] = []


def on_host(device: torch.device) -> bool:
    """Whether a unit computing on ``device`` agrees its flags over a CPU group (not on the device)."""
    return device.type != "cpu"


def init_companions(groups: Sequence[Optional[dist.ProcessGroup]]) -> None:
    """Make the CPU group of each of ``groups`` (in this order, on every rank), where it is needed."""
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            cpu_group(group)


def cpu_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """``group`` itself if it serves CPU tensors, else its companion on the default CPU backend."""
    if any(d.type == "cpu" for d in _collectives.served_devices(group)):
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    return companion_group(dist.group.WORLD, ranks, lambda: _new_companion(ranks))


def _new_companion(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    backend = dist.get_default_backend_for_device("cpu")
    group = dist.new_group(list(ranks), backend=backend, use_local_synchronization=True)
    assert isinstance(group, dist.ProcessGroup), f"this rank is not one of {ranks}"
    return group


@dataclass(eq=False)
class HostFlags:
    """One reduction's flags on their way: summed over the shard group (in flight from `issue`), then
    over the replicas (HYBRID_SHARD, by `finish_many`)."""

    values: torch.Tensor  # this rank's flags (int32, CPU); the sum over ranks once finished
    mine: list[bool]
    work: Optional[Any]
    replicas: Optional[dist.ProcessGroup]


def issue(got: Sequence[bool], group: dist.ProcessGroup, replicas: Optional[dist.ProcessGroup]) -> HostFlags:
    """Start summing this rank's flags over ``group`` (a host collective, async)."""
    values = torch.tensor([int(g) for g in got], dtype=torch.int32)
    work = dist.all_reduce(values, group=cpu_group(group), async_op=True) if dist.get_world_size(group) > 1 else None
    return HostFlags(values, list(got), work, replicas)


def finish_many(flags: Sequence[HostFlags]) -> None:
    """Wait for every shard sum, then sum over the replicas (all issued before any is waited for)."""
    for f in flags:
        work, f.work = f.work, None
        if work is not None:
            work.wait()
    for f in flags:
        group, f.replicas = f.replicas, None
        if group is not None and dist.get_world_size(group) > 1:
            f.work = dist.all_reduce(f.values, group=cpu_group(group), async_op=True)
    for f in flags:
        work, f.work = f.work, None
        if work is not None:
            work.wait()


def present(f: HostFlags) -> Optional[list[bool]]:
    """Which parameters have a gradient on some rank, once finished (None: all of them)."""
    if all(f.mine):
        return None
    return (f.values > 0).tolist()  # type: ignore[no-any-return]
