"""Tensor-parallel (`DTensor`) original parameters: flatten their local tensors, show them as
`DTensor`s again.

[Note: tensor-parallel parameters]
``parallelize_module(block, mesh["tp"], plan)`` turns a block's parameters into ``DTensor``
parameters whose ``_local_tensor`` is this rank's tensor-parallel piece. A unit sharded over the
data-parallel group flattens those *local* tensors exactly like plain parameters ([Note: original
parameters are views]): the flat parameter, its padding, the all-gather and the reduce-scatter only
ever see local pieces, so gradients are reduced over the data-parallel group alone.

The ``DTensor`` parameter objects are kept, as plain ones are, and repointed instead: a ``DTensor``
is a wrapper whose data is its ``_local_tensor`` attribute (its own ``.data`` has no storage), so we
assign ``_local_tensor`` where a plain parameter gets ``.data``. In forward and backward it is the
local-shape view into the unsharded flat parameter, so tensor-parallel ops see the ``DTensor`` they
were built for. Between steps the module registers the parameter's 2-D face instead ([Note: 2-D
faces]), whose gradient and optimizer state are 2-D ``DTensor``s too. A backward's gradient of a
``DTensor`` parameter is first brought to the parameter's placements (a ``Partial`` gradient of a
replicated parameter is summed over the tensor-parallel group) and then flattened like any other.

FULL state dicts give each parameter as the tensor-parallel model itself holds it (full over the
data-parallel group); SHARDED ones are the 2-D faces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_composable._base._strides import contiguous_strides
from fsdp_composable._comm import _collectives

__all__ = ["TPSpec"]


@dataclass(frozen=True)
class TPSpec:
    """How a tensor-parallel parameter is laid out: its ``DTensor`` mesh and placements, and its
    global shape and stride. The flat parameter holds its local tensor."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]


def spec_of(param: torch.Tensor) -> Optional[TPSpec]:
    """The tensor-parallel layout of ``param``, or None for a plain tensor."""
    if not isinstance(param, DTensor):
        return None
    return TPSpec(param.device_mesh, tuple(param.placements), param.shape, tuple(param.stride()))


def local_of(param: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory ``param`` uses: a ``DTensor``'s local tensor, else its ``.data``."""
    if isinstance(param, DTensor):
        return param._local_tensor
    return param.data


def point_at(param: torch.Tensor, view: torch.Tensor) -> None:
    """Repoint ``param`` at ``view`` (see [Note: tensor-parallel parameters])."""
    if isinstance(param, DTensor):
        param._local_tensor = view
    else:
        param.data = view


def as_local_grad(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A backward's gradient of ``param`` as a plain tensor of its local shape. A ``DTensor`` gradient
    is first brought to the parameter's placements (a collective over the tensor-parallel group when
    it is ``Partial``)."""
    if not isinstance(grad, DTensor):
        return grad
    assert isinstance(param, DTensor)
    if tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
    return grad._local_tensor


def as_param_grad(spec: Optional[TPSpec], local: torch.Tensor) -> torch.Tensor:
    """A tensor to assign to ``.grad`` of a parameter laid out by ``spec`` whose memory is ``local``."""
    if spec is None:
        return local
    return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)


def check_supported(module_fqn: str, params: list[nn.Parameter], fqns: list[str], hybrid: bool) -> None:
    """Tensor-parallel parameters need one mesh per unit and no replicate group."""
    meshes: dict[int, tuple[DeviceMesh, str]] = {}
    for p, f in zip(params, fqns):
        if not isinstance(p, DTensor):
            continue
        if p.device_mesh.ndim != 1:
            raise ValueError(
                f"parameter '{f}' is a DTensor over a {p.device_mesh.ndim}-D mesh; fully_shard flattens "
                "tensor-parallel parameters of a 1-D mesh (mesh['tp']) and shards them over process_group (mesh['dp'])"
            )
        meshes.setdefault(id(p.device_mesh), (p.device_mesh, f))
    if not meshes:
        return
    (_, first), *others = meshes.values()
    if others:
        raise ValueError(
            f"unit '{module_fqn or '<root>'}' mixes DTensor parameters of different meshes ('{first}' and "
            f"'{others[0][1]}'); parallelize the unit's modules over one tensor-parallel mesh"
        )
    if hybrid:
        raise ValueError(
            f"parameter '{first}' is tensor-parallel and the unit uses HYBRID_SHARD: a 3-D (replicate, shard, tp) "
            "layout is not supported. Use FULL_SHARD or SHARD_GRAD_OP over mesh['dp'] with tensor parallelism"
        )


def model_tp_group(module: nn.Module) -> Optional[dist.ProcessGroup]:
    """The tensor-parallel group of a model whose blocks were parallelised (its first DTensor
    parameter's 1-D mesh), or None. Everything not split by it is held whole by each of its ranks and
    must agree across it: see `is_tp_sharded`."""
    for param in module.parameters():
        if isinstance(param, DTensor) and param.device_mesh.ndim == 1 and param.device_mesh.size() > 1:
            return param.device_mesh.get_group()
    return None


def is_tp_sharded(spec: Optional[TPSpec]) -> bool:
    """Whether tensor-parallel ranks hold different pieces (else each holds the whole, the same)."""
    return spec is not None and any(isinstance(p, Shard) for p in spec.placements)


# ---------------------------------------------------------------------------- 2-D faces
def mesh_2d(dp_group: dist.ProcessGroup, spec: TPSpec, device: Optional[torch.device] = None) -> DeviceMesh:
    """The (data-parallel, tensor-parallel) mesh: the tensor-parallel mesh's parent when it has the
    data-parallel group as its other dimension, else one built from the two groups (a collective over
    the world, communicating on ``device``'s communication device). Called once per unit, when its faces
    are made; the handle keeps it."""
    tp_mesh = spec.mesh
    root = tp_mesh._get_root_mesh()
    dp_ranks = sorted(dist.get_process_group_ranks(dp_group))
    if root is not tp_mesh and root.ndim == 2:
        names = root.mesh_dim_names
        tp_name = tp_mesh.mesh_dim_names[0] if tp_mesh.mesh_dim_names else None
        if names is not None and tp_name == names[1]:
            other = sorted(root[names[0]].mesh.flatten().tolist())
            if other == dp_ranks:
                return root
    return _mesh_from_groups(dp_group, tp_mesh, device)


def _mesh_from_groups(dp_group: dist.ProcessGroup, tp_mesh: DeviceMesh, device: Optional[torch.device]) -> DeviceMesh:
    """A 2-D mesh whose rows are tensor-parallel groups and columns data-parallel groups."""
    world = dist.get_world_size()
    group = dist.group.WORLD
    assert group is not None
    values = [dist.get_rank(dp_group), tp_mesh.get_local_rank(), dist.get_rank()]
    coords = _collectives.comm_tensor(values, group, device)
    gathered = [torch.zeros_like(coords) for _ in range(world)]
    dist.all_gather(gathered, coords)
    every = _collectives.host_values(torch.stack(gathered))
    dp_size, tp_size = dist.get_world_size(dp_group), tp_mesh.size()
    layout = torch.full((dp_size, tp_size), -1, dtype=torch.int64)
    mine = set(dist.get_process_group_ranks(dp_group)) | set(tp_mesh.mesh.flatten().tolist())
    for d, t, r in (c.tolist() for c in every):
        if r in mine or layout[d, t] < 0:
            layout[d, t] = r
    return DeviceMesh.from_group(
        [dp_group, tp_mesh.get_group()], tp_mesh.device_type, mesh=layout, mesh_dim_names=("dp", "tp")
    )


def dp_placement(spec: TPSpec) -> Placement:
    """The data-parallel placement of a SHARDED value: rows of the tensor-parallel *local* tensor.

    When tensor parallelism already splits dim 0, the data-parallel chunks are chunks of each
    tensor-parallel chunk, which ``_StridedShard`` describes (a plain ``Shard(0)`` would mean chunks
    of the whole)."""
    tp_dim0 = [p for p in spec.placements if isinstance(p, Shard) and p.dim == 0]
    if not tp_dim0:
        return Shard(0)
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(0, split_factor=spec.mesh.size())


def local_part_of_full(full: torch.Tensor, spec: TPSpec) -> torch.Tensor:
    """This rank's tensor-parallel piece of a full (plain) tensor, by the `torch.chunk` rule DTensor uses."""
    out = full
    for i, placement in enumerate(spec.placements):
        if isinstance(placement, Shard):
            pieces = torch.chunk(out, spec.mesh.size(i), dim=placement.dim)
            coord = spec.mesh.get_local_rank(i)
            if coord < len(pieces):
                out = pieces[coord]
            else:
                shape = list(out.shape)
                shape[placement.dim] = 0
                out = out.new_empty(shape)
        elif not isinstance(placement, Replicate):
            raise ValueError(f"cannot load a full tensor into a DTensor parameter placed {placement}")
    return out


# [Note: 2-D faces]
# Between steps a tensor-parallel parameter's face ([Note: parameter faces]) is a ``DTensor`` of the
# *global* shape over the 2-D (dp, tp) mesh with placements ``(dp_placement, *tp placements)``; its
# local tensor is this rank's `torch.chunk` rows (over the data-parallel group) of the tensor-parallel
# local tensor, which is where the unit's rank-major flat shard holds them. When the tensor-parallel
# placement also splits dim 0, ``_StridedShard(0, split_factor=tp)`` says "rows of each
# tensor-parallel chunk" (right-to-left sharding); DTensor's ``full_tensor()`` and DCP's chunk offsets
# follow it, uneven sizes included. The same DTensors are the gradients, the optimizer's state and the
# SHARDED state-dict values. A FULL value is the parameter as the tensor-parallel model holds it (full
# over dp). Loading accepts any of these, DTensors of any other mesh or placements, and plain global
# tensors: each is first brought to this rank's tensor-parallel local tensor (`tp_local_of`), then cut
# like a plain parameter.
def sharded_placements(spec: TPSpec, dp_replicated: bool) -> tuple[Placement, ...]:
    """The placements of a SHARDED value over `mesh_2d`: data-parallel first, then the TP ones."""
    return (Replicate() if dp_replicated else dp_placement(spec), *spec.placements)


def face_spec_2d(mesh: DeviceMesh, spec: TPSpec, dp_replicated: bool, dtype: torch.dtype) -> DTensorSpec:
    """The face of a tensor-parallel parameter over ``mesh`` (`mesh_2d`): its global shape, placements
    ``(dp, *tp)`` (see [Note: 2-D faces])."""
    meta = TensorMeta(spec.shape, contiguous_strides(spec.shape), dtype)
    return DTensorSpec(mesh, sharded_placements(spec, dp_replicated), tensor_meta=meta)


def is_tp_value(value: torch.Tensor, spec: TPSpec) -> bool:
    """``value`` is laid out like the tensor-parallel parameter itself (full over dp)."""
    return (
        isinstance(value, DTensor)
        and value.shape == spec.shape
        and value.device_mesh == spec.mesh
        and tuple(value.placements) == spec.placements
    )


# [Note: a subclass's gathers on gloo]
# ``full_tensor()`` of a tensor-subclass value (NF4: its codes, scales and factors) lets the subclass
# issue one functional all-gather per inner tensor and wait for them afterwards. On gloo, torch 2.13's
# functional all-gathers in flight together intermittently corrupt the process's heap ("malloc():
# unaligned fastbin chunk detected", then SIGABRT or SIGSEGV anywhere later). Measured on an AVX2
# CPU, 2 ranks: 300 NF4 ``full_tensor()`` calls crashed in at least 2 of 6 runs, and 600 rounds of
# three plain functional all-gathers waited after all three in 1 of 5; none in 6 runs each with every
# gather waited at once, or with ``dist.all_gather_into_tensor(async_op=True)``.
# So on a CPU mesh each functional all-gather a subclass issues is waited for at once (the
# subclass's own later wait finds it done): the same collectives in the same order, one at a time.
_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default


class _GathersOneAtATime(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(t is not torch.Tensor for t in types):
            return NotImplemented  # the subclass's own handler: its inner collectives come back here
        out = func(*args, **(kwargs or {}))
        return _WAIT(out) if func is _GATHER else out


def full_tensor(value: DTensor, device: torch.device) -> torch.Tensor:
    """``value.full_tensor()``, communicated on its mesh's device: DTensor's collectives take the local
    tensor as it is, and a local on another device than the mesh's (a CPU-offloaded shard or value
    on a CUDA mesh, which NCCL does not serve) is copied there first and the result copied back.
    ``device``: where the caller computes (the unit's device, a plain parameter's), used when the mesh
    serves its type: with ``device_id=1`` and no ``set_device(1)`` the current device would be cuda:0."""
    local = value._local_tensor
    mesh = value.device_mesh
    if local.device.type == mesh.device_type:
        if mesh.device_type == "cpu" and type(local) is not torch.Tensor:
            with _GathersOneAtATime():  # [Note: a subclass's gathers on gloo]
                return value.full_tensor()
        return value.full_tensor()
    # no device of the mesh's type known here (a CPU model given a CUDA mesh's value): the type alone
    target = device if device.type == mesh.device_type else torch.device(mesh.device_type)
    moved = DTensor.from_local(
        local.to(target), mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
    )
    return moved.full_tensor().to(local.device)


def tp_local_of(value: torch.Tensor, spec: TPSpec, device: torch.device) -> torch.Tensor:
    """This rank's tensor-parallel local tensor (a plain tensor) of a value in global form: a
    ``DTensor`` laid out like the parameter (no communication), a ``DTensor`` of any other mesh or
    placements (gathered in full: a collective over its mesh), or a plain tensor of the global shape."""
    if isinstance(value, DTensor):
        if is_tp_value(value, spec):
            return value.to_local()
        value = full_tensor(value, device)
    return local_part_of_full(value, spec)


