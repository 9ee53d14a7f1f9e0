"""The runtime's own work per unit per step does not grow with the number of units.

Counted, not timed: the Python function calls (cProfile) of one training step on rank 0, beyond
those of the same steps without sharding, divided by the number of units."""

from __future__ import annotations

import cProfile
import pstats

import torch
from torch import nn

from fsdp_composable import fully_shard


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def _calls_per_step(model: nn.Module, steps: int = 3) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 6)

    def step() -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):  # lazy init, the order check, the first iteration
        step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    return pstats.Stats(prof).total_calls / steps  # type: ignore[attr-defined]


def calls_per_unit(units: int) -> float:
    torch.manual_seed(0)
    plain = nn.Sequential(*(_Block() for _ in range(units)))
    torch.manual_seed(0)
    sharded = fully_shard(nn.Sequential(*(_Block() for _ in range(units))), lambda m: isinstance(m, _Block))
    return (_calls_per_step(sharded) - _calls_per_step(plain)) / units


def test_work_per_unit_does_not_grow_with_units(dist_run) -> None:
    few, many = dist_run(2, calls_per_unit, 4)[0], dist_run(2, calls_per_unit, 32)[0]
    assert many <= 1.05 * few, (few, many)
