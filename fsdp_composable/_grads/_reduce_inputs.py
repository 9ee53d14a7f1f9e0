"""What a unit's gradient reduction sends: the gradient buffer autograd accumulates into (FLAT), the
param-major concatenation of autograd's own gradients, the rank-major input one ``_chunk_cat`` builds
from them, and the pieces gloo's exchange sends as they are ([Note: gradients land in the flat
buffer] in `_reduce_utils`)."""

from __future__ import annotations

import functools
import sys
from typing import Optional, Sequence

import torch

from fsdp_composable._base._grad_mode import NoGrad
from fsdp_composable._flat_param import FlatParamHandle
from fsdp_composable._grads import _grad_presence

__all__ = [
    "cat_in",
    "flag_room",
    "flat_of",
    "grad_buffer",
    "held_here_alone",
    "rank_major_pieces",
    "scaled_part",
    "writable_parts",
    "zeros",
]


def zeros(handle: FlatParamHandle, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype, device=handle.device)


def flag_room(handle: FlatParamHandle) -> int:
    """Elements a NO_SHARD unit's gradient buffer keeps after the padded gradient for the flags, which
    its all-reduce sends with it (0: sharded, or no rank to agree with); see [Note: which parameters
    got a gradient]."""
    alone = handle.group_size == 1 and handle.replicate_group is None
    if handle.layout.world_size > 1 or alone:
        return 0
    return len(handle.params)


def grad_buffer(handle: FlatParamHandle, dtype: torch.dtype, zero: bool = True) -> torch.Tensor:
    """A padded unsharded gradient buffer (zeroed unless ``zero`` is False); under NO_SHARD with other
    ranks, the view of the front of a tensor whose tail holds the flags (`flag_room`)."""
    numel, room = handle.layout.padded_numel, flag_room(handle)
    make = torch.zeros if zero else torch.empty
    whole = make(numel + room, dtype=dtype, device=handle.device)
    return whole[:numel] if room else whole


def flat_of(handle: FlatParamHandle, parts: list[Optional[torch.Tensor]]) -> torch.Tensor:
    """This backward's gradient as one padded unsharded tensor (FLAT: the buffer itself; AUTOGRAD: one
    concatenation of autograd's gradients, which writes each element once, with no zero fill first),
    laid out as `grad_buffer`."""
    grads = handle.grads
    if grads.buffer is not None:
        return grads.buffer
    dtype, numel, room = handle.compute_dtype, handle.layout.padded_numel, flag_room(handle)
    pieces: list[torch.Tensor] = []
    at = 0
    with NoGrad():
        for info, grad in zip(handle.layout.infos, parts):
            if info.offset > at:  # the padding of the previous parameter's region
                pieces.append(zeros(handle, info.offset - at, dtype))
            if grad is None:
                pieces.append(zeros(handle, info.numel, dtype))
            else:
                pieces.append(grad.reshape(-1).to(device=handle.device, dtype=dtype))
            at = info.offset + info.numel
        pieces.append(zeros(handle, numel + room - at, dtype))  # the padding (and the flags' room)
        whole = torch.cat(pieces)
    return whole[:numel] if room else whole


def rank_major_pieces(handle: FlatParamHandle, parts: list[Optional[torch.Tensor]]) -> list[torch.Tensor]:
    """The rank-major reduce-scatter input as views of ``parts`` (each parameter's flat gradient) and
    of one zero tensor for the padding: what gloo's point-to-point exchange sends as it is."""
    layout = handle.layout
    padding = zeros(handle, max([i.chunk_numel for i in layout.infos] + [layout.tail]), handle.reduce_dtype)
    return layout.rank_major_pieces(parts, padding)


def cat_in(
    handle: FlatParamHandle, parts: list[Optional[torch.Tensor]], dtype: torch.dtype, got: Optional[list[bool]]
) -> torch.Tensor:
    """Autograd's gradients (None: zeros) as the rank-major reduce-scatter input in ``dtype``: one
    ``_chunk_cat``, which wants one input dtype (a unit of several dtypes: each cast first). With
    ``got``, every rank's chunk is followed by these flags (one element per parameter)."""
    layout = handle.layout
    dtypes = {g.dtype for g in parts if g is not None}
    like = dtypes.pop() if len(dtypes) == 1 else dtype
    whole = [
        (g if g.dtype == like else g.to(like)) if g is not None else zeros(handle, info.numel, like).view(info.shape)
        for g, info in zip(parts, layout.infos)
    ]
    if got is None:
        return layout.cat_in(whole, grad_buffer(handle, dtype, zero=False))
    rows = torch.empty(layout.world_size, layout.shard_numel + len(got), dtype=dtype, device=handle.device)
    layout.cat_in(whole, rows[:, : layout.shard_numel])
    _grad_presence.write_flags(got, rows[:, layout.shard_numel :])  # the CPU's write: one row, broadcast
    return rows.view(-1)


def scaled_part(handle: FlatParamHandle, grad: Optional[torch.Tensor], i: int, pre: float) -> torch.Tensor:
    if grad is None:  # unused in this backward: zero, as for every other unit
        return zeros(handle, handle.layout.infos[i].numel, handle.reduce_dtype)
    part = grad.reshape(-1).to(handle.reduce_dtype)
    return part / pre if pre != 1 else part


def held_here_alone(grad: torch.Tensor, refs: int) -> bool:
    """Whether autograd's gradient ``grad``, just taken from its parameter, is held by nothing but the
    caller's ``refs`` references: no other reference to it (a hook that kept ``p.grad``), no other
    tensor on its memory (a view kept), not itself a view. Then the reduce-scatter may reuse its memory
    once this rank's own rows of it were summed ([Note: the reduce-scatter's scratch] in `_exchanges`), as autograd
    itself takes over a gradient nothing else holds. The memory's count is the tensor and the storage
    object asked for; the reference count is compared with a probe's taken the same way (`_held_once`),
    not with a number: interpreters count a call's arguments differently."""
    return (
        grad._base is None
        and _references(grad) == _held_once() + refs - 1
        and grad._use_count() == 1  # type: ignore[attr-defined]
        and torch._C._storage_Use_Count(grad.untyped_storage()._cdata) == 2  # type: ignore[attr-defined]
    )


def _references(t: torch.Tensor) -> int:
    return sys.getrefcount(t)


def _through(t: torch.Tensor) -> int:  # one call deep, as `held_here_alone` asks `_references`
    return _references(t)


@functools.cache
def _held_once() -> int:
    """`_references` of a tensor one local name holds, asked as `held_here_alone` asks it."""
    probe = torch.empty(0)
    return _through(probe)


def writable_parts(
    grads: Sequence[Optional[torch.Tensor]], scaled: Sequence[Optional[torch.Tensor]], alone: Sequence[bool]
) -> list[torch.Tensor]:
    """Of the reduce-scatter's parts (``scaled``, made by `scaled_part` from ``grads``), those whose
    memory nothing else holds: a copy (a cast, a division, a non-contiguous gradient), or autograd's
    gradient itself when it is held here ``alone``; never the shared zeros of a missing gradient."""
    out = []
    for grad, part, only_here in zip(grads, scaled, alone):
        if grad is None or part is None:
            continue
        same = part.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()
        if only_here or not same:
            out.append(part)
    return out
