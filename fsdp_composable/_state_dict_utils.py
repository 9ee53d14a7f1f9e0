"""State-dict hooks for every unit (FULL / SHARDED / LOCAL), the `state_dict_type` context manager,
and prefix hooks for wrapper modules.

[Note: full state dicts from sharded units]
Between steps an original parameter is a 1-D view of its slice of this rank's shard, so the plain
``state_dict()`` would hold shard slices. Each unit is therefore unsharded around its subtree's save
and load (see [Note: a unit is unsharded around its subtree's save and load]): FULL points the
parameters at views of the all-gathered flat tensor, so ``nn.Module`` saves and loads full shapes
itself, under every FQN and through every hook of the model's own modules.

[Note: sharded state dicts are DTensors in torch.chunk layout]
Our shard of a unit is a contiguous slice of the padded flat parameter, so a parameter's local piece
is generally not a block of its rows: it may start mid-row, or be empty. A ``Shard(0)`` DTensor (and
so `torch.distributed.checkpoint`, which reads each piece's offset from the placement) assumes the
`torch.chunk` rule: rank r holds rows [r*c, (r+1)*c) with c = ceil(rows / world). So we move the
elements instead of describing them: one all-to-all per unit sends each element from the rank whose
flat shard holds it to the rank whose row chunk holds it. Every value is then an ordinary DTensor of
the parameter's original shape, ``Shard(0)`` over a 1-D mesh of the unit's process group
(``Replicate()`` for 0-dim parameters and for units that are not sharded), which DCP saves and loads at
any world size. Loading runs the inverse all-to-all. Each rank sends and receives about one shard:
nothing is gathered in full.

[Note: local state dicts]
LOCAL_STATE_DICT stores each unit's flat shard as ``<unit>._flat_param`` and, next to it, the layout
that produced it (``<unit>._flat_param_layout``: rank, world size, numels, FQNs and shapes). The shard
only means something under the same layout, so loading compares the two and names the unit if they
differ. Per-parameter keys are absent; the load hook writes each parameter's slice back under its FQN
so the usual strict checks still apply.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_composable import _collectives, _rank_agreement, _tensor_parallel
from fsdp_composable._common_utils import _FSDPState, _get_fsdp_states
from fsdp_composable._flat_param import FlatLayout, FlatParamHandle, ParamInfo
from fsdp_composable._rank_agreement import Op
from fsdp_composable.api import (
    FullStateDictConfig,
    LocalStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictType,
    _torch_twin_error,
)

__all__ = ["state_dict_type"]

LAYOUT_SUFFIX = "_layout"  # LOCAL: ``<unit>.<flat param name>_layout`` describes the shard next to it

_CONFIG_TYPES: dict[StateDictType, type[StateDictConfig]] = {
    StateDictType.FULL_STATE_DICT: FullStateDictConfig,
    StateDictType.SHARDED_STATE_DICT: ShardedStateDictConfig,
    StateDictType.LOCAL_STATE_DICT: LocalStateDictConfig,
}


# ---------------------------------------------------------------------------- state_dict_type
@contextlib.contextmanager
def state_dict_type(
    module: nn.Module, state_dict_type: StateDictType, config: Optional[StateDictConfig] = None
) -> Iterator[None]:
    """Inside the context, ``module.state_dict()``, ``module.load_state_dict()`` and
    ``optim_state_dict`` use ``state_dict_type`` (with ``config``) for every `fully_shard` state in
    ``module``'s subtree; the previous settings come back on exit.

    ``FULL_STATE_DICT`` (the default outside the context): the unsharded model's keys and full tensors.
    ``SHARDED_STATE_DICT``: one DTensor per original parameter and buffer, for
    ``torch.distributed.checkpoint``. ``LOCAL_STATE_DICT``: each unit's flat shard and its layout.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"state_dict_type argument 'module' must be an nn.Module, got {type(module).__name__}")
    twin = _torch_twin_error("state_dict_type argument 'state_dict_type'", state_dict_type, StateDictType)
    if twin:
        raise twin
    if not isinstance(state_dict_type, StateDictType):
        raise TypeError(
            "state_dict_type argument 'state_dict_type' must be a StateDictType (e.g. "
            f"StateDictType.SHARDED_STATE_DICT), got {type(state_dict_type).__name__}: {state_dict_type!r}"
        )
    expected = _CONFIG_TYPES[state_dict_type]
    twin = _torch_twin_error(
        "state_dict_type argument 'config'",
        config,
        expected,
        or_none=True,
        suffix=f" for StateDictType.{state_dict_type.name}",
    )
    if twin:
        raise twin
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
    previous = [(s.state_dict_type, s.state_dict_config) for s in states]
    for s in states:
        s.state_dict_type, s.state_dict_config = state_dict_type, config if config is not None else expected()
    try:
        yield
    finally:
        for s, (old_type, old_config) in zip(states, previous):
            s.state_dict_type, s.state_dict_config = old_type, old_config


def _config(state: _FSDPState) -> StateDictConfig:
    return state.state_dict_config or _CONFIG_TYPES[state.state_dict_type]()


def _drops_values(state: _FSDPState) -> bool:
    """FULL with ``rank0_only``: this rank takes part in the collectives but returns nothing."""
    config = _config(state)
    return (
        state.state_dict_type is StateDictType.FULL_STATE_DICT
        and isinstance(config, FullStateDictConfig)
        and config.rank0_only
        and (state.rank != 0 or not _first_tensor_parallel_rank(state))
    )


def _first_tensor_parallel_rank(state: _FSDPState) -> bool:
    """With tensor parallelism, "rank 0" is rank 0 of both the data-parallel and the tensor-parallel
    group (its tensor-parallel peers are data-parallel rank 0 too, and would keep a copy)."""
    return all(
        info.tp.mesh.get_local_rank() == 0
        for s in state.all_states or [state]
        for handle in s.handles
        for info in handle.layout.infos
        if info.tp is not None
    )


def _to_output(state: _FSDPState, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.cpu() if _config(state).offload_to_cpu else tensor


def _copy_out(state: _FSDPState, view: torch.Tensor) -> torch.Tensor:
    """A copy of ``view`` that owns its memory (on the CPU if the config asks), so the source can be freed."""
    return view.cpu() if _config(state).offload_to_cpu and view.device.type != "cpu" else view.clone()


# ---------------------------------------------------------------------------- registration
def _register_state_dict_hooks(state: _FSDPState) -> None:
    # Before the unit hooks: replicated buffers become plain tensors and every rank checks the key set
    # first; the unit hooks then give parameter values the layout of their DTensor parameters.
    state.hook_handles.append(
        state.module._register_load_state_dict_pre_hook(functools.partial(_root_pre_load_hook, state), with_module=True)
    )
    for handle in state.handles:
        unit_module = handle.module
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
        state.hook_handles.append(
            unit_module.register_load_state_dict_post_hook(functools.partial(_post_load_state_dict_hook, state, handle))
        )
        _register_placement_hooks(state, handle)
    # Registered after the unit hooks, so on the root unit it runs after them.
    state.hook_handles.append(
        state.module._register_state_dict_hook(functools.partial(_root_post_state_dict_hook, state))
    )


# ---------------------------------------------------------------------------- a unit unsharded for one save/load
# [Note: a unit is unsharded around its subtree's save and load]
# FULL and SHARDED state dicts never look keys up by name. A state-dict *pre*-hook on the unit module
# gives each original parameter its original shape before ``nn.Module`` visits the unit's subtree:
# FULL points ``param.data`` at a view of the unit's all-gathered flat tensor; SHARDED registers, in
# place of each original parameter, a `DTensor` parameter of the original shape holding this rank's
# `torch.chunk` rows (see [Note: sharded state dicts are DTensors in torch.chunk layout]). So every
# module below sees what it would see without sharding: its own state-dict hooks (a fused QKV weight
# split into three, torchtitan-style), a module registered under two FQNs, a `CheckpointWrapper`
# renaming keys, ``load_state_dict(assign=True)``. The post-hook takes over whatever tensors ended up
# viewing the gathered flat tensor (cloning them, so it can be freed) and restores the sharded views.
# Loading is the mirror image: the pre-hook opens the same full-shape parameters (filled with the
# current values, so a missing key keeps its value), ``nn.Module`` copies the checkpoint into them, and
# the load post-hook (which runs after the whole subtree loaded) writes this rank's part back into the
# flat shard. Cost: a unit's full flat tensor lives while its subtree is saved, so nested units hold
# their ancestors' too (the root unit plus one unit at a time for a root/blocks policy).
# A save or load that raised midway leaves its units open; the next save, load or forward closes them
# without writing anything back (`close_stale_units`).
@dataclass
class _OpenUnit:
    kind: StateDictType
    full: Optional[torch.Tensor] = None  # FULL: the flat tensor the parameters view
    # SHARDED: (module, attribute, original parameter, the DTensor parameter registered instead)
    swaps: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = field(default_factory=list)
    dparams: list[nn.Parameter] = field(default_factory=list)  # SHARDED: one per ParamInfo
    prefix: str = ""
    error_msgs: Optional[list[str]] = None


_OPEN: "weakref.WeakKeyDictionary[FlatParamHandle, _OpenUnit]" = weakref.WeakKeyDictionary()


def close_stale_units(state: _FSDPState) -> None:
    """Close units that a failed save or load left open (nothing is written back)."""
    if not _OPEN:  # the usual case: checked at every forward
        return
    for handle in state.handles:
        _close_stale(handle)


def _unit_name(handle: FlatParamHandle) -> str:
    return f"unit '{handle.unit_fqn or '<root>'}'"


def _check_registered(handle: FlatParamHandle) -> None:
    """Every holder still registers its original parameter (else we would save or overwrite another)."""
    for param, info in zip(handle.params, handle.layout.infos):
        for module, attr, fqn in info.holders:
            if module._parameters.get(attr) is not param:
                raise RuntimeError(
                    f"parameter '{_join(handle.unit_fqn, fqn)}' was replaced after fully_shard (its module registers "
                    "another tensor under that name), so fully_shard cannot save or load it. Assign new values in "
                    "place (param.copy_(t) inside unshard_params(model, writeback=True)) or load them with "
                    "load_state_dict; to change the model's structure, do it before fully_shard"
                )


def _open_full(handle: FlatParamHandle) -> _OpenUnit:
    """Every parameter of the unit becomes a full-shape view of its all-gathered flat tensor (full precision)."""
    _check_registered(handle)
    full = _gather_full_flat(handle)
    for param, info in zip(handle.params, handle.layout.infos):
        _tensor_parallel.point_at(param, full[info.offset : info.offset + info.numel].view(info.shape))
    return _OpenUnit(StateDictType.FULL_STATE_DICT, full=full)


def _open_sharded(state: _FSDPState, handle: FlatParamHandle, for_save: bool) -> _OpenUnit:
    """Register a `DTensor` parameter of the original shape in place of each original parameter."""
    _check_registered(handle)
    layout = handle.layout
    chunks = _flat_to_chunks(handle, handle.flat_param.detach())
    mesh = _mesh_of(handle.process_group, handle.device)
    opened = _OpenUnit(StateDictType.SHARDED_STATE_DICT)
    for param, info, chunk in zip(handle.params, layout.infos, chunks):
        local = _to_output(state, chunk) if for_save else chunk
        dparam = nn.Parameter(_sharded_value(handle, info, local, mesh), requires_grad=param.requires_grad)
        opened.dparams.append(dparam)
        for module, attr, _ in info.holders:
            opened.swaps.append((module, attr, param, dparam))
            module._parameters[attr] = dparam
    return opened


def _close(handle: FlatParamHandle, opened: _OpenUnit) -> None:
    """Put the original parameters back, viewing the shard (or the unsharded buffer, if it is unsharded)."""
    for module, attr, param, _ in opened.swaps:
        module._parameters[attr] = param
    if opened.full is not None:
        handle.use_unsharded_views() if handle.is_unsharded else handle.use_sharded_views()


def _close_stale(handle: FlatParamHandle) -> None:
    stale = _OPEN.pop(handle, None)
    if stale is not None:
        _close(handle, stale)


def _open(handle: FlatParamHandle, opened: _OpenUnit) -> None:
    _close_stale(handle)
    _OPEN[handle] = opened


@_rank_agreement.entry_point("state_dict()")
def _pre_state_dict_hook(
    state: _FSDPState, handle: FlatParamHandle, module: nn.Module, prefix: str, keep_vars: bool
) -> None:
    _close_stale(handle)
    kind = state.state_dict_type
    if kind is StateDictType.FULL_STATE_DICT:
        _open(handle, _open_full(handle))
    elif kind is StateDictType.SHARDED_STATE_DICT:
        _open(handle, _open_sharded(state, handle, for_save=True))


def _post_state_dict_hook(
    state: _FSDPState,
    handle: FlatParamHandle,
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
) -> None:
    if state.state_dict_type is StateDictType.LOCAL_STATE_DICT:
        _local_post_state_dict_hook(state, handle, state_dict, prefix)
        return
    opened = _OPEN.pop(handle, None)
    if opened is None:
        return
    try:
        if opened.full is not None:
            _take_over_views(state, opened.full, state_dict, prefix)
    finally:
        _close(handle, opened)


def _take_over_views(state: _FSDPState, full: torch.Tensor, state_dict: dict[str, Any], prefix: str) -> None:
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
            if drop or (isinstance(config, FullStateDictConfig) and config.rank0_only):
                whole = value.full_tensor()
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
    _close_stale(handle)
    kind = state.state_dict_type
    if kind is StateDictType.LOCAL_STATE_DICT:
        _local_pre_load_hook(handle, state_dict, prefix, missing_keys, error_msgs)
        return
    if kind is StateDictType.FULL_STATE_DICT:
        _check_not_rank0_only_load(state)
        opened = _open_full(handle)
    else:
        opened = _open_sharded(state, handle, for_save=False)  # values are matched by `_match_placements`
    opened.prefix, opened.error_msgs = prefix, error_msgs
    _open(handle, opened)


def _check_not_rank0_only_load(state: _FSDPState) -> None:
    config = _config(state)
    if isinstance(config, FullStateDictConfig) and config.rank0_only:
        raise ValueError(
            "load_state_dict under FULL_STATE_DICT with FullStateDictConfig(rank0_only=True) is not supported: "
            "rank0_only only applies to saving (other ranks would have nothing to load). Load with "
            "rank0_only=False and the full state dict on every rank (e.g. torch.load it on every rank, or send "
            "it with torch.distributed.broadcast_object_list), or load it into the unsharded model on rank 0 "
            "before fully_shard(..., sync_module_states=True)"
        )


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
    """Give the checkpoint value of each parameter this module holds our DTensor layout, so ``nn.Module``'s
    ``copy_`` is a local copy: a full tensor or a DTensor of another placement becomes this rank's chunk.
    Under FULL, a tensor-parallel parameter's value becomes a DTensor laid out like the parameter."""
    opened = _OPEN.get(handle)
    if opened is None:
        return
    layout = handle.layout
    if opened.kind is StateDictType.FULL_STATE_DICT:
        _match_tp_placements(handle, attrs, state_dict, prefix)
        return
    for attr, k in attrs:
        info, target = layout.infos[k], opened.dparams[k].data
        assert isinstance(target, DTensor)
        value = state_dict.get(prefix + attr)
        if not isinstance(value, torch.Tensor) or value.shape != _saved_shape(info):
            continue  # absent, or nn.Module reports the size mismatch
        if (
            isinstance(value, DTensor)
            and value.device_mesh == target.device_mesh
            and value.placements == target.placements
        ):
            continue
        chunk = _local_chunk(value, info, layout, handle.process_group).view(_chunk_shape(info, layout, layout.rank))
        state_dict[prefix + attr] = _sharded_value(handle, info, chunk.to(handle.dtype), target.device_mesh)


def _match_tp_placements(
    handle: FlatParamHandle, attrs: list[tuple[str, int]], state_dict: dict[str, Any], prefix: str
) -> None:
    """FULL load: a tensor-parallel parameter takes a plain full tensor (e.g. from the unsharded model)
    or a DTensor of any layout; give it the parameter's own layout (see [Note: 2-D state-dict values])."""
    for attr, k in attrs:
        spec = handle.layout.infos[k].tp
        value = state_dict.get(prefix + attr)
        if spec is None or not isinstance(value, torch.Tensor) or value.shape != spec.shape:
            continue
        if not _tensor_parallel.is_tp_value(value, spec):
            local = _tensor_parallel.tp_local_of(value, spec).to(handle.dtype)
            state_dict[prefix + attr] = _tensor_parallel.as_param_grad(spec, local)


@_rank_agreement.entry_point("load_state_dict()")
def _post_load_state_dict_hook(
    state: _FSDPState, handle: FlatParamHandle, module: nn.Module, incompatible_keys: Any
) -> None:
    opened = _OPEN.pop(handle, None)
    if opened is None:
        return
    try:
        if opened.kind is StateDictType.FULL_STATE_DICT:
            _write_back_full(handle, opened)
        else:
            _write_back_sharded(handle, opened, set(incompatible_keys.missing_keys))
    finally:
        _close(handle, opened)


def _write_back_full(handle: FlatParamHandle, opened: _OpenUnit) -> None:
    assert opened.full is not None
    _take_assigned(handle, opened)
    layout = handle.layout
    lo = layout.rank * layout.shard_numel
    with torch.no_grad():
        handle.flat_param.data.copy_(opened.full[lo : lo + layout.shard_numel])


def _take_assigned(handle: FlatParamHandle, opened: _OpenUnit) -> None:
    """``load_state_dict(assign=True)`` registers the checkpoint's tensors themselves: copy their values
    into the open unit and register the original parameters again."""
    layout = handle.layout
    for param, info, k in zip(handle.params, layout.infos, range(len(layout.infos))):
        expected = opened.dparams[k] if opened.dparams else param
        for module, attr, _ in info.holders:
            current = module._parameters.get(attr)
            if current is expected or current is None:
                continue
            with torch.no_grad():
                if opened.full is not None:
                    if info.tp is not None:
                        value = _tensor_parallel.tp_local_of(current.detach(), info.tp)
                    else:
                        value = current.full_tensor() if isinstance(current, DTensor) else current
                    opened.full[info.offset : info.offset + info.numel].copy_(value.detach().reshape(-1))
                else:
                    target = expected.data
                    assert isinstance(target, DTensor)
                    chunk = _local_chunk(current.detach(), info, layout, handle.process_group)
                    target.to_local().copy_(chunk.view(target.to_local().shape))
            module._parameters[attr] = expected


def _write_back_sharded(handle: FlatParamHandle, opened: _OpenUnit, missing: set[str]) -> None:
    """Every rank agrees which parameters were loaded; the chunks go back into the flat shard (an
    all-to-all). A parameter loaded on some ranks but not others keeps its values on every rank and is
    reported on every rank (see [Note: a sharded load is all or nothing per key])."""
    _take_assigned(handle, opened)
    layout = handle.layout
    loaded = [any(opened.prefix + fqn not in missing for _, _, fqn in info.holders) for info in layout.infos]
    flags = torch.tensor(loaded, dtype=torch.int32, device=handle.device)
    world = dist.get_world_size(handle.process_group)
    everyone = [torch.empty_like(flags) for _ in range(world)]
    dist.all_gather(everyone, flags, group=handle.process_group)
    by_rank = torch.stack(everyone) if layout.infos else flags.new_zeros((world, 0))
    partial = [(by_rank[:, k].min() != by_rank[:, k].max()).item() for k in range(len(layout.infos))]
    chunks = []
    for dparam in opened.dparams:
        assert isinstance(dparam.data, DTensor)
        chunks.append(dparam.data.to_local().reshape(-1).to(handle.dtype))
    flat = _chunks_to_flat(handle, chunks)
    with torch.no_grad():
        current = handle.flat_param.detach()
        for k, info in enumerate(layout.infos):
            if partial[k]:
                start, end = layout.shard_range(info)
                flat[start:end] = current[start:end]
                _report_partial_key(handle, opened, info, by_rank[:, k])
        handle.flat_param.data.copy_(flat.to(handle.flat_param.device))


# [Note: a sharded load is all or nothing per key]
# Each rank loads its own dict, and the ranks exchange pieces: a key missing on one rank would leave
# zeros (or stale values) in the other ranks' parameters while strict loading passes there. So the
# ranks compare which keys they have (`_root_pre_load_hook`, every key) and which parameters they
# loaded (`_write_back_sharded`), and a difference is an error on every rank.
def _report_partial_key(handle: FlatParamHandle, opened: _OpenUnit, info: ParamInfo, flags: torch.Tensor) -> None:
    if opened.error_msgs is None:
        return
    key = opened.prefix + info.fqn
    if any(f"'{key}'" in m for m in opened.error_msgs):
        return  # the key comparison of the whole state dict already reported it
    lacking = [r for r, f in enumerate(flags.tolist()) if not f]
    opened.error_msgs.append(
        f"SHARDED_STATE_DICT: parameter '{key}' of {_unit_name(handle)} was loaded on some ranks but not on "
        f"ranks {lacking} (of its process group); every rank must load the same keys. It keeps its previous "
        "values on every rank"
    )


def _root_post_state_dict_hook(
    state: _FSDPState, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    if _drops_values(state):
        for key in [k for k in state_dict if k.startswith(prefix)]:
            del state_dict[key]
    elif state.state_dict_type is StateDictType.SHARDED_STATE_DICT:
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
    if state.state_dict_type is StateDictType.FULL_STATE_DICT:
        _check_not_rank0_only_load(state)
    if state.state_dict_type in (StateDictType.SHARDED_STATE_DICT, StateDictType.FULL_STATE_DICT):
        _compare_keys_across_ranks(state, state_dict, prefix, error_msgs)
    # Buffers (and parameters of unsharded units) arrive as replicated DTensors: load their local value.
    for key, value in list(state_dict.items()):
        if key.startswith(prefix) and isinstance(value, DTensor) and _is_replicated(value):
            state_dict[key] = value.to_local()


def _compare_keys_across_ranks(
    state: _FSDPState, state_dict: dict[str, Any], prefix: str, error_msgs: list[str]
) -> None:
    """SHARDED and FULL loads are collective: a key some ranks have and others lack is an error on every
    rank. SHARDED: the pieces of a sharded parameter are exchanged, so a partial key is not written
    back (`_write_back_sharded`). FULL: each rank writes its own shard from its own dict, so the key is
    dropped here on every rank, and the ranks' shards (and replicas) stay of one piece."""
    mine = sorted(k for k in state_dict if k.startswith(prefix))
    everyone = _keys_of_every_rank(state, mine)
    full = state.state_dict_type is StateDictType.FULL_STATE_DICT
    for key in sorted(set().union(*everyone.values())):
        lacking = [r for r, keys in sorted(everyone.items()) if key not in keys]
        if not lacking:
            continue
        if full:
            state_dict.pop(key, None)
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
    group = state.process_group
    shard: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shard, (dist.get_rank(), mine), group=group)
    lists = shard
    if state.replicate_group is not None and dist.get_world_size(state.replicate_group) > 1:
        replicas: list[Any] = [None] * dist.get_world_size(state.replicate_group)
        dist.all_gather_object(replicas, shard, group=state.replicate_group)
        lists = [entry for replica in replicas for entry in replica]
    return {rank: set(keys) for rank, keys in lists}


# ---------------------------------------------------------------------------- FULL_STATE_DICT
def _gather_full_flat(handle: FlatParamHandle, shard: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The unit's whole flat parameter (or flat ``shard`` of the same layout, e.g. its gradient) in
    full precision: a new tensor, never the unshard buffer."""
    layout = handle.layout
    shard = handle.flat_param.detach() if shard is None else shard
    if layout.world_size == 1:
        return shard.clone()
    full = torch.empty(layout.padded_numel, dtype=shard.dtype, device=shard.device)
    work = _collectives.all_gather(full, shard, handle.process_group)
    _collectives.wait(work, f"the {_rank_agreement.doing()} all-gather of unit '{handle.unit_fqn or '<root>'}'")
    return full


# ---------------------------------------------------------------------------- flat <-> chunk layout
def _is_replicated_info(info: ParamInfo, layout: FlatLayout) -> bool:
    return layout.world_size == 1 or len(info.shape) == 0


def _chunk_rows(info: ParamInfo, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s rows [first, last) of ``info`` under ``Shard(0)``: the `torch.chunk` rule."""
    rows = info.shape[0]
    per_rank = -(-rows // world)
    first = min(rank * per_rank, rows)
    return first, min(first + per_rank, rows)


def _chunk_range(info: ParamInfo, layout: FlatLayout, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s chunk of ``info`` as a [start, end) range of the unit's unpadded flat tensor."""
    if _is_replicated_info(info, layout):
        return info.offset, info.offset + info.numel
    first, last = _chunk_rows(info, layout.world_size, rank)
    row_numel = info.numel // info.shape[0] if info.shape[0] else 0
    return info.offset + first * row_numel, info.offset + last * row_numel


def _chunk_shape(info: ParamInfo, layout: FlatLayout, rank: int) -> torch.Size:
    if _is_replicated_info(info, layout):
        return info.shape
    first, last = _chunk_rows(info, layout.world_size, rank)
    return torch.Size((last - first, *info.shape[1:]))


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return lo, max(lo, hi)


def _shard_span(layout: FlatLayout, rank: int) -> tuple[int, int]:
    return rank * layout.shard_numel, (rank + 1) * layout.shard_numel


def _all_to_all(
    handle: FlatParamHandle, send: list[torch.Tensor], in_splits: list[int], out_splits: list[int], like: torch.Tensor
) -> torch.Tensor:
    # Not one of the runtime's three collectives: only checkpointing moves data between layouts.
    send_flat = torch.cat(send) if send else like.new_empty(0)
    recv = like.new_empty(sum(out_splits))
    group, numel = handle.process_group, handle.layout.padded_numel
    _rank_agreement.agree_before(group, Op.ALL_TO_ALL, numel, like.dtype, "all-to-all")
    dist.all_to_all_single(recv, send_flat, out_splits, in_splits, group=handle.process_group)
    return recv


def _flat_to_chunks(handle: FlatParamHandle, flat_shard: torch.Tensor) -> list[torch.Tensor]:
    """Each original parameter's ``Shard(0)`` chunk (or whole value, if replicated) on this rank, from a
    flat tensor laid out like the unit's shard. A collective over the unit's process group."""
    layout = handle.layout
    infos, me = layout.infos, layout.rank
    if layout.world_size == 1:
        return [flat_shard[i.offset : i.offset + i.numel].view(i.shape).clone() for i in infos]
    mine = _shard_span(layout, me)
    send: list[torch.Tensor] = []
    in_splits, out_splits = [0] * layout.world_size, [0] * layout.world_size
    for dst in range(layout.world_size):
        for info in infos:
            a, b = _overlap(mine, _chunk_range(info, layout, dst))
            if b > a:
                send.append(flat_shard[a - mine[0] : b - mine[0]])
                in_splits[dst] += b - a
    plan: list[tuple[int, int, int]] = []  # (info index, position in its chunk, length), in arrival order
    targets = [_chunk_range(info, layout, me) for info in infos]
    for src in range(layout.world_size):
        for k, target in enumerate(targets):
            a, b = _overlap(_shard_span(layout, src), target)
            if b > a:
                plan.append((k, a - target[0], b - a))
                out_splits[src] += b - a
    recv = _all_to_all(handle, send, in_splits, out_splits, flat_shard)
    chunks = [flat_shard.new_empty(hi - lo) for lo, hi in targets]
    pos = 0
    for k, at, length in plan:
        chunks[k][at : at + length] = recv[pos : pos + length]
        pos += length
    return [c.view(_chunk_shape(info, layout, me)) for c, info in zip(chunks, infos)]


def _chunks_to_flat(handle: FlatParamHandle, chunks: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of `_flat_to_chunks`: this rank's flat shard (zero padding) from every rank's
    chunks. Replicated parameters are complete on every rank and need no communication."""
    layout = handle.layout
    infos, me = layout.infos, layout.rank
    like = chunks[0] if chunks else handle.flat_param.detach()
    flat = torch.zeros(layout.shard_numel, dtype=like.dtype, device=like.device)
    mine = _shard_span(layout, me)
    sharded = [k for k, info in enumerate(infos) if not _is_replicated_info(info, layout)]
    for k, info in enumerate(infos):
        if _is_replicated_info(info, layout):
            a, b = _overlap(mine, (info.offset, info.offset + info.numel))
            flat[a - mine[0] : b - mine[0]] = chunks[k].reshape(-1)[a - info.offset : b - info.offset]
    if not sharded:
        return flat
    send: list[torch.Tensor] = []
    in_splits, out_splits = [0] * layout.world_size, [0] * layout.world_size
    own = {k: _chunk_range(infos[k], layout, me) for k in sharded}
    for dst in range(layout.world_size):
        for k in sharded:
            a, b = _overlap(own[k], _shard_span(layout, dst))
            if b > a:
                send.append(chunks[k].reshape(-1)[a - own[k][0] : b - own[k][0]])
                in_splits[dst] += b - a
    plan: list[tuple[int, int]] = []
    for src in range(layout.world_size):
        for k in sharded:
            a, b = _overlap(_chunk_range(infos[k], layout, src), mine)
            if b > a:
                plan.append((a - mine[0], b - a))
                out_splits[src] += b - a
    recv = _all_to_all(handle, send, in_splits, out_splits, like)
    pos = 0
    for at, length in plan:
        flat[at : at + length] = recv[pos : pos + length]
        pos += length
    return flat


# The mesh only names the process group's ranks; building one is cheap, but do it once per group.
_MESHES: dict[int, tuple[dist.ProcessGroup, DeviceMesh]] = {}


def _mesh_of(group: dist.ProcessGroup, device: torch.device) -> DeviceMesh:
    key = id(group)
    cached = _MESHES.get(key)
    if cached is None or cached[0] is not group or cached[1].device_type != device.type:
        cached = (group, DeviceMesh.from_group(group, device.type))
        _MESHES[key] = cached
    return cached[1]


def _as_dtensor(chunk: torch.Tensor, info: ParamInfo, layout: FlatLayout, mesh: DeviceMesh) -> DTensor:
    placement = Replicate() if _is_replicated_info(info, layout) else Shard(0)
    return DTensor.from_local(chunk, mesh, [placement], run_check=False, shape=info.shape, stride=_stride(info.shape))


def _sharded_value(handle: FlatParamHandle, info: ParamInfo, chunk: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """``info``'s SHARDED value whose local tensor is ``chunk``: over ``mesh`` (the unit's process
    group), or for a tensor-parallel parameter over the 2-D mesh (see [Note: 2-D state-dict values])."""
    if info.tp is not None:
        replicated = _is_replicated_info(info, handle.layout)
        return _tensor_parallel.as_sharded_value(chunk, handle.process_group, info.tp, replicated)
    return _as_dtensor(chunk, info, handle.layout, mesh)


def _saved_shape(info: ParamInfo) -> torch.Size:
    """The shape of ``info``'s value in a FULL or SHARDED state dict: the global shape."""
    return info.tp.shape if info.tp is not None else info.shape


def _stride(shape: torch.Size) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


def _is_replicated(value: DTensor) -> bool:
    return all(isinstance(p, Replicate) for p in value.placements)


def _local_chunk(
    value: torch.Tensor, info: ParamInfo, layout: FlatLayout, group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """This rank's chunk of ``info`` (flattened) from a full tensor or a DTensor of any placement.
    A tensor-parallel parameter's value has the global shape; ``group`` is then the unit's process group."""
    if info.tp is not None:
        assert group is not None
        replicated = _is_replicated_info(info, layout)
        if isinstance(value, DTensor) and _tensor_parallel.is_sharded_value(value, group, info.tp, replicated):
            return value.to_local().reshape(-1)
        value = _tensor_parallel.tp_local_of(value, info.tp)
    elif isinstance(value, DTensor):
        if (
            not _is_replicated_info(info, layout)
            and tuple(value.placements) == (Shard(0),)
            and value.device_mesh.size() == layout.world_size
        ):
            return value.to_local().reshape(-1)
        value = value.to_local() if _is_replicated(value) else value.full_tensor()
    lo, hi = _chunk_range(info, layout, layout.rank)
    return value.reshape(-1)[lo - info.offset : hi - info.offset]


# ---------------------------------------------------------------------------- SHARDED_STATE_DICT
def _replicate_buffers(state: _FSDPState, state_dict: dict[str, Any], prefix: str) -> None:
    """Every persistent buffer under ``state.module`` (not in ignored modules) as a replicated DTensor."""
    mesh = _mesh_of(state.process_group, state.device)
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
    for info, sharded_view in zip(layout.infos, handle._sharded_views):
        start, end = layout.shard_range(info)
        # a tensor-parallel parameter is, between steps, a DTensor over its 1-D slice: give the same
        value = _tensor_parallel.as_param_grad(info.tp, flat[start:end].view(sharded_view.shape))
        for _, _, fqn in info.holders:
            state_dict[prefix + fqn] = value


def _describe_record(record: Any) -> str:
    if not isinstance(record, dict):
        return f"no layout record ({type(record).__name__})"
    names = ("rank", "world_size", "padded_numel")
    return ", ".join(f"{n}={record.get(n)}" for n in names) + f", {len(record.get('fqns', []))} parameters"


# ---------------------------------------------------------------------------- wrapper prefixes
# module -> the attribute name its prefix hooks hide, so FQN helpers can hide it too.
_HIDDEN_ATTR: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


def _register_prefix_hooks(module: nn.Module, inner: str) -> None:
    """Hide the ``inner`` attribute name of a wrapper module from its state-dict keys.

    Saving strips ``<prefix><inner>.``; loading adds it back, so a wrapped module's state dict loads
    into the plain module and the reverse.
    """
    _HIDDEN_ATTR[module] = inner
    module._register_state_dict_hook(functools.partial(_strip_prefix_hook, inner))
    module._register_load_state_dict_pre_hook(functools.partial(_add_prefix_hook, inner))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _clean_module_fqns(root: nn.Module) -> dict[nn.Module, str]:
    """Every module under ``root`` with its FQN as state-dict keys spell it (no wrapper attributes)."""
    out: dict[nn.Module, str] = {}
    stack = [(root, "")]
    while stack:
        module, fqn = stack.pop()
        if module in out:
            continue
        out[module] = fqn
        hidden = _HIDDEN_ATTR.get(module)
        children = [(c, fqn if n == hidden else _join(fqn, n)) for n, c in module._modules.items() if c is not None]
        stack.extend(reversed(children))
    return out


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
