"""Extension parameters in state dicts ([Note: extension parameters] in `_extensions`).

[Note: extension parameters in state dicts]
- FULL saves: each extension parameter's face is gathered whole with ``full_tensor()``, which runs the
  subclass's own all-gather of its sharded value (NF4's codes and scales; float8 training weights'
  high-precision data), on every rank in the unit's order: the checkpoint holds the parameter the user
  sharded, not what ``fsdp_post_all_gather`` makes for compute (float8's cast weight). ``rank0_only``
  keeps it on rank 0 only; ``offload_to_cpu`` moves it with the subclass's own ``cpu()``.
- SHARDED saves: the faces as they are (``DTensor``s of the subclass), as FSDP2's.
- Optimizer state (`optim_state_dict`): FULL gathers each state tensor of the face's layout whole;
  `optim_state_dict_to_load` gives a whole (or any ``DTensor``) value the face's layout again.
- Loads: a value that is not a ``DTensor`` (a FULL checkpoint, the unsharded model's state dict) is cut
  to this rank's dim-0 chunk and given the face's layout, so the module's own ``copy_`` copies subclass
  into subclass chunk by chunk (never through ``to`` or ``clone``, which NF4 answers by quantizing anew).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_composable._comm import _tensor_parallel
from fsdp_composable._common_utils import _FSDPState
from fsdp_composable._flat._extensions import ExtensionParam, ExtensionParams
from fsdp_composable._flat_param import FlatParamHandle
from fsdp_composable._state._state_dict_settings import _config, _drops_values

__all__ = ["extension_faces", "register_extension_load_hooks", "save_full_extensions", "state_in_face_layout"]


def extension_faces(states: list[_FSDPState]) -> dict[int, tuple[ExtensionParams, ExtensionParam]]:
    """id(face) -> (its unit's extension parameters, itself), for every unit of ``states``."""
    units = [h.extensions for s in states for h in s.handles if h.extensions is not None]
    return {id(p.face): (ext, p) for ext in units for p in ext.params}


def state_in_face_layout(ext: ExtensionParams, p: ExtensionParam, value: Any, device: torch.device) -> Any:
    """An optimizer state value of ``p`` (whole, or a ``DTensor`` of any layout) in its face's layout;
    anything else (``step``, a 0-dim tensor) as it is."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    face = p.face
    if isinstance(value, DTensor):
        if value.placements == face.placements and value.device_mesh == face.device_mesh:  # type: ignore[attr-defined]
            return value
        value = _tensor_parallel.full_tensor(value, device)  # a collective over the value's mesh
    if tuple(value.shape) != tuple(face.shape):
        return value  # the optimizer's own load reports the mismatch
    return _as_face(ext, p, value, device)


def _as_face(ext: ExtensionParams, p: ExtensionParam, whole: torch.Tensor, device: torch.device) -> DTensor:
    """This rank's dim-0 chunk of ``whole`` (of the face's shape) as a ``DTensor`` of the face's layout."""
    face = p.face
    chunk = torch.chunk(whole, ext.world, dim=0)[ext.rank] if ext.world > 1 else whole
    chunk = chunk if chunk.device == device else chunk.to(device)  # a subclass's `to` may rebuild it
    mesh, placements = face.device_mesh, face.placements  # type: ignore[attr-defined]
    return DTensor.from_local(chunk, mesh, placements, run_check=False, shape=face.shape, stride=face.stride())


@torch.no_grad()
def save_full_extensions(state: _FSDPState, handle: FlatParamHandle, state_dict: dict[str, Any], prefix: str) -> None:
    ext = handle.extensions
    if ext is None:
        return
    drop, offload = _drops_values(state), _config(state).offload_to_cpu
    for p in ext.params:
        for name in p.names:
            key = prefix + name
            if key not in state_dict:
                continue
            # a collective, in the same order on every rank
            whole = _tensor_parallel.full_tensor(p.face, handle.device)  # type: ignore[arg-type]
            if drop:
                del state_dict[key]
            else:
                state_dict[key] = whole.cpu() if offload and whole.device.type != "cpu" else whole


def register_extension_load_hooks(state: _FSDPState, handle: FlatParamHandle) -> None:
    """One load pre-hook per module holding an extension parameter, after the module's own hooks."""
    ext = handle.extensions
    if ext is None:
        return
    entries: dict[nn.Module, list[tuple[str, ExtensionParam]]] = {}
    for p in ext.params:
        for module, attr in p.holders:
            entries.setdefault(module, []).append((attr, p))
    for module, attrs in entries.items():
        hook = functools.partial(_to_face_layout, ext, attrs)
        state.hook_handles.append(module._register_load_state_dict_pre_hook(hook))


def _to_face_layout(
    ext: ExtensionParams, attrs: list[tuple[str, ExtensionParam]], state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    if ext.is_unsharded:  # in a step the module holds the unsharded tensors: nothing to match
        return
    for attr, p in attrs:
        key = prefix + attr
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            continue
        if tuple(value.shape) != tuple(p.face.shape):
            continue  # the module's own load reports the size mismatch, naming the key
        state_dict[key] = _as_face(ext, p, value, p.face.device)
