"""Refuse `DistributedDataParallel` around a model that `fully_shard` manages, on every rank.

[Note: DDP around a sharded model]
A sharded model's parameters are ``DTensor`` faces over this rank's shard, so DDP (also through accelerate's
``prepare(model)`` or Lightning's DDP strategy) would average shards of different parameters, and
its constructor's collectives go wrong first: the cross-rank shape check fails on ranks whose shard
is shorter while the others wait in it until the timeout, and with equal shards rank 0's shard is
broadcast over everyone's. The constructor registers the module with ``self.module = module``
before any collective; torch's global module-registration hook sees that assignment on every rank,
and raises here when the module is, holds or sits inside a sharded unit. The hook runs for every
submodule registration in the process, so it returns after one ``isinstance`` for anything but DDP.
`_torch_interop` installs it with the first `fully_shard` call (a DDP wrap comes after sharding).

[Note: fully_shard inside an existing DDP]
The other order, ``ddp = DDP(model)`` and then ``fully_shard(model.block)``, gives no registration
to see: DDP was built first, over the full parameters, and its reducer would all-reduce the shards
our reduce-scatter leaves in ``.grad`` (one gradient came out silently wrong). DDP marks the module
whose forward it runs (torch's ``DistributedDataParallel._active_ddp_module``, set around its
module's call), so the root's pre-forward asks for it, one attribute read per forward, and raises
on every rank before the first all-gather when the sharded module runs inside that DDP's module and
DDP reduces some of its parameters (a DDP told to ignore them, over the rest of the model, is fine).
"""

from __future__ import annotations

from typing import Optional

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fsdp_composable._common_utils import _get_fsdp_states, _is_inside_unit
from fsdp_composable.api import ShardedModelWrappedError

__all__ = ["ShardedModelWrappedError", "refuse_ddp_of_sharded", "refuse_inside_ddp"]


def _sharded_part(module: nn.Module) -> Optional[str]:
    """How ``module`` relates to fully_shard, or None when it does not."""
    states = _get_fsdp_states(module)
    if states:
        root = states[0].module
        if root is module:
            return f"this {type(module).__name__} was passed to fully_shard"
        fqn = next((name for name, m in module.named_modules() if m is root), None)
        if fqn is not None:
            return f"its submodule '{fqn}' ({type(root).__name__}) was passed to fully_shard"
        return f"this {type(module).__name__} is a unit of the {type(root).__name__} passed to fully_shard"
    if _is_inside_unit(module):
        return f"this {type(module).__name__}'s parameters belong to a fully_shard unit"
    return None


def refuse_ddp_of_sharded(parent: nn.Module, name: str, submodule: nn.Module) -> None:
    if not isinstance(parent, DistributedDataParallel) or name != "module":
        return
    why = _sharded_part(submodule)
    if why is not None:
        raise ShardedModelWrappedError(
            f"DistributedDataParallel cannot wrap a model sharded by fully_shard ({why}): fully_shard already "
            "reduce-scatters the gradients across the ranks, and DDP would mix different ranks' shards. Train "
            "the sharded model as it is, without DDP; with accelerate, pass only the optimizer, dataloaders and "
            "scheduler to accelerator.prepare (not the model); with Lightning, use "
            "fsdp_composable.lightning's strategies instead of the DDP strategy"
        )


def refuse_inside_ddp(module: nn.Module) -> None:
    """Raise when a DDP built before fully_shard runs ``module`` (a root's pre-forward): see
    [Note: fully_shard inside an existing DDP]."""
    ddp = getattr(DistributedDataParallel, "_active_ddp_module", None)
    if ddp is None:
        return
    fqn = next((name for name, m in ddp.module.named_modules() if m is module), None)
    if fqn is None:
        return
    # DDP built over the rest of the model only (its ignored parameters) reduces none of ours
    reduced = {id(p) for p in getattr(ddp, "_module_parameters", ddp.module.parameters())}
    if not any(id(p) in reduced for s in _get_fsdp_states(module) for h in s.handles for p in h.params):
        return
    what = (
        f"'{fqn}' ({type(module).__name__}) after DistributedDataParallel wrapped the {type(ddp.module).__name__} "
        "that holds it"
        if fqn
        else f"the {type(module).__name__} that DistributedDataParallel had wrapped before"
    )
    raise ShardedModelWrappedError(
        f"fully_shard was applied to {what}: DDP all-reduces the gradients of the full parameters it was built "
        "with, which are now this rank's shards, so the gradients would mix two reductions. Apply "
        "fully_shard to the model instead of DistributedDataParallel (it reduce-scatters the gradients "
        "across the ranks itself), or build DDP only over modules that fully_shard does not manage"
    )
