"""FSDP1's communication hooks: the record of a registered hook and the call-out that runs it in place
of a unit's gradient collective (`register_comm_hook`, in `_register_comm_hook`, attaches it).

[Note: communication hooks]
A hook replaces the reduction of every unit's gradient, FSDP1's way. `_reduce_utils.start_reduce`
asks `registered(handle)` and, for a hooked unit, hands it the whole padded unsharded flat gradient of
this backward (plus what ``no_sync`` kept) instead of issuing its own collective:
- sharded strategies: ``hook(state, grad, output)``, with ``output`` an empty tensor of the unit's
  shard size that the hook fills (torch's ``reduce_scatter_hook``);
- NO_SHARD: ``hook(state, grad)``, which reduces ``grad`` in place (torch's ``allreduce_hook``).
The hook divides as it likes (torch's default hooks average over their state's process group); ours
divides nothing more. The result then goes the usual way: added to the sharded gradient once the
backward succeeded, in the parameters' dtype. ``grad`` is a tensor of its own, so a hook may change
it in place. It runs where our collective would have run (on CUDA, the post-backward stream).

FSDP1's rules, kept: register on the root, before the first forward, once; not with HYBRID_SHARD (the
replica all-reduce has no place in the hook's signature). The gradient is in the reduce dtype of
``MixedPrecision``, except for torch's ``fp16_compress_hook`` / ``bf16_compress_hook``, which cast
and cast back themselves: they get the gradient as computed, and together with a ``reduce_dtype``
they are refused, since both would choose the reduction's precision.

The hook is attached to each unit module through the registry under its own name, so the state and
the handles stay as they are; `registered` reads it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from fsdp_composable._comm import _collectives
from fsdp_composable._composable_state import _get_module_state
from fsdp_composable._flat_param import FlatParamHandle

__all__ = ["CommHook", "registered", "start"]

API_NAME = "comm_hook"


@dataclass(frozen=True)
class CommHook:
    """A registered hook and the state object it is called with."""

    state: Any
    hook: Callable[..., Any]
    # torch's fp16/bf16 compress hooks: the dtype they reduce in (they cast the gradient themselves)
    low_precision: Optional[torch.dtype]


def registered(handle: FlatParamHandle) -> Optional[CommHook]:
    """The hook registered for ``handle``'s unit, if any."""
    return _get_module_state(handle.module, API_NAME)


@torch.no_grad()
def start(
    hook: CommHook,
    handle: FlatParamHandle,
    flat: torch.Tensor,
    kept: Optional[torch.Tensor],
    stream: Optional["torch.cuda.Stream"],
    then: Optional[Callable[[torch.Tensor], None]] = None,
) -> tuple[_collectives.InFlight, torch.Tensor, list[torch.Tensor]]:
    """Run ``hook`` on this backward's padded unsharded gradient ``flat`` where our collective would
    run. Returns the work, the tensor holding the result (the shard, or under NO_SHARD the whole), and
    the tensors to keep alive until the work is waited for: all are made here, on the compute stream
    (see [Note: streams without record_stream] in `_collectives`). ``then(result)``: CUDA only, run on
    the stream after the hook (CPU offload starts the result's copy to the host there)."""
    dtype = flat.dtype if hook.low_precision is not None else handle.reduce_dtype
    if not handle.layout.same_order_in:  # the hook reduce-scatters the rank-major flat: one copy-in
        grad = handle.layout.copy_in(flat, out=torch.empty(flat.numel(), dtype=dtype, device=flat.device))
    else:
        grad = flat if flat.dtype == dtype and flat is not kept else flat.to(dtype, copy=True)
    sharded = handle.layout.world_size > 1
    out = torch.empty(handle.layout.shard_numel, dtype=dtype, device=grad.device) if sharded else grad
    if hook.low_precision is not None:  # torch's compress hooks, computed by `_compressed`
        low = grad.to(hook.low_precision)
        low_out = torch.empty(out.shape, dtype=hook.low_precision, device=grad.device) if sharded else low
        after = (lambda: then(out)) if then is not None else None
        work = _collectives.issue(stream, lambda _async_op: _compressed(hook.state, low, low_out, out), then=after)
        return work, out, [flat, grad, low, low_out]
    after = (lambda: then(out)) if then is not None else None
    if sharded:
        work = _collectives.issue(stream, lambda _async_op: hook.hook(hook.state, grad, out), then=after)
    else:  # NO_SHARD: the hook reduces in place
        work = _collectives.issue(stream, lambda _async_op: hook.hook(hook.state, grad), then=after)
    return work, out, [flat, grad]


def _compressed(state: Any, low: torch.Tensor, low_out: torch.Tensor, out: torch.Tensor) -> None:
    """What torch's fp16/bf16 compress hooks compute, with our collectives: ``low`` (the gradient cast
    to their dtype) divided by the state's pre-divide factor, reduced over its group (into ``low_out``:
    the shard, or ``low`` itself under NO_SHARD), divided by its post-divide factor, cast back into
    ``out``. Ours because theirs calls ``record_stream`` (which our CUDA rules exclude, and which fails
    on CPU)."""
    group, pre, post = state.process_group, state.gradient_predivide_factor, state.gradient_postdivide_factor
    if pre > 1:
        low.div_(pre)
    if low_out is low:
        _collectives.wait(_collectives.all_reduce(low, group), "the compressed gradient all-reduce")
    else:
        _collectives.wait(_collectives.reduce_scatter(low_out, low, group), "the compressed gradient reduce-scatter")
    if post > 1:
        low_out.div_(post)
    out.copy_(low_out)
