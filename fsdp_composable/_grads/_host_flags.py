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
  HYBRID_SHARD sums over every rank of every replica at once, in a companion over the whole mesh
  (its ranks learnt at lazy init from the shard group's members' replicate groups), so each unit's
  flags take one host collective, issued with its reduction like the others.
- Which collectives: every reduction that carries flags (not a user's communication hook, not a unit
  alone, not a partial sum kept apart by ``set_requires_all_reduce(False)``: decided alike on every
  rank) issues its flags' all-reduce right after its gradient reduction is issued (`issue`), so the
  host collectives follow the device ones unit by unit: they can only disagree where those do, and
  a rank whose backward fails after issuing them leaves no peer waiting for one it never issued.
- Every issued flags collective is waited for (`finish_many`): at the end of backward, or when the
  step is abandoned (its work must not outlive the step).
On the CPU the flags ride with the gradient (no second collective) and their read is a host read
anyway, so none of this runs there (`on_host` is False).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from fsdp_composable._comm import _collectives
from fsdp_composable._composable_state import companion_group

__all__: list[str] = []


def on_host(device: torch.device) -> bool:
    """Whether a unit computing on ``device`` agrees its flags over a CPU group (not on the device)."""
    return device.type != "cpu"


def init_companions(groups: Sequence[tuple[dist.ProcessGroup, Optional[dist.ProcessGroup]]]) -> None:
    """Make the CPU group each (shard group, replicate group) of ``groups`` sums its flags over (in
    this order, on every rank)."""
    for group, replicas in groups:
        flags_group(group, replicas)


def flags_group(group: dist.ProcessGroup, replicas: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The CPU group over every rank whose gradients a unit's reduction sums: ``group``'s, or with
    ``replicas`` (HYBRID_SHARD) every rank of every replica (None: this rank alone)."""
    if replicas is not None:
        key = (tuple(dist.get_process_group_ranks(group)), tuple(dist.get_process_group_ranks(replicas)))
        return companion_group(dist.group.WORLD, key, lambda: _whole(group, replicas))
    return cpu_group(group) if dist.get_world_size(group) > 1 else None


def cpu_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """``group`` itself if it serves CPU tensors, else its companion on the default CPU backend."""
    if any(d.type == "cpu" for d in _collectives.served_devices(group)):
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    return companion_group(dist.group.WORLD, ranks, lambda: _new_companion(ranks))


def _whole(group: dist.ProcessGroup, replicas: dist.ProcessGroup) -> dist.ProcessGroup:
    """HYBRID_SHARD: the CPU group over the replicate groups of every rank of ``group`` (the whole
    mesh), learnt from the shard group's members (at lazy init: an object gather on the CPU)."""
    mine = dist.get_process_group_ranks(replicas)
    everyone: list[Any] = [mine]
    if dist.get_world_size(group) > 1:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=cpu_group(group))
    ranks = tuple(sorted({r for theirs in everyone for r in theirs}))
    return companion_group(dist.group.WORLD, ranks, lambda: _new_companion(ranks))


def _new_companion(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    backend = dist.get_default_backend_for_device("cpu")
    group = dist.new_group(list(ranks), backend=backend, use_local_synchronization=True)
    assert isinstance(group, dist.ProcessGroup), f"this rank is not one of {ranks}"
    return group


@dataclass(eq=False)
class HostFlags:
    """One reduction's flags on their way: summed over every rank its reduction sums (from `issue`)."""

    values: torch.Tensor  # this rank's flags (int32, CPU); the sum over ranks once finished
    mine: list[bool]
    work: Optional[Any]


def issue(got: Sequence[bool], group: dist.ProcessGroup, replicas: Optional[dist.ProcessGroup]) -> HostFlags:
    """Start summing this rank's flags over ``group`` (and ``replicas``): a host collective, async."""
    values = torch.tensor([int(g) for g in got], dtype=torch.int32)
    over = flags_group(group, replicas)
    work = dist.all_reduce(values, group=over, async_op=True) if over is not None else None
    return HostFlags(values, list(got), work)


def finish_many(flags: Sequence[HostFlags]) -> None:
    """Wait for every sum (a host wait on the other ranks' hosts, never on a device)."""
    for f in flags:
        work, f.work = f.work, None
        if work is not None:
            work.wait()


def present(f: HostFlags) -> Optional[list[bool]]:
    """Which parameters have a gradient on some rank, once finished (None: all of them)."""
    if all(f.mine):
        return None
    return (f.values > 0).tolist()  # type: ignore[no-any-return]
