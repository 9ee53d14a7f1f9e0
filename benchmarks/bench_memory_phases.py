"""What is alive at the peak of forward, backward and the optimizer step, and who holds it.

Usage (see benchmarks/README.md, "Memory by phase"):
    python benchmarks/bench_memory_phases.py --out benchmarks/results/memory_phases_fp32.json \
        --png docs/images/memory_phases_fp32.png

Runs ``ours`` and ``torch-fsdp2`` (one after another, ``--world-size`` gloo ranks, the benchmark GPT,
AdamW) through `bench_step.py`'s worker: ``--warmup`` steps, ``--steps`` timed ones, then one step under
`LiveBytesTracker`, which marks the end of forward (the loss), of backward and of the optimizer step and
names every storage alive at each phase's peak ([Note: what is alive at a peak] in `_mem_tracker.py`).
Each storage is put in one term (`TERMS`) by what it was between steps or by the phase and op that made
it. Beside them, `estimate_memory`'s terms for ours (the model on the meta device, one rank's batch).
Writes a JSON file, a stacked-bar chart (one bar per phase and impl, plus the estimate) and a table.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from benchmarks._impls import FSDP2_EQUIVALENT, HYBRID_SHARD_GROUP  # noqa: E402
from benchmarks._model import SMALL, BenchGPT, Block, ModelConfig, loss_of_logits, make_batch  # noqa: E402
from benchmarks._report import MIB, pyplot, save_run, wrote  # noqa: E402
from benchmarks._worker import run_impl  # noqa: E402
from benchmarks.bench_scaling import SIZES  # noqa: E402
from benchmarks.bench_step import source_info  # noqa: E402

PHASES = ("forward", "backward", "optimizer")
# term -> what it is; `term_of` decides which one a storage is in
TERMS: dict[str, str] = {
    "sharded parameters": "this rank's shard of every parameter, alive between steps",
    "optimizer state": "AdamW's exp_avg and exp_avg_sq of the shard, alive between steps",
    "unsharded parameters": "units all-gathered for forward or backward (storages regrown by resize_)",
    "made in forward": "what forward made and still holds: saved activations, the logits, the loss",
    "made in backward": "gradients: the unsharded ones of the unit in flight, the reduced shards, "
    "and the activations' gradients",
    "made in the optimizer step": "the optimizer's temporaries (foreach: one per parameter and op)",
    "other": "communication buffers and anything else",
}


def term_of(source: str) -> str:
    """The term of `TERMS` a storage with this source ([Note: what is alive at a peak]) belongs to."""
    if source in ("parameters", "flat parameters", "buffers"):
        return "sharded parameters"
    if source == "optimizer state":
        return "optimizer state"
    if source == "regrown by resize_":
        return "unsharded parameters"
    phase = source.split(":", 1)[0]
    if ":" in source and "found" not in source and phase in PHASES:
        return {"forward": "made in forward", "backward": "made in backward"}.get(phase, "made in the optimizer step")
    return "other"


def terms_by_phase(rank: dict[str, Any]) -> dict[str, dict[str, int]]:
    """One rank's result: phase -> term -> bytes alive at that phase's peak."""
    out: dict[str, dict[str, int]] = {}
    for phase in PHASES:
        terms = dict.fromkeys(TERMS, 0)
        for source, nbytes in rank["peak_live_sources_by_phase"][phase].items():
            terms[term_of(source)] += nbytes
        out[phase] = terms
    return out


def estimate(cfg: ModelConfig, world_size: int, strategy: str, bf16: bool) -> dict[str, Any]:
    """`estimate_memory` of ours' configuration, the model on the meta device and one rank's batch."""
    import fsdp_composable

    with torch.device("meta"):
        model = BenchGPT(cfg)
    mp = fsdp_composable.MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
    idx, target = make_batch(cfg, 0, 0)
    est = fsdp_composable.estimate_memory(
        model,
        policy=fsdp_composable.ModuleWrapPolicy({Block}),
        world_size=HYBRID_SHARD_GROUP if strategy == "HYBRID_SHARD" else world_size,
        strategy=fsdp_composable.ShardingStrategy[strategy],
        mixed_precision=mp,
        optimizer="adamw",
        batch_example=idx,
        loss_fn=loss_of_logits(target),
    )
    return {
        "peak_bytes": est.peak_bytes,
        "peak_moment": est.peak_moment,
        "moments": est.moments,
        "unsharded_at_backward_start": est.unsharded_at_backward_start,
        "breakdown": dict(est.breakdown),
    }


# moment of `MemoryEstimate.moments` -> the terms that make it up ([Note: the memory model])
MOMENT_TERMS: dict[str, tuple[str, ...]] = {
    "loss": (
        "sharded_params",
        "optimizer_state",
        "unsharded_params",
        "activations",
        "post_forward_shards",
        "output_and_loss",
    ),
    "backward": (
        "sharded_params",
        "optimizer_state",
        "unsharded_params",
        "unsharded_grads",
        "activations",
        "post_forward_shards",
    ),
    "backward_end": ("sharded_params", "optimizer_state", "unsharded_params", "unsharded_grads", "sharded_grads"),
    "optimizer_step": ("sharded_params", "optimizer_state", "sharded_grads", "optimizer_step"),
}


def peak_terms(result: dict[str, Any]) -> dict[str, int]:
    """The terms of `estimate_memory`'s breakdown that make up its peak_bytes: those of its peak moment
    (at ``loss`` only the units kept unsharded after their forward count as unsharded_params)."""
    breakdown = result["breakdown"]
    terms = {k: breakdown[k] for k in MOMENT_TERMS[result["peak_moment"]] if k in breakdown}
    if result["peak_moment"] == "loss":
        terms["unsharded_params"] = result["unsharded_at_backward_start"]
    return terms


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    cfg = SMALL if args.small else SIZES[args.size]
    results = []
    for impl in args.impl_list:
        spec = {
            "impl": impl,
            "procs": args.world_size,
            "model": cfg.as_dict(),
            "steps": args.steps,
            "warmup": args.warmup,
            "strategy": args.strategy,
            "forward_prefetch": False,  # ours: the library's default (None)
            "param_dtype": args.param_dtype,
            "device": "cpu",
            "threads": args.threads,
            "timeout_s": args.timeout,
            "profile": False,
            "start_method": "fork",
        }
        print(f"[bench_memory_phases] {impl} ...", file=sys.stderr, flush=True)
        r = run_impl(spec)
        if r["status"] != "ok":
            raise RuntimeError(f"{impl} failed: {r.get('error')}")
        ranks = r["per_rank"]
        results.append(
            {
                "impl": impl,
                "peak_live_bytes": r["peak_live_bytes"],
                "terms_by_phase_rank0": terms_by_phase(ranks[0]),
                "terms_by_phase_by_rank": [terms_by_phase(x) for x in ranks],
                "peak_by_phase_by_rank": [x["peak_live_bytes_by_phase"] for x in ranks],
                "sources_by_phase_rank0": ranks[0]["peak_live_sources_by_phase"],
                "peak_rss_bytes_by_rank": [x["peak_rss_bytes"] for x in ranks],
            }
        )
    results.append({"impl": "estimate_memory (ours)", **estimate(cfg, args.world_size, args.strategy, args.bf16)})
    return results


def format_table(results: list[dict[str, Any]]) -> str:
    """Rank 0's bytes alive at each phase's peak, by term, MiB; the estimate's terms below."""
    measured = [r for r in results if "terms_by_phase_rank0" in r]
    cols = [(r["impl"], phase) for r in measured for phase in PHASES]
    lines = [
        "| term | " + " | ".join(f"{impl}: {phase}" for impl, phase in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for term in TERMS:
        cells = [r["terms_by_phase_rank0"][phase][term] / MIB for r in measured for phase in PHASES]
        if any(cells):
            lines.append(f"| {term} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    totals = [sum(r["terms_by_phase_rank0"][phase].values()) / MIB for r in measured for phase in PHASES]
    lines.append("| **peak of the phase** | " + " | ".join(f"**{t:.1f}**" for t in totals) + " |")
    for r in results:
        if "breakdown" in r:
            terms = ", ".join(f"{k} {v / MIB:.1f}" for k, v in r["breakdown"].items())
            moments = ", ".join(f"{k} {v / MIB:.1f}" for k, v in r["moments"].items())
            lines.append(
                f"\n{r['impl']}: peak {r['peak_bytes'] / MIB:.1f} MiB at {r['peak_moment']} ({moments}); {terms}"
            )
    return "\n".join(lines)


def write_plot(results: list[dict[str, Any]], path: str, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    colors = dict(zip(TERMS, ["#4c72b0", "#8172b2", "#dd8452", "#55a868", "#c44e52", "#937860", "#bbbbbb"]))
    est_colors = {
        "sharded_params": colors["sharded parameters"],
        "optimizer_state": colors["optimizer state"],
        "unsharded_params": colors["unsharded parameters"],
        "unsharded_grads": colors["made in backward"],
        "sharded_grads": colors["made in backward"],
        "activations": colors["made in forward"],
        "output_and_loss": colors["made in forward"],
        "optimizer_step": colors["made in the optimizer step"],
        "post_forward_shards": "#64b5cd",
    }
    fig, ax = plt.subplots(figsize=(11, 5.5))
    labels: list[str] = []
    x = 0
    for r in results:
        if "terms_by_phase_rank0" in r:
            for phase in PHASES:
                bottom = 0.0
                for term, nbytes in r["terms_by_phase_rank0"][phase].items():
                    mib = nbytes / MIB
                    ax.bar(x, mib, bottom=bottom, color=colors[term], label=term if x == 0 else None)
                    bottom += mib
                ax.text(x, bottom + 3, f"{bottom:.0f}", ha="center", fontsize=8)
                labels.append(f"{r['impl']}\n{phase}")
                x += 1
        else:
            bottom = 0.0
            for term, nbytes in peak_terms(r).items():
                mib = nbytes / MIB
                ax.bar(x, mib, bottom=bottom, color=est_colors.get(term, "#bbbbbb"), hatch="//", edgecolor="white")
                if mib > 12:
                    ax.text(x, bottom + mib / 2, term, ha="center", va="center", fontsize=6, color="white")
                bottom += mib
            ax.text(x, bottom + 3, f"{bottom:.0f}", ha="center", fontsize=8)
            labels.append(f"estimate_memory\n(ours, its peak:\n{r['peak_moment']})")
            x += 1
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("live tensor bytes at the phase's peak, rank 0 (MiB)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.subplots_adjust(left=0.07, right=0.78, bottom=0.16)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_memory_phases.py", description=__doc__.splitlines()[0])
    p.add_argument("--impls", default="torch-fsdp2,ours", help="comma-separated, from torch-fsdp2, ours")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--strategy", choices=tuple(FSDP2_EQUIVALENT), default="FULL_SHARD")
    p.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--steps", type=int, default=1, help="timed steps before the tracked one")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--size", choices=tuple(SIZES), default="34M", help="model size (bench_scaling's; 34M: the default)")
    p.add_argument("--small", action="store_true", help="a tiny model, for smoke tests")
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "memory_phases.json"))
    p.add_argument("--png", default=None, help="chart path (default: --out with .png)")
    args = p.parse_args(argv)
    args.impl_list = [s.strip() for s in args.impls.split(",") if s.strip()]
    if not args.impl_list or any(i not in ("ours", "torch-fsdp2") for i in args.impl_list):
        p.error(f"--impls: choose from torch-fsdp2, ours; got {args.impls!r}")
    if args.strategy == "NO_SHARD" and "torch-fsdp2" in args.impl_list:
        p.error("torch FSDP2 has no NO_SHARD; use --impls ours")
    if args.steps < 1 or args.warmup < 0 or args.world_size < 2:
        p.error("--steps must be >= 1, --warmup >= 0, --world-size >= 2")
    args.bf16 = args.param_dtype == "bf16"
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    source = source_info()  # before the run: the checkout may move while it runs
    results = run(args)
    keys = ("world_size", "strategy", "param_dtype", "steps", "warmup", "small", "size")
    config = {k: getattr(args, k) for k in keys}
    config["source"] = source
    png = save_run(__file__, config, results, args.out)
    png = args.png or png
    if os.path.dirname(png):
        os.makedirs(os.path.dirname(png), exist_ok=True)
    model = "small model" if args.small else f"{args.size}-parameter GPT"
    title = f"{model}, {args.strategy}, {args.param_dtype}, {args.world_size} gloo ranks, AdamW: alive at each peak"
    write_plot(results, png, title)
    print(format_table(results))
    print(wrote(args.out, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
