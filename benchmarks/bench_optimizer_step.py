"""What the optimizer step alone costs over `DTensor` parameters (the faces) against plain tensors.

Usage (see benchmarks/README.md, "the optimizer step over DTensor parameters"):
    python benchmarks/bench_optimizer_step.py --world-size 2 --out benchmarks/results/optimizer_step_ws2.json

The ranks (gloo on 127.0.0.1, forked) build ``fully_shard(BenchGPT, ModuleWrapPolicy({Block}))`` with
AdamW and run one training step, so every parameter has a gradient. Then four AdamW optimizers step
the same memory: over the `DTensor` parameters the model registers (``faces``) or over plain
parameters aliasing each face's local tensor and gradient (``plain``, as the earlier 1-D-view design
was stepped), each with torch's default on the CPU (the per-tensor loop) and with ``foreach=True``.
Each round times one ``step()`` of each, in an order rotated every round; a time is the slowest
rank's, a variant's the median over rounds. Values are not checked (all update the same memory).
Writes a JSON file, a PNG chart next to it, and prints a markdown table.
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
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from benchmarks._impls import build  # noqa: E402
from benchmarks._model import ModelConfig, add_shape_args, config_of  # noqa: E402
from benchmarks._ranks import run_ranks, slowest_steps  # noqa: E402
from benchmarks._report import save_run, write_time_bars, wrote  # noqa: E402

VARIANTS = ("faces", "faces, foreach", "plain", "plain, foreach")


def _optimizers(model: nn.Module) -> dict[str, torch.optim.Optimizer]:
    """The four variants, each stepped once (its state made)."""
    faces = list(model.parameters())
    plain = []
    for p in faces:
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor)
        twin = nn.Parameter(p.to_local().detach())
        twin.grad = p.grad.to_local()
        plain.append(twin)
    out = {}
    for name in VARIANTS:
        params = faces if name.startswith("faces") else plain
        out[name] = torch.optim.AdamW(params, lr=1e-3, foreach=True if "foreach" in name else None)
        out[name].step()
    return out


def _rank(rank: int, world: int, model: dict[str, int], rounds: int, warmup: int) -> dict[str, Any]:
    cfg = ModelConfig(**model)
    built = build("ours", cfg, strategy="FULL_SHARD", bf16=False, device=torch.device("cpu"), world_size=world)
    built.train_step(cfg, 0, rank)
    optims = _optimizers(built.model)
    for _ in range(warmup):
        for optim in optims.values():
            optim.step()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(rounds):
        for name in VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]:
            dist.barrier()
            t0 = time.perf_counter()
            optims[name].step()
            times[name].append(time.perf_counter() - t0)
        if rank == 0 and (r + 1) % 5 == 0:
            print(f"[bench_optimizer_step] round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    count = len(list(built.model.parameters()))
    return {"times": times, "params": count}


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    cfg = config_of(args)
    ranks = run_ranks(args.world_size, _rank, (cfg.as_dict(), args.rounds, args.warmup), args.threads)
    rows = []
    for name in VARIANTS:
        rows.append({"variant": name, "params": ranks[0]["params"], **slowest_steps(ranks, name)})
    plain = rows[2]["median_s"]
    for row in rows:
        row["vs_plain"] = row["median_s"] / plain
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| AdamW over | parameters | step (ms, median) | step (ms, min) | / plain (per-tensor loop) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        median, low = 1e3 * r["median_s"], 1e3 * r["min_s"]
        lines.append(f"| {r['variant']} | {r['params']} | {median:.1f} | {low:.1f} | {r['vs_plain']:.2f} |")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_optimizer_step.py", description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (forked)")
    p.add_argument("--rounds", type=int, default=20, help="rounds; each times one step of each optimizer")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each first")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank")
    add_shape_args(p)
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "optimizer_step_ws2.json"), help="JSON path")
    args = p.parse_args(argv)
    if min(args.world_size, args.rounds, args.threads) < 1 or args.warmup < 0:
        p.error("--world-size, --rounds and --threads must be positive and --warmup not negative")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    rows = measure(args)
    png = save_run(__file__, {k: v for k, v in vars(args).items() if k != "out"}, rows, args.out)
    cfg = config_of(args)
    title = f"AdamW step alone, d={cfg.d} x {cfg.n_layers} blocks, world size {args.world_size}: median"
    colors = ["tab:blue", "tab:blue", "tab:gray", "tab:gray"]
    millis = [r["median_s"] * 1e3 for r in rows]
    write_time_bars([r["variant"] for r in rows], millis, colors, png, title, "ms / optimizer step")
    print(format_table(rows))
    print(wrote(args.out, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
