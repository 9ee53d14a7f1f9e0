"""Draw the fsdp:: ranges of a Chrome trace written by ``python -m fsdp_composable --profile PATH``.

    python docs/draw_trace.py trace.json docs/images/trace.png

One lane per kind of range (hooks, unshard and its all-gather, waits, reshard, the reduction and
its reduce-scatter), one colour per unit, time in milliseconds from the first range. Needs only
matplotlib (the trace is JSON).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

LANES = [
    "pre_forward", "post_forward", "pre_backward", "post_backward", "unshard", "all_gather",
    "wait_unshard", "wait", "reshard", "reduce", "reduce_scatter", "finish_reduce",
]  # fmt: skip


def load(path: str) -> list[tuple[str, str, float, float]]:
    """(what, unit, start ms, duration ms) of every complete fsdp:: range, sorted by start."""
    with open(path, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    spans = [
        (e["name"].split(" ", 1)[0].removeprefix("fsdp::"), e["name"].split(" ", 1)[1], e["ts"] / 1e3, e["dur"] / 1e3)
        for e in events
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("fsdp::")
    ]
    t0 = min(s[2] for s in spans)
    return sorted((what, unit, start - t0, dur) for what, unit, start, dur in spans)


def draw(spans: list[tuple[str, str, float, float]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    units = sorted({unit for _, unit, _, _ in spans}, key=lambda u: (u != "<root>", u))
    colours = {unit: plt.get_cmap("tab10")(i % 10) for i, unit in enumerate(units)}
    by_lane: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for what, unit, start, dur in spans:
        by_lane[what].append((start, max(dur, 0.01), unit))
    lanes = [lane for lane in LANES if lane in by_lane]
    fig, ax = plt.subplots(figsize=(12, 4.8))
    for y, lane in enumerate(lanes):
        for start, dur, unit in by_lane[lane]:
            ax.broken_barh([(start, dur)], (y - 0.4, 0.8), color=colours[unit])
    ax.set_yticks(range(len(lanes)), [f"fsdp::{lane}" for lane in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first fsdp:: range (rank 0)")
    ax.set_title("One training step of python -m fsdp_composable (2 CPU ranks, FULL_SHARD), rank 0")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[u]) for u in units]
    ax.legend(handles, units, title="unit", loc="upper right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python docs/draw_trace.py TRACE.json OUT.png")
    draw(load(sys.argv[1]), sys.argv[2])
