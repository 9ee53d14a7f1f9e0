"""One impl's measurement: spawn the ranks, time the steps, track one step, combine per-rank results.

[Note: what one rank does]
warm-up steps (not measured) -> measured steps, each preceded by a barrier and timed alone, with
the Python collective counter on -> one tracked step under `LiveBytesTracker` (with the dispatcher
collective counter), kept apart so the Python dispatch mode does not slow the timed steps ->
peak RSS from ``getrusage``. Each rank writes its result as JSON; the parent combines them: a step's
time is the slowest rank's, the reported time the median over measured steps.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import statistics
import tempfile
import time
import traceback
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks._comm_counter import CommCounter, DispatchCommCounter
from benchmarks._impls import Built, build
from benchmarks._mem_tracker import LiveBytesTracker
from benchmarks._model import ModelConfig, count_params, gpt_loss, make_batch
from benchmarks._profile import profile_call
from benchmarks._ranks import free_port, join_ranks, leave_rank

__all__ = ["run_impl"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_step(
    built: Built,
    cfg: ModelConfig,
    step: int,
    rank: int,
    device: torch.device,
    tracker: Optional[LiveBytesTracker] = None,
) -> float:
    idx, target = make_batch(cfg, step, rank)
    batch = (idx.to(device), target.to(device))
    built.optimizer.zero_grad(set_to_none=True)
    loss = gpt_loss(built.model, batch)
    if tracker is not None:
        tracker.mark("forward")
    loss.backward()
    if tracker is not None:
        tracker.mark("backward")
    built.optimizer.step()
    if tracker is not None:
        tracker.mark("optimizer")
    return float(loss.detach())


def _comm_thread_cpu() -> Optional[float]:
    """CPU seconds used so far by this process's communication threads (gloo's and NCCL's, which move
    the bytes off the Python thread); None where ``/proc`` does not list threads (not Linux)."""
    root = "/proc/self/task"
    if not os.path.isdir(root):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for tid in os.listdir(root):
        try:
            with open(f"{root}/{tid}/comm") as f:
                name = f.read().strip()
            if not name.startswith(("gloo", "pt_gloo", "pt_nccl", "nccl")):
                continue
            with open(f"{root}/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
        except OSError:  # the thread ended meanwhile
            continue
    return total


def _per_step(snapshot: dict[str, Any], steps: int) -> dict[str, Any]:
    out = dict(snapshot)
    out["payload_bytes"] = snapshot["payload_bytes"] / steps
    out["wire_bytes"] = snapshot["wire_bytes"] / steps
    out["payload_bytes_by_kind"] = {k: v / steps for k, v in snapshot["payload_bytes_by_kind"].items()}
    out["ops"] = {
        k: {
            **v,
            "calls": v["calls"] / steps,
            "payload_bytes": v["payload_bytes"] / steps,
            "wire_bytes": v["wire_bytes"] / steps,
        }
        for k, v in snapshot["ops"].items()
    }
    return out


def _measure(spec: dict[str, Any], rank: int, world: int, device: torch.device, counter: CommCounter) -> dict[str, Any]:
    cfg = ModelConfig(**spec["model"])
    distributed = dist.is_initialized()
    built = build(
        spec["impl"],
        cfg,
        strategy=spec["strategy"],
        forward_prefetch=True if spec.get("forward_prefetch") else None,
        bf16=spec["param_dtype"] == "bf16",
        device=device,
        world_size=world,
    )
    local_numel = sum(getattr(p, "_local_tensor", p).numel() for p in built.model.parameters())
    warmup, steps = spec["warmup"], spec["steps"]
    for i in range(warmup):
        _train_step(built, cfg, i, rank, device)
    counter.reset()
    times: list[float] = []
    cpu: list[float] = []  # this process's CPU seconds per step, every thread
    comm_cpu: list[Optional[float]] = []  # of which the communication threads'
    losses: list[float] = []
    for i in range(warmup, warmup + steps):
        if distributed:
            dist.barrier()
        _sync(device)
        c0, k0 = time.process_time(), _comm_thread_cpu()
        t0 = time.perf_counter()
        losses.append(_train_step(built, cfg, i, rank, device))
        _sync(device)
        times.append(time.perf_counter() - t0)
        k1 = _comm_thread_cpu()
        cpu.append(time.process_time() - c0)
        comm_cpu.append(k1 - k0 if k0 is not None and k1 is not None else None)
    comm_py = _per_step(counter.snapshot(), steps)

    counter.reset()
    dispatch = DispatchCommCounter(world)
    gc.collect()
    if distributed:
        dist.barrier()
    with LiveBytesTracker(on_op=dispatch.observe) as tracker:
        for label, tensors in built.labelled_tensors():
            tracker.add_existing(tensors, label)
        baseline_at_start = tracker.baseline
        t0 = time.perf_counter()
        tracked_loss = _train_step(built, cfg, warmup + steps, rank, device, tracker)
        tracked_time = time.perf_counter() - t0
    profile = None
    if spec["profile"]:  # one more step, every rank stepping, rank 0 under cProfile
        if distributed:
            dist.barrier()
        step = warmup + steps + 1
        if rank == 0:
            profile = profile_call(lambda: _train_step(built, cfg, step, rank, device))
        else:
            _train_step(built, cfg, step, rank, device)
    return {
        "status": "ok",
        "notes": built.notes,
        "profile_rank0": profile,
        "step_times_s": times,
        "cpu_times_s": cpu,
        "comm_thread_cpu_times_s": comm_cpu,
        "losses": losses,
        "tracked_step_loss": tracked_loss,
        "tracked_step_time_s": tracked_time,
        "local_param_numel": local_numel,
        "comm_py_api": comm_py,
        "comm_py_api_tracked_step": counter.snapshot(),
        "comm_dispatcher_tracked_step": dispatch.snapshot(),
        "peak_live_bytes": tracker.peak_bytes,
        "live_bytes_at_step_start": baseline_at_start,
        "live_bytes_before_step_incl_found_later": tracker.baseline,
        "peak_live_op": tracker.peak_op,
        "peak_live_bytes_by_phase": tracker.phase_peaks,
        "peak_live_sources_by_phase": tracker.peak_sources,
        "found_alive_bytes_by_op": tracker.found_alive,
        "found_transient_bytes_by_op": tracker.found_transient,
        "cuda_max_memory_allocated": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }


def _rank_main(rank: int, spec: dict[str, Any], out_dir: str) -> None:
    world = spec["procs"]
    torch.set_num_threads(spec["threads"])
    device = torch.device(f"cuda:{rank}" if spec["device"] == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    counter = CommCounter()
    result: dict[str, Any]
    try:
        if spec["impl"] != "local":
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
            backend = "nccl" if device.type == "cuda" else "gloo"
            timeout = datetime.timedelta(seconds=min(spec["timeout_s"], 120))
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        counter.install()  # after every module that binds a collective has been imported
        result = _measure(spec, rank, world, device, counter)
        result["patched_collectives"] = sorted({f"{m.__name__}.{a}" for m, a, _ in counter.patched})
        result["unavailable_collectives"] = counter.missing
    except Exception as e:
        result = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    finally:
        counter.uninstall()
    leave_rank(out_dir, rank, result)


def _combine(spec: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    failed = [r for r in ranks if r.get("status") != "ok"]
    if failed:
        return {"impl": spec["impl"], "status": "failed", "error": failed[0].get("error"), "per_rank": ranks}
    r0 = ranks[0]
    step_times = [max(r["step_times_s"][i] for r in ranks) for i in range(spec["steps"])]
    cpu_times = [statistics.fmean(r["cpu_times_s"][i] for r in ranks) for i in range(spec["steps"])]
    comm = [[r["comm_thread_cpu_times_s"][i] for r in ranks] for i in range(spec["steps"])]
    comm_cpu = [statistics.fmean(c) if None not in c else None for c in comm]
    return {
        "impl": spec["impl"],
        "status": "ok",
        "procs": spec["procs"],
        "notes": r0["notes"],
        "step_times_s": step_times,
        "median_step_time_s": statistics.median(step_times),
        "min_step_time_s": min(step_times),
        # CPU seconds per step, mean over ranks: all threads, and the communication threads alone
        "cpu_times_s": cpu_times,
        "comm_thread_cpu_times_s": comm_cpu,
        "losses_rank0": r0["losses"],
        "peak_live_bytes": max(r["peak_live_bytes"] for r in ranks),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "comm_py_api_per_step": r0["comm_py_api"],
        "comm_dispatcher_tracked_step": r0["comm_dispatcher_tracked_step"],
        "profile_rank0": r0.get("profile_rank0"),
        "per_rank": ranks,
    }


def run_impl(spec: dict[str, Any]) -> dict[str, Any]:
    """Spawn ``spec['procs']`` ranks for one impl and return the combined result (never raises on rank failure)."""
    spec = dict(spec, port=free_port())
    with tempfile.TemporaryDirectory(prefix="bench_step_") as out_dir:
        ctx = mp.start_processes(
            _rank_main, args=(spec, out_dir), nprocs=spec["procs"], join=False, start_method=spec["start_method"]
        )
        error = join_ranks(ctx, spec["timeout_s"])
        ranks = []
        for rank in range(spec["procs"]):
            path = os.path.join(out_dir, f"rank{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    ranks.append(json.load(f))
            else:
                ranks.append({"status": "failed", "error": error or "no result written"})
    result = _combine(spec, ranks)
    result["param_count"] = count_params_of(spec)
    return result


def count_params_of(spec: dict[str, Any]) -> int:
    from benchmarks._model import BenchGPT

    with torch.device("meta"):
        return count_params(BenchGPT(ModelConfig(**spec["model"])))
