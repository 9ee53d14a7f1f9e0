"""The main job: a small GPT-style model trained with `fully_shard` on synthetic data, one rank per process.

`run_rank` is what every rank runs (join the process group, `train`, leave); `python -m fsdp_composable`
parses the arguments and starts the ranks. `train` calls the hook functions below at fixed points so
checkpoint save/resume and plan printing can be added without touching the loop.

[Note: the synthetic task]
Every sequence walks a fixed successor table: token ``t`` is always followed by ``succ[t]`` for one
random permutation ``succ`` of the vocabulary (drawn from the seed). The first token is random, the
rest is fully determined, so the loss starts near ``ln(vocab)`` and a model that learns the table
drives it towards zero within a few dozen steps. Batch ``step`` is drawn from a generator seeded with
``(seed, step)`` and each rank takes its slice of the global batch, so the data depends only on the
seed, the step and the global batch, never on the process that draws it.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp_composable import (
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    StateDictType,
    checkpoint,
    describe,
    fully_shard,
    init_optim_state,
    optim_state_dict,
    optim_state_dict_to_load,
    state_dict_type,
)

__all__ = ["GPT", "Block", "RunContext", "run_rank", "synthetic_batch", "train"]


# ---------------------------------------------------------------------------- model
class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP, each with a residual."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"Block: d_model={d_model} must be a multiple of n_heads={n_heads}")
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (b, heads, t, head_dim)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layers`` blocks, a final norm and a linear head."""

    def __init__(self, vocab: int, d_model: int, n_layers: int, seq: int, n_heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(args: argparse.Namespace, device: torch.device) -> GPT:
    """The same initial weights on every rank: each rank seeds its generator identically."""
    torch.manual_seed(args.seed)
    return GPT(args.vocab, args.d_model, args.layers, args.seq, args.heads).to(device)


# ---------------------------------------------------------------------------- data
def successor_table(vocab: int, seed: int) -> torch.Tensor:
    """The fixed permutation the sequences follow; see [Note: the synthetic task]."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))


def synthetic_batch(step: int, global_batch: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, each ``(global_batch, seq)`` int64, for ``step``."""
    succ = successor_table(vocab, seed)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.empty(global_batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (global_batch,), generator=g)
    for i in range(seq):
        tokens[:, i + 1] = succ[tokens[:, i]]
    return tokens[:, :-1], tokens[:, 1:]


def rank_slice(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = batch.shape[0] // world_size
    return batch[rank * per_rank : (rank + 1) * per_rank]


# ---------------------------------------------------------------------------- run state and hooks
@dataclass
class RunContext:
    """Everything a hook may need: the parsed arguments, this rank, the sharded model and optimizer."""

    args: argparse.Namespace
    rank: int
    world_size: int
    device: torch.device
    model: nn.Module
    optimizer: torch.optim.Optimizer
    start_step: int = 0  # steps already done before this run (a resumed run sets it)
    losses: list[float] = field(default_factory=list)  # mean loss over ranks, one per step run here
    step_times: list[float] = field(default_factory=list)


def after_setup(ctx: RunContext) -> None:
    """The model is sharded and the optimizer built: rank 0 shows how the model is sharded."""
    plan = describe(ctx.model)  # local, no communication
    if ctx.rank == 0:
        print(plan, flush=True)


def resume(ctx: RunContext) -> int:
    """With ``--resume``: load model and optimizer from ``--checkpoint-dir``; return its step (0: none).

    A sharded checkpoint (DTensors, one file per rank) loads at any world size."""
    if not ctx.args.resume:
        return 0
    import torch.distributed.checkpoint as dcp

    directory = ctx.args.checkpoint_dir
    init_optim_state(ctx.optimizer)  # DCP loads into existing tensors: give the optimizer its state first
    with state_dict_type(ctx.model, StateDictType.SHARDED_STATE_DICT):
        state: dict[str, Any] = {
            "model": ctx.model.state_dict(),
            "optim": optim_state_dict(ctx.model, ctx.optimizer),
            "step": 0,
        }
        dcp.load(state, checkpoint_id=directory)
        ctx.model.load_state_dict(state["model"])
        ctx.optimizer.load_state_dict(optim_state_dict_to_load(ctx.model, ctx.optimizer, state["optim"]))
    step = int(state["step"])
    if ctx.rank == 0:
        print(f"resumed from {directory} at step {step}", flush=True)
    return step


def save_checkpoint(ctx: RunContext, step: int) -> None:
    """Save model + optimizer + step as a sharded checkpoint with torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp

    with state_dict_type(ctx.model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": ctx.model.state_dict(), "optim": optim_state_dict(ctx.model, ctx.optimizer), "step": step}
        dcp.save(state, checkpoint_id=ctx.args.checkpoint_dir)
    if ctx.rank == 0:
        print(f"saved checkpoint at step {step} to {ctx.args.checkpoint_dir}", flush=True)


def after_step(ctx: RunContext, step: int) -> None:
    """Optimizer step ``step`` (1-based) is done on every rank: save every ``--checkpoint-every`` steps."""
    every = ctx.args.checkpoint_every
    if ctx.args.checkpoint_dir and every and step % every == 0 and step != ctx.args.steps:
        save_checkpoint(ctx, step)


def after_train(ctx: RunContext) -> None:
    """The last step is done on every rank: save the final checkpoint if ``--checkpoint-dir`` is set."""
    if ctx.args.checkpoint_dir and ctx.args.steps > ctx.start_step:
        save_checkpoint(ctx, ctx.args.steps)


# ---------------------------------------------------------------------------- training
def shard_model(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    if args.activation_checkpointing:
        for block in model.modules():
            if isinstance(block, Block):
                checkpoint(block)  # composable: no wrapper, FQNs and state-dict keys unchanged
    mp = MixedPrecision(param_dtype=torch.bfloat16) if args.mixed_precision == "bf16" else None
    return fully_shard(model, ModuleWrapPolicy({Block}), strategy=ShardingStrategy[args.strategy], mixed_precision=mp)


def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    # Built after fully_shard: it steps the original parameters, which are views of this rank's shard.
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)


def rank_device(args: argparse.Namespace, local_rank: int) -> torch.device:
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def train_step(ctx: RunContext, step: int) -> tuple[float, float]:
    """One optimizer step on this rank's slice; returns (mean loss over ranks, seconds)."""
    args = ctx.args
    inputs, targets = synthetic_batch(step, args.batch * ctx.world_size, args.seq, args.vocab, args.seed)
    inputs = rank_slice(inputs, ctx.rank, ctx.world_size).to(ctx.device)
    targets = rank_slice(targets, ctx.rank, ctx.world_size).to(ctx.device)
    start = time.perf_counter()
    logits = ctx.model(inputs)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    ctx.optimizer.step()
    ctx.optimizer.zero_grad(set_to_none=True)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    seconds = time.perf_counter() - start
    mean = loss.detach().float().reshape(1)
    dist.all_reduce(mean)  # for reporting only: every rank prints/returns the same number
    return mean.item() / ctx.world_size, seconds


def train(args: argparse.Namespace, local_rank: int = 0) -> list[float]:
    """Train on this rank (the process group must be up); returns the per-step mean losses."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = rank_device(args, local_rank)
    model = shard_model(build_model(args, device), args)
    ctx = RunContext(args, rank, world_size, device, model, build_optimizer(model, args))
    after_setup(ctx)
    ctx.start_step = resume(ctx)
    bar = _progress_bar(ctx)
    for step in range(ctx.start_step + 1, args.steps + 1):
        loss, seconds = train_step(ctx, step)
        ctx.losses.append(loss)
        ctx.step_times.append(seconds)
        if rank == 0:
            _log_step(bar, step, loss, seconds)
        after_step(ctx, step)
    if bar is not None:
        bar.close()
    after_train(ctx)
    report_memory(ctx)
    if rank == 0 and args.plot:
        save_loss_plot(ctx.losses, ctx.start_step, args.plot)
    return ctx.losses


def run_rank(rank: int, args: argparse.Namespace, init_method: str, local_rank: Optional[int] = None) -> None:
    """Entry point of one rank: join the group at ``init_method``, train, and leave the group."""
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.threads:
        torch.set_num_threads(args.threads)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=args.world_size,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    try:
        train(args, rank if local_rank is None else local_rank)
    finally:
        # The sharded model is garbage in a reference cycle (hooks -> state -> module) that holds the
        # process group: free it now, not at interpreter exit, where destroying a gloo group can abort.
        gc.collect()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- reporting
def _progress_bar(ctx: RunContext) -> Any:
    if ctx.rank != 0:
        return None
    from tqdm import tqdm  # rank 0 only: the other ranks never draw

    return tqdm(total=ctx.args.steps, initial=ctx.start_step, desc="train", unit="step", file=sys.stderr)


def _log_step(bar: Any, step: int, loss: float, seconds: float) -> None:
    line = f"step {step} loss {loss:.4f} time {seconds:.2f}s"
    if bar is None:
        print(line, flush=True)
        return
    bar.set_postfix(loss=f"{loss:.4f}", step_time=f"{seconds:.2f}s", refresh=False)
    bar.update(1)
    bar.write(line, file=sys.stdout)
    sys.stdout.flush()


def peak_rss_mib() -> float:
    """This process's peak resident set size (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def report_memory(ctx: RunContext) -> None:
    """Rank 0 prints every rank's peak RSS (and peak CUDA memory on CUDA): a collective."""
    mine = {"rss": peak_rss_mib()}
    if ctx.device.type == "cuda":
        mine["cuda"] = torch.cuda.max_memory_allocated(ctx.device) / 2**20
    everyone: list[Optional[dict[str, float]]] = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    if ctx.rank != 0:
        return
    for rank, mem in enumerate(everyone):
        assert mem is not None
        cuda = f" peak CUDA {mem['cuda']:.1f} MiB" if "cuda" in mem else ""
        print(f"rank {rank} peak RSS {mem['rss']:.1f} MiB{cuda}", flush=True)


def save_loss_plot(losses: list[float], start_step: int, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed (pip install matplotlib); no plot written", flush=True)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(start_step + 1, start_step + len(losses) + 1), losses, marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over ranks)")
    ax.set_title("fsdp_composable demo")
    if losses and all(math.isfinite(x) and x > 0 for x in losses):
        ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"loss curve written to {path}", flush=True)
