"""State-dict hooks for every unit (FULL / SHARDED / LOCAL): the `state_dict_type` context manager,
hook registration and dispatch to one strategy per type (`_state_dict_full`, `_state_dict_sharded`,
`_state_dict_local`), and the key agreement across ranks."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, Optional

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_composable._comm import _rank_agreement
from fsdp_composable._common_utils import _FSDPState, _get_fsdp_states
from fsdp_composable._flat._checkpoint_comm import all_gather_object
from fsdp_composable._flat_param import FlatParamHandle
from fsdp_composable._guards._dtype_casts import adopt_cast
from fsdp_composable._init._group_units import check_no_local_state_dict
from fsdp_composable._names._fsdp1_names import as_ours
from fsdp_composable._runtime._module_controls import reshard_left_unsharded
from fsdp_composable._runtime._state_dict_keys import _clean_module_fqns as _clean_module_fqns
from fsdp_composable._runtime._state_dict_keys import _join as _join
from fsdp_composable._runtime._state_dict_keys import _register_prefix_hooks as _register_prefix_hooks
from fsdp_composable._runtime._state_dict_open import (
    _check_registered,
    _close,
    _close_stale,
    _open,
    _take_open,
)
from fsdp_composable._runtime._state_dict_open import close_stale_units as close_stale_units
from fsdp_composable._state._extension_state import register_extension_load_hooks, save_full_extensions
from fsdp_composable._state._state_dict_atomic import decide_after_load, keep_before_load
from fsdp_composable._state._state_dict_full import _open_full, _take_over_views
from fsdp_composable._state._state_dict_local import _local_post_state_dict_hook, _local_pre_load_hook
from fsdp_composable._state._state_dict_settings import (
    _CONFIG_TYPES,
    _check_not_rank0_only_load,
    _config,
    _drops_values,
    _kind,
    _restore_setting,
    _set_setting,
)
from fsdp_composable._state._state_dict_sharded import (
    _is_replicated,
    _match_face_placements,
    _replicate_buffers,
    _saved_faces,
    _take_assigned,
)
from fsdp_composable.api import StateDictConfig, StateDictType

__all__: list[str] = ["state_dict_type"]


# ---------------------------------------------------------------------------- state_dict_type
@contextlib.contextmanager
def state_dict_type(
    module: nn.Module, state_dict_type: StateDictType, config: Optional[StateDictConfig] = None
) -> Iterator[None]:
    """Inside the context, ``module.state_dict()``, ``module.load_state_dict()`` and
    ``optim_state_dict`` use ``state_dict_type`` (with ``config``) for every `fully_shard` state in
    ``module``'s subtree (after the first forward: every state under its root, see [Note: the
    state-dict setting is root-wide]); the previous settings come back on exit.

    ``FULL_STATE_DICT`` (the default outside the context): the unsharded model's keys and full tensors.
    ``SHARDED_STATE_DICT``: one DTensor per original parameter and buffer, for
    ``torch.distributed.checkpoint``. ``LOCAL_STATE_DICT``: each unit's flat shard and its layout.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"state_dict_type argument 'module' must be an nn.Module, got {type(module).__name__}")
    # FSDP1's classes from torch.distributed.fsdp: see [Note: torch's FSDP1 objects]
    state_dict_type = as_ours("state_dict_type argument 'state_dict_type'", state_dict_type)
    config = as_ours("state_dict_type argument 'config'", config)
    if not isinstance(state_dict_type, StateDictType):
        raise TypeError(
            "state_dict_type argument 'state_dict_type' must be a StateDictType (e.g. "
            f"StateDictType.SHARDED_STATE_DICT), got {type(state_dict_type).__name__}: {state_dict_type!r}"
        )
    expected = _CONFIG_TYPES[state_dict_type]
    if config is not None and not isinstance(config, expected):
        raise TypeError(
            f"state_dict_type argument 'config' must be a {expected.__name__} or None for "
            f"StateDictType.{state_dict_type.name}, got {type(config).__name__}"
        )
    states = _get_fsdp_states(module)
    if not states:
        raise ValueError(
            f"state_dict_type: no fully_shard state on this {type(module).__name__} or its submodules; "
            "call fully_shard(module) first"
        )
    # root-wide: see [Note: the state-dict setting is root-wide]
    with _setting(states, state_dict_type, config if config is not None else expected(), None):
        yield


@contextlib.contextmanager
def _setting(
    states: list[_FSDPState], kind: StateDictType, config: StateDictConfig, optim_config: Optional[StateDictConfig]
) -> Iterator[None]:
    previous = _set_setting(states, kind, config, optim_config)
    try:
        yield
    finally:
        _restore_setting(states, previous)


@contextlib.contextmanager
def state_dict_type_with_optim(
    module: nn.Module, kind: StateDictType, config: Optional[StateDictConfig], optim_config: Optional[StateDictConfig]
) -> Iterator[None]:
    """`state_dict_type`, with FSDP1's separate setting for optimizer state dicts (None: the model's)."""
    with state_dict_type(module, kind, config):  # its checks
        with _setting(_get_fsdp_states(module), kind, _config(_get_fsdp_states(module)[0]), optim_config):
            yield


# ---------------------------------------------------------------------------- registration
def _register_state_dict_hooks(state: _FSDPState) -> None:
    # Before the unit hooks: replicated buffers become plain tensors and every rank checks the key set
    # first; the unit hooks then give parameter values the layout of their DTensor parameters.
    state.hook_handles.append(
        state.module._register_load_state_dict_pre_hook(functools.partial(_root_pre_load_hook, state), with_module=True)
    )
    for handle in state.handles:
        for unit_module in handle.members:  # each member opens the unit around its own subtree
            state.hook_handles.append(
                unit_module.register_state_dict_pre_hook(functools.partial(_pre_state_dict_hook, state, handle))
            )
            state.hook_handles.append(
                unit_module._register_state_dict_hook(functools.partial(_post_state_dict_hook, state, handle))
            )
            state.hook_handles.append(
                unit_module._register_load_state_dict_pre_hook(
                    functools.partial(_pre_load_state_dict_hook, state, handle), with_module=True
                )
            )
            post_load = functools.partial(_post_load_state_dict_hook, state, handle)
            state.hook_handles.append(unit_module.register_load_state_dict_post_hook(post_load))
        _register_placement_hooks(state, handle)
        register_extension_load_hooks(state, handle)
    # Registered after the unit hooks, so on the root unit it runs after them.
    state.hook_handles.append(
        state.module._register_state_dict_hook(functools.partial(_root_post_state_dict_hook, state))
    )
    state.hook_handles.append(
        state.module.register_load_state_dict_post_hook(functools.partial(_root_post_load_hook, state))
    )


@_rank_agreement.entry_point("state_dict()")
def _pre_state_dict_hook(
    state: _FSDPState, handle: FlatParamHandle, module: nn.Module, prefix: str, keep_vars: bool
) -> None:
    _close_stale(state, handle)
    adopt_cast(handle)  # model.half() since the last step: see [Note: casts after sharding]
    kind = _kind(state)
    if kind is StateDictType.FULL_STATE_DICT:
        _open(state, handle, _open_full(handle))
    elif kind is StateDictType.SHARDED_STATE_DICT:  # the faces: [Note: sharded state dicts are the faces]
        _check_registered(handle)


def _post_state_dict_hook(
    state: _FSDPState,
    handle: FlatParamHandle,
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
) -> None:
    if _kind(state) is StateDictType.LOCAL_STATE_DICT:
        check_no_local_state_dict(handle)
        _local_post_state_dict_hook(state, handle, state_dict, prefix)
        return
    opened = _take_open(state, handle)
    if opened is None:
        if _kind(state) is StateDictType.SHARDED_STATE_DICT:
            _saved_faces(state, state_dict, prefix)
        return
    try:
        _take_over_views(state, handle, opened.full, state_dict, prefix)
        save_full_extensions(state, handle, state_dict, prefix)
    finally:
        _close(handle, opened)


@_rank_agreement.entry_point("load_state_dict()")
def _pre_load_state_dict_hook(
    state: _FSDPState,
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
    _close_stale(state, handle)
    reshard_left_unsharded(state, handle)  # its unsharded copy would go stale ([Note: a unit left unsharded])
    adopt_cast(handle)
    kind = _kind(state)
    if kind is StateDictType.LOCAL_STATE_DICT:
        check_no_local_state_dict(handle)
        _local_pre_load_hook(handle, state_dict, prefix, missing_keys, error_msgs)
        return
    if kind is StateDictType.FULL_STATE_DICT:
        _check_not_rank0_only_load(state)
    _check_registered(handle)  # the values are copied into the faces: see [Note: loading into the faces]


def _register_placement_hooks(state: _FSDPState, handle: FlatParamHandle) -> None:
    """One load pre-hook per module holding a parameter of ``handle``, registered after the module's own
    hooks, so it sees the value that module will load (e.g. one its hook fused from three)."""
    entries: dict[nn.Module, list[tuple[str, int]]] = {}
    for k, info in enumerate(handle.layout.infos):
        for module, attr, _ in info.holders:
            entries.setdefault(module, []).append((attr, k))
    for module, attrs in entries.items():
        hook = functools.partial(_match_placements, state, handle, attrs)
        state.hook_handles.append(module._register_load_state_dict_pre_hook(hook))


def _match_placements(
    state: _FSDPState,
    handle: FlatParamHandle,
    attrs: list[tuple[str, int]],
    state_dict: dict[str, Any],
    prefix: str,
    *args: Any,
) -> None:
    """Give the checkpoint value of each parameter this module holds its face's layout (see [Note: loading
    into the faces])."""
    if _kind(state) is StateDictType.LOCAL_STATE_DICT or handle.registered is not handle.faces:
        return  # LOCAL gives the faces' layout itself; in a step there is nothing to match
    _match_face_placements(handle, attrs, state_dict, prefix)


@_rank_agreement.entry_point("load_state_dict()")
def _post_load_state_dict_hook(
    state: _FSDPState, handle: FlatParamHandle, module: nn.Module, incompatible_keys: Any
) -> None:
    if _kind(state) is not StateDictType.LOCAL_STATE_DICT:
        _take_assigned(handle)


def _root_post_state_dict_hook(
    state: _FSDPState, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    if _drops_values(state):
        for key in [k for k in state_dict if k.startswith(prefix)]:
            del state_dict[key]
    elif _kind(state) is StateDictType.SHARDED_STATE_DICT:
        _replicate_buffers(state, state_dict, prefix)


@_rank_agreement.entry_point("load_state_dict()")
def _root_pre_load_hook(
    state: _FSDPState,
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    _rank_agreement.check_in(h.process_group for s in state.all_states or [state] for h in s.handles)
    if _kind(state) is StateDictType.FULL_STATE_DICT:
        _check_not_rank0_only_load(state)
    if _kind(state) in (StateDictType.SHARDED_STATE_DICT, StateDictType.FULL_STATE_DICT):
        _compare_keys_across_ranks(state, state_dict, prefix, error_msgs)
    # Buffers (and parameters of unsharded units) arrive as replicated DTensors: load their local value.
    for key, value in list(state_dict.items()):
        if key.startswith(prefix) and isinstance(value, DTensor) and _is_replicated(value):
            state_dict[key] = value.to_local()
    if _kind(state) in (StateDictType.SHARDED_STATE_DICT, StateDictType.FULL_STATE_DICT):
        keep_before_load(state, module, error_msgs)  # see [Note: a refused load writes nothing]


@_rank_agreement.entry_point("load_state_dict()")
def _root_post_load_hook(state: _FSDPState, module: nn.Module, incompatible_keys: Any) -> None:
    decide_after_load(state, incompatible_keys)


def _compare_keys_across_ranks(
    state: _FSDPState, state_dict: dict[str, Any], prefix: str, error_msgs: list[str]
) -> None:
    """SHARDED and FULL loads are collective: a key some ranks have and others lack is dropped here and
    is an error on every rank (which then puts everything back: [Note: a refused load writes nothing]),
    so the ranks' shards (and replicas) stay of one piece."""
    mine = sorted(k for k in state_dict if k.startswith(prefix))
    everyone = _keys_of_every_rank(state, mine)
    full = _kind(state) is StateDictType.FULL_STATE_DICT
    for key in sorted(set().union(*everyone.values())):
        lacking = [r for r, keys in sorted(everyone.items()) if key not in keys]
        if not lacking:
            continue
        state_dict.pop(key, None)
        if full:
            message = (
                f"FULL_STATE_DICT: key '{key}' is in the state dict on some ranks but not on ranks {lacking}; "
                "every rank must load the same keys (each rank writes its shard of every parameter from its own "
                "dict). It was loaded on no rank"
            )
        else:
            message = (
                f"SHARDED_STATE_DICT: key '{key}' is in the state dict on some ranks but not on ranks {lacking}; "
                "every rank must load the same keys (the pieces of a sharded parameter are exchanged between "
                "ranks). Nothing was loaded for it"
            )
        if message not in error_msgs:
            error_msgs.append(message)


def _keys_of_every_rank(state: _FSDPState, mine: list[str]) -> dict[int, set[str]]:
    """Global rank -> its keys, for every rank of the state's groups (HYBRID_SHARD: the shard group's
    lists, then those of every replica)."""
    shard = all_gather_object(state.process_group, (dist.get_rank(), mine), state.device, "exchange of state-dict keys")
    lists = shard
    if state.replicate_group is not None and dist.get_world_size(state.replicate_group) > 1:
        replicas = all_gather_object(state.replicate_group, shard, state.device, "exchange of state-dict keys")
        lists = [entry for replica in replicas for entry in replica]
    return {rank: set(keys) for rank, keys in lists}
