"""Slow subprocess runs (docs examples, benchmarks) that a test module starts together.

Most of such a run is its interpreter importing torch on one core, so a module fixture starts the
runs of its *selected* tests (``-k`` picks a few, ``-x`` stops the rest) two at a time, and each test
checks its own run's result. Every run must have its own directory, store and port.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator, Mapping, TypeVar

import pytest

T = TypeVar("T")
AT_ONCE = 2


def selected_tests(request: pytest.FixtureRequest) -> set[str]:
    """The names (``test_x`` or ``test_x[id]``) of the requesting module's tests this session runs."""
    return {item.name for item in request.session.items if getattr(item, "module", None) is request.module}


@contextlib.contextmanager
def started_together(jobs: Mapping[str, Callable[[], T]], at_once: int = AT_ONCE) -> Iterator[dict[str, Future[T]]]:
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        runs = {name: pool.submit(job) for name, job in jobs.items()}
        try:
            yield runs
        finally:
            for run in runs.values():  # not started yet: the session stopped before its test
                run.cancel()
