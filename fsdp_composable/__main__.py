"""`python -m fsdp_composable`: train the demo GPT (`fsdp_composable.demo`) with `fully_shard`.

Without a launcher it starts ``--world-size`` ranks itself (gloo on 127.0.0.1 for ``--device cpu``).
Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` are set) this process is one rank and joins the group
the launcher describes. New options go in `build_parser`; `demo.train` reads them from ``args``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Optional

import torch
import torch.multiprocessing as mp

from fsdp_composable.demo import run_rank

__all__ = ["build_parser", "main", "parse_args"]

DEFAULT_WORLD_SIZE = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fsdp_composable",
        description="Train a small GPT-style model on synthetic data with fully_shard (one unit per block).",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help=f"ranks to start (default {DEFAULT_WORLD_SIZE}); ignored under torchrun, which sets WORLD_SIZE",
    )
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--d-model", type=int, default=64, help="model width (default 64)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks, one unit each (default 4)")
    p.add_argument("--heads", type=int, default=4, help="attention heads; must divide --d-model (default 4)")
    p.add_argument("--seq", type=int, default=32, help="sequence length (default 32)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--vocab", type=int, default=64, help="vocabulary size (default 64)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument(
        "--strategy",
        choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"],
        default="FULL_SHARD",
        help="ShardingStrategy for every unit (default FULL_SHARD)",
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
        "--threads",
        type=int,
        default=None,
        help="torch threads per rank (default: CPU cores / ranks when this command starts the ranks)",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="process group timeout in seconds (default 120)")
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each block's forward in backward (fsdp_composable.checkpoint on every block)",
    )
    p.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        default=None,
        help="save a sharded checkpoint (model + optimizer, torch.distributed.checkpoint) to DIR at the end",
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
        help="load the checkpoint in --checkpoint-dir first and continue from its step (any world size)",
    )
    return p


def _launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Parse and check ``argv``; a bad value exits with status 2 and says which option and why."""
    parser = build_parser()
    args = parser.parse_args(argv)
    positive = ["world_size", "steps", "d_model", "layers", "heads", "seq", "batch", "vocab", "threads"]
    for name in positive:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.lr <= 0 or args.timeout <= 0:
        parser.error(f"--lr and --timeout must be positive, got --lr {args.lr} --timeout {args.timeout}")
    if args.d_model % args.heads:
        parser.error(f"--heads {args.heads} must divide --d-model {args.d_model}")
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        parser.error("--resume and --checkpoint-every need --checkpoint-dir DIR")
    if args.checkpoint_every < 0:
        parser.error(f"--checkpoint-every must be at least 0, got {args.checkpoint_every}")
    if args.resume and not os.path.isdir(args.checkpoint_dir):
        parser.error(f"--resume: no checkpoint directory {args.checkpoint_dir!r}; save one first with --checkpoint-dir")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine; use --device cpu")
    if _launched_by_torchrun():
        args.world_size = int(os.environ["WORLD_SIZE"])
    elif args.world_size is None:
        args.world_size = DEFAULT_WORLD_SIZE
    if args.device == "cuda" and not _launched_by_torchrun() and args.world_size > torch.cuda.device_count():
        parser.error(
            f"--world-size {args.world_size} with --device cuda needs that many GPUs, found "
            f"{torch.cuda.device_count()}; lower --world-size or launch with torchrun"
        )
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(args: argparse.Namespace) -> None:
    """Run this process as one torchrun rank, or start ``args.world_size`` ranks and wait for them."""
    if _launched_by_torchrun():
        run_rank(int(os.environ["RANK"]), args, "env://", int(os.environ.get("LOCAL_RANK", "0")))
        return
    if args.threads is None and args.device == "cpu":
        args.threads = max(1, (os.cpu_count() or 1) // args.world_size)  # do not oversubscribe the cores
    init_method = f"tcp://127.0.0.1:{free_port()}"
    if args.world_size == 1:
        run_rank(0, args, init_method)  # no second process to start
        return
    mp.spawn(run_rank, args=(args, init_method), nprocs=args.world_size, join=True)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        launch(args)
    except mp.ProcessRaisedException as e:  # a rank failed: its traceback is the useful part
        print(f"a rank failed:\n{e}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as e:
        print(f"a rank exited abnormally: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
