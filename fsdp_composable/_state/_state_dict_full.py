"""FULL_STATE_DICT: full tensors, gathered one unit at a time.

[Note: full state dicts from sharded units]
Between steps a module registers its parameters' faces, DTensors holding this rank's chunks, so the
plain ``state_dict()`` would hold those. Each unit is therefore unsharded around its subtree's save
(see [Note: a unit is unsharded around its subtree's save and load]): FULL registers the original
parameters, pointed at views of the all-gathered flat tensor, so ``nn.Module`` saves full tensors
itself, under every FQN and through every hook of the model's own modules. A FULL load needs no
gather: each rank copies its chunk of the full values into the faces ([Note: loading into the faces]).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fsdp_composable._comm import _tensor_parallel
from fsdp_composable._common_utils import _FSDPState
from fsdp_composable._flat._checkpoint_comm import gather_full_flat as _gather_full_flat
from fsdp_composable._flat_param import FlatParamHandle
from fsdp_composable._runtime._state_dict_open import _check_registered, _OpenUnit
from fsdp_composable._state._state_dict_settings import _config, _copy, _drops_values, _rank0_only

__all__: list[str] = []


def _copy_out(state: _FSDPState, view: torch.Tensor) -> torch.Tensor:
    """A copy of ``view`` that owns its memory (on the CPU if the config asks), so the source can be freed."""
    return _copy(view, _config(state))  # type: ignore[no-any-return]


def _open_full(handle: FlatParamHandle) -> _OpenUnit:
    """Every parameter of the unit becomes a full-shape view of its all-gathered flat tensor (full precision)."""
    _check_registered(handle)
    full = _gather_full_flat(handle)
    for param, info in zip(handle.params, handle.layout.infos):
        _tensor_parallel.point_at(param, full[info.offset : info.offset + info.numel].view(info.shape))
    handle.register_params()
    return _OpenUnit(full)


def _take_over_views(
    state: _FSDPState, handle: FlatParamHandle, full: torch.Tensor, state_dict: dict[str, Any], prefix: str
) -> None:
    """Replace every saved tensor that views ``full`` (a parameter, or a piece a module's hook cut from
    one) by a copy that owns its memory, or drop it for ``rank0_only`` on other ranks."""
    storage = full.untyped_storage().data_ptr()
    drop = _drops_values(state)
    for key in [k for k in state_dict if k.startswith(prefix)]:
        value = state_dict[key]
        local = value._local_tensor if isinstance(value, DTensor) else value
        if not (
            type(local) is torch.Tensor
            and local.device == full.device
            and local.untyped_storage().data_ptr() == storage
        ):
            continue
        if isinstance(value, DTensor):
            # [Note: tensor-parallel parameters]: full over data parallelism, as the tensor-parallel
            # model holds it; ``rank0_only`` wants the whole tensor in one process
            config = _config(state)
            if drop or _rank0_only(config):
                whole = _tensor_parallel.full_tensor(value, handle.device)
                if drop:
                    del state_dict[key]
                else:
                    state_dict[key] = _copy_out(state, whole)
            else:
                state_dict[key] = DTensor.from_local(
                    _copy_out(state, local),
                    value.device_mesh,
                    value.placements,
                    run_check=False,
                    shape=value.shape,
                    stride=value.stride(),
                )
        elif drop:
            del state_dict[key]
        else:
            state_dict[key] = _copy_out(state, value)
