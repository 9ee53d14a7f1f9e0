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
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp_composable import _rank_agreement, _tensor_parallel
from fsdp_composable._common_utils import API_NAME, FLAT_MODE, FSDP_FLATTENED, _get_fsdp_states
from fsdp_composable._composable_state import _module_to_states
from fsdp_composable._flat_param import FlatParameter, FlatParamHandle
from fsdp_composable._rank_agreement import Op
from fsdp_composable._state_dict_utils import (
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
    _saved_shape,
    _sharded_value,
)
from fsdp_composable.api import FullStateDictConfig, ShardedStateDictConfig, StateDictConfig, StateDictType

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
    # A tied parameter is named as named_parameters() names it: its first FQN in traversal order
    # (torch's get_optimizer_state_dict uses that name too), whichever holder the unit met first.
    first: dict[int, str] = {}
    for owner, owner_fqn in fqns.items():
        for name, param in owner._parameters.items():
            if param is not None:
                first.setdefault(id(param), _join(owner_fqn, name))
    index = _Index()
    for state in _get_fsdp_states(module):
        for handle in state.handles:
            if handle.module not in fqns:
                continue
            names = [
                first.get(id(p), _join(fqns[i.holders[0][0]], i.holders[0][1]))
                for p, i in zip(handle.params, handle.layout.infos)
            ]
            unit = _Unit(handle, names)
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
            if info.tp is not None and isinstance(value, DTensor):
                value = value.to_local()  # the optimizer's DTensor over the 1-D slice, like the parameter
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


@dataclass(frozen=True)
class _Record:
    """What one rank knows about one unit's optimizer state, exchanged so all ranks agree."""

    unit: tuple[str, int]  # unit FQN and unpadded numel: the same unit on every rank
    has_state: tuple[bool, ...]
    empty: tuple[bool, ...]  # the parameter's slice on this rank is empty
    keys: tuple[tuple[str, str], ...]  # (state key, dtype) of per-parameter tensors
    scalars: tuple[Any, ...]  # per parameter: its scalar state (``step``), or None


def _record(unit: _Unit, c: _UnitState) -> _Record:
    handle = unit.handle
    ranges = [handle.layout.shard_range(info) for info in handle.layout.infos]
    empty = tuple(start == end for start, end in ranges)
    return _Record(
        (handle.unit_fqn, handle.layout.unpadded_numel),
        tuple(c.has_state),
        empty,
        tuple(sorted((key, str(dtype)) for key, dtype in c.flats)),
        tuple(dict(s) if has else None for has, s in zip(c.has_state, c.scalars)),
    )


def _check_same_on_all_ranks(units: list[_Unit], collected: list[_UnitState]) -> None:
    """The per-unit collectives that follow need every rank to hold the same state keys. Exchange
    what each rank has (once per process group, groups in a rank-independent order) and agree.

    A parameter whose slice is empty on some rank may have no state there (its gradient there is
    None, so the optimizer never created any): that rank takes the keys and scalars (``step``) from
    a rank that has them, with zero-length tensors. Any other difference raises on every rank."""
    by_group: dict[tuple[int, ...], list[int]] = {}
    groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for i, unit in enumerate(units):
        if unit.handle.layout.world_size > 1:
            ranks = tuple(dist.get_process_group_ranks(unit.handle.process_group))
            by_group.setdefault(ranks, []).append(i)
            groups[ranks] = unit.handle.process_group
    for ranks in sorted(by_group):
        mine = [_record(units[i], collected[i]) for i in by_group[ranks]]
        everyone: list[Any] = [None] * len(ranks)
        _rank_agreement.agree_before(groups[ranks], Op.ALL_GATHER_OBJECT, len(mine), None, "optimizer state check")
        dist.all_gather_object(everyone, mine, group=groups[ranks])
        if any(len(theirs) != len(mine) for theirs in everyone):
            raise RuntimeError(
                "the optimizer holds parameters of different units on different ranks "
                f"({[len(theirs) for theirs in everyone]} units): every rank must build the same optimizer "
                "from the same sharded model"
            )
        for j, i in enumerate(by_group[ranks]):
            _agree(units[i], collected[i], [theirs[j] for theirs in everyone])


def _agree(unit: _Unit, c: _UnitState, records: list[_Record]) -> None:
    def differs(why: str) -> RuntimeError:
        return RuntimeError(
            f"optimizer state of unit '{unit.handle.unit_fqn or '<root>'}' differs across ranks ({why}): "
            f"{[(r.has_state, r.keys) for r in records]}. Every rank must build the same optimizer and step "
            "the same parameters"
        )

    if len({r.unit for r in records}) > 1:
        raise differs(f"the ranks list different units: {sorted({r.unit for r in records})}")
    # the keys of ranks that hold state for a parameter with a non-empty slice must all agree
    full = {r.keys for r in records if any(h and not e for h, e in zip(r.has_state, r.empty))}
    if len(full) > 1:
        raise differs("their keys and dtypes")
    keys = next(iter(full), tuple(sorted({k for r in records for k in r.keys})))
    for k in range(len(unit.handle.layout.infos)):
        holders = [r for r in records if r.has_state[k]]
        if not holders or c.has_state[k]:
            continue
        if any(not r.has_state[k] and not r.empty[k] for r in records):
            raise differs(f"which parameters have state: '{unit.fqns[k]}'")
        c.has_state[k] = True
        c.scalars[k] = {key: _clone(v) for key, v in (holders[0].scalars[k] or {}).items()}
    layout, handle = unit.handle.layout, unit.handle
    for key, dtype_name in keys:
        dtype = getattr(torch, dtype_name.replace("torch.", ""))
        if (key, dtype) not in c.flats:
            c.flats[(key, dtype)] = torch.zeros(layout.shard_numel, dtype=dtype, device=handle.device)


def _export_entries(
    unit: _Unit, c: _UnitState, sharded: bool, config: StateDictConfig
) -> list[Optional[dict[str, Any]]]:
    """Each original parameter's state (None where it has none): full tensors, or with ``sharded``
    ``DTensor``s of the parameter's shape laid out like the SHARDED model state dict. A collective."""
    handle, layout = unit.handle, unit.handle.layout
    out: list[Optional[dict[str, Any]]] = [
        {key: _copy(v, config) for key, v in scalars.items()} if has else None
        for has, scalars in zip(c.has_state, c.scalars)
    ]
    mesh = _mesh_of(handle.process_group, handle.device) if sharded else None
    for key, dtype in sorted(c.flats, key=lambda kd: (kd[0], str(kd[1]))):
        flat = c.flats[(key, dtype)]
        if mesh is not None:
            for info, entry, chunk in zip(layout.infos, out, _flat_to_chunks(handle, flat)):
                if entry is not None:
                    entry[key] = _sharded_value(handle, info, chunk.cpu() if config.offload_to_cpu else chunk, mesh)
            continue
        full = _gather_full_flat(handle, flat) if layout.world_size > 1 else flat
        for info, entry in zip(layout.infos, out):
            if entry is not None:
                value = _copy(full[info.offset : info.offset + info.numel].view(info.shape), config)
                entry[key] = value if info.tp is None else _full_tp_value(info.tp, value, config)
    return out


def _full_tp_value(spec: _tensor_parallel.TPSpec, local: torch.Tensor, config: StateDictConfig) -> torch.Tensor:
    """FULL: a tensor-parallel parameter's state as the model's FULL state dict gives the parameter (a
    DTensor full over dp; with ``rank0_only`` the plain global tensor, gathered on every rank)."""
    value = _tensor_parallel.as_param_grad(spec, local)
    assert isinstance(value, DTensor)
    if isinstance(config, FullStateDictConfig) and config.rank0_only:
        return value.full_tensor()
    return value


def _export(unit: _Unit, c: _UnitState, sharded: bool, config: StateDictConfig) -> dict[str, dict[str, Any]]:
    entries = _export_entries(unit, c, sharded, config)
    return {fqn: entry for fqn, entry in zip(unit.fqns, entries) if entry is not None}


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
    _install_optimizer_hooks(optim)
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
    for group in optim.param_groups:
        # not optim.state_dict(): its hook (see [Note: torch's optimizer state dict]) is a collective
        entry = {k: v for k, v in group.items() if k != "params"}
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
            if info.tp is not None and isinstance(value, DTensor) and not _in_global_form(unit.handle.params[k], value):
                scalars[k][key] = value  # already this rank's slice, as the optimizer keeps it
            elif key != STEP and isinstance(value, torch.Tensor) and value.shape == _saved_shape(info):
                groups.setdefault((key, value.dtype), []).append((k, value))
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                raise ValueError(
                    f"optimizer state {key!r} of parameter '{fqn}' in the checkpoint has shape "
                    f"{tuple(value.shape)}, the parameter has shape {tuple(_saved_shape(info))}"
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
            chunk = _local_chunk(value, layout.infos[k], layout, handle.process_group)
            chunks[k] = chunk.to(dtype=dtype, device=handle.device)
        return _chunks_to_flat(handle, chunks)
    flat = torch.zeros(layout.shard_numel, dtype=dtype, device=handle.device)
    lo = layout.rank * layout.shard_numel
    for k, value in members:
        info = layout.infos[k]
        start, end = layout.shard_range(info)
        begin = lo + start - info.offset
        whole = _full_value(value) if info.tp is None else _tensor_parallel.tp_local_of(value, info.tp)
        flat[start:end] = whole.reshape(-1)[begin : begin + end - start]
    return flat


def _local_state(unit: _Unit, saved: list[Optional[Mapping[str, Any]]]) -> list[Optional[dict[str, Any]]]:
    """Each original parameter's state on this rank (its slice of every per-parameter tensor) from
    its saved state in global form (full tensors or DTensors of the parameter's shape; None: no
    state). A collective when the values are DTensors."""
    handle, layout = unit.handle, unit.handle.layout
    by_fqn = {fqn: value for fqn, value in zip(unit.fqns, saved) if value is not None}
    scalars, groups = _split_saved(unit, by_fqn)
    out: list[Optional[dict[str, Any]]] = [
        {key: _clone(v) for key, v in s.items()} if s is not None else None for s in scalars
    ]
    for (key, dtype), members in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        flat = _to_flat_shard(unit, dtype, members)
        for k, _ in members:
            start, end = layout.shard_range(layout.infos[k])
            entry = out[k]
            assert entry is not None
            local = flat[start:end].view(handle._sharded_views[k].shape).clone()
            # a tensor-parallel parameter's state is a DTensor over its 1-D slice, as the optimizer makes it
            entry[key] = _tensor_parallel.as_param_grad(layout.infos[k].tp, local)
    return out


def _flat_state(unit: _Unit, saved: list[Optional[Mapping[str, Any]]]) -> dict[str, Any]:
    """The state of the unit's flat parameter (the wrapper's ``use_orig_params=False``), in global form:
    per-parameter tensors become this rank's flat shard, presented as a ``Shard(0)`` DTensor of the
    padded flat shape (see [Note: torch's optimizer state dict])."""
    handle = unit.handle
    by_fqn = {fqn: value for fqn, value in zip(unit.fqns, saved) if value is not None}
    scalars, groups = _split_saved(unit, by_fqn)
    out = {key: _clone(v) for s in reversed(scalars) if s for key, v in s.items()}
    for (key, dtype), members in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        out[key] = _flat_global(handle, _to_flat_shard(unit, dtype, members))
    return out


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
    _install_optimizer_hooks(optim)
    ids = {id(p): i for i, p in enumerate(params)}
    out: dict[int, Any] = {}
    _rank_agreement.check_in(u.handle.process_group for u in _units_in(index, params))
    # Original parameters keep the global form: optim.load_state_dict's hook takes their slices.
    for p in params:
        fqns = [index.orig[id(p)][0].fqns[index.orig[id(p)][1]]] if id(p) in index.orig else []
        state = saved_state.get(fqns[0]) if fqns else None
        if isinstance(state, Mapping):
            out[ids[id(p)]] = dict(state)
    for unit in _units_in(index, params):
        if id(unit.handle.flat_param) in ids:
            saved = [saved_state.get(fqn) for fqn in unit.fqns]
            if any(isinstance(v, Mapping) for v in saved):
                out[ids[id(unit.handle.flat_param)]] = _flat_state(unit, saved)
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
    _install_optimizer_hooks(optim)
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
    """Called by every fully_shard call (and the wrapper): the global hooks into torch's optimizers,
    and the routing of torch's clip_grad_norm_ (see [Note: torch's clip_grad_norm_])."""
    from fsdp_composable._torch_clip_grad import _install  # it imports this module

    _install()
    global _hook_registered, _generation
    _generation += 1
    if not _hook_registered:
        register_optimizer_step_pre_hook(_check_optimizer_on_first_step)
        _hook_registered = True


def _check_optimizer_on_first_step(optim: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _checked.get(optim) == _generation:
        return
    _checked[optim] = _generation
    if _holds_sharded_params(optim):
        _install_optimizer_hooks(optim)
        _take_back_state_loaded_early(optim)
        for handle in _handles_holding(_optimizer_params(optim)):
            if handle.is_unsharded:  # its first step would create state of the full shapes
                del _checked[optim]
                raise RuntimeError(
                    f"optimizer.step() was called while the parameters of unit '{handle.unit_fqn or '<root>'}' are "
                    "unsharded (between a forward and its backward, or inside unshard_params), so it would create "
                    "optimizer state of the full shapes. Step after backward; to get a state-dict template from a "
                    "fresh optimizer (init_optim_state, torch's get_state_dict), call it before the forward"
                )
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


# ---------------------------------------------------------------------------- optim.state_dict() hooks
# [Note: torch's optimizer state dict]
# Between steps the optimizer holds, per original parameter, its slice of this rank's flat shard, so a
# plain ``optim.state_dict()`` would be per-rank pieces under the global parameter numbering, which
# `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` then names by FQN: DCP would keep
# one rank's piece. Instead every optimizer that holds our parameters gets two hooks:
# - a state-dict post-hook presents each original parameter's per-parameter tensors in the layout of
#   the SHARDED model state dict: ``DTensor``s of the parameter's shape (a collective per unit, like
#   ``model.state_dict()``). The wrapper's flat parameters (``use_orig_params=False``) are presented as
#   ``Shard(0)`` DTensors of the padded flat shape (no communication; they load at the same world size
#   and wrapping only: use `optim_state_dict` to move between them);
# - a load-state-dict pre-hook takes that global form back (DTensors of any placement and mesh size,
#   or full tensors), keyed by int ids or by FQN (as torch's set_optimizer_state_dict passes it): it
#   matches saved to current parameters by position in the param groups, as ``load_state_dict`` does.
# Units are visited in the order they were built, never in the optimizer's order, so ranks that list
# parameters in different orders still run the same collectives. Hooks are installed when an optimizer
# first steps after `fully_shard` (torch's get/set_optimizer_state_dict step a fresh optimizer first),
# and by `init_optim_state`, `optim_state_dict` and `optim_state_dict_to_load`.
_hooked: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def _flat_global(handle: FlatParamHandle, shard: torch.Tensor) -> torch.Tensor:
    layout = handle.layout
    if layout.world_size == 1:
        return shard
    mesh = _mesh_of(handle.process_group, handle.device)
    shape = torch.Size((layout.padded_numel,))
    return DTensor.from_local(shard, mesh, [Shard(0)], run_check=False, shape=shape, stride=(1,))


def _flat_local(unit: _Unit, key: str, value: Any) -> Any:
    """This rank's flat shard from the global form `_flat_global` gives (or a full flat tensor)."""
    layout = unit.handle.layout
    if not isinstance(value, torch.Tensor) or key == STEP or value.dim() == 0:
        return _clone(value)
    if isinstance(value, DTensor):
        if tuple(value.placements) == (Shard(0),) and value.device_mesh.size() == layout.world_size:
            local = value.to_local()
            if local.shape == (layout.shard_numel,):
                return local.clone()
        value = value.full_tensor()
    if value.shape != (layout.padded_numel,):
        raise ValueError(
            f"optimizer state {key!r} of the flat parameter of unit '{unit.handle.unit_fqn or '<root>'}' has shape "
            f"{tuple(value.shape)}; this rank's optimizer expects the padded flat shape ({layout.padded_numel},) "
            "of the same wrapping and world size. To move optimizer state between wrappings or world sizes, "
            "save with optim_state_dict(model, optim) and load with optim_state_dict_to_load"
        )
    lo = layout.rank * layout.shard_numel
    return value[lo : lo + layout.shard_numel].clone()


def _handles_holding(params: list[torch.Tensor]) -> list[FlatParamHandle]:
    """The handles with a parameter in ``params``, in the order `fully_shard` built them (the same on
    every rank), whichever order ``params`` lists them in."""
    ids = {id(p) for p in params}
    out: list[FlatParamHandle] = []
    seen: set[int] = set()
    for apis in list(_module_to_states.values()):
        state = apis.get(API_NAME)
        if state is None:
            continue
        for handle in state.handles:
            if id(handle) in seen:
                continue
            seen.add(id(handle))
            if id(handle.flat_param) in ids or any(id(p) in ids for p in handle.params):
                out.append(handle)
    return out


def _unit_of(handle: FlatParamHandle) -> _Unit:
    return _Unit(handle, [getattr(p, "_fsdp_fqn", info.fqn) for p, info in zip(handle.params, handle.layout.infos)])


def _numbering(optim: torch.optim.Optimizer) -> dict[int, int]:
    """id(param) -> the number ``optim.state_dict()`` gives it."""
    out: dict[int, int] = {}
    start = 0
    for group in optim.param_groups:
        for i, p in enumerate(group["params"], start):
            out.setdefault(id(p), i)
        start += len(group["params"])
    return out


def _present_state_hook(optim: torch.optim.Optimizer, state_dict: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Optimizer state-dict post-hook: see [Note: torch's optimizer state dict]."""
    handles = _handles_holding(_optimizer_params(optim))
    if not handles:
        return None
    numbers = _numbering(optim)
    units = [_unit_of(h) for h in handles]
    collected = [_collect(u, optim) for u in units]
    _check_same_on_all_ranks(units, collected)
    state = dict(state_dict["state"])
    config = ShardedStateDictConfig()
    for unit, c in zip(units, collected):
        handle = unit.handle
        if id(handle.flat_param) in numbers:
            number = numbers[id(handle.flat_param)]
            if isinstance(state.get(number), Mapping):
                state[number] = {
                    key: _flat_global(handle, v.detach())
                    if isinstance(v, torch.Tensor) and key != STEP and v.shape == handle.flat_param.shape
                    else v
                    for key, v in state[number].items()
                }
            continue
        for param, entry in zip(handle.params, _export_entries(unit, c, True, config)):
            if entry is not None and id(param) in numbers:
                state[numbers[id(param)]] = entry
    # The same order on every rank: a parameter with no state here (its slice is empty, so it got no
    # gradient) was added above, and torch's API gathers DTensor values in this dict's order.
    return {**state_dict, "state": dict(sorted(state.items(), key=lambda kv: (str(type(kv[0])), kv[0])))}


def _take_back_state_hook(optim: torch.optim.Optimizer, state_dict: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Optimizer load-state-dict pre-hook: see [Note: torch's optimizer state dict]."""
    saved_groups, saved_state = state_dict.get("param_groups"), state_dict.get("state")
    if not isinstance(saved_groups, (list, tuple)) or not isinstance(saved_state, Mapping):
        return None  # load_state_dict raises its own error
    if not all(isinstance(g, Mapping) and "params" in g for g in saved_groups):
        return None
    current = _optimizer_params(optim)
    saved_keys = [key for g in saved_groups for key in g["params"]]
    if len(saved_groups) != len(optim.param_groups) or len(saved_keys) != len(current):
        return None  # load_state_dict raises its own error
    key_of = {id(p): key for key, p in zip(saved_keys, current)}
    handles = _handles_holding(current)
    if not handles:
        return None
    state = dict(saved_state)
    for handle in handles:
        unit = _unit_of(handle)
        flat_key = key_of.get(id(handle.flat_param))
        if flat_key is not None:
            entry = saved_state.get(flat_key)
            if isinstance(entry, Mapping):
                state[flat_key] = {key: _flat_local(unit, key, v) for key, v in entry.items()}
            continue
        keys = [key_of.get(id(p)) for p in handle.params]
        saved = [saved_state.get(key) if key is not None else None for key in keys]
        for key, entry in zip(keys, _local_state(unit, [s if isinstance(s, Mapping) else None for s in saved])):
            if key is not None and entry is not None:
                state[key] = entry
    return {**state_dict, "state": state}


def _install_optimizer_hooks(optim: torch.optim.Optimizer) -> None:
    if optim in _hooked:
        return
    _hooked.add(optim)
    optim.register_state_dict_post_hook(_present_state_hook)
    optim.register_load_state_dict_pre_hook(_take_back_state_hook)


def _holds_sharded_params(optim: torch.optim.Optimizer) -> bool:
    return any(getattr(p, FSDP_FLATTENED, False) or type(p) is FlatParameter for p in _optimizer_params(optim))


def _in_global_form(param: torch.Tensor, value: Any) -> bool:
    """A DTensor state value that is not what the optimizer itself keeps: a tensor-parallel parameter's
    own state is a DTensor laid out like the parameter over its 1-D slice."""
    if not isinstance(value, DTensor):
        return False
    return not (
        isinstance(param, DTensor)
        and value.device_mesh == param.device_mesh
        and value.placements == param.placements
        and value.to_local().shape == param.to_local().shape
    )


def _take_back_state_loaded_early(optim: torch.optim.Optimizer) -> None:
    """``optim.load_state_dict`` of a state dict in global form (DTensors) on an optimizer that had
    not stepped yet ran before its hooks existed: convert the state now, on its first step."""
    params = _optimizer_params(optim)
    mine = [p for p in params if getattr(p, FSDP_FLATTENED, False) or type(p) is FlatParameter]
    if not any(_in_global_form(p, v) for p in mine for v in optim.state.get(p, {}).values()):
        return
    numbers = _numbering(optim)
    groups = [{"params": [numbers[id(p)] for p in g["params"]]} for g in optim.param_groups]
    state = {numbers[id(p)]: optim.state[p] for p in params if p in optim.state}
    converted = _take_back_state_hook(optim, {"state": state, "param_groups": groups})
    assert converted is not None
    for p in mine:
        if numbers[id(p)] in converted["state"]:
            optim.state[p] = converted["state"][numbers[id(p)]]
