"""What `fully_shard` checks about ``ignored_modules`` before it builds any unit.

[Note: ignored modules across ranks]
Parameters of ignored modules stay whole on every rank and fully_shard never reduces their
gradients (FSDP1's rule): they are the user's. Two things would make that silently wrong, so both
are refused while sharding, on every rank:
- a parameter of an ignored module that a module fully_shard shards also registers (a tied
  weight): the sharded module would train a copy whose gradient each rank keeps to itself, so the
  ranks' copies drift apart. The error names both FQNs.
- ranks that ignore different modules build different units, whose collectives cannot match (FSDP1
  does not support it either). Every rank's ignored FQNs are gathered once per `fully_shard` call
  (one small ``all_gather_object`` on its groups, after the gloo header: [Note: collective
  headers]); a difference is a `ValueError` on every rank naming what each rank ignores.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch import nn

from fsdp_composable import _rank_agreement
from fsdp_composable._rank_agreement import Op

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
    module: nn.Module, ignored: set[nn.Module], groups: tuple[Optional[dist.ProcessGroup], ...], where: str
) -> None:
    """Raise on every rank of ``groups`` if their ranks ignore different modules (by FQN)."""
    names = sorted(name for name, sub in module.named_modules() if sub in ignored)
    for group in groups:
        if group is None or dist.get_world_size(group) <= 1:
            continue
        _rank_agreement.agree_before(group, Op.ALL_GATHER_OBJECT, 0, None, "check of ignored_modules", "fully_shard()")
        everyone: list[Optional[list[str]]] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, names, group=group)
        if any(other != names for other in everyone):
            ranks = dist.get_process_group_ranks(group)
            shown = "; ".join(f"rank {r}: {n}" for r, n in zip(ranks, everyone))
            raise ValueError(
                f"{where}: the ranks ignore different modules ({shown}). Every rank must build the same "
                "units: pass the same ignored_modules on every rank"
            )
