"""``floor``: what a FULL_SHARD step's bytes cost, without a sharding library's bookkeeping.

Every rank computes the unsharded model's forward and backward on its batch (as ``local-ranks``)
and moves, with plain gloo point-to-point messages posted receives first, exactly the bytes a
FULL_SHARD step of the same units moves: each unit's all-gather before its forward (the next unit's
posted when a unit starts, a one-unit prefetch), each block's all-gather again before its backward
(the next block's posted likewise; the root stays gathered, as the sharded impls keep it), and each
unit's reduce-scatter once its gradients exist, the gradients sent as per-parameter slices of each
peer's chunk and the own slices added to what arrives. AdamW then steps one flat shard per unit
(half the elements at 2 ranks) whose gradient is the reduced chunk. The model's weights never
change (nothing is gathered into them), so its losses stay near the first step's, and a block's
gathered copy is dropped as soon as it arrived instead of living through the block's compute; the
bytes, the messages and the optimizer's work are a sharded step's, the memory held is less. The gap
from ``floor`` to ``ours`` is the library's own work; the gap from ``local-ranks`` to ``floor`` is
the transport's.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["build_floor"]

_TAG = 0x464C0001  # one tag for every message; both ranks post them in the same order


class _Unit:
    def __init__(self, params: list[nn.Parameter], rank: int, world: int) -> None:
        self.params = params
        numel = sum(p.numel() for p in params)
        self.chunk = -(-numel // world)  # padded to a multiple of the world size
        self.rank, self.world = rank, world
        self.shard = nn.Parameter(torch.zeros(self.chunk))  # this rank's chunk, which AdamW steps
        self.gathered: Optional[torch.Tensor] = None
        self.pending: list[Any] = []

    def post_all_gather(self) -> None:
        buffer = torch.empty(self.chunk * self.world)
        peers = [p for p in range(self.world) if p != self.rank]
        works = [dist.irecv(buffer[p * self.chunk : (p + 1) * self.chunk], p, tag=_TAG) for p in peers]
        works += [dist.isend(self.shard.detach(), p, tag=_TAG) for p in peers]
        buffer[self.rank * self.chunk : (self.rank + 1) * self.chunk].copy_(self.shard.detach())
        self.gathered, self.pending = buffer, works

    def wait_all_gather(self) -> None:
        for w in self.pending:
            w.wait()
        self.pending = []

    def post_reduce_scatter(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor, list[Any], Callable[[], None]]:
        flat = [g.reshape(-1) for g in grads]
        mine = _slices(flat, self.rank * self.chunk, self.chunk)
        out = torch.empty(self.chunk)
        filled = sum(piece.numel() for _, piece in mine)
        out[filled:].zero_()  # the padding, which no peer sends
        # the first peer's slices land in the output itself, the others' in temporaries (as ours)
        received = [out] + [torch.empty(self.chunk) for _ in range(self.world - 2)]
        peers = [p for p in range(self.world) if p != self.rank]
        works = [
            dist.irecv(buf[offset : offset + piece.numel()], p, tag=_TAG)
            for buf, p in zip(received, peers)
            for offset, piece in mine
        ]
        for p in peers:
            works += [dist.isend(piece, p, tag=_TAG) for _, piece in _slices(flat, p * self.chunk, self.chunk)]

        def add() -> None:
            for offset, piece in mine:
                out[offset : offset + piece.numel()] += piece
            for buf in received[1:]:
                out.add_(buf)
            out.div_(self.world)

        return out, works, add


def _slices(flat: list[torch.Tensor], start: int, length: int) -> list[tuple[int, torch.Tensor]]:
    """(offset in the chunk, piece) for every parameter overlapping [start, start + length)."""
    pieces, begin = [], 0
    for t in flat:
        lo, hi = max(start, begin), min(start + length, begin + t.numel())
        if lo < hi:
            pieces.append((lo - start, t[lo - begin : hi - begin]))
        begin += t.numel()
    return pieces


def build_floor(
    model: nn.Module, block_type: type, make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
) -> torch.optim.Optimizer:
    """Attach the floor's hooks to ``model`` (blocks of ``block_type`` are units, the rest the root);
    returns ``make_optimizer`` over the units' shards, whose step waits for the reductions first."""
    rank, world = dist.get_rank(), dist.get_world_size()
    blocks = [m for m in model.modules() if isinstance(m, block_type)]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root = _Unit([p for p in model.parameters() if id(p) not in in_blocks], rank, world)
    units = [root] + [_Unit(list(b.parameters()), rank, world) for b in blocks]
    reductions: list[tuple[_Unit, torch.Tensor, list[Any], Callable[[], None]]] = []

    def gather(i: int, order: list[_Unit]) -> None:
        if i == 0:
            order[0].post_all_gather()
        order[i].wait_all_gather()
        if i + 1 < len(order):
            order[i + 1].post_all_gather()

    def before_forward(i: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            gather(i, units)
            if i > 0:  # the model computes with its own weights: a block's gathered copy goes once it arrived
                units[i].gathered = None

        return hook

    def before_backward(j: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            gather(j, backward_order)
            backward_order[j].gathered = None

        return hook

    def reduce(unit: _Unit) -> Callable[[Any], None]:
        def hook(grads: Any) -> None:
            reductions.append((unit, *unit.post_reduce_scatter(list(grads))))

        return hook

    backward_order = units[:0:-1]  # the blocks, last first
    model.register_forward_pre_hook(before_forward(0))
    for i, block in enumerate(blocks, start=1):
        block.register_forward_pre_hook(before_forward(i))
        j = len(blocks) - i

        def attach(_m: nn.Module, _a: Any, out: torch.Tensor, j: int = j) -> None:
            if out.requires_grad:
                out.register_hook(before_backward(j))

        block.register_forward_hook(attach)
    for unit in units:
        torch.autograd.graph.register_multi_grad_hook(unit.params, reduce(unit), mode="all")

    optimizer = make_optimizer([u.shard for u in units])

    def finish_reductions(*_: Any) -> None:
        for unit, out, works, add in reductions:
            for w in works:
                w.wait()
            add()
            unit.shard.grad = out
        reductions.clear()
        for p in model.parameters():
            p.grad = None  # the unsharded gradients are dropped once reduced, as a sharded step does

    optimizer.register_step_pre_hook(finish_reductions)
    return optimizer
