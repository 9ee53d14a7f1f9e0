"""Theoretical communication volume, the markdown table and the PNG chart of a benchmark run.

[Note: theoretical bytes]
Per rank per step with ring collectives, N ranks, Psi parameters: FULL_SHARD all-gathers in
forward and again in backward and reduce-scatters once, (N-1)/N * Psi * (2*ag + rs) bytes, i.e.
3(N-1)/N * Psi * bytes at one dtype; SHARD_GRAD_OP skips the backward all-gather,
(N-1)/N * Psi * (ag + rs); NO_SHARD and DDP all-reduce, 2(N-1)/N * Psi * bytes. ``ag`` is the
element size of the all-gather (the param dtype) and ``rs`` of the reduction (fsdp_composable and
FSDP2 both reduce in the param dtype when no reduce_dtype is given). Padding and the root unit
(neither library reshards it after forward, so it is not gathered again in backward) make the
measured all-gather differ slightly.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from typing import Any, Optional

__all__ = [
    "theory_bytes",
    "format_table",
    "format_cpu_table",
    "format_profile_table",
    "write_chart",
    "write_time_bars",
    "pyplot",
    "wrote",
    "save_run",
    "command_line",
    "machine_info",
    "MIB",
]

MIB = 2**20
NO_MATPLOTLIB = (
    "plot skipped: matplotlib is not installed (pip install -e '.[bench]' installs it); the results are in the JSON"
)


def pyplot() -> Any:
    """matplotlib's pyplot (drawing to files), or None, having said why, when matplotlib is not installed:
    the JSON is written first, so a run without it loses only the picture."""
    try:
        import matplotlib
    except ImportError:
        print(NO_MATPLOTLIB, flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def wrote(out: str, png: str) -> str:
    """The closing line of a benchmark: the files it wrote."""
    return f"wrote {out} and {png}" if os.path.exists(png) else f"wrote {out} (no plot)"


def theory_bytes(
    impl: str, strategy: str, world_size: int, psi: int, param_dtype: str, shard_group: int = 2
) -> dict[str, Any]:
    """Theoretical wire bytes per rank per step, and the formula it came from. ``strategy`` is ours' and
    that of the torch FSDP2 configuration equivalent to it; HYBRID_SHARD shards over groups of
    ``shard_group`` ranks (S) and all-reduces each 1/S gradient shard across the R = N/S replicas."""
    n = world_size
    share = (n - 1) / n if n > 1 else 0.0
    ag = rs = 2 if param_dtype == "bf16" else 4
    if impl in ("local", "local-ranks"):
        return {"bytes": 0.0, "formula": "0 (no communication)"}
    if impl == "ddp" or (impl == "ours" and strategy == "NO_SHARD"):
        return {"bytes": 2 * share * psi * rs, "formula": f"2(N-1)/N*Psi*{rs}"}
    strategy = strategy if impl in ("ours", "torch-fsdp2") else "FULL_SHARD"  # floor: a FULL_SHARD step's bytes
    if strategy == "SHARD_GRAD_OP":
        return {"bytes": share * psi * (ag + rs), "formula": f"(N-1)/N*Psi*({ag}+{rs})"}
    if strategy == "HYBRID_SHARD":
        s, r = shard_group, n // shard_group
        in_group = (s - 1) / s * psi * (2 * ag + rs)
        across = 2 * (r - 1) / r * psi / s * rs
        return {"bytes": in_group + across, "formula": f"(S-1)/S*Psi*(2*{ag}+{rs}) + 2(R-1)/R*Psi/S*{rs}"}
    return {"bytes": share * psi * (2 * ag + rs), "formula": f"(N-1)/N*Psi*(2*{ag}+{rs})"}


def _mib(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / MIB:.1f}"


def _label(r: dict[str, Any]) -> str:
    return f"{r['impl']} ({r['variant']})" if r.get("variant") else r["impl"]


def _ok(results: list[dict[str, Any]], impl: str) -> Optional[dict[str, Any]]:
    return next((r for r in results if r["impl"] == impl and r["status"] == "ok"), None)


def _times(r: dict[str, Any], base: Optional[dict[str, Any]]) -> str:
    return f"{r['median_step_time_s'] / base['median_step_time_s']:.2f}" if base else "-"


def format_table(results: list[dict[str, Any]]) -> str:
    """A markdown table of one run: one row per impl, memory and bytes in MiB (per rank; comm per step).
    ``x local``: over the unsharded model alone on the machine; ``x local-ranks``: over the unsharded
    model run in every rank's process at once, which shares the cores as the ranks do."""
    local, local_ranks = _ok(results, "local"), _ok(results, "local-ranks")
    header = (
        "| impl | step (s, median) | step (s, min) | x local | x local-ranks | peak live/rank (MiB) "
        "| peak RSS/rank (MiB) "
        "| comm wire/step, py API (MiB) | comm wire/step, c10d ops (MiB) | theory (MiB) "
        "| all-gather payload (MiB) | reduce-scatter payload (MiB) | all-reduce payload (MiB) "
        "| point-to-point sent (MiB) | last loss |"
    )
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for r in results:
        if r["status"] != "ok":
            err = str(r.get("error", "")).splitlines()[0][:100].replace("|", "/")
            lines.append(f"| {_label(r)} | FAILED: {err} |" + " |" * 13)
            continue
        py, c10d = r["comm_py_api_per_step"], r["comm_dispatcher_tracked_step"]
        kinds = c10d["payload_bytes_by_kind"]
        cells = [
            _label(r),
            f"{r['median_step_time_s']:.3f}",
            f"{r['min_step_time_s']:.3f}",
            _times(r, local),
            _times(r, local_ranks),
            _mib(r["peak_live_bytes"]),
            _mib(r["peak_rss_bytes"]),
            _mib(py["wire_bytes"]),
            _mib(c10d["wire_bytes"]),
            _mib(r["theory"]["bytes"]),
            _mib(kinds.get("all_gather", 0)),
            _mib(kinds.get("reduce_scatter", 0)),
            _mib(kinds.get("all_reduce", 0)),
            _mib(kinds.get("send", 0)),
            f"{r['losses_rank0'][-1]:.4f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_cpu_table(results: list[dict[str, Any]]) -> str:
    """Where a step's time goes on a machine whose cores the ranks share: the CPU seconds each rank
    used per step (all its threads; median over steps), the part its communication threads used,
    and that CPU time over the step's wall time (below 1: the rank waited; the cores were shared)."""
    import statistics

    def median_cpu(impl: str) -> Optional[float]:
        r = _ok(results, impl)
        return statistics.median(r["cpu_times_s"]) if r and r.get("cpu_times_s") else None

    local_cpu, ranks_cpu = median_cpu("local"), median_cpu("local-ranks")
    lines = [
        "| impl | step (s, median) | CPU/step/rank (s) | comm threads CPU/step (s) | CPU / step time | CPU x local "
        "| CPU x local-ranks |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["status"] != "ok" or not r.get("cpu_times_s"):
            continue
        cpu = statistics.median(r["cpu_times_s"])
        comm = [c for c in r.get("comm_thread_cpu_times_s", []) if c is not None]
        cells = [
            _label(r),
            f"{r['median_step_time_s']:.3f}",
            f"{cpu:.3f}",
            f"{statistics.median(comm):.3f}" if comm else "-",
            f"{cpu / r['median_step_time_s']:.2f}",
            f"{cpu / local_cpu:.2f}" if local_cpu else "-",
            f"{cpu / ranks_cpu:.2f}" if ranks_cpu else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_profile_table(results: list[dict[str, Any]]) -> str:
    """Rank 0's cProfile own time by area, one row per impl that was profiled (seconds)."""
    profiled = [r for r in results if r["status"] == "ok" and r.get("profile_rank0")]
    if not profiled:
        return ""
    areas: list[str] = []
    for r in profiled:
        areas += [a for a in r["profile_rank0"]["by_area_s"] if a not in areas]
    lines = ["| impl | profiled step (s) | " + " | ".join(areas) + " |", "|---|---|" + "---|" * len(areas)]
    for r in profiled:
        prof = r["profile_rank0"]
        cells = [f"{prof['by_area_s'].get(a, 0.0):.3f}" for a in areas]
        lines.append(f"| {_label(r)} | {prof['total_s']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_chart(results: list[dict[str, Any]], path: str, title: str) -> None:
    """Three bar panels: median step time, peak live bytes (and RSS) per rank, comm bytes per step."""
    plt = pyplot()
    if plt is None:
        return

    ok = [r for r in results if r["status"] == "ok"]
    labels = [_label(r) for r in ok]
    xs = list(range(len(ok)))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    axes[0].bar(xs, [r["median_step_time_s"] for r in ok], color="tab:blue")
    axes[0].set_title("median step time (s)")
    w = 0.4
    axes[1].bar([x - w / 2 for x in xs], [r["peak_live_bytes"] / MIB for r in ok], w, label="peak live tensors")
    axes[1].bar([x + w / 2 for x in xs], [r["peak_rss_bytes"] / MIB for r in ok], w, label="peak RSS")
    axes[1].set_title("memory per rank (MiB)")
    axes[1].legend(fontsize=8)
    w = 0.27
    series = [
        ("py API counter", [r["comm_py_api_per_step"]["wire_bytes"] / MIB for r in ok]),
        ("c10d op counter", [r["comm_dispatcher_tracked_step"]["wire_bytes"] / MIB for r in ok]),
        ("theory", [r["theory"]["bytes"] / MIB for r in ok]),
    ]
    for i, (name, values) in enumerate(series):
        axes[2].bar([x + (i - 1) * w for x in xs], values, w, label=name)
    axes[2].set_title("comm wire bytes / step / rank (MiB)")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, rotation=15, fontsize=8)
    failed = [_label(r) for r in results if r["status"] != "ok"]
    fig.suptitle(title + (f"  [failed: {', '.join(failed)}]" if failed else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# glibc malloc settings read at process start (see docs/performance.md, "the CPU allocator"): part of
# how a run is reproduced, so the recorded command carries them
_ALLOCATOR_ENV = (
    "GLIBC_TUNABLES",
    "MALLOC_ARENA_MAX",
    "MALLOC_MMAP_MAX_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "LD_PRELOAD",
)


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo; elsewhere what `platform` knows): the VM's host
    can change between days, and step times with it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """What every benchmark JSON records of the machine it ran on."""
    import torch

    return {
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
        "load_average_at_start": os.getloadavg(),
    }


def command_line(script: str) -> str:
    """The command that ran ``script``, with the allocator environment it ran under first."""
    env = [f"{name}={os.environ[name]}" for name in _ALLOCATOR_ENV if os.environ.get(name)]
    return " ".join(env + ["python", os.path.relpath(script)] + sys.argv[1:])


def save_run(script: str, config: dict[str, Any], results: list[dict[str, Any]], out: str) -> str:
    """Write a small benchmark's JSON (command, machine, config, results) to ``out``; return the
    path its chart goes to (``out`` with ``.png``)."""
    report = {
        "command": command_line(script),
        "machine": machine_info(),
        "config": config,
        "results": results,
    }
    out_dir = os.path.dirname(out)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    return os.path.splitext(out)[0] + ".png"


def write_time_bars(
    labels: list[str], millis: list[float], colors: list[str], path: str, title: str, xlabel: str
) -> None:
    """One horizontal bar per label (a small benchmark's median times), first label on top."""
    plt = pyplot()
    if plt is None:
        return

    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.45 * len(labels)))
    ys = list(range(len(labels)))
    ax.barh(ys, millis, color=colors)
    ax.set_yticks(ys)
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
