"""Time one unit's all-gather and reduce-scatter: gloo's own collectives vs fsdp_composable's.

Usage (see benchmarks/README.md, "gloo collectives"):
    python benchmarks/bench_collectives.py --world-size 2 --out benchmarks/results/collectives_ws2.json

The payload is one block of the step benchmark's model (3,150,336 fp32 values, 12.0 MiB) unless
``--numel`` says otherwise. Each op runs ``--warmup`` times, then ``--reps`` times after a barrier;
an op's time is the slowest rank's median. The reduce-scatter "parts" row splits the input at the
block's parameter boundaries, as the runtime does with autograd's gradients. The "by parameter" rows
(a block's payload, ``--d`` sets its width) move the block's rank-major shards as the runtime does:
each chunk straight where it goes, or through one buffer and one copy.
Writes a JSON file, a PNG chart next to it, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable, Optional

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._model import DEFAULT, Block  # noqa: E402
from benchmarks._ranks import free_port, slowest_steps  # noqa: E402
from benchmarks._report import save_run, write_time_bars, wrote  # noqa: E402
from fsdp_composable._comm import _collectives  # noqa: E402
from fsdp_composable._flat._rank_major import build_layout  # noqa: E402

_gloo_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_gloo_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
MIB = 2**20


def _block_sizes(d: int = DEFAULT.d) -> list[int]:
    return [p.numel() for p in Block(d, DEFAULT.heads).parameters()]


def _by_parameter(d: int, world: int) -> dict[str, tuple[str, Callable[[], Any]]]:
    """A block's rank-major layout ([Note: rank-major flat shards]): its all-gather laid out by
    parameter and its reduce-scatter from a param-major gradient, each chunk moved where it goes
    (one message per chunk) or through one rank-major buffer and one copy ([Note: moving chunks])."""
    params = list(Block(d, DEFAULT.heads).parameters())
    holders = [[(nn.Module(), "p", f"p{k}")] for k in range(len(params))]
    layout = build_layout(params, holders, dist.get_rank(), world)  # type: ignore[arg-type]
    group, rs = dist.group.WORLD, _collectives.reduce_scatter
    shard, by_param = torch.randn(layout.shard_numel), torch.empty(layout.padded_numel)
    grad, out = torch.randn(layout.padded_numel), torch.empty(layout.shard_numel)
    zeros = torch.zeros(max(layout.chunk_sizes))
    grads = [grad[i.offset : i.offset + i.numel] for i in layout.infos]

    def gather(direct: bool) -> Callable[[], Any]:
        regions = layout.regions_of(by_param)
        work = lambda: _collectives.all_gather(by_param, shard, group, regions=regions, direct=direct)  # noqa: E731
        return lambda: _collectives.wait(work(), "benchmark")

    def reduce(pieces: bool) -> Callable[[], Any]:
        send = lambda: layout.rank_major_pieces(grads, zeros) if pieces else [layout.copy_in(grad)]  # noqa: E731
        return lambda: _collectives.wait(rs(out, send(), group), "benchmark")

    return {
        "all-gather by parameter, ours (each chunk where it goes)": ("all_gather", gather(True)),
        "all-gather by parameter, ours (one buffer + copy-out)": ("all_gather", gather(False)),
        "reduce-scatter by parameter, ours (each chunk from where it is)": ("reduce_scatter", reduce(True)),
        "reduce-scatter by parameter, ours (one copy-in)": ("reduce_scatter", reduce(False)),
    }


def _ops(numel: int, world: int, d: int) -> dict[str, tuple[str, Callable[[], Any]]]:
    """name -> (kind, one call that returns once the collective completed)."""
    group = dist.group.WORLD
    shard_numel = -(-numel // world)
    shard = torch.randn(shard_numel)
    gathered = torch.empty(shard_numel * world)
    full = torch.randn(shard_numel * world)
    out = torch.empty(shard_numel)
    block = numel == sum(_block_sizes(d))
    sizes = _block_sizes(d) if block else [numel]
    sizes.append(shard_numel * world - numel)  # the padding part
    parts = list(full.split(sizes))

    def ours(make: Callable[[], Any]) -> Callable[[], Any]:
        return lambda: _collectives.wait(make(), "benchmark")

    rs = _collectives.reduce_scatter
    return {
        "all-gather, gloo all_gather_single": ("all_gather", lambda: _gloo_all_gather(gathered, shard)),
        "all-gather, ours": ("all_gather", ours(lambda: _collectives.all_gather(gathered, shard, group))),
        "reduce-scatter, gloo reduce_scatter_single": ("reduce_scatter", lambda: _gloo_reduce_scatter(out, full)),
        "reduce-scatter, ours (one tensor)": ("reduce_scatter", ours(lambda: rs(out, full, group))),
        "reduce-scatter, ours (parts)": ("reduce_scatter", ours(lambda: rs(out, parts, group))),
        "all-reduce, gloo (reference)": ("all_reduce", lambda: dist.all_reduce(full)),
        **(_by_parameter(d, world) if block else {}),
    }


def _rank_main(rank: int, args: argparse.Namespace, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    address = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=args.world_size, timeout=timeout)
    times: dict[str, list[float]] = {}
    kinds: dict[str, str] = {}
    for name, (kind, call) in _ops(args.numel, args.world_size, args.d).items():
        kinds[name] = kind
        for _ in range(args.warmup):
            call()
        times[name] = []
        for _ in range(args.reps):
            dist.barrier()
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"times": times, "kinds": kinds}, f)
    dist.barrier()
    dist.destroy_process_group()


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bench_collectives_") as out_dir:
        mp.start_processes(_rank_main, args=(args, free_port(), out_dir), nprocs=args.world_size, start_method="fork")
        ranks = []
        for rank in range(args.world_size):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
    share = (args.world_size - 1) / args.world_size
    payload = -(-args.numel // args.world_size) * args.world_size * 4
    rows = []
    for name, kind in ranks[0]["kinds"].items():
        median, low = (slowest_steps(ranks, name)[k] for k in ("median_s", "min_s"))
        wire = payload * share * (2 if kind == "all_reduce" else 1)  # what one rank sends
        rows.append({"op": name, "kind": kind, "median_s": median, "min_s": low, "wire_bytes": wire})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| op | median (ms) | min (ms) | sent per rank (MiB) | MiB/s per rank |", "|---|---|---|---|---|"]
    for r in rows:
        sent = r["wire_bytes"] / MIB
        median, fastest = r["median_s"], r["min_s"]
        cells = [r["op"], f"{median * 1e3:.2f}", f"{fastest * 1e3:.2f}", f"{sent:.1f}", f"{sent / median:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


_COLORS = {"all_gather": "tab:blue", "reduce_scatter": "tab:orange", "all_reduce": "tab:gray"}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_collectives.py", description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks on 127.0.0.1 (at least 2)")
    p.add_argument("--d", type=int, default=DEFAULT.d, help="width of the block whose parameters are the payload")
    p.add_argument("--numel", type=int, default=None, help="fp32 values per unit (default: one block)")
    p.add_argument("--reps", type=int, default=20, help="timed calls per op")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per op first")
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "collectives.json"), help="JSON path")
    args = p.parse_args(argv)
    if args.d < 1 or args.d % DEFAULT.heads:
        p.error(f"--d must be a positive multiple of {DEFAULT.heads} (the block's heads), got {args.d}")
    if args.numel is None:
        args.numel = sum(_block_sizes(args.d))
    if args.world_size < 2:
        p.error(f"--world-size must be at least 2, got {args.world_size}")
    if args.numel < 1 or args.reps < 1 or args.warmup < 0:
        p.error("--numel and --reps must be positive and --warmup not negative")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    rows = measure(args)
    config = {"world_size": args.world_size, "d": args.d, "numel": args.numel, "reps": args.reps, "warmup": args.warmup}
    png = save_run(__file__, config, rows, args.out)
    title = f"{args.numel:,} fp32 values, world size {args.world_size}, gloo, torch {torch.__version__}"
    millis = [r["median_s"] * 1e3 for r in rows]
    colors = [_COLORS[r["kind"]] for r in rows]
    write_time_bars([r["op"] for r in rows], millis, colors, png, title, "median time per call (ms)")
    print(format_table(rows))
    print(wrote(args.out, png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
