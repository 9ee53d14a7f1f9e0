"""QLoRA memory and all-gather bytes per rank: NF4 base weights sharded by their subclass, ours and FSDP2.

Usage (see benchmarks/README.md, "QLoRA: NF4 weights"; needs the [torchao] extra):
    python benchmarks/bench_qlora.py --world-size 2 --out benchmarks/results/qlora_ws2.json

A Llama-style model (``--layers`` blocks of width ``--dim``: attention's q, k, v, o and the MLP's gate,
up and down projections; an embedding and an output head) whose block linears are frozen torchao
``NF4Tensor`` weights with trainable LoRA adapters (rank 8), sharded per block, trained with AdamW on
the adapters. The configurations:
- ``ours, NF4``: ``fully_shard(model, ModuleWrapPolicy({Block}))``; the NF4 weights are extension
  parameters (all-gathered as 4-bit codes and scales);
- ``FSDP2, NF4``: torch's ``fully_shard`` on each block, then the model (torch's own extension path);
- ``ours, float32 base``: the same model with the base weights dequantized to frozen float32.
The ranks (gloo on 127.0.0.1, forked) run 2 warm-up steps, then one step under the live-bytes tracker
(peak live tensor bytes, `_mem_tracker`) and the collective counter (bytes each rank sends to
all-gathers: the gathered output), then ``--steps`` timed steps; for ours, `estimate_memory()` of
the model before sharding beside the measured peak. Writes a JSON file, a PNG chart next to it, and
prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # noqa: E402

from benchmarks._comm_counter import CommCounter  # noqa: E402
from benchmarks._mem_tracker import LiveBytesTracker  # noqa: E402
from benchmarks._ranks import run_ranks  # noqa: E402
from benchmarks._report import MIB, pyplot, save_run, wrote  # noqa: E402
from fsdp_composable import ModuleWrapPolicy, estimate_memory, fully_shard  # noqa: E402
from fsdp_composable._comm import _collectives  # noqa: E402

CONFIGS = ("ours, NF4", "FSDP2, NF4", "ours, float32 base")
VOCAB, SEQ, BATCH = 512, 64, 2  # per rank


class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, nf4: bool, rank: int = 8) -> None:
        from torchao.quantization import to_nf4

        super().__init__()
        weight = torch.randn(d_out, d_in) / d_in**0.5
        quantized = to_nf4(weight)
        self.weight = nn.Parameter(quantized if nf4 else quantized.get_original_weight(), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(d_out, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + (x @ self.lora_a.t()) @ self.lora_b.t()


class Block(nn.Module):
    def __init__(self, dim: int, nf4: bool, heads: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.q, self.k, self.v, self.o = (LoRALinear(dim, dim, nf4) for _ in range(4))
        self.gate, self.up = LoRALinear(dim, 4 * dim, nf4), LoRALinear(dim, 4 * dim, nf4)
        self.down = LoRALinear(4 * dim, dim, nf4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.norm1(x)
        q, k, v = (m(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.o(a)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Model(nn.Module):
    def __init__(self, dim: int, layers: int, nf4: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim).requires_grad_(False)
        self.blocks = nn.ModuleList(Block(dim, nf4) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False).requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> float:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


class _GatheredBytes:
    """The bytes every unit all-gather of ours gathers (its output), counted where the units call it."""

    def __init__(self) -> None:
        self.bytes = 0
        self._orig = _collectives.all_gather

    def __enter__(self) -> _GatheredBytes:
        def spy(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.bytes += output.numel() * output.element_size()
            return self._orig(output, *args, **kwargs)

        _collectives.all_gather = spy  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        _collectives.all_gather = self._orig  # type: ignore[assignment]


def _rank(rank: int, world: int, config: str, dim: int, layers: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Model(dim, layers, nf4=config != "ours, float32 base")
    base = sum(m.weight.numel() for m in model.modules() if isinstance(m, LoRALinear))
    estimate = None
    if config.startswith("ours"):  # the same batch shape and loss as `_step`
        tokens = torch.zeros(BATCH, SEQ + 1, dtype=torch.long)
        estimate = estimate_memory(
            model,
            policy=ModuleWrapPolicy({Block}),
            world_size=world,
            optimizer="adamw",
            batch_example=tokens[:, :-1],
            loss_fn=lambda logits: F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)),
        ).peak_bytes
    if config == "FSDP2, NF4":
        for block in model.blocks:
            torch_fully_shard(block)
        torch_fully_shard(model)
    else:
        fully_shard(model, ModuleWrapPolicy({Block}))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for i in range(2):
        _step(model, opt, i, rank)
    existing = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    existing += [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    with CommCounter() as counter, _GatheredBytes() as ours, LiveBytesTracker() as tracker:
        tracker.add_existing(existing)
        _step(model, opt, 2, rank)
    # the gathered (output) bytes: ours where its units call the all-gather (gloo sends point to
    # point), FSDP2's from its all-gather calls (`_comm_counter`'s payload: the output)
    theirs = counter.snapshot()["payload_bytes_by_kind"].get("all_gather", 0)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        _step(model, opt, 3 + i, rank)
        times.append(time.perf_counter() - t0)
    return {
        "peak_live_bytes": tracker.peak_bytes,
        "estimate_bytes": estimate,
        "all_gather_bytes": theirs if config.startswith("FSDP2") else ours.bytes,
        "step_s": sorted(times)[len(times) // 2],
        "frozen_base_numel": base,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/qlora_ws2.json")
    args = parser.parse_args()
    results = []
    for config in CONFIGS:
        print(f"[{len(results) + 1}/{len(CONFIGS)}] {config}: {args.world_size} ranks ...", flush=True)
        ranks = run_ranks(args.world_size, _rank, (config, args.dim, args.layers, args.steps))
        results.append(
            {
                "config": config,
                "peak_live_mib": max(r["peak_live_bytes"] for r in ranks) / MIB,
                # estimate_memory() of the model before sharding (ours only), rank 0's bytes
                "estimate_mib": ranks[0]["estimate_bytes"] / MIB if ranks[0]["estimate_bytes"] else None,
                "all_gather_mib": max(r["all_gather_bytes"] for r in ranks) / MIB,
                "step_s": max(r["step_s"] for r in ranks),
                "ranks": ranks,
            }
        )
    base = results[0]["ranks"][0]["frozen_base_numel"]
    config = {"world_size": args.world_size, "dim": args.dim, "layers": args.layers, "frozen_base_numel": base}
    png = save_run(__file__, config, results, args.out)
    print(f"\n{args.layers} blocks of width {args.dim}, {base:,} NF4 base weights, {args.world_size} ranks:\n")
    print(
        "| configuration | peak live / rank (MiB) | estimate_memory (MiB) | estimate / measured "
        "| all-gathered / rank / step (MiB) | median step (s) |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        est = r["estimate_mib"]
        ratio = f"{est:.1f} | {est / r['peak_live_mib']:.3f}" if est is not None else "- | -"
        print(f"| {r['config']} | {r['peak_live_mib']:.1f} | {ratio} | {r['all_gather_mib']:.2f} | {r['step_s']:.3f} |")
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        names = [r["config"] for r in results]
        panels = (("peak_live_mib", "peak live MiB / rank"), ("all_gather_mib", "all-gathered MiB / rank / step"))
        for ax, (key, title) in zip(axes, panels):
            ax.barh(names, [r[key] for r in results], color=["tab:blue", "tab:orange", "tab:gray"])
            ax.set_title(title)
        fig.suptitle(f"QLoRA, {args.layers} x {args.dim}, {args.world_size} ranks (CPU, gloo)")
        fig.tight_layout()
        fig.savefig(png, dpi=100)
    print(wrote(args.out, png))


if __name__ == "__main__":
    main()
