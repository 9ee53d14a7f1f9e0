"""Build the model and optimizer for one implementation under test.

``ours`` is ``fsdp_composable.fully_shard(model, ModuleWrapPolicy({Block}), strategy=...)``;
``torch-fsdp2`` is torch's ``fully_shard`` on each block then the root, configured to do what the
strategy does (`FSDP2_EQUIVALENT`); ``ddp`` is
``DistributedDataParallel``; ``local`` is the unsharded model alone with the per-rank batch;
``local-ranks`` is that unsharded model in every rank's process at once (no communication), so the
ranks share the machine's cores and memory as the distributed impls' ranks do; ``floor`` is
``local-ranks`` plus a FULL_SHARD step's bytes moved by hand and AdamW over shards (`_floor.py`).
Every impl starts from the same seed, so all of them start from the same weights.
Everything that binds a collective is imported here, at import time, so that `CommCounter.install`
(called after this module is imported) finds and wraps those bindings.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn.parallel import DistributedDataParallel

import fsdp_composable
from benchmarks._floor import build_floor
from benchmarks._model import BenchGPT, Block, ModelConfig, gpt_loss, make_batch

__all__ = ["IMPLS", "Built", "build"]

IMPLS = ("ours", "torch-fsdp2", "ddp", "local", "local-ranks", "floor")
# HYBRID_SHARD: both sharded impls over a 2-D (replicate, shard) mesh whose shard groups have this many ranks
HYBRID_SHARD_GROUP = 2
# each strategy of ours -> the torch FSDP2 configuration that does the same thing (None: FSDP2 has none)
# (reshard_after_forward left to FSDP2's default, None: True for every module but the root, which stays
# unsharded from forward to backward as ours' root unit does; an explicit True would reshard the root too)
FSDP2_EQUIVALENT: dict[str, Optional[str]] = {
    "FULL_SHARD": "reshard_after_forward default, 1-D mesh",
    "SHARD_GRAD_OP": "reshard_after_forward=False, 1-D mesh",
    "HYBRID_SHARD": f"reshard_after_forward default, 2-D mesh (replicate, shard={HYBRID_SHARD_GROUP})",
    "NO_SHARD": None,  # FSDP2 has no NO_SHARD: compare ours' NO_SHARD with ddp
}
BEFORE = "ours-before"  # only paired against ours: `bench_before_after.py`
# the package `bench_before_after.py` exported from an earlier commit under another name
BEFORE_PACKAGE = "BENCH_BEFORE_PACKAGE"


@dataclass
class Built:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    notes: list[str] = field(default_factory=list)
    # Tensors alive between steps that model.parameters()/.grad/optimizer state do not reach.
    extra_tensors: Any = None

    def existing_tensors(self) -> Iterator[Optional[torch.Tensor]]:
        for _, tensors in self.labelled_tensors():
            yield from tensors

    def labelled_tensors(self) -> Iterator[tuple[str, Iterator[Optional[torch.Tensor]]]]:
        """What lives between steps, by what it is (generators: a list would keep alive the gradients
        that zero_grad frees)."""
        yield "parameters", iter(list(self.model.parameters()))
        yield "gradients", (p.grad for p in self.model.parameters())
        yield "buffers", self.model.buffers()
        state = self.optimizer.state.values()
        yield "optimizer state", (v for st in state for v in st.values() if isinstance(v, torch.Tensor))
        if self.extra_tensors is not None:
            yield "flat parameters", self.extra_tensors()

    def train_step(self, cfg: ModelConfig, step: int, rank: int) -> None:
        """One training step on ``rank``'s batch of step ``step`` (CPU), as every benchmark times it."""
        self.optimizer.zero_grad(set_to_none=True)
        gpt_loss(self.model, make_batch(cfg, step, rank)).backward()
        self.optimizer.step()


def _optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """Every impl's optimizer (floor's over its shards). ``foreach=True``, as torch picks on GPUs: on the
    CPU torch's default is a loop per tensor, which over `DTensor` parameters (ours, FSDP2) pays
    DTensor's dispatch for every op of every parameter (`bench_optimizer_step.py` measures it)."""
    return torch.optim.AdamW(params, lr=1e-3, foreach=True)


def _build_ours(
    model: nn.Module,
    strategy: str,
    bf16: bool,
    device: torch.device,
    forward_prefetch: Optional[bool],
    lib: ModuleType = fsdp_composable,
) -> Built:
    """``lib``: this tree's package, or an earlier commit's (`_build_ours_before`)."""
    mp = lib.MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
    lib.fully_shard(
        model,
        lib.ModuleWrapPolicy({Block}),
        process_group=_hybrid_mesh(device) if strategy == "HYBRID_SHARD" else None,
        strategy=lib.ShardingStrategy[strategy],
        mixed_precision=mp,
        device_id=device if device.type == "cuda" else None,
        forward_prefetch=forward_prefetch,
    )
    handles = list(lib.fully_shard.state(model).handles)

    def flat_tensors() -> Iterator[Optional[torch.Tensor]]:
        for h in handles:
            yield h.flat_param
            yield h.flat_param.grad

    prefetch = "" if forward_prefetch is None else f", forward_prefetch={forward_prefetch}"
    call = "fully_shard" if lib is fsdp_composable else f"{lib.__name__}.fully_shard"
    notes = [f"{call}(ModuleWrapPolicy({{Block}}), strategy={strategy}{prefetch}) -> {len(handles)} units"]
    return Built(model, _optimizer(model.parameters()), notes, flat_tensors)


def _build_ours_before(
    model: nn.Module, strategy: str, bf16: bool, device: torch.device, forward_prefetch: Optional[bool]
) -> Built:
    """``ours`` as an earlier commit built it: its package, exported under another name by
    `bench_before_after.py`, named by the environment."""
    name = os.environ.get(BEFORE_PACKAGE)
    if not name:
        raise ValueError(f"impl='ours-before' needs {BEFORE_PACKAGE}: run it through benchmarks/bench_before_after.py")
    return _build_ours(model, strategy, bf16, device, forward_prefetch, importlib.import_module(name))


def _hybrid_mesh(device: torch.device) -> Any:
    """The 2-D (replicate, shard) mesh of HYBRID_SHARD, for ours and FSDP2 alike."""
    world_size = dist.get_world_size()
    if world_size % HYBRID_SHARD_GROUP or world_size < 2 * HYBRID_SHARD_GROUP:
        need = f"a multiple of {HYBRID_SHARD_GROUP} ranks, at least {2 * HYBRID_SHARD_GROUP}"
        raise ValueError(f"HYBRID_SHARD needs {need}; got {world_size}")
    shape = (world_size // HYBRID_SHARD_GROUP, HYBRID_SHARD_GROUP)
    return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))


def _build_fsdp2(model: nn.Module, strategy: str, bf16: bool, device: torch.device, world_size: int) -> Built:
    """torch FSDP2 configured as `FSDP2_EQUIVALENT` says for ``strategy``."""
    if FSDP2_EQUIVALENT.get(strategy) is None:
        raise ValueError(f"torch FSDP2 has no equivalent of {strategy}; compare ours' {strategy} with impl 'ddp'")
    mesh = _hybrid_mesh(device) if strategy == "HYBRID_SHARD" else init_device_mesh(device.type, (world_size,))
    reshard = False if strategy == "SHARD_GRAD_OP" else None
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        torch_fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    torch_fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    notes = [f"torch fully_shard on {len(blocks)} blocks + root, {FSDP2_EQUIVALENT[strategy]}"]
    return Built(model, _optimizer(model.parameters()), notes)


def _build_ddp(model: nn.Module, device: torch.device) -> Built:
    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids)
    notes = ["builtin C++ reducer (no comm hook): its all-reduce is visible only to the dispatcher counter"]
    return Built(ddp, _optimizer(ddp.parameters()), notes)


def build(
    impl: str,
    cfg: ModelConfig,
    *,
    strategy: str,
    bf16: bool,
    device: torch.device,
    world_size: int,
    forward_prefetch: Optional[bool] = None,
) -> Built:
    """The model (seeded identically for every impl) prepared for ``impl``, with its AdamW;
    ``forward_prefetch`` applies to ours (None: the library's default)."""
    if impl not in IMPLS and impl != BEFORE:
        raise ValueError(f"impl={impl!r} is not one of {', '.join(IMPLS)}")
    if impl == "floor" and device.type != "cpu":  # its messages are CPU tensors: gloo's transport only
        raise ValueError(f"impl='floor' measures gloo on the CPU; got device {device}")
    torch.manual_seed(0)
    model = BenchGPT(cfg).to(device)
    if impl == "local":
        return Built(model, _optimizer(model.parameters()), ["unsharded model, one process, per-rank batch"])
    if impl == "local-ranks":  # no collective: the process group only lines the ranks' steps up
        notes = ["unsharded model in every rank's process, no communication"]
        return Built(model, _optimizer(model.parameters()), notes)
    if not dist.is_initialized():
        raise RuntimeError(f"impl={impl!r} needs an initialised process group")
    if impl == "ours":
        return _build_ours(model, strategy, bf16, device, forward_prefetch)
    if impl == BEFORE:
        return _build_ours_before(model, strategy, bf16, device, forward_prefetch)
    if impl == "floor":
        optimizer = build_floor(model, Block, _optimizer)
        return Built(model, optimizer, ["unsharded compute, a FULL_SHARD step's gloo messages, AdamW over shards"])
    if impl == "torch-fsdp2":
        return _build_fsdp2(model, strategy, bf16, device, world_size)
    return _build_ddp(model, device)
