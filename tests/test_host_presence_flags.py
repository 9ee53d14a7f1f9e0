"""Off the CPU, which parameters got a gradient on some rank is agreed on the host: every rank's
flags summed as a CPU tensor over a CPU group ([Note: presence flags agreed on the host] in
``fsdp_composable/_grads/_host_flags.py``), never read back from the device. These runs take that path on
gloo ranks (the path a CUDA unit takes, forced on for CPU units) with the device flags' read refused,
and train next to the unsharded model as test_partial_grads.py does: a parameter unused on one rank
gets the reduced gradient on every rank, one unused on every rank keeps ``.grad`` None."""

from __future__ import annotations

from typing import Any, Sequence

import pytest
import torch
from test_partial_grads import train
from test_recovery import KINDS, recovery_matrix

from fsdp_composable._grads import _grad_presence, _host_flags


def _refused(reduced_flags: Sequence[torch.Tensor]) -> list[list[bool]]:
    if reduced_flags:
        raise AssertionError(f"the presence flags of {len(reduced_flags)} units were read back from the device")
    return []


def on_host(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` with the flags agreed on the host and their device read refused."""
    real_on_host, real_read = _host_flags.on_host, _grad_presence.present_of_many
    _host_flags.on_host = lambda device: True  # type: ignore[assignment]
    _grad_presence.present_of_many = _refused  # type: ignore[assignment]
    try:
        return fn(*args)
    finally:
        _host_flags.on_host = real_on_host  # type: ignore[assignment]
        _grad_presence.present_of_many = real_read  # type: ignore[assignment]


def train_on_host(strategy: str, schedule: str, accumulate: str) -> dict[str, Any]:
    return on_host(train, "fully_shard", strategy, schedule, accumulate, True)


@pytest.mark.parametrize(
    "world,strategy,schedule,accumulate",
    [
        (2, "FULL_SHARD", "steps", "plain"),
        (2, "NO_SHARD", "steps", "plain"),
        (2, "FULL_SHARD", "accumulate", "no_sync"),
        (4, "HYBRID_SHARD", "steps", "plain"),  # summed within the shard group, then across replicas
        (4, "HYBRID_SHARD", "accumulate", "no_sync"),
    ],
)
def test_flags_summed_on_the_host_give_ddps_grads(
    dist_run, world: int, strategy: str, schedule: str, accumulate: str
) -> None:
    for r in dist_run(world, train_on_host, strategy, schedule, accumulate):
        assert r["mismatches"] == []
        assert r["diff"] < 1e-12


def companion_sums() -> dict[str, Any]:
    """Groups that serve only CUDA (as NCCL; faked here): each gets a gloo companion over its ranks,
    made by its members alone (the other pair never calls for it), once, and the flags sum there."""
    import torch.distributed as dist

    from fsdp_composable._comm import _collectives

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    real = _collectives.served_devices
    _collectives.served_devices = lambda group: [torch.device("cuda")]  # type: ignore[assignment]
    try:
        _host_flags.init_companions([(mine, None)])
        companion = _host_flags.cpu_group(mine)
        flags = _host_flags.issue([rank == 0, rank == 3, False], mine, None)
        _host_flags.finish_many([flags])
        return {
            "companion": companion is not mine and _host_flags.cpu_group(mine) is companion,
            "ranks": dist.get_process_group_ranks(companion),
            "backend": dist.get_backend(companion),
            "present": _host_flags.present(flags),
        }
    finally:
        _collectives.served_devices = real  # type: ignore[assignment]


def test_companion_group_made_once_by_its_members(dist_run) -> None:
    results = dist_run(4, companion_sums)
    for rank, r in enumerate(results):
        pair = [0, 1] if rank < 2 else [2, 3]
        assert r["companion"] and r["ranks"] == pair and r["backend"] == "gloo", r
        mine = [rank == 0, rank == 3, False]
        summed = [pair[0] == 0, pair[1] == 3, False]
        assert r["present"] == (None if all(mine) else summed), r


def test_failed_step_on_host_leaves_no_trace_and_no_wait(dist_run) -> None:
    """A forward or backward that raises (a backward after the later units' reductions and their
    flags' sums were issued): every issued sum is finished on the abandoned step too, so the ranks
    stay matched, and training goes on bit for bit as without the failure (test_recovery.py)."""
    for bad in dist_run(2, on_host, recovery_matrix, "FULL_SHARD", KINDS, ["plain", "no_sync", "synced"]):
        assert bad == []
