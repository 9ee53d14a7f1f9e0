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
import contextlib
import datetime
import gc
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, NoReturn, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp_composable._init._wrap_utils import ModuleWrapPolicy

# Submodules, not the package: under `python -m fsdp_composable` the package defers its own imports
# (see [Note: python -m fsdp_composable starts fast] in __init__.py).
from fsdp_composable._job import _job_checkpoint as job_ckpt
from fsdp_composable._state._optim_utils import init_optim_state, optim_state_dict, optim_state_dict_to_load
from fsdp_composable._state._state_dict_utils import state_dict_type
from fsdp_composable.api import MixedPrecision, ShardingStrategy, StateDictType
from fsdp_composable.checkpoint import checkpoint
from fsdp_composable.fully_shard import fully_shard
from fsdp_composable.inspect import describe

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
    train_seconds: float = 0.0  # wall time of the training loop on this rank, saves excluded
    save_seconds: float = 0.0  # wall time of the checkpoint saves on this rank (every rank waits for all)
    saves: int = 0
    loop_start_time: float = 0.0  # time.time() when the first step started


def after_setup(ctx: RunContext) -> None:
    """The model is sharded and the optimizer built: rank 0 shows how the model is sharded."""
    plan = describe(ctx.model)  # local, no communication
    if ctx.rank == 0:
        print("\n".join(plan_lines(plan)), flush=True)


def resume(ctx: RunContext) -> int:
    """With ``--resume``: load model and optimizer from ``--checkpoint-dir``'s latest checkpoint;
    return its step (0: none). `python -m fsdp_composable` has checked that it fits this model.

    A sharded checkpoint (DTensors, one file per rank) loads at any world size."""
    if not ctx.args.resume:
        return 0
    import torch.distributed.checkpoint as dcp

    saved = job_ckpt.latest(ctx.args.checkpoint_dir)
    assert saved is not None, "parse_args checks that --resume has a checkpoint"
    init_optim_state(ctx.optimizer)  # DCP loads into existing tensors: give the optimizer its state first
    with state_dict_type(ctx.model, StateDictType.SHARDED_STATE_DICT):
        state: dict[str, Any] = {
            "model": ctx.model.state_dict(),
            "optim": optim_state_dict(ctx.model, ctx.optimizer),
            "step": 0,
        }
        dcp.load(state, checkpoint_id=saved.path)
        ctx.model.load_state_dict(state["model"])
        ctx.optimizer.load_state_dict(optim_state_dict_to_load(ctx.model, ctx.optimizer, state["optim"]))
    step = int(state["step"])
    if ctx.rank == 0:
        was = saved.job.get("world_size")
        print(f"resumed from {saved.path} at step {step} (saved by {was} ranks, now {ctx.world_size})", flush=True)
    return step


def save_checkpoint(ctx: RunContext, step: int) -> None:
    """Save model + optimizer + step to ``--checkpoint-dir``/step_<step>, then point ``latest`` at it;
    see [Note: the main job's checkpoint directory]."""
    import torch.distributed.checkpoint as dcp

    start = time.perf_counter()
    root = ctx.args.checkpoint_dir
    path = job_ckpt.step_dir(root, step)
    with state_dict_type(ctx.model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": ctx.model.state_dict(), "optim": optim_state_dict(ctx.model, ctx.optimizer), "step": step}
        dcp.save(state, checkpoint_id=path)  # collective; rank 0 writes the metadata last
    if ctx.rank == 0:
        # every rank's files are written once dcp.save returned: [Note: the digests of a saved checkpoint]
        job_ckpt.write_job(path, job_ckpt.job_record(ctx.args, step, ctx.world_size, job_ckpt.file_digests(path)))
        job_ckpt.point_latest(root, path)
    dist.barrier()  # no rank reads `latest` (a later resume) before it names the new checkpoint
    seconds = time.perf_counter() - start
    ctx.save_seconds += seconds
    ctx.saves += 1
    if ctx.rank == 0:
        print(f"saved checkpoint at step {step} to {path} in {seconds:.2f}s", flush=True)


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
def process_group_for(args: argparse.Namespace, rank: int, world_size: int) -> Any:
    """None (the default group), or for HYBRID_SHARD the ``(shard group, replicate group)`` of this rank:
    ranks ``[i*K, (i+1)*K)`` shard together (K = ``--shard-group-size``; under torchrun the ranks of
    one node) and ranks ``j, j+K, j+2K, ...`` hold the same shard and all-reduce their gradients."""
    if args.strategy != "HYBRID_SHARD":
        return None
    k = args.shard_group_size
    shard = replicate = None
    for i in range(world_size // k):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(i * k, (i + 1) * k)))
        if rank // k == i:
            shard = group
    for j in range(k):
        group = dist.new_group(list(range(j, world_size, k)))
        if rank % k == j:
            replicate = group
    return shard, replicate


def shard_model(model: nn.Module, args: argparse.Namespace, process_group: Any = None) -> nn.Module:
    if args.activation_checkpointing:
        for block in model.modules():
            if isinstance(block, Block):
                checkpoint(block)  # composable: no wrapper, FQNs and state-dict keys unchanged
    mp = MixedPrecision(param_dtype=torch.bfloat16) if args.mixed_precision == "bf16" else None
    strategy = ShardingStrategy[args.strategy]
    return fully_shard(
        model, ModuleWrapPolicy({Block}), strategy=strategy, mixed_precision=mp, process_group=process_group
    )


def build_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    # Built after fully_shard: it steps the original parameters, which are views of this rank's shard.
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)


def rank_device(args: argparse.Namespace, local_rank: int) -> torch.device:
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def train_step(ctx: RunContext, step: int) -> tuple[float, float]:
    """One optimizer step on this rank's slice of the global batch; returns (mean loss over ranks, seconds)."""
    args = ctx.args
    inputs, targets = synthetic_batch(step, args.global_batch, args.seq, args.vocab, args.seed)
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
    model = shard_model(build_model(args, device), args, process_group_for(args, rank, world_size))
    ctx = RunContext(args, rank, world_size, device, model, build_optimizer(model, args))
    after_setup(ctx)
    ctx.start_step = resume(ctx)
    bar = ProgressBar(args.steps) if rank == 0 and use_progress_bar() else None
    ctx.loop_start_time = time.time()
    loop_start = time.perf_counter()
    for step in range(ctx.start_step + 1, args.steps + 1):
        if bar is not None:
            bar.show(step - 1)
        with _profile_last_step(ctx, step):
            loss, seconds = train_step(ctx, step)
        if bar is not None:
            bar.hide()
        ctx.losses.append(loss)
        ctx.step_times.append(seconds)
        if rank == 0:
            print(f"step {step} loss {loss:.4f} time {seconds:.2f}s", flush=True)
        after_step(ctx, step)
    ctx.train_seconds = time.perf_counter() - loop_start - ctx.save_seconds  # saves are reported apart
    after_train(ctx)
    report(ctx)
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
    if rank == 0:
        ranks = f"{args.world_size} rank{'s' if args.world_size != 1 else ''}"
        print(f"process group up: {ranks} after {_since_start(args)}; building and sharding the model", flush=True)
    try:
        train(args, rank if local_rank is None else local_rank)
    finally:
        # The sharded model is garbage in a reference cycle (hooks -> state -> module) that holds the
        # process group: free it now, not at interpreter exit, where destroying a gloo group can abort.
        gc.collect()
        dist.destroy_process_group()


def spawned_rank(rank: int, args: argparse.Namespace, init_method: str) -> None:
    """A rank that ``python -m fsdp_composable`` started; it ends as `end_trained_rank` says. An error
    still propagates to ``python -m fsdp_composable`` as usual (`fsdp_composable._job._job_processes`)."""
    # every rank prints this line: one write, so that two ranks' lines cannot interleave mid-line (print
    # writes the text and its newline apart where stdout writes through)
    sys.stdout.write(f"rank {rank} (pid {os.getpid()}) imported torch after {_since_start(args)}; joining\n")
    sys.stdout.flush()
    run_rank(rank, args, init_method)
    end_trained_rank()


def end_trained_rank() -> NoReturn:
    """A rank that has trained and left its process group (started by ``python -m fsdp_composable``
    or by torchrun) ends without the interpreter's teardown. Gloo's worker threads can still hold
    tensors then, and freeing them while the interpreter finalises aborts the process now and then
    (SIGABRT, "terminate called without an active exception", after a finished run: about 1 run in 12
    on a loaded 2-core machine)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _since_start(args: argparse.Namespace) -> str:
    """Seconds since ``python -m fsdp_composable`` started, for the lines of the silent start."""
    start = getattr(args, "start_time", None)
    return "?" if start is None else f"{time.time() - start:.1f}s"


# ---------------------------------------------------------------------------- reporting
@contextlib.contextmanager
def _profile_last_step(ctx: RunContext, step: int) -> Iterator[None]:
    """With ``--profile PATH``: record the last step with torch.profiler on every rank (the labels
    need the profiler on everywhere to be comparable) and write rank 0's as a Chrome trace."""
    if not ctx.args.profile or step != ctx.args.steps:
        yield
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield
    if ctx.rank == 0:
        prof.export_chrome_trace(ctx.args.profile)
        print(f"trace of step {step} (rank 0) written to {ctx.args.profile}", flush=True)


def use_progress_bar(stdout: Any = None, stderr: Any = None) -> bool:
    """Draw a bar only when both streams are terminals: the bar redraws itself with carriage returns
    on stderr, which would be mixed into the step lines of a log file or a pipe (``2>&1 | tee``)."""
    streams = (stdout or sys.stdout, stderr or sys.stderr)
    return all(getattr(s, "isatty", lambda: False)() for s in streams)


class ProgressBar:
    """Rank 0's one-line bar on stderr (a terminal), shown only while a step runs, so that every line
    printed (a step, a save) starts on a clean line. Ours, not tqdm's: tqdm's lock is a
    multiprocessing semaphore, and a rank ends with ``os._exit`` (see `spawned_rank`), so the
    semaphore was never released and multiprocessing's resource tracker warned about it after the
    job had ended."""

    WIDTH = 40

    def __init__(self, total: int, stream: Any = None) -> None:
        self.total = total
        self.stream = stream or sys.stderr

    def show(self, done: int) -> None:
        filled = self.WIDTH * done // max(self.total, 1)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        self.stream.write(f"\rtrain [{bar}] {done}/{self.total} steps")
        self.stream.flush()

    def hide(self) -> None:
        self.stream.write("\r\x1b[K")  # back to the line's start, erase it
        self.stream.flush()


def _count(n: int) -> str:
    """Exact below ten million, then three significant figures: a table column stays narrow."""
    if n < 10**7:
        return f"{n:,}"
    return f"{n / 1e6:.1f}M" if n < 10**9 else f"{n / 1e9:.1f}G"


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.2f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    raise AssertionError("unreachable")


def plan_lines(plan: Any) -> list[str]:
    """`describe()`'s plan as the job prints it: its first line, then a table of the columns that can
    differ in this job, so every line fits 100 columns (the demo never offloads and sets no reduce dtype)."""
    headers = ("unit", "params", "numel", "shard", "dtype", "strategy", "compute", "shard bytes")
    rows = [
        (
            u.fqn or "<root>",
            str(u.num_params),
            _count(u.numel),
            _count(u.shard_numel),
            str(u.dtype).removeprefix("torch."),
            u.strategy.name,
            str(u.param_dtype or u.dtype).removeprefix("torch."),
            _size(u.shard_bytes),
        )
        for u in plan.units
    ]
    total = ("total", str(sum(u.num_params for u in plan.units)), _count(plan.numel), _count(plan.shard_numel))
    rows.append((*total, "", "", "", _size(plan.sharded_param_bytes)))
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    right = {1, 2, 3, 7}

    def line(cells: tuple[str, ...]) -> str:
        padded = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "  ".join(padded).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return [str(plan).splitlines()[0], line(headers), rule, *map(line, rows[:-1]), rule, line(rows[-1])]


def peak_rss_mib() -> float:
    """This process's peak resident set size (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def gather_peak_memory(ctx: RunContext) -> list[tuple[float, float]]:
    """Every rank's (peak RSS MiB, peak CUDA MiB or -1), on every rank: a collective.

    A tensor all-gather, not ``all_gather_object``: that one pickles through numpy, which torch
    does not depend on, so it fails in a virtualenv with only torch installed."""
    cuda = torch.cuda.max_memory_allocated(ctx.device) / 2**20 if ctx.device.type == "cuda" else -1.0
    mine = torch.tensor([peak_rss_mib(), cuda], dtype=torch.float64, device=ctx.device)
    everyone = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, mine)
    return [(float(t[0]), float(t[1])) for t in everyone]


def summary(ctx: RunContext, memory: list[tuple[float, float]]) -> list[str]:
    """The last lines of a run: each rank's peak memory, the throughput of the training steps, and
    where the time went: starting up, training, checkpoint saves (the whole run counted once)."""
    lines = []
    for rank, (rss, cuda) in enumerate(memory):
        lines.append(f"rank {rank} peak RSS {rss:.1f} MiB" + (f" peak CUDA {cuda:.1f} MiB" if cuda >= 0 else ""))
    steps = len(ctx.losses)
    seconds = max(ctx.train_seconds, 1e-9)
    tokens = steps * ctx.args.global_batch * ctx.args.seq
    lines.append(
        f"summary: {steps} steps, {steps / seconds:.2f} steps/s, {tokens / seconds:,.0f} tokens/s"
        + (f", final loss {ctx.losses[-1]:.4f}" if ctx.losses else "")
    )
    start = getattr(ctx.args, "start_time", None)
    if start is not None:
        saves = f"{ctx.saves} checkpoint save{'s' if ctx.saves != 1 else ''}"
        lines.append(
            f"time: {time.time() - start:.1f}s in all: {ctx.loop_start_time - start:.1f}s starting up, "
            f"{ctx.train_seconds:.2f}s training"
            + (f", {ctx.save_seconds:.2f}s for {saves}" if ctx.args.checkpoint_dir else "")
        )
    return lines


def report(ctx: RunContext) -> None:
    """Rank 0 prints every rank's peak memory and the run's summary: a collective."""
    memory = gather_peak_memory(ctx)
    if ctx.rank == 0:
        print("\n".join(summary(ctx, memory)), flush=True)


def save_loss_plot(losses: list[float], start_step: int, path: str) -> None:
    import matplotlib  # python -m fsdp_composable checked that it is installed

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
