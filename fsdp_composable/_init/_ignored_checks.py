"""What `fully_shard` checks about ``ignored_modules`` before it builds any unit.

[Note: ignored modules across ranks]
Parameters of ignored modules stay whole on every rank and fully_shard never reduces their
gradients (FSDP1's rule): they are the user's. Two things would make that silently wrong, so both
are refused while sharding, on every rank:
- a parameter of an ignored module that a module fully_shard shards also registers (a tied
  weight): the sharded module would train a copy whose gradient each rank keeps to itself, so the
  ranks' copies drift apart. The error names both FQNs.
- ranks that ignore different modules build different units, whose collectives cannot match (FSDP1
  does not support it either). Each `fully_shard` call all-reduces a digest of the rank's sorted
  ignored FQNs (one two-number all-reduce per group, on the group's device, no pickling, so no
  numpy); only when the digests differ are the names themselves gathered, as bytes, for a
  `ValueError` on every rank naming what each rank ignores.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_composable._comm import _collectives, _rank_agreement

__all__: list[str] = []


def check_no_param_tied_to_ignored(module: nn.Module, ignored: set[nn.Module], where: str) -> None:
    """Raise if a parameter of an ignored module is also registered by a module that is not ignored."""
    owners: dict[nn.Parameter, str] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        if sub in ignored:
            for attr, param in sub._parameters.items():
                if param is not None:
                    owners.setdefault(param, f"{name}.{attr}" if name else attr)
    if not owners:
        return
    for name, sub in module.named_modules(remove_duplicate=False):
        if sub in ignored:
            continue
        for attr, param in sub._parameters.items():
            if param is not None and param in owners:
                fqn = f"{name}.{attr}" if name else attr
                raise ValueError(
                    f"{where}: parameter '{fqn}' is tied to '{owners[param]}' of an ignored module. Ignored "
                    "parameters' gradients are not reduced, so each rank would train its own copy of it. "
                    f"Ignore the module of '{fqn}' as well, untie them, or do not ignore the module of "
                    f"'{owners[param]}'"
                )


def check_ranks_ignore_alike(
    module: nn.Module,
    ignored: set[nn.Module],
    groups: tuple[Optional[dist.ProcessGroup], ...],
    where: str,
    device: Optional[torch.device] = None,
) -> None:
    """Raise on every rank of ``groups`` if their ranks ignore different modules (by FQN); ``device``:
    the compute device, whose communication device the check uses (not the current CUDA device)."""
    names = sorted(name for name, sub in module.named_modules() if sub in ignored)
    encoded = "\n".join(names).encode()
    digest = int.from_bytes(hashlib.sha256(encoded).digest()[:7], "big")
    for group in groups:
        if group is None or dist.get_world_size(group) <= 1:
            continue
        both = _collectives.comm_tensor([digest, -digest], group, device)  # max and -min in one all-reduce
        with _rank_agreement.entry_point("fully_shard()"):  # a new call: an earlier abandoned step is over
            _collectives.wait(_collectives.all_reduce(both, group, dist.ReduceOp.MAX), "the check of ignored_modules")
        high, minus_low = _collectives.host_values(both).tolist()
        if high == -minus_low:
            continue
        ranks = dist.get_process_group_ranks(group)
        with _rank_agreement.entry_point("fully_shard()"):
            names_of = _gather_bytes(group, encoded, both.device)
        shown = "; ".join(f"rank {r}: {n}" for r, n in zip(ranks, names_of))
        raise ValueError(
            f"{where}: the ranks ignore different modules ({shown}). Every rank must build the same "
            "units: pass the same ignored_modules on every rank"
        )


def _gather_bytes(group: dist.ProcessGroup, mine: bytes, device: torch.device) -> list[list[str]]:
    """Every rank's ``mine`` (newline-separated names), gathered as padded uint8 tensors on ``device``."""
    world = dist.get_world_size(group)
    length = _collectives.comm_tensor([len(mine)], group, device)
    lengths = torch.empty(world, dtype=torch.int64, device=length.device)
    _collectives.wait(_collectives.all_gather(lengths, length, group), "the check of ignored_modules")
    sizes = _collectives.host_values(lengths).tolist()
    width = max(max(sizes), 1)
    padded = torch.zeros(width, dtype=torch.uint8, device=length.device)
    padded[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8) if mine else padded[:0]
    everyone = torch.empty(world * width, dtype=torch.uint8, device=length.device)
    _collectives.wait(_collectives.all_gather(everyone, padded, group), "the check of ignored_modules")
    data = bytes(_collectives.host_values(everyone).tolist())
    texts = [data[i * width : i * width + n].decode() for i, n in enumerate(sizes)]
    return [t.split("\n") if t else [] for t in texts]
