"""A pool of gloo ranks that stays up for the whole test session.

Importing torch costs seconds, so each world size gets one pool of worker processes, each with an
initialised gloo process group, forked from a server that imported torch once (`_context`). A test
sends a module-level function to every rank and gets each rank's return value back, or every rank's
traceback as one failure. A test that hangs is killed after its timeout and the pool restarts, so the
suite never hangs.
"""

from __future__ import annotations

import datetime
import gc
import os
import queue
import socket
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch.multiprocessing as mp

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RankError:
    rank: int
    text: str


def _worker(rank: int, world_size: int, port: int, tasks: Any, results: Any, pg_timeout_s: float) -> None:
    sys.path.insert(0, TESTS_DIR)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout_s))
    import torch.distributed.tensor  # noqa: F401  (with sympy: most of what a worker ever imports)

    import fsdp_composable  # noqa: F401

    # what the imports made lives as long as the worker: Python's full collections, which tests run
    # often (gc.collect() to count live bytes, and automatically), then walk only what the tests make
    gc.freeze()
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    gc.collect()  # free sharded models (reference cycles hold the group) before the group goes away
    dist.destroy_process_group()
    # The parent has every result already; the interpreter's own teardown of torch would take
    # seconds more, per rank, at the end of every session.
    os._exit(0)


def _context() -> Any:
    """Workers forked by a server that imported torch and the package once: a worker then starts in
    well under a second instead of importing them again (seconds of CPU per rank and per restart). The
    server is a fresh interpreter with no threads or process group of its own to inherit. ``torch._dynamo``
    is among them: torch imports it on the first ``DTensor`` built (its constructor is dynamo-disabled),
    which cost each worker seconds more."""
    ctx = mp.get_context("forkserver")
    preload = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.tensor", "fsdp_composable"]
    ctx.set_forkserver_preload(preload)
    return ctx


class DistPool:
    def __init__(self, world_size: int, pg_timeout_s: float = 60.0) -> None:
        self.world_size = world_size
        self.pg_timeout_s = pg_timeout_s
        self._start()

    def _start(self) -> None:
        ctx = _context()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, port, self._tasks[r], self._results, self.pg_timeout_s),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 180.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order."""
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out: dict[int, Any] = {}
        errors: list[RankError] = []
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while len(out) + len(errors) < self.world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            try:  # polled, so that a rank that died (a crash in C++) fails the test now, not at its timeout
                rank, ok, value = self._results.get(timeout=min(max(remaining, 0.01), 1.0))
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead or remaining <= 1.0:
                    self.restart()
                    what = f"rank(s) died (rank, exit code): {dead}" if dead else f"did not finish within {timeout}s"
                    done = f"; ranks that finished: {sorted(out)}, that raised: {[(e.rank, e.text) for e in errors]}"
                    raise TimeoutError(f"{fn.__name__} on {self.world_size} ranks: {what}{done}") from None
                continue
            if ok:
                out[rank] = value
            else:
                errors.append(RankError(rank, value))
        if errors:
            self.restart()  # a failed collective can leave the process group unusable
            text = "\n".join(f"--- rank {e.rank} ---\n{e.text}" for e in sorted(errors, key=lambda e: e.rank))
            raise AssertionError(f"{fn.__name__} failed on {len(errors)} rank(s):\n{text}")
        return [out[r] for r in range(self.world_size)]

    def restart(self) -> None:
        self.close(graceful=False)
        self._start()

    def ask_to_stop(self) -> None:
        """Let every rank leave its loop and destroy its group; `close` then waits for them."""
        for q in self._tasks:
            q.put(None)

    def close(self, graceful: bool = True) -> None:
        if graceful:
            self.ask_to_stop()  # a second None after an earlier ask_to_stop is never read
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join()


_shared: dict[tuple[int, float], DistPool] = {}


def shared_pool(world_size: int, pg_timeout_s: float = 60.0) -> DistPool:
    """The session's pool of ``world_size`` ranks whose groups time out after ``pg_timeout_s``:
    modules that need the same short timeout share one (each pool start imports torch per rank)."""
    key = (world_size, pg_timeout_s)
    if key not in _shared:
        _shared[key] = DistPool(world_size, pg_timeout_s)
    return _shared[key]


def close_shared_pools() -> None:
    for pool in _shared.values():  # every pool's ranks shut down at once, then each is waited for
        pool.ask_to_stop()
    for pool in _shared.values():
        pool.close()
    _shared.clear()


def error_of(fn: Callable[[], Any]) -> str:
    """``"Type: message"`` of what ``fn()`` raises on this rank, or "" if it returns."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares the text on every rank
        return f"{type(e).__name__}: {e}"
    return ""
