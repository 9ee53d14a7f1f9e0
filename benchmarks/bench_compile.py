"""What torch.compile buys a sharded training step on the CPU: eager against compiled, after warm-up.

Usage (see benchmarks/README.md, "torch.compile"):
    python benchmarks/bench_compile.py --world-size 2 --rounds 10 --out benchmarks/results/compile_ws2.json

The ranks (gloo on 127.0.0.1, forked) build one copy of BenchGPT per variant, each from the same seed,
with AdamW (``foreach=True``), and train them on the same batches:

- ``eager``: ``fully_shard(model, ModuleWrapPolicy({Block}))``, nothing compiled;
- ``compiled blocks``: the same, then ``block.compile()`` for every block;
- ``compiled model``: the same, then ``model.compile()`` (the whole model);
- with ``--plain``, also ``plain eager`` and ``plain compiled``: the unsharded model in every rank's
  process, no communication, eager and ``model.compile()`` (what compiling buys the compute alone).

Each variant first runs ``--warmup`` untimed steps, one variant after another; its first step compiles
(its time is reported as ``first_step_s``, with the graphs and graph breaks dynamo counted in the
warm-up). Then each round times one step of each variant, in an order rotated every round; a step's time
is its slowest rank's, a variant's time the median over rounds, and its ratio to eager both the ratio
of the medians and the median of the rounds' ratios (steady on a machine whose load comes and goes).
The backend is inductor (``--backend``). Writes a JSON file, a PNG chart and a markdown table
(``.md``) next to it, and prints the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Optional

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._model import DEFAULT, SMALL, BenchGPT, Block, ModelConfig, gpt_loss, make_batch  # noqa: E402
from benchmarks._ranks import run_ranks, slowest_steps  # noqa: E402
from benchmarks._report import save_run, write_time_bars, wrote  # noqa: E402
from fsdp_composable import ModuleWrapPolicy, fully_shard  # noqa: E402

SHARDED = ("eager", "compiled blocks", "compiled model")
PLAIN = ("plain eager", "plain compiled")


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"[bench_compile] {text}", file=sys.stderr, flush=True)


def _build(variant: str, cfg: ModelConfig, backend: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = BenchGPT(cfg)
    if not variant.startswith("plain"):
        fully_shard(model, ModuleWrapPolicy({Block}))
    if variant == "compiled blocks":
        for block in model.blocks:
            block.compile(backend=backend)
    elif variant in ("compiled model", "plain compiled"):
        model.compile(backend=backend)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)


def _step(model: nn.Module, optim: torch.optim.Optimizer, cfg: ModelConfig, step: int, rank: int) -> float:
    optim.zero_grad(set_to_none=True)
    loss = gpt_loss(model, make_batch(cfg, step, rank))
    loss.backward()
    optim.step()
    return float(loss.detach())


def _rank(
    rank: int, world: int, model_cfg: dict[str, int], variants: list[str], backend: str, rounds: int, warmup: int
) -> dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    cfg = ModelConfig(**model_cfg)
    built = {v: _build(v, cfg, backend) for v in variants}
    info: dict[str, dict[str, Any]] = {}
    for v in variants:  # warm-up: the first step compiles
        counters.clear()
        first = 0.0
        for s in range(warmup):
            dist.barrier()
            t0 = time.perf_counter()
            _step(*built[v], cfg, s, rank)
            took = time.perf_counter() - t0
            first = first or took
            _say(rank, f"{v}: warm-up step {s + 1}/{warmup} took {took:.1f}s")
        info[v] = {
            "first_step_s": first,
            "graphs_compiled": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
        }
    times: dict[str, list[float]] = {v: [] for v in variants}
    losses: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            dist.barrier()
            t0 = time.perf_counter()
            loss = _step(*built[v], cfg, warmup + r, rank)
            times[v].append(time.perf_counter() - t0)
            losses[v].append(loss)
        _say(rank, f"round {r + 1}/{rounds}: " + ", ".join(f"{v} {1e3 * times[v][-1]:.0f} ms" for v in variants))
    torch._dynamo.reset()
    return {"times": times, "losses": losses, "info": info}


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    cfg = SMALL if args.small else DEFAULT
    variants = list(SHARDED) + (list(PLAIN) if args.plain else [])
    run_args = (cfg.as_dict(), variants, args.backend, args.rounds, args.warmup)
    ranks = run_ranks(args.world_size, _rank, run_args, args.threads)
    rows = []
    for v in variants:
        row: dict[str, Any] = {"variant": v, **ranks[0]["info"][v], **slowest_steps(ranks, v)}
        row["first_step_s"] = max(r["info"][v]["first_step_s"] for r in ranks)
        row["last_loss_rank0"] = ranks[0]["losses"][v][-1]
        rows.append(row)
    for row in rows:  # against the eager variant of the same kind (sharded or plain)
        kind = "plain eager" if row["variant"].startswith("plain") else "eager"
        base = next(r for r in rows if r["variant"] == kind)
        row["vs_eager"] = row["median_s"] / base["median_s"]
        # the median of the rounds' own ratios: each round's steps ran back to back, so a burst of load
        # from elsewhere on the machine slows both sides of a ratio alike
        pairs = zip(row["step_times_s"], base["step_times_s"])
        row["vs_eager_per_round"] = statistics.median(t / b for t, b in pairs)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | step (ms, median) | step (ms, min) | / its eager (medians) | / its eager (per round, median) "
        "| first step (s) | graphs | graph breaks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        median, low = 1e3 * r["median_s"], 1e3 * r["min_s"]
        lines.append(
            f"| {r['variant']} | {median:.0f} | {low:.0f} | {r['vs_eager']:.2f} | {r['vs_eager_per_round']:.3f} "
            f"| {r['first_step_s']:.1f} "
            f"| {r['graphs_compiled']} | {r['graph_breaks']} |"
        )
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_compile.py", description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (forked)")
    p.add_argument("--rounds", type=int, default=10, help="rounds; each times one step of each variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each variant first (the first compiles)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: no code generation)")
    p.add_argument("--plain", action="store_true", help="also the unsharded model in every rank, eager and compiled")
    p.add_argument("--small", action="store_true", help="the tiny model (smoke test)")
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "compile_ws2.json"), help="JSON path")
    args = p.parse_args(argv)
    if min(args.world_size, args.rounds, args.threads, args.warmup) < 1:
        p.error("--world-size, --rounds, --threads and --warmup must be positive (the first step compiles)")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    rows = measure(args)
    png = save_run(__file__, {k: v for k, v in vars(args).items() if k != "out"}, rows, args.out)
    cfg = SMALL if args.small else DEFAULT
    title = (
        f"training step, d={cfg.d} x {cfg.n_layers} blocks, world size {args.world_size}, gloo, "
        f"{args.backend}: median of {args.rounds}"
    )
    colors = ["tab:gray" if "eager" in r["variant"] else "tab:blue" for r in rows]
    write_time_bars([r["variant"] for r in rows], [1e3 * r["median_s"] for r in rows], colors, png, title, "ms / step")
    table = format_table(rows)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(table + "\n")
    print(table)
    print(wrote(args.out, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
