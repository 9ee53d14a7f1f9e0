"""What each cross-rank safety check costs in a training step: every check on, each one off, all off.

Usage (see benchmarks/README.md, "cost of the safety checks"):
    python benchmarks/bench_safety.py --world-size 2 --out benchmarks/results/safety_ws2.json

The ranks (gloo on 127.0.0.1, forked) build ``fully_shard(BenchGPT, ModuleWrapPolicy({Block}))`` with
AdamW once, then run ``--rounds`` rounds; each round runs ``--steps`` timed steps of every variant,
in an order rotated by one each round, so that drift of the machine hits every variant alike. A
variant turns checks off with the private `fsdp_composable._base._safety.switched_off` ([Note: safety
switches]): the same model and optimizer, only the checks differ. A step's time is the slowest
rank's; a variant's time is the median over its steps. The cost of a check is the all-on median
minus the median with that check off, as a share of the all-on step. Writes a JSON file, a PNG chart
next to it, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Optional

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._impls import build  # noqa: E402
from benchmarks._model import ModelConfig, add_shape_args, config_of  # noqa: E402
from benchmarks._ranks import run_ranks, slowest_steps  # noqa: E402
from benchmarks._report import save_run, write_time_bars, wrote  # noqa: E402
from fsdp_composable._base import _safety  # noqa: E402

VARIANTS: list[tuple[str, tuple[str, ...]]] = [
    ("every check on", ()),
    *((f"{name} off", (name,)) for name in _safety.NAMES),
    ("every check off", _safety.NAMES),
]


def _rank(rank: int, world: int, model: dict[str, int], rounds: int, steps: int, warmup: int) -> dict[str, Any]:
    cfg = ModelConfig(**model)
    built = build("ours", cfg, strategy="FULL_SHARD", bf16=False, device=torch.device("cpu"), world_size=world)
    step = 0
    for _ in range(warmup):
        built.train_step(cfg, step, rank)
        step += 1
    times: dict[str, list[float]] = {name: [] for name, _ in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for name, off in order:
            with _safety.switched_off(*off):
                for _ in range(steps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    built.train_step(cfg, step, rank)
                    times[name].append(time.perf_counter() - t0)
                    step += 1
        if rank == 0:
            print(f"[bench_safety] round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    return {"times": times}


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    cfg = config_of(args)
    ranks = run_ranks(args.world_size, _rank, (cfg.as_dict(), args.rounds, args.steps, args.warmup), args.threads)
    rows = []
    for name, off in VARIANTS:
        rows.append({"variant": name, "off": list(off), **slowest_steps(ranks, name)})
    on = rows[0]["median_s"]
    for row in rows:
        row["cost_s"] = on - row["median_s"]
        row["cost_share"] = row["cost_s"] / on
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | step (s, median) | step (s, min) | saved vs every check on (ms) | share of the step |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        share = "-" if not r["off"] else f"{100 * r['cost_share']:.1f} %"
        saved = "-" if not r["off"] else f"{1e3 * r['cost_s']:.1f}"
        lines.append(f"| {r['variant']} | {r['median_s']:.3f} | {r['min_s']:.3f} | {saved} | {share} |")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_safety.py", description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (forked)")
    p.add_argument("--rounds", type=int, default=6, help="rounds; each runs every variant once")
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank")
    add_shape_args(p)
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "safety_ws2.json"), help="JSON path")
    args = p.parse_args(argv)
    if args.world_size < 2:
        p.error(f"--world-size must be at least 2 (the headers run between ranks), got {args.world_size}")
    if min(args.rounds, args.steps, args.threads) < 1 or args.warmup < 0:
        p.error("--rounds, --steps and --threads must be positive and --warmup not negative")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    rows = measure(args)
    png = save_run(__file__, {k: v for k, v in vars(args).items() if k != "out"}, rows, args.out)
    cfg = config_of(args)
    title = f"ours, d={cfg.d} x {cfg.n_layers} blocks, world size {args.world_size}: median step by checks on/off"
    colors = ["tab:blue"] + ["tab:green"] * (len(rows) - 2) + ["tab:gray"]
    write_time_bars([r["variant"] for r in rows], [r["median_s"] * 1e3 for r in rows], colors, png, title, "ms / step")
    print(format_table(rows))
    print(wrote(args.out, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
