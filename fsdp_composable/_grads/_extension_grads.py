"""The gradients of a unit's extension parameters ([Note: extension parameters] in `_extensions`).

A trainable extension parameter's unsharded tensor is a leaf of its own, so autograd accumulates its
gradient (a plain tensor of the full shape) there. At the unit's post-backward, in a backward that
synchronises gradients, it is reduce-scattered by dim-0 chunk over the shard group (all-reduced over
the replicas under HYBRID_SHARD), averaged as the flat parameter's gradients are, and added to the
face's gradient, a ``DTensor`` of the face's placement. Outside a synchronising backward (``no_sync``)
it stays on the unsharded leaf and the next one adds to it. The reduction is synchronous: these
parameters are few (a unit's frozen or float8 weights), and most are frozen.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from fsdp_composable._comm import _collectives, _custom_comms
from fsdp_composable._flat_param import FlatParamHandle
from fsdp_composable._grads._reduce_utils import divide_factors

__all__ = ["reduce_extension_grads"]


@torch.no_grad()
def reduce_extension_grads(handle: FlatParamHandle) -> None:
    ext = handle.extensions
    if ext is None:
        return
    # NO_SHARD: every rank holds the whole parameter, and the gradient is all-reduced over the group
    world = (ext.world if ext.group is not None else handle.group_size) * handle.replicas
    for p in ext.params:
        unsharded = p.unsharded
        if unsharded is None or unsharded.grad is None:
            continue
        full, unsharded.grad = unsharded.grad, None
        dtype = handle.config.reduce_dtype(p.face.dtype)
        pre, post = divide_factors(world, dtype, handle.grads.controls.divide_factor)
        full = full.to(dtype).contiguous()
        if pre != 1:
            full.div_(pre)
        what = f"the gradient reduction of parameter '{p.fqn}'"
        if ext.group is None:
            mine = full.view(-1)
            if handle.group_size > 1:
                _collectives.wait(_collectives.all_reduce(mine, handle.process_group), what)
        elif ext.world > 1:
            mine = torch.empty(full.numel() // ext.world, dtype=dtype, device=full.device)
            comm = handle.grads.controls.reduce_scatter_comm  # the user's: [Note: custom collectives]
            if comm is not None:
                work = _custom_comms.reduce_scatter(comm, mine, full.view(-1), ext.group)
            else:
                work = _collectives.reduce_scatter(mine, full.view(-1), ext.group)
            _collectives.wait(work, what)
        else:
            mine = full.view(-1)
        if handle.replicate_group is not None and handle.replicas > 1:
            _collectives.wait(_collectives.all_reduce(mine, handle.replicate_group), what)
        if post != 1:
            mine.div_(post)
        face = p.face
        local = mine.view(face._local_tensor.shape).to(face.dtype)  # type: ignore[attr-defined]
        if face.grad is None:
            placements, mesh = face.placements, face.device_mesh  # type: ignore[attr-defined]
            shape, stride = face.shape, face.stride()
            face.grad = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
        else:
            face.grad._local_tensor.add_(local)  # type: ignore[attr-defined]
