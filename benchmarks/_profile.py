"""A cProfile summary of one training step on rank 0: where the wall time of a step goes.

[Note: reading the summary]
cProfile sees Python calls only. A C++ op called from Python (``torch._C._nn.linear``, the autograd
engine's ``run_backward``, ``Work.wait``) is one built-in entry whose own time covers the kernel; the
Python hooks the engine calls during backward are profiled on the same thread (CPU autograd runs
backward on the caller's thread). ``by_area`` adds up *own* time (tottime) by where the function
lives, so the areas partition the step: 'comm wait' is time blocked in ``Work.wait``/``barrier``,
'comm issue' the built-in collective calls themselves (gloo does part of the work, e.g. copies,
before returning the async work), 'fsdp_composable python' / 'torch FSDP2 python' / 'DTensor python'
the libraries' own Python (hooks, views, bookkeeping), 'torch C++ ops' the other built-in calls
(kernels, including the backward engine's).
"""

from __future__ import annotations

import cProfile
import pstats
from typing import Any, Callable

__all__ = ["profile_call"]

_AREAS = (
    ("fsdp_composable", "fsdp_composable python"),
    ("torch/distributed/fsdp", "torch FSDP2 python"),
    ("torch/distributed/tensor", "DTensor python"),
    ("torch/nn/parallel", "DDP python"),
    ("torch/optim", "optimizer python"),
    ("torch/distributed", "torch.distributed python"),
    ("torch/", "other torch python"),
    ("benchmarks", "benchmark python"),
)


def _area(filename: str, name: str) -> str:
    if filename == "~":  # a built-in
        if "wait" in name or "barrier" in name:
            return "comm wait (built-in wait/barrier)"
        if "_distributed_c10d" in name:
            return "comm issue (built-in collective calls)"
        return "torch C++ ops and other built-ins"
    path = filename.replace("\\", "/")
    for needle, label in _AREAS:
        if needle in path:
            return label
    return "other python"


def _label(key: tuple[str, int, str]) -> str:
    filename, line, name = key
    if filename == "~":
        return name
    parts = filename.replace("\\", "/").split("/")
    return f"{'/'.join(parts[-2:])}:{line}({name})"


def profile_call(fn: Callable[[], Any], top: int = 15) -> dict[str, Any]:
    """Run ``fn`` under cProfile; return the total, own time by area, and the top functions by own time."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats = pstats.Stats(prof)
    entries = stats.stats  # type: ignore[attr-defined]
    by_area: dict[str, float] = {}
    rows = []
    for key, (_cc, nc, tt, ct, _callers) in entries.items():
        area = _area(key[0], key[2])
        by_area[area] = by_area.get(area, 0.0) + tt
        rows.append({"function": _label(key), "area": area, "calls": nc, "tottime_s": tt, "cumtime_s": ct})
    rows.sort(key=lambda r: -r["tottime_s"])
    total = sum(by_area.values())
    return {
        "total_s": total,
        "calls": sum(r["calls"] for r in rows),  # every function call, built-ins included: machine-independent
        "by_area_s": dict(sorted(by_area.items(), key=lambda kv: -kv[1])),
        "top_by_tottime": rows[:top],
    }
