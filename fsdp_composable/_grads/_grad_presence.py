"""Which original parameters of a unit got a gradient: decided per parameter, agreed across ranks,
carried with the gradient reduction.

[Note: which parameters got a gradient]
A unit is one flat parameter, but a gradient belongs to an original parameter. A backward may give
some original parameters of a unit nothing (a loss that uses part of the model, an output unused in
this iteration, a branch skipped): they must end with ``.grad`` None, or unchanged when
accumulating, exactly as the unsharded model under DDP: a parameter has a gradient if any rank's
backward produced one for it. Zeros would be wrong: AdamW's weight decay and momentum move a
parameter whose ``.grad`` is a zero tensor, and leave one whose ``.grad`` is None alone.

- Locally: with autograd's own gradients (AUTOGRAD) a parameter got one if its ``.grad`` is not
  None after its unit's backward. With the flat buffer (FLAT) ``.grad`` is our view before the
  backward starts, so a post-accumulate-grad hook on each trainable original parameter (registered
  once, `watch_accumulation`) marks the ones autograd wrote into.
- Across ranks: one element per original parameter (1 where this rank's backward, or an earlier
  ``no_sync`` micro-batch, produced a gradient, else 0) is summed over ranks with the unit's
  reduction, and lands right after the reduced gradient in the reduction's output: positive means
  "some rank had a gradient". HYBRID_SHARD's all-reduce across replicas takes that output whole, so
  it reduces the flags with the shard. Never a copy of the unit's gradient to carry them:
  - gloo (point-to-point exchange): the flags end every rank's chunk of the reduce-scatter input
    (`with_presence`), sent as pieces as they are; no collective of their own.
  - Other backends on the CPU (torch's fake process group, gloo's own collectives): where
    the reduce-scatter input is built from autograd's gradients anyway (one ``_chunk_cat``, a unit
    of several parameters), it is built with room for the flags after every rank's chunk, and they
    ride in the reduce-scatter. Otherwise (FLAT: the gradient buffer as it is, or its copy-in),
    the flags are all-reduced (written into the output's tail) right after it, on
    the same stream, waited for with it: a second, tiny collective per unit, rather than a copy of
    the whole gradient to make room. Off the CPU (NCCL) the flags are summed on the host (below),
    so the device has no flags and no second collective.
  - NO_SHARD with other ranks: the unit's gradient buffer is allocated with room for the flags after
    the padded gradient (``_reduce_inputs.grad_buffer``; ``.grad`` views cover its front), so the one
    all-reduce takes the whole buffer, flags included: no second collective, which on gloo would
    also cost a header round trip.
  - Alone (world size 1 without replicas): no collective at all, and the gradient buffer itself
    becomes the sharded gradient; this rank's flags are the answer (``PendingReduce.own_flags``).
- The flags are written on the device by device-side fills (ones, then zeros over the runs of
  parameters without a gradient: `write_flags`), never by copying host values to the device.
- Whether a ``.grad`` is None is host state, and it must agree across ranks. On the CPU the end of
  backward reads the reduced flags of every unit where this rank lacked a gradient at once
  (`present_of_many`; a rank whose own backward gave every parameter a gradient knows the answer
  without reading). Off the CPU that read would be a device synchronisation, so there every rank's
  flags are summed on the host over a CPU group instead ([Note: presence flags agreed on the host]
  in `_host_flags`), and the device holds none (NO_SHARD's ride in its buffer, unread).
- A user's communication hook replaces the reduction and sees only the gradient: with one, every
  trainable parameter of a unit whose backward ran is treated as having a gradient (zeros).
- Between steps `UnitGrads.missing` lists the parameters whose slice of ``flat_param.grad`` holds
  no gradient; `_exposed_grads.expose_sharded_grads` leaves their ``.grad`` None, and a later backward
  that produces one for them (or a ``.grad`` the user assigns) takes them off the list.
The wrapper's flat-parameter mode exposes the flat parameter, whose ``.grad`` is one tensor for the
whole unit: there the parameters without gradient hold zeros, as in FSDP1. All of this is within a
unit whose backward runs on every rank; a unit whose backward runs on some ranks only leaves the
ranks' reductions unmatched, a `RankMismatchError` as before.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch

from fsdp_composable._comm import _collectives
from fsdp_composable._flat_param import FlatParamHandle

__all__: list[str] = []


def watch_accumulation(handle: FlatParamHandle, touched: list[bool], hooks: list[Any]) -> None:
    """FLAT mode: reset ``touched`` (one flag per original parameter) and make sure every trainable
    original parameter has a hook that sets its flag when autograd accumulates into its ``.grad``."""
    touched[:] = [False] * len(handle.params)
    if hooks:
        return
    for i, param in enumerate(handle.params):
        if param.requires_grad:
            hooks.append(param.register_post_accumulate_grad_hook(functools.partial(_touch, touched, i)))


def _touch(touched: list[bool], i: int, param: torch.Tensor) -> None:
    if i < len(touched):
        touched[i] = True


def union(a: Optional[list[bool]], b: Optional[list[bool]]) -> Optional[list[bool]]:
    """Flags of two backwards summed (a micro-batch kept under ``no_sync`` and this one)."""
    if a is None or b is None:
        return a if b is None else b
    return [x or y for x, y in zip(a, b)]


def flags(got: Sequence[bool], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The flags as a tensor made on ``device`` without copying host data (no synchronisation)."""
    if device.type == "cpu":
        return torch.tensor(got, dtype=dtype) if not all(got) else torch.ones(len(got), dtype=dtype)
    out = torch.empty(len(got), dtype=dtype, device=device)
    write_flags(got, out)
    return out


def write_flags(got: Sequence[bool], into: torch.Tensor) -> None:
    """Write the flags into ``into`` (the tail of a reduction's buffer), on its device, without
    copying host data to a device (no synchronisation)."""
    if into.device.type == "cpu" and not all(got):
        into.copy_(torch.tensor(got, dtype=into.dtype))
        return
    into.fill_(1)  # every parameter got one (the common step): no host tensor to build and copy
    for start, end in _absent_runs(got):
        into[start:end].zero_()  # a fill on the device (``into[i] = 0`` copies a host scalar there)


def _absent_runs(got: Sequence[bool]) -> list[tuple[int, int]]:
    """The [start, end) runs of parameters without a gradient."""
    runs: list[tuple[int, int]] = []
    for i, present in enumerate(got):
        if present:
            continue
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def with_presence(parts: Sequence[torch.Tensor], chunks: int, flag: torch.Tensor) -> list[torch.Tensor]:
    """The 1-D ``parts`` (whose concatenation splits into ``chunks`` equal chunks) as pieces, with
    ``flag`` after every chunk: the reduce-scatter input whose every chunk ends with the flags."""
    size = sum(part.numel() for part in parts) // chunks
    out: list[torch.Tensor] = []
    offset = 0  # within the current chunk
    for part in parts:
        start = 0
        while start < part.numel():
            end = min(part.numel(), start + size - offset)
            out.append(part if start == 0 and end == part.numel() else part[start:end])
            offset += end - start
            start = end
            if offset == size:
                out.append(flag)
                offset = 0
    if size == 0:  # an empty unit: every chunk is the flags alone
        out.extend([flag] * chunks)
    return out


def with_room(front: torch.Tensor, room: int) -> Optional[torch.Tensor]:
    """``front`` (1-D: a NO_SHARD gradient buffer's view) and the ``room`` elements after it in its
    storage, as one tensor; None if its storage has no room there."""
    end = (front.storage_offset() + front.numel() + room) * front.element_size()
    if not front.is_contiguous() or front.untyped_storage().nbytes() < end:
        return None
    return front.as_strided((front.numel() + room,), (1,))


def present(got: Optional[list[bool]], reduced_flags: Optional[torch.Tensor]) -> Optional[list[bool]]:
    """Which parameters have a gradient on some rank (None: all of them, or unknown).
    ``reduced_flags`` None: no other rank, this rank's own flags are the answer."""
    if got is None or all(got):
        return None
    if reduced_flags is None:
        return list(got)
    return present_of_many([reduced_flags])[0]


def present_of_many(reduced_flags: Sequence[torch.Tensor]) -> list[list[bool]]:
    """Which parameters have a gradient on some rank, for several units' reduced flags: those on a
    device are read in one host read (one synchronisation, not one per unit)."""
    on_device = [f for f in reduced_flags if f.device.type != "cpu"]
    read: list[torch.Tensor] = []
    if on_device:
        values = _collectives.host_values(torch.cat([f > 0 for f in on_device]))
        read = list(values.split([f.numel() for f in on_device]))
    answers = iter(read)
    return [((next(answers) if f.device.type != "cpu" else f) > 0).tolist() for f in reduced_flags]
