"""`python -m fsdp_composable`: train the demo GPT (`fsdp_composable._job.demo`) with `fully_shard`.

Without a launcher it starts ``--world-size`` ranks itself (gloo on 127.0.0.1 for ``--device cpu``).
Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` are set) this process is one rank and joins the group
the launcher describes. New options go in `build_parser` and are checked in `parse_args`;
`demo.train` reads them from ``args``.

[Note: the main job checks everything before it imports torch]
This module imports only the standard library at the top (the package skips its own imports too,
see [Note: python -m fsdp_composable starts fast] in ``__init__.py``), so ``--help`` and a bad
option answer at once, and the first lines of a run are printed before torch is imported (which
takes seconds); a process that starts the ranks never imports torch at all (on CPU), the ranks do.
Every option (its range too), the launcher's environment, every path and the checkpoint to resume
are checked in `parse_args`, before any rank starts: a mistake is one line on stderr and exit status
2, never a traceback from N ranks after a minute of training. Everything else the job prints fits
`COLUMNS`.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shutil
import signal
import socket
import sys
import time
import warnings
from typing import NoReturn, Optional

from fsdp_composable._job import _job_checkpoint as job_ckpt
from fsdp_composable._job import _job_processes as job_procs

__all__ = ["build_parser", "main", "parse_args"]

START_TIME = time.time()  # the summary's total time counts from here
DEFAULT_WORLD_SIZE = 2
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]
NUMPY_WARNING = "Failed to initialize NumPy"  # torch's, see `_quiet_numpy_warning`
COLUMNS = 100  # every line the job prints fits this width (error lines aside: they are one line)
MAX_RANKS = 4096
# The accepted range of each integer option. The upper bounds keep the data's seed arithmetic and
# every tensor size inside int64; the model's size is checked against the memory separately.
INT_RANGES = {
    "world_size": (1, MAX_RANKS),
    "steps": (1, 10**9),
    "d_model": (1, 2**16),
    "layers": (1, MAX_RANKS),
    "heads": (1, 2**16),
    "seq": (1, 2**20),
    "global_batch": (1, 2**24),
    "vocab": (1, 2**24),
    "threads": (1, MAX_RANKS),
    "shard_group_size": (1, MAX_RANKS),
    "seed": (0, 2**32 - 1),
    "checkpoint_every": (0, 10**9),
}
# The largest accepted value of each float option (all must be finite and above 0): AdamW only
# diverges beyond a learning rate of 10, and a process-group timeout beyond a week is a typo.
FLOAT_MAX = {"lr": 10.0, "timeout": 7 * 24 * 3600.0}


class _Parser(argparse.ArgumentParser):
    """Errors are one line (no usage block in front), so a wrong option is easy to spot in a log."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _help_formatter(prog: str) -> argparse.HelpFormatter:
    # argparse fills the whole terminal; keep --help within COLUMNS like the rest of the output
    return argparse.HelpFormatter(prog, width=min(shutil.get_terminal_size().columns, COLUMNS) - 2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m fsdp_composable",
        description="Train a small GPT-style model on synthetic data with fully_shard (one unit per block).",
        formatter_class=_help_formatter,
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help=f"ranks to start (default {DEFAULT_WORLD_SIZE}); ignored under torchrun, which sets WORLD_SIZE",
    )
    p.add_argument("--steps", type=int, default=20, help="train until this optimizer step (default 20)")
    p.add_argument("--d-model", type=int, default=64, help="model width (default 64)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks, one unit each (default 4)")
    p.add_argument("--heads", type=int, default=4, help="attention heads; must divide --d-model (default 4)")
    p.add_argument("--seq", type=int, default=32, help="sequence length (default 32)")
    p.add_argument(
        "--global-batch",
        type=int,
        default=16,
        help="sequences per step over all ranks, split evenly; must be a multiple of the world size (default 16)",
    )
    p.add_argument("--vocab", type=int, default=64, help="vocabulary size (default 64)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate, at most 10 (default 3e-3)")
    p.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="FULL_SHARD",
        help="ShardingStrategy for every unit (default FULL_SHARD)",
    )
    p.add_argument(
        "--shard-group-size",
        type=int,
        default=None,
        metavar="K",
        help="HYBRID_SHARD: ranks that shard together, the rest replicate (default: the ranks of one node "
        "under torchrun, LOCAL_WORLD_SIZE; else half the ranks)",
    )
    p.add_argument(
        "--mixed-precision",
        choices=["none", "bf16"],
        default="none",
        help="bf16: MixedPrecision(param_dtype=torch.bfloat16) (default none)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu uses gloo, cuda uses nccl")
    p.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the data (default 0)")
    p.add_argument("--plot", metavar="PATH", default=None, help="write the loss curve to PATH (needs matplotlib)")
    p.add_argument(
        "--profile",
        metavar="PATH",
        default=None,
        help="record the last step with torch.profiler and write rank 0's Chrome trace (JSON) to PATH",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per rank (default: CPU cores / ranks when this command starts the ranks)",
    )
    p.add_argument(
        "--timeout", type=float, default=120.0, help="process group timeout in seconds, at most a week (default 120)"
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each block's forward in backward (fsdp_composable.checkpoint on every block)",
    )
    p.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        default=None,
        help="save sharded checkpoints (model + optimizer, torch.distributed.checkpoint) under DIR, each in "
        "DIR/step_N with DIR/latest naming the newest; every node must be able to read and write DIR",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="K",
        help="also save every K steps (default: only at the end)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="load DIR/latest from --checkpoint-dir first and continue from its step (any world size)",
    )
    return p


def _launched_by_torchrun() -> bool:
    """A launcher set RANK and WORLD_SIZE (`_check_launcher` checks them and the rest)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _env_int(parser: argparse.ArgumentParser, name: str, low: int, high: int) -> Optional[int]:
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        parser.error(f"environment variable {name}={text!r} is not an integer; the launcher (torchrun) sets it")
    if not low <= value <= high:
        parser.error(f"environment variable {name}={value} must be from {low} to {high}")
    return value


def _check_launcher(parser: argparse.ArgumentParser) -> None:
    """The variables a launcher such as torchrun sets, when it sets them: all there and consistent."""
    given = [name for name in ("RANK", "WORLD_SIZE") if name in os.environ]
    if len(given) == 1:
        missing = "WORLD_SIZE" if given == ["RANK"] else "RANK"
        parser.error(
            f"environment variable {given[0]} is set but {missing} is not: a launcher such as torchrun sets "
            f"both; unset {given[0]} to have this command start the ranks"
        )
    if not given:
        return
    world_size = _env_int(parser, "WORLD_SIZE", 1, MAX_RANKS)
    assert world_size is not None
    _env_int(parser, "RANK", 0, world_size - 1)
    local_world_size = _env_int(parser, "LOCAL_WORLD_SIZE", 1, world_size)
    _env_int(parser, "LOCAL_RANK", 0, (local_world_size or world_size) - 1)
    if not os.environ.get("MASTER_ADDR") or _env_int(parser, "MASTER_PORT", 0, 65535) is None:
        parser.error(
            "RANK and WORLD_SIZE are set but MASTER_ADDR or MASTER_PORT is not: the env:// rendezvous needs "
            "all four (torchrun sets them)"
        )


def model_params(args: argparse.Namespace) -> int:
    """The demo GPT's parameter count (`fsdp_composable._job.demo.GPT`), computed without building it."""
    d = args.d_model
    block = 12 * d * d + 13 * d  # qkv, proj, fc1, fc2 (weights and biases) and two LayerNorms
    return args.layers * block + (2 * args.vocab + args.seq + 2) * d


def _physical_memory() -> Optional[int]:
    """This machine's memory in bytes, or None where the system does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        return None


def _check_model_fits(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every rank builds the whole model in float32 before sharding it: the ranks of this machine
    together need at least that much memory."""
    memory = _physical_memory()
    here = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if _launched_by_torchrun() else args.world_size
    params = model_params(args)
    need = 4 * params * here
    if memory is not None and need > memory:
        parser.error(
            f"the model has {params:,} parameters and each of the {here} ranks on this machine builds it whole "
            f"(4 bytes a parameter) before sharding: {need / 2**30:,.1f} GiB, more than the machine's "
            f"{memory / 2**30:,.1f} GiB; lower --d-model, --layers or --vocab"
        )


def _check_writable_path(parser: argparse.ArgumentParser, option: str, path: str, is_dir: bool) -> None:
    """``path`` can be created (or written) by this process: no file where a directory goes, an
    existing, writable parent."""
    if is_dir and os.path.exists(path) and not os.path.isdir(path):
        parser.error(f"{option} {path}: exists and is not a directory")
    if not is_dir and os.path.isdir(path):
        parser.error(f"{option} {path}: is a directory; give a file name such as loss.png")
    existing = os.path.abspath(path) if is_dir else os.path.dirname(os.path.abspath(path))
    if not is_dir and not os.path.isdir(existing):
        parser.error(f"{option} {path}: directory {existing!r} does not exist")
    while not os.path.exists(existing):  # a checkpoint directory is created with its parents
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        parser.error(f"{option} {path}: {existing!r} is a file, not a directory")
    if not os.access(existing, os.W_OK):
        parser.error(f"{option} {path}: {existing!r} is not writable")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Parse and check ``argv`` without importing torch; a bad value exits with status 2 and one line
    saying which option and why. `check_devices` does the checks that need torch."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, (low, high) in INT_RANGES.items():
        value = getattr(args, name)
        if value is not None and not low <= value <= high:
            parser.error(f"--{name.replace('_', '-')} must be from {low} to {high}, got {value}")
    for name, highest in FLOAT_MAX.items():
        value = getattr(args, name)
        if not (math.isfinite(value) and 0 < value <= highest):
            parser.error(f"--{name} must be a finite number above 0 and at most {highest:g}, got {value}")
    if args.d_model % args.heads:
        parser.error(f"--heads {args.heads} must divide --d-model {args.d_model}")
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        parser.error("--resume and --checkpoint-every need --checkpoint-dir DIR")
    _check_launcher(parser)
    if args.plot is not None:
        _check_writable_path(parser, "--plot", args.plot, is_dir=False)
        if importlib.util.find_spec("matplotlib") is None:
            parser.error(f"--plot {args.plot}: needs matplotlib, which is not installed (pip install matplotlib)")
    if args.profile is not None:
        _check_writable_path(parser, "--profile", args.profile, is_dir=False)
    if args.checkpoint_dir is not None:
        _check_writable_path(parser, "--checkpoint-dir", args.checkpoint_dir, is_dir=True)
    if _launched_by_torchrun():
        args.world_size = int(os.environ["WORLD_SIZE"])
    elif args.world_size is None:
        args.world_size = DEFAULT_WORLD_SIZE
    if args.global_batch % args.world_size:
        parser.error(
            f"--global-batch {args.global_batch} must be a multiple of the world size {args.world_size} "
            "(every rank takes an equal slice)"
        )
    _check_model_fits(parser, args)
    _check_strategy(parser, args)
    _check_checkpoint(parser, args)
    return args


def _check_strategy(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.strategy != "HYBRID_SHARD":
        if args.shard_group_size is not None:
            parser.error(f"--shard-group-size is only for --strategy HYBRID_SHARD, not {args.strategy}")
        return
    if args.shard_group_size is None:
        local = os.environ.get("LOCAL_WORLD_SIZE") if _launched_by_torchrun() else None
        args.shard_group_size = int(local) if local else max(1, args.world_size // 2)
    if args.world_size % args.shard_group_size:
        parser.error(
            f"--shard-group-size {args.shard_group_size} must divide the world size {args.world_size} "
            "(HYBRID_SHARD lays the ranks out as replicas x shard group)"
        )


def _check_checkpoint(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A fresh run never writes over an existing checkpoint; a resume finds one that fits this model."""
    if args.checkpoint_dir is None:
        return
    try:
        latest = job_ckpt.latest(args.checkpoint_dir)
    except ValueError as e:
        parser.error(f"--checkpoint-dir: {e}")
    if not args.resume:
        if latest is not None:
            parser.error(
                f"--checkpoint-dir {args.checkpoint_dir} already holds a checkpoint ({latest.path}); "
                "add --resume to continue it, or choose another directory"
            )
        return
    if latest is None:
        parser.error(
            f"--resume: no checkpoint in {args.checkpoint_dir!r} (no {job_ckpt.LATEST} file); "
            "save one first with --checkpoint-dir"
        )
    mismatch = job_ckpt.shape_mismatch(latest, args)
    if mismatch:
        parser.error(f"--resume: {latest.path} was saved for a different model ({mismatch}); pass the same options")
    if args.steps <= latest.step:
        parser.error(
            f"--resume: {latest.path} is already at step {latest.step} and --steps is {args.steps}: nothing to "
            f"train; pass --steps greater than {latest.step}"
        )


def check_devices(args: argparse.Namespace) -> None:
    """The checks that need torch (imported here, after the first line is printed; only for CUDA, so
    that a CPU run's main process never imports torch: its ranks do)."""
    if args.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        _fail("--device cuda: torch.cuda.is_available() is False on this machine; use --device cpu")
    count = torch.cuda.device_count()
    if not _launched_by_torchrun() and args.world_size > count:
        _fail(
            f"--world-size {args.world_size} with --device cuda needs that many GPUs, found {count}; "
            "lower --world-size or launch with torchrun"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if _launched_by_torchrun() and local_rank >= count:
        _fail(f"--device cuda: LOCAL_RANK={local_rank} but this machine has {count} GPUs; start fewer ranks per node")


def _fail(message: str) -> NoReturn:
    print(f"python -m fsdp_composable: error: {message} (see --help)", file=sys.stderr)
    sys.exit(2)


def describe_run(args: argparse.Namespace) -> list[str]:
    """The first lines: what is about to run, and what it amounts to where the strategy's name says more."""
    ranks = f"{args.world_size} {args.device.upper() if args.device == 'cuda' else 'CPU'} rank"
    ranks += "s" if args.world_size != 1 else ""
    backend = "nccl" if args.device == "cuda" else "gloo"
    strategy = args.strategy
    if strategy == "HYBRID_SHARD":
        replicas = args.world_size // args.shard_group_size
        strategy += f" ({replicas} replica{'s' if replicas != 1 else ''} x shard group {args.shard_group_size})"
    if _launched_by_torchrun():
        how = "under torchrun"
    else:
        how = "in this process" if args.world_size == 1 else "starting them"
    lines = [
        f"fsdp_composable demo: GPT with {args.layers} blocks, d_model {args.d_model}, {args.steps} steps, "
        f"global batch {args.global_batch}",
        f"{strategy} on {ranks} ({backend}, {how})",
    ]
    effect = _what_runs(args)
    if effect:
        lines.append(effect)
    if args.resume:
        lines.append(f"resuming from {args.checkpoint_dir}")
    return lines


def _what_runs(args: argparse.Namespace) -> str:
    """What the strategy amounts to at this world size ('' when it is what it says); the rule is
    `_init_utils._init_core_state`'s: a group of one rank runs NO_SHARD, with no collective in it."""
    if args.world_size == 1:
        return "with 1 rank there is nothing to shard or reduce: every unit runs as NO_SHARD, without communication"
    if args.strategy != "HYBRID_SHARD":
        return ""
    if args.shard_group_size == 1:
        return (
            f"a shard group of 1 rank shards nothing: this runs as NO_SHARD over {args.world_size} ranks "
            "(as DDP does)"
        )
    if args.shard_group_size == args.world_size:
        return f"1 replica replicates nothing: this runs as FULL_SHARD over {args.world_size} ranks"
    return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _quiet_numpy_warning() -> None:
    """torch warns on import, in every rank, that it failed to initialise numpy when numpy is not
    installed; the job does not use numpy (see `demo.gather_peak_memory`), so the warning (a line of
    200 columns per rank) is noise. Filtered here and, through the environment, in the ranks."""
    warnings.filterwarnings("ignore", message=NUMPY_WARNING, category=UserWarning)
    option = f"ignore:{NUMPY_WARNING}:UserWarning"
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), option]))


def launch(args: argparse.Namespace) -> None:
    """Run this process as the only rank or one torchrun rank, or start ``args.world_size`` ranks and
    wait for them (see [Note: how the main job stops its ranks] in ``_job_processes.py``)."""
    _quiet_numpy_warning()
    if _launched_by_torchrun():
        from fsdp_composable._job.demo import end_trained_rank, run_rank  # torch: after the first lines

        run_rank(int(os.environ["RANK"]), args, "env://", int(os.environ.get("LOCAL_RANK", "0")))
        end_trained_rank()
    if args.threads is None and args.device == "cpu":
        args.threads = max(1, (os.cpu_count() or 1) // args.world_size)  # do not oversubscribe the cores
    init_method = f"tcp://127.0.0.1:{free_port()}"
    if args.world_size == 1:
        from fsdp_composable._job.demo import run_rank

        run_rank(0, args, init_method)  # no second process to start
        return
    print(f"starting {args.world_size} ranks: each imports torch, then they join one process group", flush=True)
    job_procs.run_ranks("fsdp_composable._job.demo:spawned_rank", args.world_size, (args, init_method))


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    args.start_time = START_TIME
    rank = int(os.environ.get("RANK", "0"))
    if _launched_by_torchrun() or args.world_size == 1:  # this process is a rank: it ends at once
        job_procs.exit_on_signals(
            lambda signum: f"python -m fsdp_composable: interrupted by {signal.Signals(signum).name}; "
            f"rank {rank} stopped"
        )
    else:
        job_procs.raise_on_signals()
    if rank == 0:
        print("\n".join(describe_run(args)), flush=True)
    try:
        check_devices(args)
        launch(args)
    except job_procs.Interrupted as e:
        print(job_procs.interrupted_line(e), file=sys.stderr, flush=True)
        return e.exit_status
    except job_procs.RankFailed as e:  # its traceback, or how it ended
        print(e, file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
