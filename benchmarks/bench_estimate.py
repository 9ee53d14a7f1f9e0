"""`estimate_memory()` against the measured peak of a training step, by model size and configuration.

Usage (see benchmarks/README.md, "estimate_memory against the measured peak"):
    python benchmarks/bench_estimate.py --sizes 10M,34M,97M --out benchmarks/results/estimate_vs_measured.json

For each size of `bench_scaling.py` (``--sizes``) and each configuration of ours (`CONFIGS`: every
strategy, bf16 mixed precision, ``reshard_after_forward=2``), on gloo ranks (2, or 4 for HYBRID_SHARD,
a 2 x 2 (replicate, shard) mesh, and for the int): the model is built and sharded, AdamW
(``foreach=True``) runs ``--warmup`` steps, and one more step runs under `LiveBytesTracker`; its
peak (the largest over ranks) is set beside `estimate_memory` of the same configuration (the model on
the meta device, one rank's batch and its loss, ``optimizer="adamw"``). The goal: estimate / measured within
0.9-1.1 everywhere. Writes a JSON file, a chart and a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Any, Optional

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import fsdp_composable  # noqa: E402
from benchmarks._impls import Built, _optimizer  # noqa: E402
from benchmarks._mem_tracker import LiveBytesTracker  # noqa: E402
from benchmarks._model import BenchGPT, Block, ModelConfig, count_params, loss_of_logits, make_batch  # noqa: E402
from benchmarks._ranks import run_ranks  # noqa: E402
from benchmarks._report import MIB, pyplot, save_run, wrote  # noqa: E402
from benchmarks.bench_scaling import QUICK_SIZES, SIZES  # noqa: E402
from benchmarks.bench_step import source_info  # noqa: E402

# name -> (world size, fully_shard keywords as strings: strategy, bf16, reshard_after_forward)
CONFIGS: dict[str, tuple[int, dict[str, Any]]] = {
    "FULL_SHARD": (2, {}),
    "FULL_SHARD bf16": (2, {"bf16": True}),
    "SHARD_GRAD_OP": (2, {"strategy": "SHARD_GRAD_OP"}),
    "SHARD_GRAD_OP bf16": (2, {"strategy": "SHARD_GRAD_OP", "bf16": True}),
    "NO_SHARD": (2, {"strategy": "NO_SHARD"}),
    "NO_SHARD bf16": (2, {"strategy": "NO_SHARD", "bf16": True}),
    "HYBRID_SHARD 2x2": (4, {"strategy": "HYBRID_SHARD"}),
    "HYBRID_SHARD 2x2 bf16": (4, {"strategy": "HYBRID_SHARD", "bf16": True}),
    "reshard_after_forward=2 (4 ranks)": (4, {"reshard_after_forward": 2}),
    "reshard_after_forward=2 (4 ranks) bf16": (4, {"reshard_after_forward": 2, "bf16": True}),
}


def _keywords(config: dict[str, Any]) -> dict[str, Any]:
    """fully_shard's (and estimate_memory's) keywords for a `CONFIGS` entry."""
    out: dict[str, Any] = {"strategy": fsdp_composable.ShardingStrategy[config.get("strategy", "FULL_SHARD")]}
    if config.get("bf16"):
        out["mixed_precision"] = fsdp_composable.MixedPrecision(param_dtype=torch.bfloat16)
    if "reshard_after_forward" in config:
        out["reshard_after_forward"] = config["reshard_after_forward"]
    return out


def estimate(cfg: ModelConfig, world_size: int, config: dict[str, Any]) -> fsdp_composable.MemoryEstimate:
    """`estimate_memory` of the configuration: the model on the meta device, one rank's batch, its loss."""
    with torch.device("meta"):
        model = BenchGPT(cfg)
    hybrid = config.get("strategy") == "HYBRID_SHARD"
    idx, target = make_batch(cfg, 0, 0)
    est = fsdp_composable.estimate_memory(
        model,
        policy=fsdp_composable.ModuleWrapPolicy({Block}),
        world_size=2 if hybrid else world_size,  # HYBRID_SHARD: the shard group's size
        optimizer="adamw",
        batch_example=idx,
        loss_fn=loss_of_logits(target),
        **_keywords(config),
    )
    return est


def _rank(rank: int, world: int, sizes: dict[str, dict[str, int]], names: list[str], warmup: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size, model_cfg in sizes.items():
        cfg = ModelConfig(**model_cfg)
        for name in names:
            config = CONFIGS[name][1]
            torch.manual_seed(0)
            model = BenchGPT(cfg)
            keywords = _keywords(config)
            if config.get("strategy") == "HYBRID_SHARD":
                keywords["process_group"] = init_device_mesh(
                    "cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard")
                )
            fsdp_composable.fully_shard(model, fsdp_composable.ModuleWrapPolicy({Block}), **keywords)
            built = Built(model, _optimizer(model.parameters()))
            for i in range(warmup):
                built.train_step(cfg, i, rank)
            gc.collect()
            dist.barrier()
            with LiveBytesTracker() as tracker:
                for label, tensors in built.labelled_tensors():
                    tracker.add_existing(tensors, label)
                built.train_step(cfg, warmup, rank)
            out[f"{size}/{name}"] = {"peak_live_bytes": tracker.peak_bytes, "phases": tracker.phase_peaks}
            del built, model, tracker
            gc.collect()
            if rank == 0:
                print(
                    f"[bench_estimate] {size} {name}: {out[f'{size}/{name}']['peak_live_bytes'] / MIB:.1f} MiB",
                    file=sys.stderr,
                    flush=True,
                )
    return out


def run(args: argparse.Namespace, sizes: dict[str, ModelConfig]) -> list[dict[str, Any]]:
    spec = {name: cfg.as_dict() for name, cfg in sizes.items()}
    measured: dict[str, int] = {}
    for world in sorted({CONFIGS[n][0] for n in args.config_list}):
        names = [n for n in args.config_list if CONFIGS[n][0] == world]
        ranks = run_ranks(world, _rank, (spec, names, args.warmup), args.threads)
        for key in (f"{size}/{name}" for size in sizes for name in names):
            measured[key] = max(r[key]["peak_live_bytes"] for r in ranks)
    rows = []
    for size, cfg in sizes.items():
        with torch.device("meta"):
            params = count_params(BenchGPT(cfg))
        for name in args.config_list:
            world, config = CONFIGS[name]
            est = estimate(cfg, world, config)
            got = measured[f"{size}/{name}"]
            rows.append(
                {
                    "size": size,
                    "params": params,
                    "config": name,
                    "world_size": world,
                    "estimated_peak_bytes": est.peak_bytes,
                    "measured_peak_bytes": got,
                    "ratio": est.peak_bytes / got,
                    "estimated_peak_moment": est.peak_moment,
                    "estimated_moments": est.moments,
                    "estimated_breakdown": est.breakdown,
                }
            )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | params | configuration | ranks | estimate (MiB) | its moment | measured peak/rank (MiB) "
        "| estimate / measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        flag = "" if 0.9 <= r["ratio"] <= 1.1 else " **outside 10 %**"
        lines.append(
            f"| {r['size']} | {r['params']:,} | {r['config']} | {r['world_size']} | "
            f"{r['estimated_peak_bytes'] / MIB:.1f} | {r.get('estimated_peak_moment', '-')} | "
            f"{r['measured_peak_bytes'] / MIB:.1f} | {r['ratio']:.3f}{flag} |"
        )
    return "\n".join(lines)


def write_plot(rows: list[dict[str, Any]], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == name]
        ax.plot([r["params"] / 1e6 for r in mine], [r["ratio"] for r in mine], "o-", label=name)
    ax.axhspan(0.9, 1.1, color="#dddddd", zorder=0)
    ax.set(xlabel="parameters (M)", ylabel="estimate / measured peak", xscale="log")
    ax.set_title("estimate_memory against the measured step peak per rank (grey: within 10 %)", fontsize=9)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.subplots_adjust(left=0.09, right=0.7, bottom=0.12)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_estimate.py", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10M,34M,97M", help=f"model sizes, from {', '.join(SIZES)}")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"from: {'; '.join(CONFIGS)} (comma-separated)")
    p.add_argument("--warmup", type=int, default=2, help="steps before the tracked one (the optimizer state exists)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="bench_scaling's tiny models, for smoke tests")
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "estimate_vs_measured.json"))
    args = p.parse_args(argv)
    args.config_list = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.config_list if c not in CONFIGS] + [s for s in args.sizes.split(",") if s not in SIZES]
    if unknown or args.warmup < 1:
        p.error(f"unknown --sizes/--configs {unknown}, or --warmup < 1 (the optimizer state must exist)")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    sizes = QUICK_SIZES if args.quick else {s: SIZES[s] for s in args.sizes.split(",")}
    source = source_info()  # before the run: the checkout may move while it runs
    rows = run(args, sizes)
    config = {"sizes": list(sizes), "configs": args.config_list, "warmup": args.warmup, "source": source}
    png = save_run(__file__, config, rows, args.out)
    write_plot(rows, png)
    print(format_table(rows))
    print(wrote(args.out, png))
    return 0 if all(0.9 <= r["ratio"] <= 1.1 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
