"""LOCAL_STATE_DICT: each unit's flat shard and the layout that produced it.

[Note: local state dicts]
LOCAL_STATE_DICT stores each unit's flat shard as ``<unit>._flat_param`` and, next to it, the layout
that produced it (``<unit>._flat_param_layout``: rank, world size, numels, FQNs and shapes). The shard
only means something under the same layout, so loading compares the two and names the unit if they
differ. Per-parameter keys are absent; the load hook writes each parameter's slice back under its FQN
so the usual strict checks still apply.
"""

from __future__ import annotations

from typing import Any

import torch

from fsdp_composable._common_utils import _FSDPState
from fsdp_composable._flat_param import FlatLayout, FlatParamHandle
from fsdp_composable._state._state_dict_settings import _to_output

__all__: list[str] = []


LAYOUT_SUFFIX = "_layout"  # LOCAL: ``<unit>.<flat param name>_layout`` describes the shard next to it
# how the shard's elements are ordered ([Note: rank-major flat shards]); records without it were saved
# by versions whose shard was a contiguous slice of the concatenated parameters
ORDER = "rank-major"


# ---------------------------------------------------------------------------- LOCAL_STATE_DICT
def _layout_record(layout: FlatLayout) -> dict[str, Any]:
    """Plain Python values, so ``torch.load(..., weights_only=True)`` reads them back."""
    return {
        "rank": layout.rank,
        "world_size": layout.world_size,
        "unpadded_numel": layout.unpadded_numel,
        "padded_numel": layout.padded_numel,
        "fqns": [info.fqn for info in layout.infos],
        "shapes": [list(info.shape) for info in layout.infos],
        "order": ORDER,
    }


def _local_post_state_dict_hook(
    state: _FSDPState, handle: FlatParamHandle, state_dict: dict[str, Any], prefix: str
) -> None:
    for info in handle.layout.infos:
        for _, _, fqn in info.holders:
            state_dict.pop(prefix + fqn, None)
    state_dict[prefix + handle.name] = _to_output(state, handle.flat_param.detach())
    state_dict[prefix + handle.name + LAYOUT_SUFFIX] = _layout_record(handle.layout)


def _local_pre_load_hook(
    handle: FlatParamHandle, state_dict: dict[str, Any], prefix: str, missing_keys: list[str], error_msgs: list[str]
) -> None:
    key = prefix + handle.name
    flat = state_dict.pop(key, None)
    record = state_dict.pop(key + LAYOUT_SUFFIX, None)
    layout = handle.layout
    unit = f"unit '{handle.unit_fqn or '<root>'}'"
    if flat is None:
        missing_keys.append(key)
        flat = handle.flat_param.detach().clone()  # keep the parameters as they are
    elif isinstance(record, dict) and record.get("order") != ORDER:
        error_msgs.append(
            f"LOCAL_STATE_DICT of {unit} (key {key}) was saved by an earlier version of fsdp_composable, "
            "whose flat shards hold the parameters' elements in another order: it cannot be loaded as it is. "
            "Load it with that version and save a FULL_STATE_DICT or SHARDED_STATE_DICT, which load here."
        )
        flat = handle.flat_param.detach().clone()
    elif record != _layout_record(layout):
        error_msgs.append(
            f"LOCAL_STATE_DICT layout mismatch for {unit} (key {key}): the checkpoint was "
            f"saved with {_describe_record(record)}, this model has {_describe_record(_layout_record(layout))}. "
            "A local state dict only loads at the same rank, world size and policy; use SHARDED_STATE_DICT "
            "to change them."
        )
        flat = handle.flat_param.detach().clone()
    elif not isinstance(flat, torch.Tensor) or flat.shape != handle.flat_param.shape:
        error_msgs.append(
            f"size mismatch for {key} of {unit}: expected a flat shard of shape "
            f"{tuple(handle.flat_param.shape)}, got {getattr(flat, 'shape', type(flat).__name__)}."
        )
        flat = handle.flat_param.detach().clone()
    for k, info in enumerate(layout.infos):
        start, end = layout.shard_range(info)
        value = handle.face_grad(k, flat[start:end])  # laid out like the face: nn.Module's copy is local
        for _, _, fqn in info.holders:
            state_dict[prefix + fqn] = value


def _describe_record(record: Any) -> str:
    if not isinstance(record, dict):
        return f"no layout record ({type(record).__name__})"
    names = ("rank", "world_size", "padded_numel")
    return ", ".join(f"{n}={record.get(n)}" for n in names) + f", {len(record.get('fqns', []))} parameters"
