"""Off the CPU, which parameters got a gradient on some rank is agreed on the host: every rank's
flags summed as a CPU tensor over a CPU group ([Note: presence flags agreed on the host] in
``fsdp_composable/_host_flags.py``), never read back from the device. These runs take that path on
gloo ranks (the path a CUDA unit takes, forced on for CPU units) with the device flags' read refused,
and train next to the unsharded model as test_partial_grads.py does: a parameter unused on one rank
gets the reduced gradient on every rank, one unused on every rank keeps ``.grad`` None."""

from __future__ import annotations

from typing import Any, Sequence

import pytest
import torch
from test_partial_grads import train

from fsdp_composable import _grad_presence, _host_flags


def _refused(reduced_flags: Sequence[torch.Tensor]) -> list[list[bool]]:
    if reduced_flags:
        raise AssertionError(f"the presence flags of {len(reduced_flags)} units were read back from the device")
    return []


def train_on_host(strategy: str, schedule: str, accumulate: str) -> dict[str, Any]:
    real_on_host, real_read = _host_flags.on_host, _grad_presence.present_of_many
    _host_flags.on_host = lambda device: True  # type: ignore[assignment]
    _grad_presence.present_of_many = _refused  # type: ignore[assignment]
    try:
        return train("fully_shard", strategy, schedule, accumulate, native=True)
    finally:
        _host_flags.on_host = real_on_host  # type: ignore[assignment]
        _grad_presence.present_of_many = real_read  # type: ignore[assignment]


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
