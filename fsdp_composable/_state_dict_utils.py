"""State-dict hooks: FULL_STATE_DICT for every unit, and prefix hooks for wrapper modules.

[Note: full state dicts from sharded units]
Between steps an original parameter is a 1-D view of its slice of this rank's shard, so the plain
``state_dict()`` would hold shard slices. A post-hook on each unit module all-gathers the unit's flat
parameter in full precision and puts each original parameter's full tensor under every FQN that
registers it. A pre-hook on load does the reverse: it checks the full shape and replaces the value by
this rank's slice, so ``nn.Module``'s own loader copies it straight into the shard.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import nn

from fsdp_composable import _collectives
from fsdp_composable._common_utils import _FSDPState
from fsdp_composable._flat_param import FlatParamHandle

__all__: list[str] = []


def _register_state_dict_hooks(state: _FSDPState) -> None:
    for unit_module, handle in state.handles.items():
        state.hook_handles.append(
            unit_module._register_state_dict_hook(functools.partial(_full_post_state_dict_hook, handle))
        )
        state.hook_handles.append(
            unit_module._register_load_state_dict_pre_hook(
                functools.partial(_full_pre_load_hook, handle), with_module=True
            )
        )


def _gather_full_flat(handle: FlatParamHandle, shard: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The unit's whole flat parameter (or flat ``shard`` of the same layout, e.g. its gradient) in
    full precision: a new tensor, never the unshard buffer."""
    layout = handle.layout
    shard = handle.flat_param.detach() if shard is None else shard
    if layout.world_size == 1:
        return shard.clone()
    full = torch.empty(layout.padded_numel, dtype=shard.dtype, device=shard.device)
    work = _collectives.all_gather(full, shard, handle.process_group)
    if work is not None:
        work.wait()
    return full


def _full_post_state_dict_hook(
    handle: FlatParamHandle, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    full = _gather_full_flat(handle)
    for info in handle.layout.infos:
        value = full[info.offset : info.offset + info.numel].view(info.shape).clone()
        for _, _, fqn in info.holders:
            if prefix + fqn in state_dict:
                state_dict[prefix + fqn] = value


def _full_pre_load_hook(
    handle: FlatParamHandle,
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    layout = handle.layout
    lo = layout.rank * layout.shard_numel
    for info, sharded_view in zip(layout.infos, handle._sharded_views):
        for _, _, fqn in info.holders:
            key = prefix + fqn
            value = state_dict.get(key)
            if not isinstance(value, torch.Tensor):
                continue
            if value.shape != info.shape:
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, "
                    f"the shape in current model is {info.shape}."
                )
                state_dict[key] = sharded_view.detach().clone()  # leave the parameter as it was
                continue
            start, end = layout.shard_range(info)
            begin = lo + start - info.offset
            state_dict[key] = value.reshape(-1)[begin : begin + end - start].view(sharded_view.shape)


# ---------------------------------------------------------------------------- wrapper prefixes
def _register_prefix_hooks(module: nn.Module, inner: str) -> None:
    """Hide the ``inner`` attribute name of a wrapper module from its state-dict keys.

    Saving strips ``<prefix><inner>.``; loading adds it back, so a wrapped module's state dict loads
    into the plain module and the reverse.
    """
    module._register_state_dict_hook(functools.partial(_strip_prefix_hook, inner))
    module._register_load_state_dict_pre_hook(functools.partial(_add_prefix_hook, inner))


def _strip_prefix_hook(
    inner: str, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    # The subtree's keys are the last ones added, so re-inserting them keeps the overall order.
    full = f"{prefix}{inner}."
    for key in [k for k in state_dict if k.startswith(full)]:
        state_dict[prefix + key[len(full) :]] = state_dict.pop(key)
    _rename_metadata(state_dict, full, prefix)


def _add_prefix_hook(inner: str, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    full = f"{prefix}{inner}."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(full)]:
        state_dict[full + key[len(prefix) :]] = state_dict.pop(key)


def _rename_metadata(state_dict: Any, old: str, new: str) -> None:
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is None:
        return
    for key in [k for k in metadata if k == old[:-1] or k.startswith(old)]:
        renamed = new[:-1] if key == old[:-1] else new + key[len(old) :]
        metadata.setdefault(renamed, metadata.pop(key))
