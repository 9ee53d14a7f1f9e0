"""A reduced shard gradient's copy to pinned host memory under CPU offload on CUDA."""

from __future__ import annotations

from typing import Optional

import torch

from fsdp_composable._flat_param import FlatParamHandle

__all__ = ["offload_copy"]


def offload_copy(handle: FlatParamHandle, reduced: torch.Tensor) -> Optional[torch.Tensor]:
    """Start copying a reduced shard gradient to pinned host memory (CPU offload on CUDA), in the
    dtype the sharded gradient keeps; None when the gradient stays where it is.

    [Note: offloaded gradients reach the host]
    With ``CPUOffload(offload_params=True)`` on CUDA, each reduced shard gradient is cast on the
    device and copied to pinned host memory with ``non_blocking=True`` on the stream that produced
    it, as soon as its reduction is issued, so the copies run during backward. Nothing on the host
    reads them until the end of the backward, where `sync_offload_copies` synchronises the CPU with
    the device once, before any gradient is committed to ``.grad`` and before the optimizer can
    step. A blocking copy is needed only where the host reads a gradient with no synchronisation in
    between: FSDP1's NO_SHARD, whose optimizer read an all-reduced gradient copied without one (the
    race the seeds describe, fixed there with a blocking copy). Here no gradient reaches ``.grad``
    except through `commit`, after that synchronisation, so NO_SHARD's gradients take the same
    non-blocking path; the blocking copy stays where the host does read without it: NO_SHARD's
    unshard copies the offloaded parameters into the device buffer with a blocking ``copy_``, so the
    host may write them (an optimizer step after a forward with no backward, hence no end-of-step
    synchronisation) as soon as the forward returns. On a CPU compute device nothing is copied."""
    if handle.shard_device == handle.device or handle.device.type != "cuda":
        return None
    mp = handle.config.mixed_precision
    dtype = reduced.dtype if mp is not None and mp.keep_low_precision_grads else handle.dtype
    on_device = reduced if reduced.dtype == dtype else reduced.to(dtype)
    host = torch.empty(reduced.shape, dtype=dtype, device=handle.shard_device, pin_memory=True)
    host.copy_(on_device, non_blocking=True)
    return host
