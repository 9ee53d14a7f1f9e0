"""``p.data = t`` between steps, kept: see [Note: edits of a sharded model] in `_model_edit_checks`.
Called wherever the shard is read or written next: the root's forward, `unshard_params`, and the
state-dict hooks (so ``state_dict()`` right after the write saves it, and a load is not undone by
it at the next forward)."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_composable._comm._tensor_parallel import local_of, point_at
from fsdp_composable._flat_param import FlatParamHandle

__all__: list[str] = []


def keep_data_writes(handle: FlatParamHandle) -> None:
    """``p.data = t`` between steps, ``t`` of the view's dtype and device and of its shape (a write
    of this rank's slice) or of the parameter's full or flattened full shape: copy ``t`` (its slice of
    it) into this rank's shard and point ``p`` back at its view. See [Note: edits of a sharded model]."""
    if handle.is_unsharded:
        return
    layout = handle.layout
    for param, info, view in zip(handle.params, layout.infos, handle._sharded_views):
        data = param.data
        if info.tp is not None or same_data(param, view):
            continue
        if (data.dtype, data.device) != (view.dtype, view.device):
            continue  # a cast or a move: refused by `_restore_views`
        if data.shape == view.shape:
            src = data
        elif data.shape in (info.shape, (info.numel,)):  # the whole parameter: every rank keeps its slice
            first, last = layout.param_range(info)
            src = data.reshape(-1)[first:last].view(view.shape)
        else:
            continue
        with torch.no_grad():
            view.copy_(src)
        point_at(param, view)


def same_data(param: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``param.data`` is still ``view``. Every empty tensor has data pointer 0, so for a
    parameter whose slice of this rank's shard is empty compare the storages as well; otherwise
    ``p.data = t`` goes unnoticed on exactly the ranks that hold none of ``p``, they run the next
    forward while the others raise, and the ranks' collectives no longer match."""
    # a plain parameter's own pointers are its ``.data``'s, without making that tensor (every step)
    data = param if type(param) is nn.Parameter else local_of(param)
    if data.data_ptr() != view.data_ptr():
        return False
    return view.numel() > 0 or data.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
