"""Optimizer state dicts keyed by original parameter FQN: `optim_state_dict`, `optim_state_dict_to_load`
and `init_optim_state`.

[Note: optimizer state of a sharded unit]
The optimizer steps the original parameters, each a 1-D view of its slice of this rank's shard (possibly
empty), so every per-parameter state tensor (Adam's ``exp_avg``, ...) has that slice's shape. For each
unit and state key we write the slices of all its parameters into one tensor laid out like the unit's
flat shard; the unit's layout then moves them like parameters: an all-gather gives full tensors
(FULL_STATE_DICT), the all-to-all of `_state_dict_utils` gives ``Shard(0)`` DTensors
(SHARDED_STATE_DICT). Loading goes back: slice a full value, or run the inverse all-to-all for
DTensors, and hand each parameter its slice. With the wrapper's flat parameters
(``use_orig_params=False``) the optimizer's state already is such a flat tensor. ``step`` and other
scalars are the same on every rank and pass through unchanged. The saved form names parameters by
FQN (in ``state`` and in each param group's ``params``), so it loads at any world size, with either
parameter mode, and into a plain model.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp_composable import _rank_agreement
from fsdp_composable._common_utils import FLAT_MODE, FSDP_FLATTENED, _get_fsdp_states
from fsdp_composable._flat_param import FlatParamHandle
from fsdp_composable._rank_agreement import Op
from fsdp_composable._state_dict_utils import (
    _as_dtensor,
    _chunk_shape,
    _chunks_to_flat,
    _clean_module_fqns,
    _config,
    _drops_values,
    _flat_to_chunks,
    _gather_full_flat,
    _join,
    _local_chunk,
    _mesh_of,
)
from fsdp_composable.api import FullStateDictConfig, StateDictConfig, StateDictType

__all__ = ["init_optim_state", "optim_state_dict", "optim_state_dict_to_load"]

# The one scalar every torch optimizer keeps per parameter. Named, because for a 0-dim parameter a
# 0-dim ``step`` and a 0-dim ``exp_avg`` look alike.
STEP = "step"


@dataclass
class _Unit:
    handle: FlatParamHandle
    fqns: list[str]  # per ParamInfo, as state-dict keys spell it


@dataclass
class _Index:
    """Where each parameter under a module lives, and its FQN."""

    units: list[_Unit] = field(default_factory=list)
    orig: dict[int, tuple[_Unit, int]] = field(default_factory=dict)  # id(original param) -> (unit, info index)
    flat: dict[int, _Unit] = field(default_factory=dict)  # id(flat param) -> unit
    plain: dict[int, str] = field(default_factory=dict)  # id(any other param) -> FQN


def _index(module: nn.Module) -> _Index:
    fqns = _clean_module_fqns(module)
    index = _Index()
    for state in _get_fsdp_states(module):
        for handle in state.handles:
            if handle.module not in fqns:
                continue
            unit = _Unit(handle, [_join(fqns[i.holders[0][0]], i.holders[0][1]) for i in handle.layout.infos])
            index.units.append(unit)
            index.flat[id(handle.flat_param)] = unit
            for k, orig in enumerate(handle.params):
                index.orig[id(orig)] = (unit, k)
    for owner, fqn in fqns.items():
        for name, param in owner._parameters.items():
            pid = id(param)
            if param is not None and pid not in index.orig and pid not in index.flat and pid not in index.plain:
                index.plain[pid] = _join(fqn, name)
    return index


def _param_fqns(index: _Index, param: torch.Tensor, position: int) -> list[str]:
    pid = id(param)
    if pid in index.orig:
        unit, k = index.orig[pid]
        return [unit.fqns[k]]
    if pid in index.flat:
        return list(index.flat[pid].fqns)
    if pid in index.plain:
        return [index.plain[pid]]
    raise ValueError(
        f"optimizer parameter #{position} (shape {tuple(param.shape)}) is not a parameter of this module; "
        "build the optimizer from module.parameters() after fully_shard, and pass the same module here"
    )


def _optimizer_params(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optim.param_groups for p in group["params"]]


def _check_args(where: str, module: Any, optim: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{where} argument 'module' must be an nn.Module, got {type(module).__name__}")
    if not isinstance(optim, torch.optim.Optimizer):
        raise TypeError(f"{where} argument 'optim' must be a torch.optim.Optimizer, got {type(optim).__name__}")


def _mode(where: str, module: nn.Module) -> tuple[bool, StateDictConfig, bool]:
    """(sharded, config, drop) from the `state_dict_type` of the outermost state under ``module``."""
    states = _get_fsdp_states(module)
    if not states:
        return False, FullStateDictConfig(), False
    state = states[0]
    if state.state_dict_type is StateDictType.LOCAL_STATE_DICT:
        raise ValueError(
            f"{where} does not support StateDictType.LOCAL_STATE_DICT; use FULL_STATE_DICT (full tensors) or "
            "SHARDED_STATE_DICT (DTensors for torch.distributed.checkpoint)"
        )
    return state.state_dict_type is StateDictType.SHARDED_STATE_DICT, _config(state), _drops_values(state)


def _units_in(index: _Index, params: list[torch.Tensor]) -> list[_Unit]:
    """Units with at least one parameter in the optimizer (the same on every rank)."""
    ids = {id(p) for p in params}
    return [u for u in index.units if id(u.handle.flat_param) in ids or any(id(p) in ids for p in u.handle.params)]


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _copy(value: Any, config: StateDictConfig) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().cpu() if config.offload_to_cpu and value.device.type != "cpu" else value.detach().clone()


# ---------------------------------------------------------------------------- saving
@dataclass
class _UnitState:
    """One unit's optimizer state, per-parameter tensors as flat shards keyed by (state key, dtype)."""

    has_state: list[bool]
    flats: dict[tuple[str, torch.dtype], torch.Tensor]
    scalars: list[dict[str, Any]]

    def signature(self) -> Any:
        return (
            tuple(self.has_state),
            sorted((key, str(dtype)) for key, dtype in self.flats),
            [sorted(s) for s in self.scalars],
        )


def _bad_state_shape(key: str, fqn: str, shape: torch.Size, expected: torch.Size) -> ValueError:
    return ValueError(
        f"optimizer state {key!r} of parameter '{fqn}' has shape {tuple(shape)}, which is neither the "
        f"parameter's local shape {tuple(expected)} nor a scalar; optim_state_dict cannot convert it"
    )


def _collect(unit: _Unit, optim: torch.optim.Optimizer) -> _UnitState:
    handle, layout = unit.handle, unit.handle.layout
    n = len(layout.infos)
    out = _UnitState([False] * n, {}, [{} for _ in range(n)])
    sharded = layout.world_size > 1
    flat_state = optim.state.get(handle.flat_param)
    if flat_state:  # the wrapper's flat-parameter mode
        out.has_state = [True] * n
        for key, value in flat_state.items():
            if key != STEP and isinstance(value, torch.Tensor) and value.shape == handle.flat_param.shape:
                out.flats[(key, value.dtype)] = value.detach()
            elif sharded and isinstance(value, torch.Tensor) and value.dim() > 0:
                raise _bad_state_shape(
                    key, f"{handle.unit_fqn or '<root>'}._flat_param", value.shape, handle.flat_param.shape
                )
            else:
                for scalars in out.scalars:
                    scalars[key] = value
        return out
    for k, (info, param, view) in enumerate(zip(layout.infos, handle.params, handle._sharded_views)):
        state = optim.state.get(param)
        if not state:
            continue
        out.has_state[k] = True
        start, end = layout.shard_range(info)
        for key, value in state.items():
            if key != STEP and isinstance(value, torch.Tensor) and value.shape == view.shape:
                flat = out.flats.get((key, value.dtype))
                if flat is None:
                    flat = torch.zeros(layout.shard_numel, dtype=value.dtype, device=value.device)
                    out.flats[(key, value.dtype)] = flat
                flat[start:end] = value.detach().reshape(-1)
            elif sharded and isinstance(value, torch.Tensor) and value.dim() > 0:
                raise _bad_state_shape(key, unit.fqns[k], value.shape, view.shape)
            else:
                out.scalars[k][key] = value
    return out


def _check_same_on_all_ranks(units: list[_Unit], collected: list[_UnitState]) -> None:
    """The per-unit collectives below need every rank to hold the same keys: check once per group."""
    by_group: dict[int, list[tuple[int, Any]]] = {}
    groups: dict[int, dist.ProcessGroup] = {}
    for i, (unit, c) in enumerate(zip(units, collected)):
        if unit.handle.layout.world_size > 1:
            by_group.setdefault(id(unit.handle.process_group), []).append((i, c.signature()))
            groups[id(unit.handle.process_group)] = unit.handle.process_group
    for gid, mine in by_group.items():
        everyone: list[Any] = [None] * dist.get_world_size(groups[gid])
        _rank_agreement.agree_before(groups[gid], Op.ALL_GATHER_OBJECT, len(mine), None, "optimizer state check")
        dist.all_gather_object(everyone, mine, group=groups[gid])
        for (i, sig), *others in zip(mine, *everyone):
            if any(o[1] != sig for o in others):
                raise RuntimeError(
                    f"optimizer state of unit '{units[i].handle.unit_fqn or '<root>'}' differs across ranks "
                    f"(which parameters have state, or their keys and dtypes): {[o[1] for o in others]}. Every "
                    "rank must build the same optimizer and step the same parameters"
                )


def _export(unit: _Unit, c: _UnitState, sharded: bool, config: StateDictConfig) -> dict[str, dict[str, Any]]:
    handle, layout = unit.handle, unit.handle.layout
    out = {
        fqn: {key: _copy(v, config) for key, v in scalars.items()}
        for fqn, has, scalars in zip(unit.fqns, c.has_state, c.scalars)
        if has
    }
    mesh = _mesh_of(handle.process_group, handle.device) if sharded else None
    for key, dtype in sorted(c.flats, key=lambda kd: (kd[0], str(kd[1]))):
        flat = c.flats[(key, dtype)]
        if mesh is not None:
            for info, fqn, has, chunk in zip(layout.infos, unit.fqns, c.has_state, _flat_to_chunks(handle, flat)):
                if has:
                    out[fqn][key] = _as_dtensor(chunk.cpu() if config.offload_to_cpu else chunk, info, layout, mesh)
            continue
        full = _gather_full_flat(handle, flat) if layout.world_size > 1 else flat
        for info, fqn, has in zip(layout.infos, unit.fqns, c.has_state):
            if has:
                out[fqn][key] = _copy(full[info.offset : info.offset + info.numel].view(info.shape), config)
    return out


@_rank_agreement.entry_point("optim_state_dict()")
def optim_state_dict(module: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """``optim``'s state keyed by original parameter FQN: ``{"state": {fqn: {key: value}},
    "param_groups": [{..., "params": [fqn, ...]}]}``.

    Follows `state_dict_type` on ``module``: under FULL_STATE_DICT (the default) per-parameter tensors
    have the parameter's full shape (``offload_to_cpu``/``rank0_only`` apply; with ``rank0_only`` other
    ranks get ``{}``); under SHARDED_STATE_DICT they are ``DTensor``s of the full shape for
    ``torch.distributed.checkpoint``. Scalars such as ``step`` are kept as they are. A collective: call
    it on every rank. Build the optimizer from ``module.parameters()`` after `fully_shard`.
    """
    _check_args("optim_state_dict", module, optim)
    sharded, config, drop = _mode("optim_state_dict", module)
    index = _index(module)
    params = _optimizer_params(optim)
    names = {id(p): _param_fqns(index, p, i) for i, p in enumerate(params)}
    units = _units_in(index, params)
    collected = [_collect(u, optim) for u in units]
    _check_same_on_all_ranks(units, collected)
    state: dict[str, dict[str, Any]] = {}
    for unit, c in zip(units, collected):
        state.update(_export(unit, c, sharded, config))
    for p in params:
        if id(p) in index.plain and optim.state.get(p):
            state[index.plain[id(p)]] = {k: _copy(v, config) for k, v in optim.state[p].items()}
    if drop:
        return {}
    groups = []
    for group, saved in zip(optim.param_groups, optim.state_dict()["param_groups"]):
        entry = {k: v for k, v in saved.items() if k != "params"}
        entry["params"] = [fqn for p in group["params"] for fqn in names[id(p)]]
        groups.append(entry)
    ordered = {fqn: state[fqn] for g in groups for fqn in g["params"] if fqn in state}
    return {"state": ordered, "param_groups": groups}


# ---------------------------------------------------------------------------- loading
def _check_osd(osd: Any) -> tuple[Mapping[str, Any], list[Any]]:
    if not isinstance(osd, Mapping) or not isinstance(osd.get("state"), Mapping):
        raise TypeError(
            "optim_state_dict_to_load argument 'optim_state_dict' must be a dict with 'state' and "
            f"'param_groups', as optim_state_dict returns; got {type(osd).__name__}"
        )
    groups = osd.get("param_groups")
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, Mapping) and "params" in g for g in groups):
        raise TypeError("optim_state_dict_to_load: 'param_groups' must be a list of dicts, each with 'params'")
    return osd["state"], list(groups)


def _check_groups(saved: list[Any], current: list[list[str]]) -> None:
    if len(saved) != len(current):
        raise ValueError(
            f"the checkpoint has {len(saved)} param groups but the optimizer has {len(current)}; build the "
            "optimizer with the same param groups as the one that was saved"
        )
    for i, (group, fqns) in enumerate(zip(saved, current)):
        missing, extra = sorted(set(fqns) - set(group["params"])), sorted(set(group["params"]) - set(fqns))
        if missing or extra:
            raise ValueError(
                f"param group {i} differs from the checkpoint's: parameters only in the optimizer: "
                f"{_some(missing)}, only in the checkpoint: {_some(extra)}. Build the optimizer with the same "
                "param groups"
            )


def _some(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{f', ... ({len(names) - limit} more)' if len(names) > limit else ''}]"


def _full_value(value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, DTensor):
        return value.full_tensor()  # a collective over the DTensor's mesh
    return value


def _split_saved(unit: _Unit, saved_state: Mapping[str, Any]) -> tuple[list[Any], dict[tuple[str, torch.dtype], list]]:
    """Each parameter's saved scalars, and its per-parameter tensors grouped by (state key, dtype)."""
    scalars: list[Any] = []
    groups: dict[tuple[str, torch.dtype], list[tuple[int, torch.Tensor]]] = {}
    for k, (info, fqn) in enumerate(zip(unit.handle.layout.infos, unit.fqns)):
        state = saved_state.get(fqn)
        if not isinstance(state, Mapping):
            scalars.append(None)
            continue
        scalars.append({})
        for key, value in state.items():
            if key != STEP and isinstance(value, torch.Tensor) and value.shape == info.shape:
                groups.setdefault((key, value.dtype), []).append((k, value))
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                raise ValueError(
                    f"optimizer state {key!r} of parameter '{fqn}' in the checkpoint has shape "
                    f"{tuple(value.shape)}, the parameter has shape {tuple(info.shape)}"
                )
            else:
                scalars[k][key] = value
    return scalars, groups


def _to_flat_shard(unit: _Unit, dtype: torch.dtype, members: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """This rank's flat shard of one state key, from full tensors or DTensors of each parameter."""
    handle, layout = unit.handle, unit.handle.layout
    if layout.world_size > 1 and any(isinstance(v, DTensor) for _, v in members):
        chunks = [
            torch.zeros(_chunk_shape(info, layout, layout.rank).numel(), dtype=dtype, device=handle.device)
            for info in layout.infos
        ]
        for k, value in members:
            chunks[k] = _local_chunk(value, layout.infos[k], layout).to(dtype=dtype, device=handle.device)
        return _chunks_to_flat(handle, chunks)
    flat = torch.zeros(layout.shard_numel, dtype=dtype, device=handle.device)
    lo = layout.rank * layout.shard_numel
    for k, value in members:
        info = layout.infos[k]
        start, end = layout.shard_range(info)
        begin = lo + start - info.offset
        flat[start:end] = _full_value(value).reshape(-1)[begin : begin + end - start]
    return flat


def _import(unit: _Unit, saved_state: Mapping[str, Any], ids: dict[int, int], out: dict[int, dict[str, Any]]) -> None:
    handle, layout = unit.handle, unit.handle.layout
    scalars, groups = _split_saved(unit, saved_state)
    flat_id = ids.get(id(handle.flat_param))
    if flat_id is not None and any(s is not None for s in scalars):
        out[flat_id] = {key: _clone(v) for s in reversed(scalars) if s for key, v in s.items()}
    for k, s in enumerate(scalars):
        pid = ids.get(id(handle.params[k]))
        if pid is not None and s is not None:
            out[pid] = {key: _clone(v) for key, v in s.items()}
    for (key, dtype), members in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        flat = _to_flat_shard(unit, dtype, members)
        if flat_id is not None:
            out[flat_id][key] = flat
            continue
        for k, _ in members:
            pid = ids.get(id(handle.params[k]))
            if pid is not None:
                start, end = layout.shard_range(layout.infos[k])
                out[pid][key] = flat[start:end].view(handle._sharded_views[k].shape).clone()


@_rank_agreement.entry_point("optim_state_dict_to_load()")
def optim_state_dict_to_load(
    module: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: Mapping[str, Any]
) -> dict[str, Any]:
    """Convert the FQN-keyed ``optim_state_dict`` (from `optim_state_dict` at any world size, FULL or
    SHARDED after ``torch.distributed.checkpoint.load``) into what ``optim.load_state_dict`` accepts
    for this rank. Every rank passes the whole dict (FULL) or its loaded DTensors (SHARDED); a
    collective when it holds DTensors. The param groups must hold the same parameters as ``optim``'s.
    """
    _check_args("optim_state_dict_to_load", module, optim)
    saved_state, saved_groups = _check_osd(optim_state_dict)
    index = _index(module)
    params = _optimizer_params(optim)
    current = [[fqn for p in g["params"] for fqn in _param_fqns(index, p, i)] for i, g in enumerate(optim.param_groups)]
    known = {fqn for fqns in current for fqn in fqns}
    unknown = sorted(set(saved_state) - known)
    if unknown:
        raise ValueError(
            f"the optimizer state dict has state for {unknown}, which the optimizer does not hold (unknown "
            "FQNs, or parameters left out of it); load a checkpoint of the same model and param groups"
        )
    _check_groups(saved_groups, current)
    ids = {id(p): i for i, p in enumerate(params)}
    out: dict[int, dict[str, Any]] = {}
    _rank_agreement.check_in(u.handle.process_group for u in _units_in(index, params))
    for unit in _units_in(index, params):
        _import(unit, saved_state, ids, out)
    for p in params:
        fqn = index.plain.get(id(p))
        state = saved_state.get(fqn) if fqn is not None else None
        if isinstance(state, Mapping):
            out[ids[id(p)]] = {k: _full_value(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    groups, position = [], 0
    for group, saved in zip(optim.param_groups, saved_groups):
        entry = {k: v for k, v in saved.items() if k != "params"}
        entry["params"] = list(range(position, position + len(group["params"])))
        position += len(group["params"])
        groups.append(entry)
    return {"state": out, "param_groups": groups}


# ---------------------------------------------------------------------------- templates
def init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Give every trainable parameter of ``optim`` its (zero) state without changing any parameter.

    Loading a sharded checkpoint needs a template of the right DTensors, and a fresh optimizer has no
    state yet: call this, then ``optim_state_dict`` under SHARDED_STATE_DICT gives the template for
    ``torch.distributed.checkpoint.load``. It runs one ``step()`` with zero gradients and learning rate
    0, so the counters it creates (``step``) are meaningless until the load replaces them. Does nothing
    if the optimizer already has state.
    """
    if not isinstance(optim, torch.optim.Optimizer):
        raise TypeError(
            f"init_optim_state argument 'optim' must be a torch.optim.Optimizer, got {type(optim).__name__}"
        )
    if optim.state:
        return
    created = []
    for p in _optimizer_params(optim):
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
            created.append(p)
    lrs = [group.get("lr") for group in optim.param_groups]
    for group in optim.param_groups:
        if "lr" in group:
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        optim.step()
    finally:
        for group, lr in zip(optim.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        for p in created:
            p.grad = None


# ---------------------------------------------------------------------------- stale optimizers
# [Note: optimizers built before fully_shard]
# fully_shard keeps the original parameter objects, so an optimizer built before it still steps the
# right tensors. Two cases go wrong silently or cryptically, and a global step pre-hook checks for
# them on each optimizer's first step after any fully_shard call (then not again until the next call,
# so steps cost nothing):
# - optimizer state created before sharding (a step was taken first): its tensors have the full
#   shape while the parameter is now a 1-D shard slice;
# - the wrapper with use_orig_params=False: the optimizer must hold the flat parameters; original
#   parameters never receive gradients there.
_checked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()
_generation = 0  # bumped by every fully_shard call
_hook_registered = False


def _register_stale_optimizer_check() -> None:
    global _hook_registered, _generation
    _generation += 1
    if not _hook_registered:
        register_optimizer_step_pre_hook(_check_optimizer_on_first_step)
        _hook_registered = True


def _check_optimizer_on_first_step(optim: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _checked.get(optim) == _generation:
        return
    _checked[optim] = _generation
    for group in optim.param_groups:
        for param in group["params"]:
            if not getattr(param, FSDP_FLATTENED, False):
                continue
            fqn = getattr(param, "_fsdp_fqn", "?")
            if getattr(param, FLAT_MODE, False):
                raise RuntimeError(
                    f"the optimizer holds original parameter '{fqn}', but FullyShardedDataParallel("
                    "use_orig_params=False) trains flat parameters: build the optimizer after wrapping, from "
                    "model.parameters() (or pass use_orig_params=True)"
                )
            for key, value in optim.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                    raise RuntimeError(
                        f"optimizer state {key!r} of parameter '{fqn}' has shape {tuple(value.shape)} but the "
                        f"parameter is now a shard of shape {tuple(param.shape)}: the optimizer stepped before "
                        "fully_shard. Build the optimizer after fully_shard, or move its state with "
                        "optim_state_dict / optim_state_dict_to_load"
                    )
