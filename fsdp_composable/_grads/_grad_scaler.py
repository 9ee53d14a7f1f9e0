"""`ShardedGradScaler`: ``torch.amp.GradScaler`` whose skip decision every rank shares.

[Note: loss scaling of a sharded model]
``torch.amp.GradScaler`` unscales the gradients the optimizer holds and records, per device, whether
any was inf or NaN (``found_inf``); ``step`` skips the optimizer step where one was, and ``update``
lowers the scale. On a sharded model each rank holds only its slices of the gradients, so an inf in
one rank's slice is seen by that rank alone: it skips the step and lowers its scale while the others
step, and the replicas silently diverge. `ShardedGradScaler.unscale_` (which ``step`` calls when the
user did not) runs torch's own unscale and then takes the maximum of ``found_inf`` over the process
group (the whole world by default, which covers every unit's shard and replicate groups): one small
all-reduce on the communication device, no host synchronisation. Every rank then skips or steps
alike and keeps the same scale. The values are written in place into the ``found_inf`` tensors
torch's scaler keeps for the optimizer (the only place ``step`` and ``update`` read them); nothing
else of torch's scaler changes. It is a collective: call ``unscale_`` / ``step`` on every rank.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from fsdp_composable._comm import _collectives, _rank_agreement
from fsdp_composable._comm._rank_agreement import Op

__all__ = ["ShardedGradScaler"]

_ENTRY = "GradScaler.unscale_()"


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for a sharded model: an inf or NaN in any rank's gradient slices makes
    every rank skip the step and lower its scale (see [Note: loss scaling of a sharded model]).

    ``process_group``: the ranks that agree (default: every rank). The other arguments are
    ``torch.amp.GradScaler``'s."""

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self.process_group = process_group
        self._flag_device = torch.device(device)  # where the summed flags live before the collective

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """torch's unscale, then every rank takes the largest ``found_inf`` of the group."""
        super().unscale_(optimizer)
        if not self.is_enabled():
            return
        if not dist.is_initialized():
            return
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        assert group is not None  # the default group exists once initialised
        if dist.get_world_size(group) == 1:
            return
        found: dict[Any, torch.Tensor] = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        comm = _collectives.comm_device(group, self._flag_device)
        total = torch.zeros(1, dtype=torch.float32, device=comm)
        for flag in found.values():
            total += flag.to(device=comm, dtype=torch.float32)
        with _rank_agreement.entry_point(_ENTRY):
            _rank_agreement.agree_before(group, Op.ALL_REDUCE, 1, torch.float32, "found_inf all-reduce")
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        for flag in found.values():
            flag.copy_(total.reshape(flag.shape).to(flag.device))
