from __future__ import annotations

import gc
import os
import sys
from typing import Iterator

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed.tensor  # noqa: E402,F401
from harness import close_shared_pools, shared_pool  # noqa: E402

import fsdp_composable  # noqa: E402,F401

# torch (with sympy, which DTensor imports) lives as long as the session: Python's full collections,
# automatic or a test's gc.collect(), then walk only what the tests make
gc.freeze()


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
