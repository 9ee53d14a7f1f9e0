"""Each original parameter's face: the ``DTensor`` parameter a module registers between steps.

[Note: parameter faces]
Between steps a module registers, in place of each original parameter, a new ``nn.Parameter`` whose
data is a ``DTensor`` of the parameter's global shape: ``Shard(0)`` over the unit's process group (or
``Replicate()`` for a parameter every rank holds whole), whose local tensor is a view of the
parameter's chunk in the unit's flat shard ([Note: rank-major flat shards]). So torch sees a
parameter as torch FSDP2 shows it (``p.shape``, ``p.numel()``, ``named_parameters()``, ``nn.init``,
the optimizer over ``DTensor`` state), and an optimizer step writes straight into the buffer the next
all-gather sends. In forward and backward the module registers the original parameter again, which
views the unsharded buffer: autograd and the user's forward see plain tensors, exactly as before.
The face objects live as long as the unit and its dtype: a load or a cast that replaces the shard
points the faces at the new one (`repoint_faces`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from fsdp_composable._base._strides import contiguous_strides
from fsdp_composable._flat._rank_major import FlatLayout, ParamInfo

__all__ = ["face_mesh", "face_spec", "face_value", "grad_face", "is_face", "make_face", "repoint_face"]


def face_mesh(group: dist.ProcessGroup, device: torch.device) -> DeviceMesh:
    """The 1-D mesh naming ``group``'s ranks on ``device``'s type (no communication)."""
    return DeviceMesh.from_group(group, device.type)


def _placement(info: ParamInfo, layout: FlatLayout) -> Placement:
    return Replicate() if info.replicated or layout.world_size == 1 else Shard(0)


def face_spec(info: ParamInfo, layout: FlatLayout, mesh: DeviceMesh, dtype: torch.dtype) -> DTensorSpec:
    """What a face of ``info`` in ``dtype`` is: its mesh, placement and global shape. Made once per
    parameter and dtype: a ``DTensor`` built from its spec costs microseconds, ``DTensor.from_local``
    about a millisecond, and every backward makes each parameter's gradient face."""
    shape = info.shape
    meta = TensorMeta(shape, contiguous_strides(shape), dtype)
    return DTensorSpec(mesh, (_placement(info, layout),), tensor_meta=meta)


def face_value(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """The ``DTensor`` described by ``spec`` whose local tensor is ``local`` (this rank's chunk).

    The wrapper takes its storage offset from the tensor it is built with, and a chunk sits at an
    offset in the flat shard; a wrapper with an offset has a nonzero ``data_ptr()`` over no storage,
    which torch's checkpoint stager (``dcp.async_save``) then tries to copy. So the wrapper is built
    over an offset-0 view of the same storage and then given the chunk."""
    value = DTensor(local.as_strided(local.shape, local.stride(), 0), spec, requires_grad=False)
    value._local_tensor = local
    return value


def grad_face(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """A gradient's ``DTensor`` over ``local`` as every backward builds it: the wrapper keeps the
    chunk's offset (as FSDP2's gradients do), half the cost of `face_value`."""
    return DTensor(local, spec, requires_grad=False)


def make_face(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool) -> nn.Parameter:
    """A new face parameter viewing ``local``."""
    with torch.no_grad():
        face = nn.Parameter(face_value(local, spec), requires_grad=requires_grad)
    face._fsdp_face = True  # type: ignore[attr-defined]
    return face


def is_face(param: torch.Tensor) -> bool:
    """Whether ``param`` is a face (not an original parameter, which a module registers only in a step)."""
    return getattr(param, "_fsdp_face", False)


def repoint_face(face: nn.Parameter, local: torch.Tensor) -> None:
    """Point ``face`` at ``local`` (a new shard of the same dtype): the object, which optimizers hold,
    stays the same."""
    assert isinstance(face, DTensor) and local.dtype == face.dtype
    face._local_tensor = local
