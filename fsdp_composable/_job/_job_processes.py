"""The main job's rank processes: start them, wait for them, stop every one on a signal or a failure.

Standard library only: the process that starts the ranks never imports torch (each rank does).

[Note: how the main job stops its ranks]
`python -m fsdp_composable` starts its ranks with multiprocessing's fork method where the platform
has it (the main process has imported no torch and runs no thread, so a forked rank starts clean
and imports torch itself; elsewhere spawn) and then only waits for them. `raise_on_signals` turns
SIGINT (Ctrl-C) and SIGTERM into `Interrupted`, which ends the wait; `run_ranks` then sends
SIGTERM to every rank still running and SIGKILL to any that outlives `STOP_GRACE_S`, and the caller
prints one line and exits with 128 + the signal number (130 for Ctrl-C). Three details make "every
rank, within seconds" hold:
- The ranks ignore SIGINT. A Ctrl-C at the terminal reaches the whole foreground process group; N
  ranks each dying with a KeyboardInterrupt traceback is the wall of text this avoids, and the main
  process alone decides. SIGINT is blocked in the main process while it creates the ranks, and a
  forked process keeps the blocked mask, so they are born deaf to it until their first line sets
  it ignored; the main process receives a Ctrl-C of that moment as soon as it unblocks it. (spawn
  does not keep the mask: a spawned child unblocks SIGINT and imports the package, torch included,
  before any code of ours runs, so a Ctrl-C then printed a rank's traceback.)
- A rank whose main process is gone (killed with SIGKILL, which nothing can catch) sees its parent
  change within `PARENT_POLL_S` and exits: no orphan trains on.
- The first rank that fails writes its traceback to a file; the main process stops the others the
  same way and raises `RankFailed` with that traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Iterator, NoReturn

__all__: list[str] = []

STOP_GRACE_S = 3.0  # after SIGTERM, how long a rank may take to exit before SIGKILL
PARENT_POLL_S = 0.5  # how often a rank checks that the main process is still there


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the main process (a BaseException, as KeyboardInterrupt is)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.ranks_stopped = 0  # set by `run_ranks` on its way out

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


class RankFailed(Exception):
    """A rank exited with a non-zero status; ``details`` is its traceback, or how it ended."""

    def __init__(self, rank: int, details: str) -> None:
        super().__init__(f"rank {rank} {details}")
        self.rank = rank
        self.details = details


def _raise_interrupted(signum: int, frame: Any) -> NoReturn:
    raise Interrupted(signum)


def raise_on_signals() -> None:
    """SIGINT and SIGTERM raise `Interrupted` in this (the main) thread."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _raise_interrupted)


def exit_on_signals(message: Callable[[int], str]) -> None:
    """SIGINT and SIGTERM print ``message(signum)`` on stderr and end this process at once, with no
    teardown: for a process that is itself a rank, whose peers a launcher (or nobody) supervises."""

    def handler(signum: int, frame: Any) -> None:
        sys.stdout.flush()
        print(message(signum), file=sys.stderr, flush=True)
        os._exit(128 + signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Children created inside are born with SIGINT blocked; see [Note: how the main job stops its ranks]."""
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None:  # not POSIX: children inherit nothing, they set SIG_IGN themselves
        yield
        return
    mask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        mask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a Ctrl-C that came meanwhile is delivered now


def run_ranks(entry: str, nprocs: int, entry_args: tuple[Any, ...]) -> None:
    """Run ``module:function`` ``entry`` as ``function(rank, *entry_args)`` in ``nprocs`` new processes
    and return once every one has exited with status 0. On the first failure, or on `Interrupted`,
    every rank still running is stopped before `RankFailed` (or `Interrupted`) propagates."""
    methods = multiprocessing.get_all_start_methods()
    context: Any = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    procs: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="fsdp_composable-") as tmp:
        errors = [os.path.join(tmp, f"rank{rank}.traceback") for rank in range(nprocs)]
        try:
            with _sigint_blocked():
                for rank in range(nprocs):
                    proc = context.Process(
                        target=_rank_process,
                        args=(entry, rank, entry_args, errors[rank], os.getpid()),
                        name=f"rank {rank}",
                        daemon=True,  # should this process die of an exception, its exit stops them too
                    )
                    proc.start()
                    procs.append(proc)
            _wait(procs, errors)
        except Interrupted as e:
            e.ranks_stopped = len(procs)
            raise
        finally:
            _stop(procs)


def _wait(procs: list[Any], errors: list[str]) -> None:
    running = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    while running:
        for sentinel in multiprocessing.connection.wait(list(running)):
            rank = running.pop(sentinel)  # type: ignore[call-overload]
            proc = procs[rank]
            proc.join()
            if proc.exitcode != 0:
                raise RankFailed(rank, _how_it_ended(proc.exitcode, errors[rank]))


def _how_it_ended(exitcode: int, error_file: str) -> str:
    if os.path.isfile(error_file):
        with open(error_file, encoding="utf-8", errors="replace") as f:
            return f"failed:\n{f.read().rstrip()}"
    if exitcode < 0:
        name = signal.Signals(-exitcode).name
        why = " (the system may have run out of memory)" if -exitcode == signal.SIGKILL else ""
        return f"was killed by {name}{why}"
    return f"exited with status {exitcode} (its output above says why)"  # before it ran ``entry``


def _stop(procs: list[Any]) -> None:
    """SIGTERM to every rank still running, SIGKILL to those still there after `STOP_GRACE_S`."""
    alive = [proc for proc in procs if proc.is_alive()]
    if not alive:
        return
    ignored = {signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:  # a second Ctrl-C must not cut the stopping short
        for proc in alive:
            proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in alive:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in alive:
            if proc.is_alive():
                proc.kill()
            proc.join()
    finally:
        for signum, handler in ignored.items():
            signal.signal(signum, handler)


def _rank_process(entry: str, rank: int, entry_args: tuple[Any, ...], error_file: str, parent: int) -> NoReturn:
    """What a started process runs: ``entry`` for ``rank``; its traceback goes to ``error_file``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process alone answers Ctrl-C
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # forked: not the main process's handler
    threading.Thread(target=_exit_without_parent, args=(parent,), name="parent watch", daemon=True).start()
    module, _, function = entry.partition(":")
    try:
        getattr(importlib.import_module(module), function)(rank, *entry_args)
    except BaseException:
        with open(error_file, "w", encoding="utf-8") as f:
            f.write(traceback.format_exc())
        _flush_and_exit(1)
    _flush_and_exit(0)


def _exit_without_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def _flush_and_exit(status: int) -> NoReturn:
    """End without the interpreter's teardown: see `fsdp_composable._job.demo.spawned_rank`."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def interrupted_line(exc: Interrupted) -> str:
    """The one line the main process prints after `Interrupted`."""
    what = f"stopped all {exc.ranks_stopped} ranks" if exc.ranks_stopped else "no rank had started"
    return f"python -m fsdp_composable: interrupted by {signal.Signals(exc.signum).name}; {what}"
