"""SHARDED_STATE_DICT: one DTensor per original parameter in torch.chunk layout, and loading into the faces.

[Note: sharded state dicts are the faces]
A unit's flat shard is rank-major ([Note: rank-major flat shards] in `_rank_major`): this rank holds
rows [r*c, (r+1)*c) of every parameter (c = ceil(rows / world), the `torch.chunk` rule), contiguous,
which is the piece a ``Shard(0)`` DTensor describes. Between steps each module registers its
parameters' faces ([Note: parameter faces]), DTensors of that layout, so ``nn.Module.state_dict()``
saves them as they are: the SHARDED values are the faces (detached: they view the live shard, as
torch FSDP2's do; ``offload_to_cpu`` gives CPU copies), and `torch.distributed.checkpoint` saves and
loads them at any world size (a tensor-parallel parameter's face is 2-D: [Note: 2-D faces]). Nothing
is gathered and no unit is opened.

[Note: loading into the faces]
FULL and SHARDED loads copy straight into the faces: a placement hook on each module holding a
parameter (`_match_sharded_placements`) turns the value it will load (a full tensor, or a DTensor of
any layout, e.g. DCP's at another world size) into a DTensor of the face's layout holding this rank's
chunk, so ``nn.Module``'s ``copy_`` writes the flat shard locally. A load that fails on any rank is
undone on every rank by [Note: a refused load writes nothing], and a key some ranks lack is refused on
every rank by the key comparison (`_compare_keys_across_ranks`), so each key loads everywhere or
nowhere. ``assign=True`` registers the checkpoint's tensors: `_take_assigned` copies them into the
faces and registers the faces again.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_composable._comm import _collectives, _tensor_parallel
from fsdp_composable._common_utils import _FSDPState
from fsdp_composable._flat._faces import face_value
from fsdp_composable._flat._flat_layout import _is_replicated_info, _saved_shape
from fsdp_composable._flat_param import FlatLayout, FlatParamHandle, ParamInfo
from fsdp_composable._runtime._state_dict_keys import _clean_module_fqns, _join
from fsdp_composable._state._state_dict_settings import _config, _to_output

__all__: list[str] = []


def _match_face_placements(
    handle: FlatParamHandle, attrs: list[tuple[str, int]], state_dict: dict[str, Any], prefix: str
) -> None:
    """FULL and SHARDED load: each checkpoint value of a parameter the module holds (a full tensor or a
    DTensor of any layout) becomes a DTensor laid out like the parameter's face, holding this rank's
    chunk, so ``nn.Module``'s ``copy_`` is a local copy (see [Note: loading into the faces])."""
    layout = handle.layout
    for attr, k in attrs:
        info, face = layout.infos[k], handle.faces[k]
        value = state_dict.get(prefix + attr)
        if not isinstance(value, torch.Tensor) or value.shape != _saved_shape(info):
            continue  # absent, or nn.Module reports the size mismatch
        chunk = _local_chunk(value, info, layout, handle.device, face)  # a view when laid out like the face
        state_dict[prefix + attr] = handle.face_grad(k, chunk.to(handle.dtype))


def _take_assigned(handle: FlatParamHandle) -> None:
    """``load_state_dict(assign=True)`` registers the checkpoint's tensors themselves: copy their values
    into the faces (this rank's chunk) and register the faces again."""
    layout = handle.layout
    for k, info in enumerate(layout.infos):
        face = handle.faces[k]
        for module, attr, _ in info.holders:
            current = module._parameters.get(attr)
            if current is face or current is None:
                continue
            with torch.no_grad():
                local = face.to_local() if isinstance(face, DTensor) else face.data
                chunk = _local_chunk(current.detach(), info, layout, handle.device, face)
                local.copy_(chunk.view(local.shape))
            module._parameters[attr] = face


def _flat_to_chunks(handle: FlatParamHandle, flat_shard: torch.Tensor) -> list[torch.Tensor]:
    """Each original parameter's ``Shard(0)`` chunk (or whole value, if replicated) on this rank, from a
    flat tensor laid out like the unit's shard: new tensors, cut where the shard holds them."""
    layout = handle.layout
    out = []
    for info in layout.infos:
        start, end = layout.shard_range(info)
        out.append(flat_shard[start:end].view(layout.local_shape(info)).clone())
    return out


def _mesh_of(group: dist.ProcessGroup, device: torch.device) -> DeviceMesh:
    """The 1-D mesh naming ``group``'s ranks. Built per call, not cached: it only names the ranks (no
    communication, ~0.2 ms) and meshes compare by value, so equal meshes need not be one object."""
    return DeviceMesh.from_group(group, device.type)


def _is_replicated(value: DTensor) -> bool:
    return all(isinstance(p, Replicate) for p in value.placements)


# [Note: a global value to this rank's piece]
# Loading (the model's SHARDED and FULL state dicts, ``assign=True``, optimizer state, both optimizer
# APIs) always starts from a *global* value of an original parameter: a full tensor or a DTensor of
# any placement and mesh size (of the global shape for a tensor-parallel parameter). `_whole` makes it
# the unit's full value of the parameter, `_local_chunk` this rank's ``Shard(0)`` chunk of it (without
# communication when it already is one), and `to_flat_shard` this rank's flat shard from the values of
# several parameters: the one conversion of global values, built on the unit's `FlatLayout`.
def _whole(value: torch.Tensor, info: ParamInfo, device: torch.device) -> torch.Tensor:
    """``info``'s whole value (a tensor-parallel parameter's: this rank's tensor-parallel piece) from
    a full tensor or a DTensor of any placement (a collective for a sharded DTensor)."""
    if info.tp is not None:
        return _tensor_parallel.tp_local_of(value, info.tp, device)
    if isinstance(value, DTensor):
        return value.to_local() if _is_replicated(value) else _tensor_parallel.full_tensor(value, device)
    return value


def _local_chunk(
    value: torch.Tensor, info: ParamInfo, layout: FlatLayout, device: torch.device, face: torch.Tensor
) -> torch.Tensor:
    """This rank's chunk of ``info`` (flattened) from a full tensor or a DTensor of any placement
    (``device``: the unit's; ``face``: the parameter's face), with no communication when the value is
    laid out like the face."""
    if isinstance(value, DTensor) and isinstance(face, DTensor):
        if value.device_mesh == face.device_mesh and value.placements == face.placements:
            return value.to_local().reshape(-1)
        if (
            info.tp is None
            and not _is_replicated_info(info, layout)
            and tuple(value.placements) == (Shard(0),)
            and value.device_mesh.size() == layout.world_size
        ):
            return value.to_local().reshape(-1)
    lo, hi = layout.param_range(info)
    return _whole(value, info, device).reshape(-1)[lo:hi]


def to_flat_shard(handle: FlatParamHandle, values: list[tuple[int, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """This rank's flat shard (zero elsewhere) on the shard's device, from the global values of some of
    the unit's parameters (parameter index, value): each value's chunk goes where the shard holds it
    (a collective only for a DTensor of another layout, which `_local_chunk` gathers)."""
    layout, device = handle.layout, handle.flat_param.device
    flat = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
    for k, value in values:
        start, end = layout.shard_range(layout.infos[k])
        chunk = _local_chunk(value, layout.infos[k], layout, handle.device, handle.faces[k])
        flat[start:end] = chunk.to(dtype=dtype, device=device)
    return flat


def _saved_faces(state: _FSDPState, state_dict: dict[str, Any], prefix: str) -> None:
    """SHARDED: the saved faces (``nn.Module`` detached them) as `face_value` builds them, so their
    wrappers hold no storage offset (see `face_value`); with ``offload_to_cpu``, over CPU copies."""
    offload = _config(state).offload_to_cpu
    for key in [k for k in state_dict if k.startswith(prefix)]:
        value = state_dict[key]
        if isinstance(value, DTensor) and (value.storage_offset() != 0 or (offload and value.device.type != "cpu")):
            local = value.to_local()
            state_dict[key] = face_value(local.cpu() if offload else local, value._spec)


# ---------------------------------------------------------------------------- SHARDED_STATE_DICT
def _replicate_buffers(state: _FSDPState, state_dict: dict[str, Any], prefix: str) -> None:
    """Every persistent buffer under ``state.module`` (not in ignored modules) as a replicated DTensor."""
    mesh = _mesh_of(state.process_group, _collectives.comm_device(state.process_group, state.device))
    for owner, fqn in _clean_module_fqns(state.module).items():
        if owner in state.ignored_modules:
            continue
        for name, buf in owner._buffers.items():
            key = prefix + _join(fqn, name)
            value = state_dict.get(key)
            if buf is None or name in owner._non_persistent_buffers_set or not isinstance(value, torch.Tensor):
                continue
            if not isinstance(value, DTensor):
                state_dict[key] = DTensor.from_local(_to_output(state, value), mesh, [Replicate()], run_check=False)
