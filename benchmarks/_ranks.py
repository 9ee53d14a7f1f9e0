"""Run one function on N forked gloo ranks (127.0.0.1) and collect what each returns.

Used by the benchmarks that time several variants inside the same ranks (`bench_safety.py`,
`bench_scaling.py`), so that variants can be interleaved round by round on the same processes.
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import socket
import statistics
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankFailed", "run_ranks"]


class RankFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join_ranks(ctx: Any, timeout_s: float) -> Optional[str]:
    """Wait for every rank started by ``ctx`` (torch.multiprocessing's context) until ``timeout_s``;
    kill the ranks still running then. Returns why some rank may have written no result (None: all
    exited in time)."""
    deadline = time.monotonic() + timeout_s
    error = None
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                error = f"timed out after {timeout_s}s"
                break
    except Exception as e:  # a rank died without writing its result
        error = f"{type(e).__name__}: {e}"
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
            p.join()
    return error


def _rank_main(
    rank: int, world: int, port: int, threads: int, fn: Callable[..., Any], args: tuple, out_dir: str
) -> None:
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result: dict[str, Any]
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
        result = {"status": "ok", "value": fn(rank, world, *args)}
    except Exception as e:
        result = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    leave_rank(out_dir, rank, result)


def leave_rank(out_dir: str, rank: int, result: dict[str, Any]) -> None:
    """Write a rank's ``result`` (with its peak RSS) to ``out_dir`` and leave the process group: cleanly
    after success, at once after a failure (peers may be stuck in a collective)."""
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        if result["status"] == "ok":
            dist.destroy_process_group()
        else:
            os._exit(0)


def run_ranks(
    world: int, fn: Callable[..., Any], args: tuple = (), threads: int = 1, timeout_s: float = 1800
) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` forked ranks of a gloo group; each rank's return value
    (JSON-able). Raises `RankFailed` with the first failing rank's traceback."""
    with tempfile.TemporaryDirectory(prefix="bench_ranks_") as out_dir:
        ctx = mp.start_processes(
            _rank_main,
            args=(world, free_port(), threads, fn, args, out_dir),
            nprocs=world,
            join=False,
            start_method="fork",
        )
        error = join_ranks(ctx, timeout_s)
        results = []
        for rank in range(world):
            path = os.path.join(out_dir, f"rank{rank}.json")
            if not os.path.exists(path):
                raise RankFailed(f"rank {rank}: {error or 'no result written'}")
            with open(path) as f:
                r = json.load(f)
            if r["status"] != "ok":
                raise RankFailed(f"rank {rank}: {r['error']}\n{r['traceback']}")
            value = r["value"]
            results.append({**value, "peak_rss_bytes": r["peak_rss_bytes"]} if isinstance(value, dict) else value)
    return results


def slowest_steps(ranks: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """Each timed step of ``name`` as its slowest rank's (``ranks``: each rank's result, whose
    ``times[name]`` lists its step times in order), with their median and minimum."""
    steps = [max(t) for t in zip(*(r["times"][name] for r in ranks))]
    return {"step_times_s": steps, "median_s": statistics.median(steps), "min_s": min(steps)}
