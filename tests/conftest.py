from __future__ import annotations

import os
import sys
from typing import Iterator

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import DistPool  # noqa: E402

_pools: dict[int, DistPool] = {}


def get_pool(world_size: int) -> DistPool:
    if world_size not in _pools:
        _pools[world_size] = DistPool(world_size)
    return _pools[world_size]


@pytest.fixture(scope="session", autouse=True)
def _close_pools() -> Iterator[None]:
    yield
    for pool in _pools.values():  # every pool's ranks shut down at once, then each is waited for
        pool.ask_to_stop()
    for pool in _pools.values():
        pool.close()
    _pools.clear()


@pytest.fixture
def dist_run():
    """``dist_run(world_size, fn, *args)`` runs ``fn`` on every rank of a gloo pool."""

    def run(world_size: int, fn, *args, **kwargs):
        return get_pool(world_size).run(fn, *args, **kwargs)

    return run
