"""How step time and memory grow: with model size, with the number of units, and at world size 1.

Usage (see benchmarks/README.md, "scaling"):
    python benchmarks/bench_scaling.py --out benchmarks/results/scaling.json
    python benchmarks/bench_scaling.py --quick --out /tmp/scaling_quick.json      # smoke test, seconds

Three parts (``--parts``, default all), each with torch FSDP2 beside ours in the same run:
- ``sizes``: gloo ranks (forked) at each of ``--world-sizes``, the benchmark GPT (`_model.BenchGPT`,
  AdamW) at ``--sizes`` (about 10M to 305M parameters); per size, each impl (ours, torch FSDP2 and
  ``floor``: a FULL_SHARD step's bytes moved by hand, `_floor.py`) is built, runs ``--warmup`` then
  ``--steps`` timed steps, then one step under `LiveBytesTracker` (peak live tensor bytes per rank),
  and is freed before the next (two alive at once would double the memory of the largest size); the
  impls' order rotates from size to size. A step's time is the slowest rank's. The floor holds less
  memory than a sharded step (it drops each gathered copy at once), so only its time is compared.
- ``units``: one process as rank 0 of ``--fake-world-size`` ranks on torch's fake process group
  (collectives return at once), ``bench_overhead.py``'s residual MLP blocks at ``--units`` units, the
  three impls built at once and timed in ``--rounds`` interleaved rounds of ``--unit-steps`` steps: the
  runtime's own CPU time per step beyond the unsharded model (medians), and per unit; also forward +
  backward alone, and the SGD step alone (over `DTensor` parameters for both sharded impls).
- ``ws1``: one gloo rank, the default GPT, ``local`` (the unsharded model), ``ours`` and
  ``torch-fsdp2``, all built at once and run in ``--rounds`` interleaved rounds of ``--steps`` steps:
  each sharded impl's speed relative to the unsharded model (world size 1 makes ours NO_SHARD).
Writes a JSON file, a PNG plot next to it (three panels), and prints markdown tables.
"""

from __future__ import annotations

import argparse
import gc
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

from benchmarks import bench_overhead  # noqa: E402
from benchmarks._impls import Built, build  # noqa: E402
from benchmarks._mem_tracker import LiveBytesTracker  # noqa: E402
from benchmarks._model import DEFAULT, SMALL, ModelConfig, count_params  # noqa: E402
from benchmarks._ranks import run_ranks  # noqa: E402
from benchmarks._report import pyplot, save_run, wrote  # noqa: E402

_BASE = dict(vocab=8136, seq=128, batch_per_rank=4)
SIZES: dict[str, ModelConfig] = {
    "10M": ModelConfig(d=256, heads=8, n_layers=8, **_BASE),
    "34M": DEFAULT,
    "97M": ModelConfig(d=768, heads=8, n_layers=12, **_BASE),
    "218M": ModelConfig(d=1024, heads=8, n_layers=16, **_BASE),
    "305M": ModelConfig(d=1152, heads=8, n_layers=18, **_BASE),
}
QUICK_SIZES: dict[str, ModelConfig] = {"small": SMALL, "small-x2": ModelConfig(64, 48, 2, 3, 16, 2)}
SHARDED = ("ours", "torch-fsdp2")
SIZE_IMPLS = (*SHARDED, "floor")  # the sizes part: the floor's step beside the sharded impls'
_CPU = torch.device("cpu")


def _log(text: str) -> None:
    print(f"[bench_scaling] {text}", file=sys.stderr, flush=True)


def _timed(built: Built, cfg: ModelConfig, first: int, steps: int, rank: int, barrier: bool) -> list[float]:
    times = []
    for i in range(first, first + steps):
        if barrier:
            dist.barrier()
        t0 = time.perf_counter()
        built.train_step(cfg, i, rank)
        times.append(time.perf_counter() - t0)
    return times


# ---------------------------------------------------------------------------- sizes (gloo ranks)
def _floor_fits(cfg: ModelConfig, world: int) -> bool:
    """Whether ``world`` floor ranks fit in three quarters of this machine's memory: each holds the
    unsharded model and its gradients (it computes unsharded), a shard with AdamW's two states, the
    activations and what the impls before it left in the process; measured, a rank's RSS reached about
    five times the model's bytes (6.2 GB at 305M and 4 ranks, where the kernel killed one of them)."""
    from benchmarks._model import BenchGPT

    with torch.device("meta"):
        params = count_params(BenchGPT(cfg))
    per_rank = 4 * params * 5
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return world * per_rank <= 0.75 * physical


def _sizes_rank(rank: int, world: int, sizes: dict[str, dict[str, int]], steps: int, warmup: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n, (name, model) in enumerate(sizes.items()):
        cfg = ModelConfig(**model)
        for impl in SIZE_IMPLS[n % 3 :] + SIZE_IMPLS[: n % 3]:
            if impl == "floor" and not _floor_fits(cfg, world):
                if rank == 0:
                    _log(f"sizes: {world} ranks, {name} floor: skipped (its ranks would not fit in memory)")
                continue
            built = build(impl, cfg, strategy="FULL_SHARD", bf16=False, device=_CPU, world_size=world)
            for i in range(warmup):
                built.train_step(cfg, i, rank)
            times = _timed(built, cfg, warmup, steps, rank, barrier=True)
            dist.barrier()
            with LiveBytesTracker() as tracker:
                tracker.add_existing(built.existing_tensors())
                built.train_step(cfg, warmup + steps, rank)
            out[f"{name}/{impl}"] = {"times": times, "peak_live_bytes": tracker.peak_bytes}
            del built, tracker
            gc.collect()
            if rank == 0:
                _log(f"sizes: {world} ranks, {name} {impl}: median {statistics.median(times):.3f} s")
    return out


def run_sizes(args: argparse.Namespace, sizes: dict[str, ModelConfig]) -> list[dict[str, Any]]:
    from benchmarks._model import BenchGPT

    spec = {name: cfg.as_dict() for name, cfg in sizes.items()}
    rows = []
    for world in args.world_size_list:
        ranks = run_ranks(world, _sizes_rank, (spec, args.steps, args.warmup), args.threads)
        for name, cfg in sizes.items():
            with torch.device("meta"):
                params = count_params(BenchGPT(cfg))
            units = cfg.n_layers + 1  # a unit per block and the root's
            row: dict[str, Any] = {"size": name, "params": params, "units": units, "world_size": world}
            row["model"] = cfg.as_dict()
            for impl in SIZE_IMPLS:
                key = f"{name}/{impl}"
                if key not in ranks[0]:  # a floor that would not fit (`_floor_fits`)
                    row[impl] = None
                    continue
                per_step = [max(r[key]["times"][i] for r in ranks) for i in range(args.steps)]
                row[impl] = {
                    "step_times_s": per_step,
                    "median_s": statistics.median(per_step),
                    "peak_live_bytes": max(r[key]["peak_live_bytes"] for r in ranks),
                }
            row["ours_vs_fsdp2"] = row["ours"]["median_s"] / row["torch-fsdp2"]["median_s"]
            row["ours_vs_floor"] = row["ours"]["median_s"] / row["floor"]["median_s"] if row["floor"] else None
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------- units (fake process group)
def run_units(args: argparse.Namespace, units: list[int]) -> list[dict[str, Any]]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(args.threads)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world_size)
    rows = []
    try:
        for n in units:
            ns = argparse.Namespace(units=n, d=64, batch=8, steps=args.unit_steps, warmup=args.warmup + 1)
            row: dict[str, Any] = {"units": n}
            # every impl built at once and timed in interleaved rounds (order rotated), so a slow spell
            # of the machine falls on all three alike
            models = {
                impl: bench_overhead._shard(impl, bench_overhead._model(ns, _CPU), args.fake_world_size, _CPU)
                for impl in bench_overhead.IMPLS  # local, ours, torch-fsdp2
            }
            times: dict[str, list[tuple[float, float]]] = {impl: [] for impl in models}
            for r in range(args.rounds):
                order = list(models)[r % len(models) :] + list(models)[: r % len(models)]
                for impl in order:
                    times[impl] += bench_overhead._time_step_parts(models[impl], ns, _CPU)
            del models
            for impl, samples in times.items():
                row[impl] = statistics.median(a + b for a, b in samples)
                row[f"{impl}_fwd_bwd_s"] = statistics.median(a for a, _ in samples)
                row[f"{impl}_optim_s"] = statistics.median(b for _, b in samples)
            for impl in SHARDED:
                row[f"{impl}_overhead_s"] = row[impl] - row["local"]
                row[f"{impl}_per_unit_s"] = row[f"{impl}_overhead_s"] / n
                row[f"{impl}_fwd_bwd_per_unit_s"] = (row[f"{impl}_fwd_bwd_s"] - row["local_fwd_bwd_s"]) / n
            row["ours_vs_fsdp2_per_unit"] = row["ours_per_unit_s"] / row["torch-fsdp2_per_unit_s"]
            fwd_bwd = row["ours_fwd_bwd_per_unit_s"] / row["torch-fsdp2_fwd_bwd_per_unit_s"]
            row["ours_vs_fsdp2_fwd_bwd_per_unit"] = fwd_bwd
            rows.append(row)
            _log(f"units: {n}: ours {row['ours_per_unit_s'] * 1e6:.0f} us/unit, "
                 f"torch-fsdp2 {row['torch-fsdp2_per_unit_s'] * 1e6:.0f} us/unit")
    finally:
        dist.destroy_process_group()
    return rows


# ---------------------------------------------------------------------------- world size 1
def _ws1_rank(rank: int, world: int, model: dict[str, int], rounds: int, steps: int, warmup: int) -> dict[str, Any]:
    cfg = ModelConfig(**model)
    impls = ("local", *SHARDED)
    built = {impl: build(impl, cfg, strategy="FULL_SHARD", bf16=False, device=_CPU, world_size=1) for impl in impls}
    for b in built.values():
        for i in range(warmup):
            b.train_step(cfg, i, rank)
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for r in range(rounds):
        order = impls[r % len(impls) :] + impls[: r % len(impls)]
        for impl in order:
            times[impl] += _timed(built[impl], cfg, warmup + r * steps, steps, rank, barrier=False)
        _log(f"ws1: round {r + 1}/{rounds} done")
    return {"times": times}


def run_ws1(args: argparse.Namespace, cfg: ModelConfig) -> dict[str, Any]:
    (r,) = run_ranks(1, _ws1_rank, (cfg.as_dict(), args.rounds, args.steps, args.warmup), args.threads)
    medians = {impl: statistics.median(t) for impl, t in r["times"].items()}
    return {
        "model": cfg.as_dict(),
        "step_times_s": r["times"],
        "median_s": medians,
        "speed_vs_local": {impl: medians["local"] / medians[impl] for impl in SHARDED},
    }


# ---------------------------------------------------------------------------- report
def format_tables(report: dict[str, Any]) -> str:
    out = []
    if report.get("sizes"):
        out += [
            "| model | params | units | ranks | ours step (s) | FSDP2 step (s) | floor step (s) | ours / FSDP2 | "
            "ours / floor | ours peak live/rank (MiB) | FSDP2 peak live/rank (MiB) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in report["sizes"]:
            o, f, b = r["ours"], r["torch-fsdp2"], r["floor"]
            floor, vs_floor = (f"{b['median_s']:.3f}", f"{r['ours_vs_floor']:.2f}") if b else ("- (does not fit)", "-")
            out.append(
                f"| {r['size']} | {r['params']:,} | {r['units']} | {r['world_size']} | {o['median_s']:.3f} | "
                f"{f['median_s']:.3f} | {floor} | {r['ours_vs_fsdp2']:.2f} | {vs_floor} | "
                f"{o['peak_live_bytes'] / 2**20:.1f} | {f['peak_live_bytes'] / 2**20:.1f} |"
            )
        out.append("")
    if report.get("units"):
        out += [
            "| units | local step (ms) | ours step (ms) | FSDP2 step (ms) | ours per unit (µs) | FSDP2 per unit (µs) | "
            "ours / FSDP2 per unit | the same, forward + backward only | optimizer step (ms): local / ours / FSDP2 |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in report["units"]:
            out.append(
                f"| {r['units']} | {r['local'] * 1e3:.2f} | {r['ours'] * 1e3:.2f} | {r['torch-fsdp2'] * 1e3:.2f} | "
                f"{r['ours_per_unit_s'] * 1e6:.0f} | {r['torch-fsdp2_per_unit_s'] * 1e6:.0f} | "
                f"{r['ours_vs_fsdp2_per_unit']:.2f} | {r['ours_vs_fsdp2_fwd_bwd_per_unit']:.2f} | "
                f"{r['local_optim_s'] * 1e3:.2f} / {r['ours_optim_s'] * 1e3:.2f} / "
                f"{r['torch-fsdp2_optim_s'] * 1e3:.2f} |"
            )
        out.append("")
    if report.get("ws1"):
        w = report["ws1"]
        out += ["| world size 1 | step (s, median) | speed vs unsharded |", "|---|---|---|"]
        for impl, median in w["median_s"].items():
            speed = "1.00" if impl == "local" else f"{w['speed_vs_local'][impl]:.3f}"
            out.append(f"| {impl} | {median:.3f} | {speed} |")
    return "\n".join(out)


def write_plot(report: dict[str, Any], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = {"ours": "tab:blue", "torch-fsdp2": "tab:orange", "local": "tab:gray", "floor": "tab:green"}
    worlds = sorted({r["world_size"] for r in report.get("sizes", [])})
    for world, line in zip(worlds, ("o-", "s--", "^:")):
        rows = [r for r in report["sizes"] if r["world_size"] == world]
        params = [r["params"] / 1e6 for r in rows]
        for impl in SIZE_IMPLS:
            style = {"color": colors[impl], "label": f"{impl}, {world} ranks"}
            ran = [(p, r[impl]) for p, r in zip(params, rows) if r[impl]]
            axes[0].plot([p for p, _ in ran], [v["median_s"] for _, v in ran], line, **style)
            if impl in SHARDED:  # the floor drops each gathered copy at once: its memory is not a step's
                axes[1].plot(params, [r[impl]["peak_live_bytes"] / 2**20 for r in rows], line, **style)
    axes[0].set(xlabel="parameters (M)", ylabel="step (s, median)", title="step time, gloo ranks")
    axes[1].set(xlabel="parameters (M)", ylabel="peak live MiB per rank", title="peak memory per rank")
    if report.get("units"):
        units = [r["units"] for r in report["units"]]
        for impl in SHARDED:
            axes[2].plot(units, [r[f"{impl}_per_unit_s"] * 1e6 for r in report["units"]], "o-", color=colors[impl],
                         label=impl)
    axes[2].set(xlabel="units", ylabel="overhead per unit (µs)", title="fake process group, CPU time beyond unsharded")
    for ax in axes:
        if ax.lines:  # a part that did not run leaves its axes empty
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    if report.get("ws1"):
        speeds = ", ".join(f"{k} {v:.3f}x" for k, v in report["ws1"]["speed_vs_local"].items())
        fig.suptitle(f"world size 1, speed vs the unsharded model: {speeds}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_scaling.py", description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="sizes,units,ws1", help="comma-separated: sizes, units, ws1")
    p.add_argument("--sizes", default=",".join(SIZES), help=f"model sizes, from {', '.join(SIZES)}")
    p.add_argument("--world-sizes", default="2,4", help="gloo world sizes of the sizes part (comma-separated)")
    p.add_argument("--units", default="8,16,32,64,128", help="unit counts for the fake-process-group part")
    p.add_argument("--fake-world-size", type=int, default=8, help="world size the fake process group pretends")
    p.add_argument("--steps", type=int, default=3, help="timed steps per impl (per round for ws1)")
    p.add_argument("--unit-steps", type=int, default=20, help="timed steps per impl in the units part")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per impl first")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds of the ws1 and units parts")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per process")
    p.add_argument("--quick", action="store_true", help="tiny models, 2 and 4 units, one step: a smoke test")
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "scaling.json"), help="JSON path")
    args = p.parse_args(argv)
    args.part_list = [x for x in args.parts.split(",") if x]
    bad = [x for x in args.part_list if x not in ("sizes", "units", "ws1")]
    unknown = [s for s in args.sizes.split(",") if s not in SIZES]
    if bad:
        p.error(f"unknown --parts {bad}; choose from sizes, units, ws1")
    if unknown:
        p.error(f"unknown --sizes {unknown}; choose from {', '.join(SIZES)}")
    try:
        args.world_size_list = [int(w) for w in args.world_sizes.split(",")]
    except ValueError:
        p.error(f"--world-sizes must be comma-separated integers, got {args.world_sizes!r}")
    if min(args.world_size_list) < 2:
        p.error(f"--world-sizes must each be at least 2 (the sizes part shards across ranks), got {args.world_sizes}")
    if args.quick:
        args.steps, args.unit_steps, args.warmup, args.rounds = 1, 2, 1, 1
        args.world_size_list = [2]
    if min(args.steps, args.unit_steps, args.rounds, args.threads) < 1 or args.warmup < 0 or args.fake_world_size < 2:
        p.error("--steps, --unit-steps, --rounds and --threads must be positive, --warmup not negative, "
                "--fake-world-size at least 2")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    sizes = QUICK_SIZES if args.quick else {s: SIZES[s] for s in args.sizes.split(",")}
    units = [2, 4] if args.quick else [int(u) for u in args.units.split(",")]
    report: dict[str, Any] = {}
    if "sizes" in args.part_list:
        report["sizes"] = run_sizes(args, sizes)
    if "ws1" in args.part_list:
        report["ws1"] = run_ws1(args, SMALL if args.quick else DEFAULT)
    if "units" in args.part_list:  # last: it starts a fake process group in this process
        report["units"] = run_units(args, units)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "part_list", "world_size_list")}
    png = save_run(__file__, config, [report], args.out)
    write_plot(report, png)
    print(format_tables(report))
    print(wrote(args.out, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
