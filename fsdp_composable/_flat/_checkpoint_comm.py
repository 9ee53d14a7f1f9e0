"""The collectives of checkpointing (FULL / SHARDED / LOCAL state dicts, optimizer-state conversion,
`unshard_params`), each on its group's communication device.

[Note: checkpoint collectives on the communication device]
A collective's tensors must live on the device its group serves (`_collectives.comm_device`: NCCL
serves CUDA only). The values checkpointing moves may live elsewhere: with
``CPUOffload(offload_params=True)`` a unit's flat shard, its gradient and its optimizer state are on
the CPU. So every function here copies its inputs to the unit's communication device, communicates
there, and gives its result back on the device its input lived on (copy in, communicate, copy out);
where the group serves that device already (gloo and CPU tensors, NCCL and CUDA tensors) nothing is
copied. The same holds outside this file: `reset_parameters`'s broadcasts of the CPU full copy
(`_reset_params`) and DTensor gathers (`_tensor_parallel.full_tensor`, on the mesh's device). Results
are read on the host with `_collectives.host_values` only. Object collectives
(``all_gather_object``) build their tensors on torch's *current* CUDA device when the group is NCCL,
so they run with the unit's device made current.

The blocking collectives here (torch's object, flag and all-to-all collectives) name what they were for
when they fail (`_failure_named`), as `_collectives.wait` names the asynchronous ones: a survivor of a
rank that died inside ``optim_state_dict()`` reads which entry point and which unit, not only gloo's
"Connection closed by peer".
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from fsdp_composable._comm import _collectives, _rank_agreement
from fsdp_composable._comm._header_fields import for_unit
from fsdp_composable._flat_param import FlatParamHandle
from fsdp_composable.api import CollectiveError, FSDPError

__all__: list[str] = []


@contextlib.contextmanager
def _failure_named(what: str) -> Iterator[None]:
    """A collective inside that fails (a peer died, the group timed out) raises `CollectiveError` naming
    the entry point running now and ``what`` (e.g. "all-to-all of unit 'blocks.1'")."""
    try:
        yield
    except FSDPError:
        raise
    except RuntimeError as e:
        raise CollectiveError(
            f"fully_shard: the {_rank_agreement.doing()} {what} did not complete: {e}. Another rank probably "
            "died, hung, or ran different modules; check the other ranks' logs (the process group timeout "
            f"bounds the wait){_rank_agreement.entry_hint()}"
        ) from e


def _unit(handle: FlatParamHandle) -> str:
    return f"unit '{handle.root_fqn}'"


def comm_device_of(handle: FlatParamHandle) -> torch.device:
    """Where the collectives of ``handle``'s unit take their tensors."""
    return _collectives.comm_device(handle.process_group, handle.device)


def gather_full_flat(handle: FlatParamHandle, shard: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The unit's whole flat parameter (or flat ``shard`` of the same layout, e.g. its gradient) in
    full precision, on the shard's device, laid out by parameter (each at ``info.offset``): a new
    tensor, never the unshard buffer."""
    layout = handle.layout
    shard = handle.flat_param.detach() if shard is None else shard
    if layout.world_size == 1:
        return shard.clone()
    device = comm_device_of(handle)
    full = torch.empty(layout.padded_numel, dtype=shard.dtype, device=device)
    with for_unit(handle.root_fqn):
        regions = None if layout.same_order else layout.regions_of(full)  # [Note: rank-major flat shards]
        work = _collectives.all_gather(full, shard.to(device), handle.process_group, regions=regions)
    _collectives.wait(work, f"the {_rank_agreement.doing()} all-gather of unit '{handle.unit_fqn or '<root>'}'")
    return full.to(shard.device)


def any_rank(handle: FlatParamHandle, flag: bool) -> bool:
    """Whether ``flag`` holds on some rank of the unit's process group."""
    has = torch.tensor([int(flag)], device=comm_device_of(handle))
    with _failure_named(f"all-reduce of a flag of {_unit(handle)}"):
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=handle.process_group)
    return bool(_collectives.host_values(has)[0])


def all_gather_object(group: dist.ProcessGroup, obj: Any, device: torch.device, what: str) -> list[Any]:
    """Every rank's ``obj`` over ``group`` (``device``: the compute device of the unit asking; ``what``:
    what it is for, in errors)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    with _collectives.comm_device_current(group, device), _failure_named(what):
        dist.all_gather_object(out, obj, group=group)
    return out
