"""Several implementations side by side in the same ranks, their steps interleaved: paired step times.

Usage (see benchmarks/README.md, "paired steps"):
    python benchmarks/bench_paired.py --impls ours,ours-no-forward-prefetch,torch-fsdp2,local-ranks \
        --world-size 2 --out benchmarks/results/paired_ws2.json

`bench_step.py` runs each implementation in its own processes, one after another; on a shared
virtual machine its per-run medians drift by more than the few percent one setting changes. Here the
ranks (gloo on 127.0.0.1, forked) build every implementation once, each its own copy of the
benchmark model (same seed) with its own AdamW, then run ``--rounds`` rounds; each round runs one
timed step of every implementation, in an order rotated by one each round, so the machine's drift
hits them alike. ``local`` is the unsharded model stepped by rank 0 alone while the other ranks wait
at the next barrier (blocked, using no CPU: the process alone on the machine, as `bench_step.py`'s
``local``); ``local-ranks`` is it stepped by every rank at once; ``floor`` is ``local-ranks`` plus a
FULL_SHARD step's messages sent by hand and AdamW over shards (``benchmarks/_floor.py``): what the
bytes alone cost, without a library's bookkeeping. A step's time is the slowest rank's
(``local``: rank 0's); an implementation's time is the median over its steps, and each ratio is the
median of the per-round ratios to the first implementation listed; each rank's CPU seconds and minor
page faults per step (fresh pages from the kernel: docs/performance.md, "The CPU allocator") are
medians too. Writes a JSON file, a PNG chart next to it, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from typing import Any, Optional

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._impls import Built, build  # noqa: E402
from benchmarks._model import ModelConfig, add_shape_args, config_of  # noqa: E402
from benchmarks._ranks import run_ranks, slowest_steps  # noqa: E402
from benchmarks._report import save_run, write_time_bars, wrote  # noqa: E402

# name -> (impl of benchmarks._impls, ours' forward_prefetch: None is the library's default)
CHOICES: dict[str, tuple[str, Optional[bool]]] = {
    "ours": ("ours", None),
    "ours-no-forward-prefetch": ("ours", False),
    "ours-before": ("ours-before", None),  # an earlier commit's package: bench_before_after.py
    "torch-fsdp2": ("torch-fsdp2", None),
    "ddp": ("ddp", None),
    "local": ("local", None),
    "local-ranks": ("local-ranks", None),
    "floor": ("floor", None),
}
ALONE = "local"  # stepped by rank 0 only


def _rank(rank: int, world: int, model: dict[str, int], impls: list[str], rounds: int, warmup: int) -> dict[str, Any]:
    cfg = ModelConfig(**model)
    built: dict[str, Built] = {}
    mine = [name for name in impls if name != ALONE or rank == 0]
    for name in mine:
        impl, forward_prefetch = CHOICES[name]
        built[name] = build(
            impl,
            cfg,
            strategy="FULL_SHARD",
            bf16=False,
            device=torch.device("cpu"),
            world_size=world,
            forward_prefetch=forward_prefetch,
        )
    for name in mine:
        for i in range(warmup):
            built[name].train_step(cfg, i, rank)
    times: dict[str, list[float]] = {name: [] for name in impls}
    cpu_s: dict[str, list[float]] = {name: [] for name in impls}  # this process's CPU seconds (all threads)
    # minor page faults of this process: fresh pages the kernel maps and zeroes (see docs/performance.md,
    # "the CPU allocator")
    faults: dict[str, list[int]] = {name: [] for name in impls}
    for r in range(rounds):
        for name in impls[r % len(impls) :] + impls[: r % len(impls)]:
            dist.barrier()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c0, t0 = time.process_time(), time.perf_counter()
            if name in built:
                built[name].train_step(cfg, warmup + r, rank)  # every impl sees the same batches
            times[name].append(time.perf_counter() - t0)
            cpu_s[name].append(time.process_time() - c0)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        if rank == 0 and (r + 1) % max(1, rounds // 10) == 0:
            print(f"[bench_paired] round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    return {"times": times, "cpu": cpu_s, "faults": faults}


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    cfg = config_of(args)
    ranks = run_ranks(
        args.world_size, _rank, (cfg.as_dict(), args.impl_list, args.rounds, args.warmup), args.threads, args.timeout
    )
    stepping = {name: ranks[:1] if name == ALONE else ranks for name in args.impl_list}
    timed = {name: slowest_steps(stepping[name], name) for name in args.impl_list}
    first = timed[args.impl_list[0]]["step_times_s"]
    return [
        {
            "impl": name,
            **t,
            "ratio_to_first": statistics.median(s / f for s, f in zip(t["step_times_s"], first)),
            # CPU seconds per step (median) of each rank's process: for `local`, the waiting ranks' too
            "cpu_s_by_rank": [statistics.median(r["cpu"][name]) for r in ranks],
            "minor_faults_by_rank": [statistics.median(r["faults"][name]) for r in ranks],
        }
        for name, t in timed.items()
    ]


def format_table(rows: list[dict[str, Any]]) -> str:
    first = rows[0]["impl"]
    lines = [
        f"| impl | step (s, median) | step (s, min) | x {first} (median of rounds) | {first} / this "
        "| CPU/step by rank (s) | page faults/step by rank |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["ratio_to_first"]
        cpu = ", ".join(f"{c:.3f}" for c in r["cpu_s_by_rank"])
        faults = ", ".join(f"{f:.0f}" for f in r["minor_faults_by_rank"])
        lines.append(
            f"| {r['impl']} | {r['median_s']:.3f} | {r['min_s']:.3f} | {ratio:.3f} | {1 / ratio:.3f} | {cpu} "
            f"| {faults} |"
        )
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_paired.py", description=__doc__.splitlines()[0])
    p.add_argument(
        "--impls",
        default="ours,torch-fsdp2,local,local-ranks,floor",
        help=f"comma-separated, from {','.join(CHOICES)}; ratios are to the first",
    )
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (forked)")
    p.add_argument("--rounds", type=int, default=20, help="rounds; each runs one step of every impl")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each impl first")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed for the whole run")
    add_shape_args(p)
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "paired_ws2.json"), help="JSON path")
    args = p.parse_args(argv)
    args.impl_list = [name.strip() for name in args.impls.split(",") if name.strip()]
    unknown = [name for name in args.impl_list if name not in CHOICES]
    if unknown or not args.impl_list:
        p.error(f"--impls: unknown {unknown or 'empty list'}; choose from {','.join(CHOICES)}")
    if len(set(args.impl_list)) != len(args.impl_list):
        p.error(f"--impls lists one more than once: {args.impls}")
    if args.world_size < 2:
        p.error(f"--world-size must be at least 2, got {args.world_size}")
    if min(args.rounds, args.threads) < 1 or args.warmup < 0:
        p.error("--rounds and --threads must be positive and --warmup not negative")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    rows = measure(args)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "impl_list")}
    png = save_run(__file__, config, rows, args.out)
    cfg = config_of(args)
    title = f"d={cfg.d} x {cfg.n_layers} blocks, world size {args.world_size}: median step, steps interleaved"
    colors = ["tab:blue" if r["impl"].startswith("ours") else "tab:gray" for r in rows]
    write_time_bars([r["impl"] for r in rows], [r["median_s"] * 1e3 for r in rows], colors, png, title, "ms / step")
    print(format_table(rows))
    print(wrote(args.out, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
