"""Casts of a sharded model: ``model.half()``, ``.bfloat16()``, ``.double()``, ``.float()``, ``.to(dtype)``.

[Note: casts after sharding]
As with torch FSDP1 and FSDP2, a sharded model cast with ``nn.Module`` methods trains on in the new
dtype. Between steps the modules register the faces ([Note: parameter faces]): ``nn.Module._apply``
swaps each face's contents (``torch.utils.swap_tensors``) for a cast ``DTensor`` whose local tensor
is a new tensor outside the unit's flat shard, and with them the face's own attributes. The face
objects stay, so an optimizer built after the cast steps them. So before anything reads a unit (the
root's forward, ``state_dict()``, ``load_state_dict()``, ``unshard_params``, ``clip_grad_norm_``,
``optim_state_dict``) `adopt_casts` looks for a handle whose faces all have one new floating-point
dtype and rebuilds it (`FlatParamHandle.change_dtype`): the shard in the new dtype (from the faces'
cast local tensors), the faces pointed at it again, the unsharded buffer in the compute dtype the
unit's mixed precision now implies (a ``param_dtype`` still applies), and the sharded gradient in the
gradient dtype. In flat-parameter mode (the wrapper's ``use_orig_params=False``) ``_apply`` casts
the registered flat parameter itself, which is adopted the same way. A unit whose
``unshard(module, async_op=True)`` was still in flight when the model was cast is resharded first:
its gather is of the old dtype, so it is dropped and the unit's next use gathers the new one.

A cast is local to a rank. Ranks whose shards end up in different dtypes disagree at their next
all-gather: on gloo the collective header carries the dtype the shard had before any mixed-precision
cast ([Note: collective headers]), so every rank raises `RankMismatchError` instead of training on in
different precisions. Cast on every rank alike. Moves to another device, units with tensor-parallel
parameters, and a cast of only some parameters of a handle are not adopted: `_model_edit_checks`
reports them and points the faces back at the shard.
"""

from __future__ import annotations

from typing import Optional

import torch

from fsdp_composable._base._copy_guard import refuse_copies
from fsdp_composable._common_utils import _FSDPState
from fsdp_composable._flat_param import FSDP_FLATTENED, FlatParamHandle, HandleTrainingState
from fsdp_composable._grads import _exposed_grads

__all__ = ["adopt_cast", "adopt_casts", "face_locals", "mark_faces", "storage_of"]


def adopt_casts(states: list[_FSDPState]) -> None:
    """`adopt_cast` for every handle of ``states``; none when a tensor-parallel unit was cast, which no
    unit adopts, so that the edit check puts every unit back (the model stays in one dtype)."""
    handles = [h for state in states for h in state.handles]
    if any(h.tensor_parallel and h.faces and h.faces[0].dtype != h.dtype for h in handles):
        return
    for handle in handles:
        adopt_cast(handle)


def adopt_cast(handle: FlatParamHandle) -> None:
    """Rebuild ``handle`` if its parameters were all cast alike since it was built (see [Note: casts
    after sharding]); cheap when nothing was cast: one dtype check."""
    dtype, values = _cast_to(handle)
    if dtype is not None:
        _adopt(handle, dtype, values)


def face_locals(handle: FlatParamHandle) -> list[torch.Tensor]:
    """Each face's local tensor now (a swap by ``_apply`` may have replaced it)."""
    return [f.to_local() for f in handle.faces]  # type: ignore[attr-defined]


def storage_of(face: torch.Tensor) -> int:
    """The address of the face's own (wrapper) storage: ``p.data = t`` replaces it, and nothing else does."""
    return torch._C._storage_address(face)  # type: ignore[attr-defined]


def mark_faces(handle: FlatParamHandle) -> None:
    """Mark new faces, or give back the attributes ``torch.utils.swap_tensors`` (``_apply``) took with
    a face's contents: what they are, the storage `storage_of` compares, and the refusal of copies
    ([Note: copying a sharded model]). Between steps only."""
    for face, param in zip(handle.faces, handle.params):
        if getattr(face, "_fsdp_storage", None) is None:
            face._fsdp_face = True  # type: ignore[attr-defined]
            face._fsdp_fqn = param._fsdp_fqn  # type: ignore[attr-defined]
            face._fsdp_storage = storage_of(face)  # type: ignore[attr-defined]
            setattr(face, FSDP_FLATTENED, True)
            refuse_copies(face, param._fsdp_fqn)  # type: ignore[attr-defined]


def _cast_to(handle: FlatParamHandle) -> tuple[Optional[torch.dtype], Optional[list[torch.Tensor]]]:
    """The dtype ``handle``'s faces were cast to, and their new local values (None: take the flat
    parameter's); (None, None) when there is nothing to adopt."""
    if not handle.params or handle.tensor_parallel or handle.training_state is not HandleTrainingState.IDLE:
        return None, None
    flat = handle.flat_param
    if handle.flat_mode:
        if flat.dtype == handle.dtype or flat.device != handle.shard_device or not flat.is_floating_point():
            return None, None
        return flat.dtype, None
    if handle.faces[0].dtype == handle.dtype or handle.registered is not handle.faces:
        return None, None
    data = face_locals(handle)
    dtype = data[0].dtype
    layout = handle.layout
    if (
        not dtype.is_floating_point
        or any(d.dtype != dtype or d.device != handle.shard_device for d in data)
        or handle.is_unsharded
        or any(d.shape != layout.local_shape(i) for d, i in zip(data, layout.infos))
    ):
        return None, None  # a partial cast, a move, or a cast of unsharded views: `_model_edit_checks` reports it
    return dtype, data


def _adopt(handle: FlatParamHandle, dtype: torch.dtype, values: Optional[list[torch.Tensor]]) -> None:
    # ``.grad`` of original parameters were cast by ``_apply`` in place of our views: fold what the
    # user may have assigned into the flat gradient, cast it with the shard, and expose it again
    _exposed_grads.stash_sharded_grads(handle)
    handle.change_dtype(dtype, values)
    grads = handle.grads
    flat_grad = handle.flat_param.grad
    grad_dtype = handle.config.grad_dtype(dtype)
    if flat_grad is not None and flat_grad.dtype != grad_dtype:
        handle.flat_param.grad = None
        _exposed_grads.assign_grad(handle.flat_param, flat_grad.to(grad_dtype))
    if grads.kept is not None and grads.kept.dtype != handle.reduce_dtype:  # between no_sync micro-batches
        grads.kept = grads.kept.to(handle.reduce_dtype)
    _exposed_grads.expose_sharded_grads(handle)
    mark_faces(handle)
