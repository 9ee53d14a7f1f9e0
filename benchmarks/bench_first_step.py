"""The first optimizer step against the next ones, by parameter count: AdamW over `DTensor`
parameters (ours, FSDP2), with ``foreach=True`` over one parameter group, over groups of at most
``--group-size`` parameters, and with its per-tensor loop.

Usage (see benchmarks/README.md, "the first optimizer step"):
    python benchmarks/bench_first_step.py --out benchmarks/results/first_step_ws2.json

torch plans each ``DTensor`` op once per distinct call and caches the plan; a ``foreach`` op over a list of
``DTensor``s is planned over the whole list, and that planning grows faster than the list, so the
first step of a model with many parameters pays it once, then the steps are fast. Parameter groups
bound the list a ``foreach`` op plans (AdamW runs its ops per group). For each impl, AdamW variant
and depth (blocks of width ``--d``, one unit each), fresh gloo ranks (forked: no plan cached yet)
build the model, then run ``--steps`` training steps and time each ``optimizer.step()`` alone (the
slowest rank's). Writes a JSON file, a PNG chart next to it, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Any, Optional

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._impls import build  # noqa: E402
from benchmarks._model import DEFAULT, ModelConfig, _heads, _width, gpt_loss, make_batch  # noqa: E402
from benchmarks._ranks import run_ranks, slowest_steps  # noqa: E402
from benchmarks._report import pyplot, save_run, wrote  # noqa: E402

# (impl, how AdamW runs: "foreach" over one group, "groups" of at most --group-size parameters, each
# foreach, or the per-tensor "loop"); plain tensors against the faces: bench_optimizer_step.py
MODES = ("foreach", "groups", "loop")
VARIANTS = tuple((impl, mode) for impl in ("ours", "torch-fsdp2") for mode in MODES)


def _rank(
    rank: int, world: int, model: dict[str, int], impl: str, mode: str, group_size: int, steps: int
) -> dict[str, Any]:
    cfg = ModelConfig(**model)
    built = build(impl, cfg, strategy="FULL_SHARD", bf16=False, device=torch.device("cpu"), world_size=world)
    params = [p for group in built.optimizer.param_groups for p in group["params"]]
    size = group_size if mode == "groups" else len(params)
    groups = [{"params": params[i : i + size]} for i in range(0, len(params), size)]
    optimizer = torch.optim.AdamW(groups, lr=1e-3, foreach=mode != "loop")
    times = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        gpt_loss(built.model, make_batch(cfg, step, rank)).backward()
        dist.barrier()
        t0 = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    return {"times": {"step": times}, "params": len(params), "groups": len(optimizer.param_groups)}


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for n_layers in args.layers:
        cfg = replace(DEFAULT, d=args.d, heads=_heads(args.d), n_layers=n_layers)
        for impl, mode in VARIANTS:
            work = (cfg.as_dict(), impl, mode, args.group_size, args.steps)
            ranks = run_ranks(args.world_size, _rank, work, args.threads)
            slowest = slowest_steps(ranks, "step")["step_times_s"]
            row = {
                "impl": impl,
                "mode": mode,
                "group_size": args.group_size if mode == "groups" else None,
                "blocks": n_layers,
                "params": ranks[0]["params"],
                "param_groups": ranks[0]["groups"],
                "first_s": slowest[0],
                "later_median_s": statistics.median(slowest[1:]),
                "step_times_s": slowest,
            }
            rows.append(row)
            print(
                f"[bench_first_step] {n_layers} blocks, {impl}, {_kind(row)}: first {row['first_s']:.2f} s",
                file=sys.stderr,
                flush=True,
            )
    return rows


def _kind(row: dict[str, Any]) -> str:
    if row["mode"] == "groups":
        return f"foreach, groups of <= {row['group_size']}"
    return "foreach" if row["mode"] == "foreach" else "per-tensor loop"


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| blocks | parameters | impl | AdamW | first step (s) | later steps (ms, median) | first / later |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["first_s"] / r["later_median_s"]
        lines.append(
            f"| {r['blocks']} | {r['params']} | {r['impl']} | {_kind(r)} | {r['first_s']:.2f} | "
            f"{1e3 * r['later_median_s']:.1f} | {ratio:.0f} |"
        )
    return "\n".join(lines)


def write_chart(rows: list[dict[str, Any]], path: str, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for impl, mode in VARIANTS:
        mine = [r for r in rows if r["impl"] == impl and r["mode"] == mode]
        if mine:
            label = f"{impl}, {_kind(mine[0])}"
            ax.plot([r["params"] for r in mine], [r["first_s"] for r in mine], marker="o", label=label)
    ax.set_xlabel("parameters")
    ax.set_ylabel("first optimizer step (s)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_first_step.py", description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (forked afresh for every row)")
    p.add_argument("--d", type=_width, default=128, help="block width")
    p.add_argument("--layers", default="16,32,64", help="comma-separated block counts")
    p.add_argument("--group-size", type=int, default=64, help="parameters per group in the grouped variant")
    p.add_argument("--steps", type=int, default=4, help="training steps per row (the first, then the later ones)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank")
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "first_step_ws2.json"), help="JSON path")
    args = p.parse_args(argv)
    try:
        args.layers = [int(x) for x in args.layers.split(",")]
    except ValueError:
        p.error(f"--layers must be comma-separated integers, got {args.layers!r}")
    if min([args.world_size, args.threads, args.group_size, *args.layers]) < 1 or args.steps < 2:
        p.error("--world-size, --threads, --group-size and --layers must be positive and --steps at least 2")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    rows = measure(args)
    png = save_run(__file__, {k: v for k, v in vars(args).items() if k != "out"}, rows, args.out)
    write_chart(rows, png, f"first AdamW step by parameter count, d={args.d}, world size {args.world_size}")
    print(format_table(rows))
    print(wrote(args.out, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
