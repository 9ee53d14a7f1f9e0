"""CPU overhead per training step of the sharding runtime itself, with a fake process group.

Usage (see benchmarks/README.md, "runtime overhead"):
    python benchmarks/bench_overhead.py --world-size 8 --out benchmarks/results/overhead_fake_ws8.json

One process plays rank 0 of ``--world-size`` ranks on torch's fake process group (every collective
returns at once without moving data), so what a sharded step costs beyond the unsharded one is the
runtime's own work: hooks, bookkeeping, views, allocation of the gathered buffers, issuing the
collectives. The model is ``--units`` small residual MLP blocks, one unit each, so that work is not
hidden behind compute. Each impl runs ``--warmup`` steps, then ``--steps`` timed steps (forward,
backward, SGD step, zero_grad); the overhead is its median step time minus the unsharded model's.
Writes a JSON file, a PNG chart next to it, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._profile import profile_call  # noqa: E402
from benchmarks._report import save_run, write_time_bars, wrote  # noqa: E402

IMPLS = ("local", "ours", "torch-fsdp2")
_PROFILED_STEPS = 5


class MLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def _model(args: argparse.Namespace, device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(MLPBlock(args.d) for _ in range(args.units))).to(device)


def _shard(impl: str, model: nn.Sequential, world_size: int, device: torch.device) -> nn.Module:
    if impl == "ours":
        from fsdp_composable import ModuleWrapPolicy, fully_shard

        return fully_shard(model, ModuleWrapPolicy({MLPBlock}), device_id=device if device.type == "cuda" else None)
    if impl == "torch-fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        mesh = init_device_mesh(device.type, (world_size,))
        for block in model:
            torch_fully_shard(block, mesh=mesh)
        return torch_fully_shard(model, mesh=mesh)
    return model


def _time_steps(model: nn.Module, args: argparse.Namespace, device: torch.device) -> list[float]:
    return [a + b for a, b in _time_step_parts(model, args, device)]


def _time_step_parts(model: nn.Module, args: argparse.Namespace, device: torch.device) -> list[tuple[float, float]]:
    """Each timed step as (forward + backward, optimizer step + zero_grad) seconds."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(args.batch, args.d, device=device)
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for step in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        model(x).sum().backward()
        sync()
        t1 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        sync()
        if step >= args.warmup:
            times.append((t1 - t0, time.perf_counter() - t1))
    return times


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    try:
        rows = []
        for impl in IMPLS:
            model = _shard(impl, _model(args, device), args.world_size, device)
            times = _time_steps(model, args, device)
            rows.append({"impl": impl, "median_s": statistics.median(times), "min_s": min(times)})
            if args.profile:  # a few more steps under cProfile: where the time goes, and calls per step
                quiet = argparse.Namespace(**{**vars(args), "warmup": 0, "steps": _PROFILED_STEPS})
                rows[-1]["profile"] = profile_call(functools.partial(_time_steps, model, quiet, device), top=25)
                rows[-1]["calls_per_step"] = rows[-1]["profile"]["calls"] / _PROFILED_STEPS
            print(f"[bench_overhead] {impl}: {rows[-1]['median_s'] * 1e3:.2f} ms", file=sys.stderr, flush=True)
    finally:
        dist.destroy_process_group()
    local = rows[0]["median_s"]
    for row in rows:
        row["overhead_s"] = row["median_s"] - local
        row["overhead_per_unit_s"] = row["overhead_s"] / args.units
        if args.profile:
            row["extra_calls_per_unit"] = (row["calls_per_step"] - rows[0]["calls_per_step"]) / args.units
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| impl | step (ms, median) | step (ms, min) | overhead vs local (ms/step) | overhead per unit (µs) |",
        "|---|---|---|---|---|",
    ]
    profiled = all("extra_calls_per_unit" in r for r in rows)
    if profiled:
        lines[0] += " function calls per unit beyond local (cProfile) |"
        lines[1] += "---|"
    for r in rows:
        cells = [
            r["impl"],
            f"{r['median_s'] * 1e3:.2f}",
            f"{r['min_s'] * 1e3:.2f}",
            f"{r['overhead_s'] * 1e3:.2f}",
            f"{r['overhead_per_unit_s'] * 1e6:.0f}",
        ]
        if profiled:
            cells.append(f"{r['extra_calls_per_unit']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_overhead.py", description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=8, help="ranks the fake process group pretends to have")
    p.add_argument("--units", type=int, default=32, help="blocks, one unit each")
    p.add_argument("--d", type=int, default=64, help="block width")
    p.add_argument("--batch", type=int, default=8, help="rows per step")
    p.add_argument("--steps", type=int, default=30, help="timed steps per impl")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per impl first")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--profile", action="store_true", help="also cProfile a few steps per impl (JSON: top functions)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: written, not run here (no GPU)")
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "overhead.json"), help="JSON path")
    args = p.parse_args(argv)
    if args.world_size < 2:
        p.error(f"--world-size must be at least 2, got {args.world_size}")
    if min(args.units, args.d, args.batch, args.steps, args.threads) < 1 or args.warmup < 0:
        p.error("--units, --d, --batch, --steps and --threads must be positive and --warmup not negative")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    rows = measure(args)
    png = save_run(__file__, {k: v for k, v in vars(args).items() if k != "out"}, rows, args.out)
    unit_params = 2 * args.d * (args.d + 1)
    title = f"{args.units} units of {unit_params:,} params, fake world size {args.world_size}, {args.device}"
    millis = [r["median_s"] * 1e3 for r in rows]
    colors = ["tab:gray", "tab:blue", "tab:orange"][: len(rows)]
    write_time_bars([r["impl"] for r in rows], millis, colors, png, title, "median step time (ms)")
    print(format_table(rows))
    print(wrote(args.out, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
