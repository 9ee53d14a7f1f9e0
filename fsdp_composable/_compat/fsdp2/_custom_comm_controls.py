"""FSDP2's ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` as functions on a sharded module:
the user's collective objects run a unit's all-gather and reduce-scatter ([Note: custom collectives]
in `_custom_comms`). Set on the units ``module`` owns (``recurse=True``: every unit under it), between
steps or before the first; ``None`` gives back ours. A NO_SHARD unit (any unit at world size 1) gathers
nothing and all-reduces its gradients: it accepts the objects and never calls them."""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from fsdp_composable._compat.fsdp2._reduce_controls import _check_no_comm_hook, _controls, _name, _units
from fsdp_composable._flat_param import FlatParamHandle

__all__ = ["set_custom_all_gather", "set_custom_reduce_scatter"]


def set_custom_all_gather(module: nn.Module, comm: Optional[Any], *, recurse: bool = False) -> None:
    """All-gather ``module``'s units' parameters with ``comm`` (FSDP2's ``AllGather``: ``allocate(size, *,
    dtype, device)`` and ``comm(output, input, group, async_op)``)."""
    units = _units(module, "set_custom_all_gather", recurse)
    _check(units, comm, "set_custom_all_gather")
    for handle in units:
        handle.switches.all_gather_comm = comm


def set_custom_reduce_scatter(module: nn.Module, comm: Optional[Any], *, recurse: bool = False) -> None:
    """Reduce-scatter ``module``'s units' gradients with ``comm`` (FSDP2's ``ReduceScatter``: ``allocate``
    and ``comm(output, input, group, op, async_op)``; called with ``ReduceOp.SUM``, we divide apart)."""
    units = _units(module, "set_custom_reduce_scatter", recurse)
    _check(units, comm, "set_custom_reduce_scatter")
    if comm is not None:
        _check_no_comm_hook(units, "set_custom_reduce_scatter")
    for handle in units:
        _controls(handle).reduce_scatter_comm = comm


def _check(units: list[FlatParamHandle], comm: Optional[Any], api: str) -> None:
    if comm is None:
        return
    if not (callable(comm) and callable(getattr(comm, "allocate", None))):
        raise TypeError(
            f"{api}({_name(units)}): comm must have allocate(size, *, dtype, device) and be callable (torch's "
            f"AllGather / ReduceScatter interface), got {type(comm).__name__}"
        )
