"""Optimizer state dicts keyed by original parameter FQN: `optim_state_dict`, `optim_state_dict_to_load`
and `init_optim_state`.
The conversion itself is `_optim_convert`; see [Note: optimizer state of a sharded unit] there."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_composable._comm import _rank_agreement, _tensor_parallel
from fsdp_composable._comm._header_fields import Op
from fsdp_composable._common_utils import _get_fsdp_states
from fsdp_composable._flat._checkpoint_comm import all_gather_object
from fsdp_composable._runtime._state_dict_keys import _clean_module_fqns, _join
from fsdp_composable._state._extension_state import extension_faces, state_in_face_layout
from fsdp_composable._state._optim_convert import (
    _check_same_on_all_ranks,
    _collect,
    _export_entries,
    _flat_state,
    _full_value,
    _optimizer_params,
    _Unit,
    _UnitState,
)
from fsdp_composable._state._state_dict_settings import _copy, _drops_values, _kind, _optim_config
from fsdp_composable._state._torch_interop import _install_optimizer_hooks
from fsdp_composable.api import (
    FullStateDictConfig,
    StateDictConfig,
    StateDictType,
)

__all__: list[str] = ["init_optim_state", "optim_state_dict", "optim_state_dict_to_load"]


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
                for p, i in zip(handle.faces, handle.layout.infos)
            ]
            unit = _Unit(handle, names)
            index.units.append(unit)
            index.flat[id(handle.flat_param)] = unit
            for k, face in enumerate(handle.faces):
                index.orig[id(face)] = (unit, k)
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


def _check_args(where: str, module: Any, optim: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{where} argument 'module' must be an nn.Module, got {type(module).__name__}")
    if not isinstance(optim, torch.optim.Optimizer):
        raise TypeError(f"{where} argument 'optim' must be a torch.optim.Optimizer, got {type(optim).__name__}")


def _mode(where: str, module: nn.Module) -> tuple[bool, StateDictConfig, bool]:
    """(sharded, config, drop) from the root-wide `state_dict_type` (see [Note: the state-dict setting is
    root-wide]) of the states under ``module``."""
    states = _get_fsdp_states(module)
    if not states:
        return False, FullStateDictConfig(), False
    state = states[0]  # any state under module reads the same root-wide setting
    if _kind(state) is StateDictType.LOCAL_STATE_DICT:
        raise ValueError(
            f"{where} does not support StateDictType.LOCAL_STATE_DICT; use FULL_STATE_DICT (full tensors) or "
            "SHARDED_STATE_DICT (DTensors for torch.distributed.checkpoint)"
        )
    config = _optim_config(state)
    return _kind(state) is StateDictType.SHARDED_STATE_DICT, config, _drops_values(state, config)


def _units_in(index: _Index, params: list[torch.Tensor]) -> list[_Unit]:
    """Units with at least one parameter in the optimizer (the same on every rank)."""
    ids = {id(p) for p in params}
    return [u for u in index.units if id(u.handle.flat_param) in ids or any(id(p) in ids for p in u.handle.faces)]


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
    extension = extension_faces(_get_fsdp_states(module))
    for p in params:
        if id(p) in index.plain and optim.state.get(p):
            values = optim.state[p].items()
            if id(p) in extension and not sharded:  # [Note: extension parameters in state dicts]: whole
                whole = _tensor_parallel.full_tensor
                values = [(k, whole(v, p.device) if isinstance(v, DTensor) else v) for k, v in values]
            state[index.plain[id(p)]] = {k: _copy(v, config) for k, v in values}
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


def _match_groups(saved: list[Any], current: list[list[str]]) -> list[Any]:
    """The saved param group of each of the optimizer's groups: the one at its position if it holds the
    same parameters, else the one that does (ranks may list their groups in other orders, while a
    checkpoint holds one rank's list); raises if a group has none."""
    if len(saved) != len(current):
        raise ValueError(
            f"the checkpoint has {len(saved)} param groups but the optimizer has {len(current)}; build the "
            "optimizer with the same param groups as the one that was saved"
        )
    sets = [frozenset(g["params"]) for g in saved]
    matched = []
    for i, fqns in enumerate(current):
        mine = frozenset(fqns)
        j = i if sets[i] == mine else next((j for j, other in enumerate(sets) if other == mine), None)
        if j is None:
            closest = max(range(len(sets)), key=lambda k: (len(sets[k] & mine), k == i))
            missing, extra = sorted(mine - sets[closest]), sorted(sets[closest] - mine)
            raise ValueError(
                f"param group {i} differs from every param group of the checkpoint; against the closest, group "
                f"{closest}: parameters only in the optimizer: {_some(missing)}, only in the checkpoint: "
                f"{_some(extra)}. Build the optimizer with the same param groups (listed in any order)"
            )
        matched.append(saved[j])
    return matched


def _agree_on_refusal(index: _Index, refusal: Optional[Exception]) -> None:
    """Every rank learns which ranks refused the state dict (``refusal``: this rank's error) and all
    raise the same error: a rank raising alone would leave the others waiting in the conversion's
    collectives or in the optimizer's load."""
    groups: dict[tuple[int, ...], tuple[dist.ProcessGroup, torch.device]] = {}
    for unit in index.units:
        group = unit.handle.process_group
        if dist.get_world_size(group) > 1:
            groups.setdefault(tuple(dist.get_process_group_ranks(group)), (group, unit.handle.device))
    if not groups:
        if refusal is not None:
            raise refusal
        return
    mine = None if refusal is None else (type(refusal).__name__, str(refusal))
    refused: dict[int, tuple[str, str]] = {}
    what = "check of the state dict on every rank"
    for ranks in sorted(groups):
        group, device = groups[ranks]
        _rank_agreement.agree_before(group, Op.ALL_GATHER_OBJECT, 1, None, what)
        for rank, theirs in zip(ranks, all_gather_object(group, mine, device, what)):
            if theirs is not None:
                refused[rank] = theirs
    if not refused:
        return
    first = min(refused)
    kind, text = refused[first]
    error = (TypeError if kind == "TypeError" else ValueError)(
        f"optim_state_dict_to_load: rank(s) {sorted(refused)} cannot load this optimizer state dict, so no rank "
        f"converts it (rank {first}: {text})"
    )
    raise error from refusal


def _some(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{f', ... ({len(names) - limit} more)' if len(names) > limit else ''}]"


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
    index = _index(module)
    params = _optimizer_params(optim)
    refusal: Optional[Exception] = None
    try:
        saved_state, saved_groups = _check_osd(optim_state_dict)
        current = [
            [fqn for p in g["params"] for fqn in _param_fqns(index, p, i)] for i, g in enumerate(optim.param_groups)
        ]
        known = {fqn for fqns in current for fqn in fqns}
        unknown = sorted(set(saved_state) - known)
        if unknown:
            raise ValueError(
                f"the optimizer state dict has state for {unknown}, which the optimizer does not hold (unknown "
                "FQNs, or parameters left out of it); load a checkpoint of the same model and param groups"
            )
        saved_groups = _match_groups(saved_groups, current)
    except (TypeError, ValueError) as e:
        refusal = e
    _agree_on_refusal(index, refusal)  # also the check-in: a collective on every rank
    _install_optimizer_hooks(optim)
    ids = {id(p): i for i, p in enumerate(params)}
    out: dict[int, Any] = {}
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
    extension = extension_faces(_get_fsdp_states(module))
    for p in params:
        fqn = index.plain.get(id(p))
        state = saved_state.get(fqn) if fqn is not None else None
        if isinstance(state, Mapping) and id(p) in extension:  # a tensor-subclass parameter: its face's layout
            ext, param = extension[id(p)]
            out[ids[id(p)]] = {k: state_in_face_layout(ext, param, v, p.device) for k, v in state.items()}
        elif isinstance(state, Mapping):
            out[ids[id(p)]] = {
                k: _full_value(v, p.device) if isinstance(v, torch.Tensor) else v for k, v in state.items()
            }
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
