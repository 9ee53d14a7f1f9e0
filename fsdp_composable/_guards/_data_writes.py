"""Whether a registered tensor still views its slice of the unit's buffer: see [Note: edits of a
sharded model] in `_model_edit_checks`."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_composable._comm._tensor_parallel import local_of

__all__: list[str] = []


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
