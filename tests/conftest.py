from __future__ import annotations

import os
import sys
from typing import Iterator

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import close_shared_pools, shared_pool  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _close_pools() -> Iterator[None]:
    yield
    close_shared_pools()


@pytest.fixture
def dist_run():
    """``dist_run(world_size, fn, *args)`` runs ``fn`` on every rank of a gloo pool."""

    def run(world_size: int, fn, *args, **kwargs):
        return shared_pool(world_size).run(fn, *args, **kwargs)

    return run
