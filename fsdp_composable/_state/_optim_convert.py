"""The conversion core of optimizer state: a unit's per-parameter state between this rank's slices
(what the optimizer holds) and the global form (full tensors or DTensors of each parameter's shape).
`_optim_utils` (optim_state_dict / optim_state_dict_to_load) and torch's ``optim.state_dict()`` hooks
in `_torch_interop` both use it: to the global form, `_collect` then `_export_entries` (and
`_flat_global` for a flat parameter); back, `_local_state` (and `_flat_local` / `_flat_state`), over
the model's conversion of global values, `to_flat_shard` (see [Note: a global value to this rank's
piece]).

[Note: optimizer state of a sharded unit]
The optimizer steps the faces ([Note: parameter faces]), so every per-parameter state tensor (Adam's
``exp_avg``, ...) is a DTensor laid out like its face, whose local tensor is this rank's chunk
(possibly empty). For each unit and state key we write the chunks of all its parameters into one
tensor laid out like the unit's flat shard; the unit's layout then moves them like parameters: one
all-gather per unit and key (not per parameter) gives full tensors (FULL_STATE_DICT), cutting this
rank's chunks from it gives ``Shard(0)`` DTensors (SHARDED_STATE_DICT). Loading goes back: slice a
full value, or take a DTensor's chunk, and hand each face its chunk as a DTensor laid out like it.
With the wrapper's flat parameters
(``use_orig_params=False``) the optimizer's state already is such a flat tensor. ``step`` and other
scalars are the same on every rank and pass through unchanged. The saved form names parameters by
FQN (in ``state`` and in each param group's ``params``), so it loads at any world size, with either
parameter mode, and into a plain model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from fsdp_composable._comm import _rank_agreement, _tensor_parallel
from fsdp_composable._comm._rank_agreement import Op
from fsdp_composable._common_utils import API_NAME
from fsdp_composable._composable_state import _all_states
from fsdp_composable._flat._checkpoint_comm import all_gather_object, comm_device_of
from fsdp_composable._flat._checkpoint_comm import gather_full_flat as _gather_full_flat
from fsdp_composable._flat._flat_layout import _saved_shape
from fsdp_composable._flat_param import FlatParamHandle
from fsdp_composable._state._state_dict_settings import _copy, _rank0_only
from fsdp_composable._state._state_dict_sharded import _flat_to_chunks, _mesh_of, to_flat_shard
from fsdp_composable._state._state_digest import digests
from fsdp_composable.api import StateDictConfig

__all__: list[str] = []


# The one scalar every torch optimizer keeps per parameter. Named, because for a 0-dim parameter a
# 0-dim ``step`` and a 0-dim ``exp_avg`` look alike.
STEP = "step"


@dataclass
class _Unit:
    handle: FlatParamHandle
    fqns: list[str]  # per ParamInfo, as state-dict keys spell it


def _optimizer_params(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optim.param_groups for p in group["params"]]


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


# ---------------------------------------------------------------------------- saving
@dataclass
class _UnitState:
    """One unit's optimizer state, per-parameter tensors as flat shards keyed by (state key, dtype)."""

    has_state: list[bool]
    flats: dict[tuple[str, torch.dtype], torch.Tensor]
    scalars: list[dict[str, Any]]
    held: tuple[bool, ...] = ()  # which parameters the optimizer holds (all, for a flat parameter)

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
    ids = {id(p) for p in _optimizer_params(optim)}
    whole = id(handle.flat_param) in ids
    held = tuple(whole or id(p) in ids for p in handle.faces)
    out = _UnitState([False] * n, {}, [{} for _ in range(n)], held)
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
    for k, (info, face, view) in enumerate(zip(layout.infos, handle.faces, handle._sharded_views)):
        state = optim.state.get(face)
        if not state:
            continue
        out.has_state[k] = True
        start, end = layout.shard_range(info)
        local_shape = face.to_local().shape if isinstance(face, DTensor) else view.shape
        for key, value in state.items():
            if isinstance(value, DTensor) and isinstance(face, DTensor):
                value = value.to_local()  # the optimizer's DTensor laid out like its face
            if key != STEP and isinstance(value, torch.Tensor) and value.shape == local_shape:
                flat = out.flats.get((key, value.dtype))
                if flat is None:
                    flat = torch.zeros(layout.shard_numel, dtype=value.dtype, device=value.device)
                    out.flats[(key, value.dtype)] = flat
                flat[start:end] = value.detach().reshape(-1)
            elif sharded and isinstance(value, torch.Tensor) and value.dim() > 0:
                raise _bad_state_shape(key, unit.fqns[k], value.shape, local_shape)
            else:
                out.scalars[k][key] = value
    return out


@dataclass(frozen=True)
class _Record:
    """What one rank knows about one unit's optimizer state, exchanged so all ranks agree."""

    unit: tuple[str, int]  # unit FQN and unpadded numel: the same unit on every rank
    has_state: tuple[bool, ...]
    held: tuple[bool, ...]
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
        c.held,
        empty,
        tuple(sorted((key, str(dtype)) for key, dtype in c.flats)),
        tuple(dict(s) if has else None for has, s in zip(c.has_state, c.scalars)),
    )


def _exchange(units: list[_Unit], mine: list[Any], what: str) -> list[tuple[list[int], list[list[Any]]]]:
    """Every rank's ``mine`` (one entry per unit) over each process group, groups in a rank-independent
    order: per group, the indices of its units and each rank's entries for them. Refused on every rank
    when the ranks hold different numbers of units."""
    by_group: dict[tuple[int, ...], list[int]] = {}
    groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for i, unit in enumerate(units):
        if unit.handle.layout.world_size > 1:
            ranks = tuple(dist.get_process_group_ranks(unit.handle.process_group))
            by_group.setdefault(ranks, []).append(i)
            groups[ranks] = unit.handle.process_group
    out = []
    for ranks in sorted(by_group):
        entries = [mine[i] for i in by_group[ranks]]
        _rank_agreement.agree_before(groups[ranks], Op.ALL_GATHER_OBJECT, len(entries), None, what)
        names = ", ".join(repr(units[i].handle.root_fqn) for i in by_group[ranks])
        everyone = all_gather_object(
            groups[ranks], entries, units[by_group[ranks][0]].handle.device, f"exchange for the {what} (units {names})"
        )
        if any(len(theirs) != len(entries) for theirs in everyone):
            raise RuntimeError(
                "fully_shard: the optimizer holds parameters of different units on different ranks "
                f"({[len(theirs) for theirs in everyone]} units): every rank must build the same optimizer "
                "from the same sharded model"
            )
        out.append((by_group[ranks], everyone))
    return out


def _check_same_on_all_ranks(units: list[_Unit], collected: list[_UnitState]) -> None:
    """The per-unit collectives that follow need every rank to hold the same state keys. Exchange
    what each rank has (once per process group, groups in a rank-independent order) and agree.

    A parameter whose slice is empty on some rank may have no state there (an optimizer loaded from
    a checkpoint of older versions, whose empty slices got no gradient; today they get an empty one
    and are stepped): that rank takes the keys and scalars (``step``) from a rank that has them, with
    zero-length tensors. Any other difference raises on every rank."""
    mine = [_record(u, c) for u, c in zip(units, collected)]
    for indices, everyone in _exchange(units, mine, "optimizer state check"):
        for j, i in enumerate(indices):
            _agree(units[i], collected[i], [theirs[j] for theirs in everyone])


def _saved_signature(entry: Any) -> Optional[tuple[Any, ...]]:
    """What loading ``entry`` (a parameter's saved state) does: its keys, and per tensor its kind,
    dtype, shape and placements (a DTensor is a collective to convert, a full tensor is not); and
    what it holds: a digest of each plain tensor, each number (see [Note: digests of loaded optimizer
    state])."""
    if not isinstance(entry, Mapping):
        return None
    out = []
    plain = [(str(k), v) for k, v in entry.items() if isinstance(v, torch.Tensor) and not isinstance(v, DTensor)]
    plain = [(k, v) for k, v in plain if v.dim() > 0]  # a 0-dim value (``step``) is shown as it is
    digest_of = dict(zip([k for k, _ in plain], digests([v for _, v in plain])))
    for key, value in entry.items():
        if isinstance(value, DTensor):
            out.append((str(key), "DTensor", str(value.dtype), tuple(value.shape), str(value.placements), ""))
        elif isinstance(value, torch.Tensor):
            held = repr(value.item()) if value.dim() == 0 else f"digest {digest_of[str(key)]}"
            out.append((str(key), "tensor", str(value.dtype), tuple(value.shape), "", held))
        elif isinstance(value, (bool, int, float)):
            out.append((str(key), type(value).__name__, "", (), "", repr(value)))
        else:
            out.append((str(key), type(value).__name__, "", (), "", ""))
    return tuple(sorted(out))


def _check_saved_same_on_all_ranks(units: list[_Unit], saved: list[list[Any]], usable: bool) -> None:
    """Before loading: which collectives the conversion runs depends on the saved state (a DTensor
    value is a collective, a full tensor is not), so every rank must be given the same state for the
    same parameters, and all must find the state dict usable. Exchange and agree, or raise on every
    rank naming the first parameter that differs."""
    mine = [
        (u.handle.unit_fqn, u.handle.layout.unpadded_numel, usable, [_saved_signature(e) for e in entries])
        for u, entries in zip(units, saved)
    ]
    for indices, everyone in _exchange(units, mine, "optimizer state check"):
        for j, i in enumerate(indices):
            records = [theirs[j][2:] for theirs in everyone]
            if len({theirs[j][:2] for theirs in everyone}) > 1:
                raise RuntimeError(
                    "fully_shard: the optimizer holds parameters of different units on different ranks "
                    f"({sorted({theirs[j][:2] for theirs in everyone})}): every rank must build the same "
                    "optimizer from the same sharded model"
                )
            if len({r[0] for r in records}) > 1:
                raise RuntimeError(
                    "fully_shard: optimizer.load_state_dict() got a state dict whose param groups match "
                    f"the optimizer on ranks {[r for r, rec in enumerate(records) if rec[0]]} only: every rank "
                    "must build the same optimizer (same param groups) and load the same checkpoint"
                )
            for k, fqn in enumerate(units[i].fqns):
                _check_same_values(fqn, [r[1][k] for r in records])
                if len({repr(r[1][k]) for r in records}) > 1:
                    detail = "; ".join(f"rank {r}: {rec[1][k]}" for r, rec in enumerate(records))
                    raise RuntimeError(
                        f"fully_shard: optimizer.load_state_dict() got different state for parameter '{fqn}' "
                        f"on different ranks ({detail}). Every rank must build its optimizer from the same "
                        "parameters and load the same checkpoint; to load into optimizers built from "
                        "differently ordered or grouped parameters, use optim_state_dict_to_load"
                    )


def _check_same_values(fqn: str, signatures: list[Any]) -> None:
    """Signatures equal but for the values: the ranks were given the same kind of state from different
    checkpoints (another step's, or an edited one). Name the parameter and the keys whose values differ."""
    if any(sig is None for sig in signatures) or len({tuple(f[:5] for f in sig) for sig in signatures}) > 1:
        return  # a difference in structure: the caller's message
    differing = []
    for n, field in enumerate(signatures[0]):
        values = [sig[n][5] for sig in signatures]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            differing.append(f"{field[0]}: {shown}" if field[3] == () else f"{field[0]} differs")
    if differing:
        raise RuntimeError(
            f"fully_shard: optimizer.load_state_dict() got state for parameter '{fqn}' with the same keys and "
            f"shapes but different values on different ranks ({'; '.join(differing)}): the ranks were given "
            "different checkpoints (another step's state on some rank?). Load the same checkpoint on every rank; "
            "nothing was loaded"
        )


def _agree(unit: _Unit, c: _UnitState, records: list[_Record]) -> None:
    def differs(why: str) -> RuntimeError:
        return RuntimeError(
            f"optimizer state of unit '{unit.handle.unit_fqn or '<root>'}' differs across ranks ({why}): "
            f"{[(r.has_state, r.keys) for r in records]}. Every rank must build the same optimizer and step "
            "the same parameters"
        )

    for k, fqn in enumerate(unit.fqns):
        if len({r.held[k] for r in records if len(r.held) > k}) > 1:
            holding = [rank for rank, r in enumerate(records) if r.held[k]]
            raise RuntimeError(
                f"fully_shard: the optimizer holds parameter '{fqn}' on rank(s) {holding} only: every rank "
                "must build its optimizer from the same parameters (their order and grouping may differ)"
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
            c.flats[(key, dtype)] = torch.zeros(layout.shard_numel, dtype=dtype, device=handle.flat_param.device)


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
    for key, dtype in sorted(c.flats, key=lambda kd: (kd[0], str(kd[1]))):
        flat = c.flats[(key, dtype)]
        if sharded:  # laid out like the faces
            for k, (entry, chunk) in enumerate(zip(out, _flat_to_chunks(handle, flat))):
                if entry is not None:
                    entry[key] = handle.face_grad(k, chunk.cpu() if config.offload_to_cpu else chunk)
            continue
        full = _gather_full_flat(handle, flat) if layout.world_size > 1 else flat
        for info, entry in zip(layout.infos, out):
            if entry is not None:
                value = _copy(full[info.offset : info.offset + info.numel].view(info.shape), config)
                entry[key] = value if info.tp is None else _full_tp_value(handle, info.tp, value, config)
    return out


def _full_tp_value(
    handle: FlatParamHandle, spec: _tensor_parallel.TPSpec, local: torch.Tensor, config: StateDictConfig
) -> torch.Tensor:
    """FULL: a tensor-parallel parameter's state as the model's FULL state dict gives the parameter (a
    DTensor full over dp; with ``rank0_only`` the plain global tensor, gathered on every rank)."""
    value = _tensor_parallel.as_param_grad(spec, local)
    assert isinstance(value, DTensor)
    if _rank0_only(config):
        return _tensor_parallel.full_tensor(value, handle.device)
    return value


def _full_value(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``value`` whole (``device``: where its parameter computes)."""
    if isinstance(value, DTensor):
        return _tensor_parallel.full_tensor(value, device)  # a collective over the DTensor's mesh
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
            if isinstance(value, DTensor) and not _in_global_form(unit.handle.faces[k], value):
                scalars[k][key] = value  # already this rank's piece, as the optimizer keeps it
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
        flat = to_flat_shard(unit.handle, members, dtype)
        for k, _ in members:
            start, end = layout.shard_range(layout.infos[k])
            entry = out[k]
            assert entry is not None
            # laid out like the parameter the optimizer holds (its face), as the optimizer makes it
            entry[key] = handle.face_grad(k, flat[start:end].clone())
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
        out[key] = _flat_global(handle, to_flat_shard(handle, members, dtype))
    return out


def _flat_global(handle: FlatParamHandle, shard: torch.Tensor) -> torch.Tensor:
    layout = handle.layout
    if layout.world_size == 1:
        return shard
    mesh = _mesh_of(handle.process_group, comm_device_of(handle))
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
        value = _tensor_parallel.full_tensor(value, unit.handle.device)
    if value.shape != (layout.padded_numel,):
        raise ValueError(
            f"optimizer state {key!r} of the flat parameter of unit '{unit.handle.unit_fqn or '<root>'}' has shape "
            f"{tuple(value.shape)}; this rank's optimizer expects the padded flat shape ({layout.padded_numel},) "
            "of the same wrapping and world size. To move optimizer state between wrappings or world sizes, "
            "save with optim_state_dict(model, optim) and load with optim_state_dict_to_load"
        )
    # the flat value is every rank's shard in turn: laid out by parameter, each is at its offset
    if not layout.same_order:
        value, by_param = value.contiguous(), torch.empty_like(value)
        layout.copy_out(value, by_param)
        value = by_param
    values = [(k, value[i.offset : i.offset + i.numel].view(i.shape)) for k, i in enumerate(layout.infos)]
    return to_flat_shard(unit.handle, values, value.dtype)


def _every_handle() -> list[FlatParamHandle]:
    """Every unit's handle in this process, once each, in the order `fully_shard` built them."""
    out: dict[int, FlatParamHandle] = {}
    for apis in _all_states():
        state = apis.get(API_NAME)
        for handle in state.handles if state is not None else ():
            out.setdefault(id(handle), handle)
    return list(out.values())


def _handles_holding(params: list[torch.Tensor]) -> list[FlatParamHandle]:
    """The handles with a parameter in ``params``, in the order `fully_shard` built them (the same on
    every rank), whichever order ``params`` lists them in."""
    ids = {id(p) for p in params}
    return [h for h in _every_handle() if id(h.flat_param) in ids or any(id(p) in ids for p in h.faces)]


def _unit_of(handle: FlatParamHandle) -> _Unit:
    return _Unit(handle, [getattr(p, "_fsdp_fqn", info.fqn) for p, info in zip(handle.params, handle.layout.infos)])


def _in_global_form(param: torch.Tensor, value: Any) -> bool:
    """A state value that is not what the optimizer itself keeps (a DTensor laid out like the face)."""
    if not isinstance(value, DTensor):  # a full value of a face's state
        return isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0
    return not (
        isinstance(param, DTensor)
        and value.device_mesh == param.device_mesh
        and value.placements == param.placements
        and value.to_local().shape == param.to_local().shape
    )
