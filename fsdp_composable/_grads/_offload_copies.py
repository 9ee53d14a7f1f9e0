"""CPU offload's copies between the pinned host shards and gradients and the compute device, and
the one host synchronisation of a step that has any."""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

import torch

from fsdp_composable._comm import _collectives
from fsdp_composable._flat_param import FlatParamHandle

__all__: list[str] = []


class HostCopy(Protocol):
    """What `sync_offload_copies` reads of a reduction (`_reduce_utils.PendingReduce`, which sits above
    this module and calls it): its unit and the host copy `offload_copy` made of its result."""

    handle: FlatParamHandle
    host: Optional[torch.Tensor]


def offload_copy(handle: FlatParamHandle, reduced: torch.Tensor) -> Optional[torch.Tensor]:
    """Start copying a reduced shard gradient to pinned host memory (CPU offload on CUDA), in the
    dtype the sharded gradient keeps; None when the gradient stays where it is.

    [Note: offloaded gradients reach the host]
    With ``CPUOffload(offload_params=True)`` on CUDA, each reduced shard gradient is cast on the
    device and copied to pinned host memory with ``non_blocking=True`` on the stream that produced
    it, as soon as its reduction is issued, so the copies run during backward. Nothing on the host
    reads them until the end of the backward, where `sync_offload_copies` synchronises the CPU with
    the device once, before any gradient is committed to ``.grad`` and before the optimizer can
    step. No gradient reaches ``.grad`` except through `commit`, after that synchronisation, so
    NO_SHARD's gradients take the same path (FSDP1 needed a blocking copy there). The uploads of the
    pinned shards to the device (unshard, every strategy NO_SHARD included) are non-blocking too:
    the host must not write a shard (optimizer, ``load_state_dict``, an EMA) while one may still read
    it, so the end of every step with an upload, a forward with no backward too, synchronises once
    (`sync_offload_copies`). On a CPU compute device nothing is copied."""
    if handle.shard_device == handle.device or handle.device.type == "cpu":
        return None
    mp = handle.config.mixed_precision
    dtype = reduced.dtype if mp is not None and mp.keep_low_precision_grads else handle.dtype
    on_device = reduced if reduced.dtype == dtype else reduced.to(dtype)
    pin = handle.device.type == "cuda"  # (a test's fake device has no pinned memory)
    host = torch.empty(reduced.shape, dtype=dtype, device=handle.shard_device, pin_memory=pin)
    host.copy_(on_device, non_blocking=True)
    return host


def sync_offload_copies(reductions: Sequence[HostCopy], handles: "list[FlatParamHandle]") -> None:
    """The one host synchronisation of a step with CPU offload on CUDA: the offloaded gradients are
    on the host, no shard upload reads it ([Note: offloaded gradients reach the host]: the compute
    stream waited for every upload, through its all-gather's event)."""
    devices = {r.handle.device for r in reductions if r.host is not None}
    devices |= {h.device for h in handles if h.upload_pending and h.device.type != "cpu"}
    for handle in handles:
        handle.upload_pending = False
    for device in devices:
        _collectives.compute_stream(device).synchronize()
