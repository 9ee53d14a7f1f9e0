"""Benchmark one training step of a ~33.6M-parameter GPT-like model: fsdp_composable vs DDP vs torch FSDP2.

Usage (see benchmarks/README.md):
    python benchmarks/bench_step.py --impls local,ddp,torch-fsdp2,ours --world-size 2 \
        --out benchmarks/results/default_fp32.json

Per impl it reports the median step time, the peak live tensor bytes per rank (tracked per storage
in a separate step), the peak RSS per rank, and the bytes communicated per step per rank (counted by
wrapping the torch.distributed collectives, and by the c10d dispatcher ops), next to the theory.
Writes a JSON file, a PNG chart next to it, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Optional

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)  # so `benchmarks` and `fsdp_composable` import from a checkout

from benchmarks._impls import FSDP2_EQUIVALENT, HYBRID_SHARD_GROUP, IMPLS  # noqa: E402
from benchmarks._model import DEFAULT, SMALL  # noqa: E402
from benchmarks._report import (  # noqa: E402
    command_line,
    format_cpu_table,
    format_profile_table,
    format_table,
    machine_info,
    theory_bytes,
    write_chart,
    wrote,
)
from benchmarks._worker import run_impl  # noqa: E402

STRATEGIES = tuple(FSDP2_EQUIVALENT)  # FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, NO_SHARD
SHARDED = ("ours", "torch-fsdp2")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_step.py", description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--impl", choices=IMPLS, help="one implementation (default: ours)")
    which.add_argument("--impls", help=f"comma-separated implementations run one after another, from {','.join(IMPLS)}")
    p.add_argument("--world-size", type=int, default=2, help="ranks of every impl but local (which uses 1)")
    p.add_argument("--steps", type=int, default=6, help="measured steps (after --warmup steps)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps, not measured")
    p.add_argument(
        "--rounds", type=int, default=1, help="run every impl this many times, interleaved (order rotated per round)"
    )
    p.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="FULL_SHARD",
        help="sharding strategy of ours; torch-fsdp2 runs its equivalent (SHARD_GRAD_OP: reshard_after_forward="
        f"False; HYBRID_SHARD: both over a 2-D (replicate, shard={HYBRID_SHARD_GROUP}) mesh; FSDP2 has no "
        "NO_SHARD: compare it with ddp)",
    )
    p.add_argument(
        "--forward-prefetch", action="store_true", help="ours with forward_prefetch=True (default None: on with gloo)"
    )
    p.add_argument(
        "--param-dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: mixed precision (sharded impls)"
    )
    p.add_argument("--profile", action="store_true", help="cProfile one extra step on rank 0; summary in the JSON")
    p.add_argument("--small", action="store_true", help="a tiny model, for smoke tests")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu uses gloo, cuda uses nccl")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per process")
    p.add_argument(
        "--start-method",
        choices=("fork", "spawn", "forkserver"),
        default=None,
        help="how ranks are started (default: fork on cpu, which skips re-importing torch; spawn on cuda)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per impl before it is killed")
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "bench.json"), help="JSON path")
    p.add_argument("--png", default=None, help="chart path (default: --out with .png)")
    args = p.parse_args(argv)
    args.impl_list = _impl_list(p, args)
    if args.world_size < 1:
        p.error(f"--world-size must be >= 1, got {args.world_size}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.steps < 1 or args.warmup < 0:
        p.error(f"--steps must be >= 1 and --warmup >= 0, got --steps {args.steps} --warmup {args.warmup}")
    if args.strategy == "NO_SHARD" and "torch-fsdp2" in args.impl_list:
        p.error("torch FSDP2 has no NO_SHARD; compare ours' NO_SHARD with ddp (--impls ddp,ours)")
    hybrid_ranks = 2 * HYBRID_SHARD_GROUP
    if args.strategy == "HYBRID_SHARD" and (args.world_size % HYBRID_SHARD_GROUP or args.world_size < hybrid_ranks):
        p.error(
            f"--strategy HYBRID_SHARD shards over groups of {HYBRID_SHARD_GROUP} ranks and replicates across "
            f"at least 2: --world-size must be a multiple of {HYBRID_SHARD_GROUP}, at least {hybrid_ranks}"
        )
    if args.param_dtype == "bf16":
        unsupported = [i for i in args.impl_list if i not in SHARDED]
        if unsupported:
            p.error(f"--param-dtype bf16 applies to {' and '.join(SHARDED)} only; drop {','.join(unsupported)}")
    return args


def _impl_list(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    if args.impls is None:
        return [args.impl or "ours"]
    names = [s.strip() for s in args.impls.split(",") if s.strip()]
    unknown = [n for n in names if n not in IMPLS]
    if unknown or not names:
        p.error(f"--impls: unknown implementation(s) {unknown or args.impls!r}; choose from {','.join(IMPLS)}")
    return names


def _variant(impl: str, args: argparse.Namespace) -> str:
    parts = [args.strategy] if impl == "ours" else []
    if impl == "torch-fsdp2" and args.strategy != "FULL_SHARD":  # FULL_SHARD's equivalent: FSDP2's defaults
        parts.append(f"{args.strategy}: {FSDP2_EQUIVALENT[args.strategy]}")
    if impl == "ours" and args.forward_prefetch:
        parts.append("forward_prefetch")
    if impl in SHARDED and args.param_dtype == "bf16":
        parts.append("bf16")
    return ", ".join(parts)


def source_info() -> dict[str, Any]:
    """Which fsdp_composable was measured: the checkout's HEAD and a hash of the package sources as run."""
    digest = hashlib.sha256()
    package = os.path.join(_ROOT, "fsdp_composable")
    for path in sorted(glob.glob(os.path.join(package, "**", "*.py"), recursive=True)):
        with open(path, "rb") as f:  # named from the package (a top-level module: its file name, as before)
            digest.update(os.path.relpath(path, package).encode() + b"\0" + f.read())
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_ROOT, capture_output=True, text=True, timeout=10)
        commit = head.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"git_head": commit, "fsdp_composable_sources_sha256": digest.hexdigest()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = SMALL if args.small else DEFAULT
    source = source_info()  # the ranks are forked from this process and run the package it imported
    machine = machine_info()
    by_impl: dict[str, dict[str, Any]] = {}
    for rnd in range(args.rounds):  # impls interleaved: each round runs every impl, order rotated
        order = args.impl_list[rnd % len(args.impl_list) :] + args.impl_list[: rnd % len(args.impl_list)]
        if args.rounds > 1:
            print(f"[bench_step] round {rnd + 1}/{args.rounds}: {','.join(order)}", file=sys.stderr, flush=True)
        for impl in order:
            r = _run_one(impl, args, cfg)
            kept = by_impl.setdefault(impl, r)
            kept.setdefault("round_medians_s", []).append(r.get("median_step_time_s"))
            if kept is not r and r["status"] == "ok" and kept["status"] == "ok":
                kept["step_times_s"] = kept["step_times_s"] + r["step_times_s"]
                kept["median_step_time_s"] = statistics.median(kept["step_times_s"])
                kept["min_step_time_s"] = min(kept["step_times_s"])
                for key in ("cpu_times_s", "comm_thread_cpu_times_s"):
                    kept[key] = kept[key] + r[key]
            elif r["status"] != "ok":
                by_impl[impl] = {**r, "round_medians_s": kept["round_medians_s"]}
    results = [by_impl[impl] for impl in args.impl_list]
    return {
        "command": command_line(__file__),
        "machine": machine,
        "source": source,
        "config": {
            "model": cfg.as_dict(),
            "param_count": results[0]["param_count"] if results else None,
            "world_size": args.world_size,
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "strategy": args.strategy,
            "forward_prefetch": args.forward_prefetch,
            "param_dtype": args.param_dtype,
            "threads_per_process": args.threads,
            "optimizer": "AdamW(lr=1e-3)",
        },
        "results": results,
    }


def _run_one(impl: str, args: argparse.Namespace, cfg: Any) -> dict[str, Any]:
    spec = {
        "impl": impl,
        "procs": 1 if impl == "local" else args.world_size,
        "model": cfg.as_dict(),
        "steps": args.steps,
        "warmup": args.warmup,
        "strategy": args.strategy,
        "forward_prefetch": args.forward_prefetch,
        "param_dtype": args.param_dtype if impl in SHARDED else "fp32",
        "device": args.device,
        "threads": args.threads,
        "timeout_s": args.timeout,
        "profile": args.profile,
        "start_method": args.start_method or ("spawn" if args.device == "cuda" else "fork"),
    }
    t0 = time.monotonic()
    print(f"[bench_step] {impl}: {spec['procs']} process(es) ...", file=sys.stderr, flush=True)
    r = run_impl(spec)
    r["variant"] = _variant(impl, args)
    r["wall_s"] = time.monotonic() - t0
    r["theory"] = theory_bytes(
        impl, args.strategy, spec["procs"], r["param_count"], spec["param_dtype"], HYBRID_SHARD_GROUP
    )
    status = r["status"] if r["status"] == "ok" else f"FAILED ({r.get('error')})"
    print(f"[bench_step] {impl}: {status} in {r['wall_s']:.1f}s", file=sys.stderr, flush=True)
    return r


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    report = run(args)
    out_dir = os.path.dirname(args.out)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    png = args.png or os.path.splitext(args.out)[0] + ".png"
    cfg = report["config"]
    title = (
        f"{cfg['param_count']:,} params, world size {cfg['world_size']}, {cfg['param_dtype']}, "
        f"{report['machine']['cpu_count']} CPUs, torch {report['machine']['torch']}"
    )
    write_chart(report["results"], png, title)
    print(f"model: {cfg['param_count']:,} parameters; {cfg['model']}")
    print(format_table(report["results"]))
    print("\nCPU work per step and rank (all threads; the communication threads apart):")
    print(format_cpu_table(report["results"]))
    profile_table = format_profile_table(report["results"])
    if profile_table:
        print("\ncProfile of one step on rank 0, own time by area (s):")
        print(profile_table)
    print(wrote(args.out, png))
    return 0 if all(r["status"] == "ok" for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
