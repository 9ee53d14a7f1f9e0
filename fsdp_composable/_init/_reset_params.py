"""``reset_parameters()`` of a sharded module runs on full-shape parameters and agrees on every rank.

[Note: reset_parameters after sharding]
Between steps a module registers its parameters' faces, ``DTensor``s of the global shape
([Note: parameter faces]). Torch FSDP2 runs ``reset_parameters()`` on such ``DTensor``s: each rank draws
its own shard from its own generator (on CPU meshes ``DTensor`` has no random-number tracker), so the
values are not the plain model's under the same seed, and replicas under NO_SHARD or HYBRID_SHARD
draw different values. We run it on full-shape plain tensors instead, so that a seed means what it
means for the plain model. A call ``module.reset_parameters()`` has no extension point but the
module's attribute lookup, which is why the wrapper below is an instance attribute.

At the end of `fully_shard` (after ``param_init_fn`` ran: materialisation calls the class's own method)
every module whose subtree holds parameters a unit manages gets an instance attribute
``reset_parameters`` that calls `reset_module`: it gathers the units holding that module's parameters,
registers the original parameters pointed at full-shape, full-precision copies, runs the module's own
``reset_parameters`` (the class's, or an instance attribute that was there before), broadcasts the
module's parameters from the lowest rank of each unit's shard group and then of its replicate group, and
writes the values back into the shards (the faces are registered again). So with one seed on every rank
the result is exactly what the plain module gives under that seed (the same random draws on the same
shapes), and with different seeds every rank still ends with the lowest rank's values. A reset that
raises on any rank raises on every rank and writes nothing back. Nested calls (a parent's
``reset_parameters`` that calls its children's) run directly inside the outer one.

It is an entry point for rank agreement (see [Note: collective headers] in `_rank_agreement`): the
all-gathers, the status exchange and the broadcasts are labelled ``reset_parameters()``, so a reset on
one rank only is a `RankMismatchError` on every rank. During forward or backward it is refused with an
error naming the module (the unit is unsharded, the autograd graph holds its views); inside
``unshard_params`` (full shapes already) it runs on the summoned parameters and broadcasts them.
"""

from __future__ import annotations

import weakref
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_composable._comm import _collectives, _rank_agreement
from fsdp_composable._comm._rank_agreement import Op
from fsdp_composable._comm._tensor_parallel import is_tp_sharded, local_of, point_at
from fsdp_composable._common_utils import TrainingState, _FSDPState
from fsdp_composable._flat._checkpoint_comm import gather_full_flat as _gather_full_flat
from fsdp_composable._flat_param import FlatParamHandle, HandleTrainingState
from fsdp_composable._grads import _exposed_grads
from fsdp_composable._init._group_units import unit_roots_named_modules
from fsdp_composable._runtime._entry_points import _settle_unfinished_step
from fsdp_composable._runtime._unshard_param_utils import _restore_handle, _Summoned, begin_summon, end_summon

__all__ = ["install_reset_hooks", "reset_module"]

_ENTRY = "reset_parameters()"
_MARK = "_fsdp_reset_parameters"  # set on our instance-level wrapper


@dataclass
class _Target:
    """What `reset_module` needs for one module: its name and the states whose units may hold its
    parameters (several when fully_shard was applied bottom-up by hand)."""

    fqn: str
    original: Optional[Callable[[], Any]]  # an instance-level reset_parameters that was there before
    states: list[_FSDPState] = field(default_factory=list)


_TARGET = "_fsdp_reset_target"  # the module's `_Target`, kept on the module (a global map would keep it alive)
# whether a reset runs now: a nested call (an enclosing module's reset calling its children's) runs directly
_ACTIVE: ContextVar[bool] = ContextVar("fsdp_composable_reset_running", default=False)


def install_reset_hooks(state: _FSDPState) -> None:
    """Give every module under ``state.module`` that has a ``reset_parameters`` and whose subtree
    holds a parameter of ``state``'s units the wrapper (see [Note: reset_parameters after sharding])."""
    holders = {m for h in state.handles for info in h.layout.infos for m, _, _ in info.holders}
    for fqn, module in unit_roots_named_modules(state):
        target = module.__dict__.get(_TARGET)
        if target is not None:
            target.fqn = fqn  # an enclosing fully_shard call names it from further up
        if not callable(getattr(module, "reset_parameters", None)) or not holders.intersection(module.modules()):
            continue
        if target is None:
            target = module.__dict__[_TARGET] = _Target(fqn, module.__dict__.get("reset_parameters"))
            module.__dict__["reset_parameters"] = _make_wrapper(module)
        if state not in target.states:
            target.states.append(state)


def _make_wrapper(module: nn.Module) -> Callable[[], Any]:
    ref = weakref.ref(module)  # no cycle through the module's own __dict__

    def reset_parameters() -> Any:
        m = ref()
        assert m is not None  # the method is looked up on the module, so it is alive
        return reset_module(m)

    setattr(reset_parameters, _MARK, True)
    return reset_parameters


def _call_original(module: nn.Module, target: _Target) -> Any:
    if target.original is not None:
        return target.original()
    return type(module).reset_parameters(module)  # type: ignore[attr-defined]


def _selected(module: nn.Module, target: _Target) -> list[tuple[_FSDPState, FlatParamHandle, list[int]]]:
    """Each handle holding a parameter registered in ``module``'s subtree, with those parameters' indices."""
    subtree = set(module.modules())
    out = []
    for state in target.states:
        for handle in state.handles:
            indices = [
                i
                for i, info in enumerate(handle.layout.infos)
                if any(m in subtree for m, _, _ in info.holders)
            ]
            if indices:
                out.append((state, handle, indices))
    return out


def reset_module(module: nn.Module) -> Any:
    """Run ``module``'s own ``reset_parameters`` on full-shape parameters, identical on every rank."""
    target: _Target = module.__dict__[_TARGET]
    if _ACTIVE.get():  # called from an enclosing module's reset_parameters: already full shapes
        return _call_original(module, target)
    selected = _selected(module, target)
    if not selected:
        return _call_original(module, target)
    states = list({id(s): s for s, _, _ in selected}.values())
    _settle_unfinished_step(states[0])  # a step that stopped midway (see _entry_points)
    name = f"'{target.fqn or '<root>'}' ({type(module).__name__})"
    if any(s.training_state is TrainingState.FORWARD_BACKWARD for s in states):
        raise RuntimeError(
            f"reset_parameters() of module {name} was called during forward or backward of a fully_shard "
            "model: its unit is unsharded for the running step. Call it between steps (outside forward and "
            "backward); it then re-initialises the full-shape parameters on every rank"
        )
    if any(s.training_state is TrainingState.SUMMON_FULL_PARAMS for s in states):
        return _reset_inside_unshard_params(module, target, name, selected)
    with _rank_agreement.entry_point(_ENTRY):
        return _reset_sharded(module, target, states, selected)


def _reset_sharded(
    module: nn.Module,
    target: _Target,
    states: list[_FSDPState],
    selected: list[tuple[_FSDPState, FlatParamHandle, list[int]]],
) -> Any:
    flat_mode = begin_summon(states)
    summoned: list[_Summoned] = []
    ok = False
    try:
        for _, handle, _ in selected:
            handle.set_training_state(HandleTrainingState.SUMMON_FULL_PARAMS)
            summoned.append(_summon(handle))
        result = _run_everywhere(module, target, [h for _, h, _ in selected])
        for entry, (_, handle, indices) in zip(summoned, selected):
            _fold_assignments(entry, indices, target)
            _broadcast_params(handle, entry, indices)
        ok = True
    finally:
        for entry in summoned:
            _restore_handle(entry, writeback=ok)  # a failed reset leaves the shards as they were
        end_summon(states, [h for _, h, _ in selected], flat_mode)
    return result


def _summon(handle: FlatParamHandle) -> _Summoned:
    """Point the handle's parameters at full-shape views of a full-precision copy of the unit."""
    _exposed_grads.stash_sharded_grads(handle)  # keep the user's gradients; `_restore_handle` re-exposes them
    full = _gather_full_flat(handle)
    entry = _Summoned(handle, full)
    for param, info in zip(handle.params, handle.layout.infos):
        view = full[info.offset : info.offset + info.numel].view(info.shape)
        param.grad = None
        point_at(param, view)
        entry.views.append(view)
        entry.grad_views.append(None)
    handle.register_params()  # the module's own reset sees them, not the faces; `_restore_handle` puts the faces back
    return entry


def _groups(handles: list[FlatParamHandle]) -> list[dist.ProcessGroup]:
    """The distinct groups the units span, shard groups before replicate groups (the broadcast order)."""
    groups: dict[int, dist.ProcessGroup] = {}
    for handle in handles:
        for group in (handle.process_group, handle.replicate_group):
            if group is not None and dist.get_world_size(group) > 1:
                groups.setdefault(id(group), group)
    return list(groups.values())


def _run_everywhere(module: nn.Module, target: _Target, handles: list[FlatParamHandle]) -> Any:
    """Run the module's own reset; then every rank learns whether it raised anywhere, so either every
    rank writes back or none does (one small all-reduce per group)."""
    token = _ACTIVE.set(True)
    error: Optional[BaseException] = None
    try:
        result = _call_original(module, target)
    except Exception as e:  # noqa: BLE001 - re-raised below, after the peers know
        error, result = e, None
    finally:
        _ACTIVE.reset(token)
    failed = int(error is not None)
    for group in _groups(handles):
        flag = _collectives.comm_tensor([failed], group, handles[0].device)
        _rank_agreement.agree_before(group, Op.ALL_REDUCE, 1, torch.int64, "status all-reduce")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        failed = max(failed, int(_collectives.host_values(flag)[0]))
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(
            f"reset_parameters() of module '{target.fqn or '<root>'}' ({type(module).__name__}) raised on another "
            "rank (see its log); nothing was written back, the parameters are unchanged"
        )
    return result


def _fold_assignments(entry: _Summoned, indices: list[int], target: _Target) -> None:
    """A reset that assigned ``p.data = t`` (same shape): copy ``t`` into the full view and point the
    parameter back at it, so the broadcast carries it."""
    handle = entry.handle
    for i in indices:
        param, info, view = handle.params[i], handle.layout.infos[i], entry.views[i]
        data = local_of(param)
        if data.data_ptr() == view.data_ptr() and data.shape == view.shape:
            continue
        if data.shape != info.shape:
            raise ValueError(
                f"reset_parameters() of module '{target.fqn or '<root>'}' gave parameter '{info.fqn}' of unit "
                f"'{handle.unit_fqn or '<root>'}' the shape {tuple(data.shape)}, not {tuple(info.shape)}; "
                "a sharded parameter keeps its shape. Nothing was written back"
            )
        with torch.no_grad():
            view.copy_(data)
        point_at(param, view)


def _broadcast_params(handle: FlatParamHandle, entry: _Summoned, indices: list[int]) -> None:
    """Every rank takes the lowest rank's values of the reset parameters: its shard group's first rank,
    then its replicate group's (so under HYBRID_SHARD the global lowest rank's)."""
    full = entry.full
    assert full is not None
    infos = handle.layout.infos
    slices = [full[infos[i].offset : infos[i].offset + infos[i].numel] for i in indices]
    for group in _groups([handle]):
        _broadcast_slices(handle, group, slices)
    # tensor parallelism: what each tensor-parallel rank holds whole (plain or Replicate parameters)
    # must agree across the tensor-parallel group too; its pieces differ by design
    if handle.tp_group is not None:
        whole = [s for i, s in zip(indices, slices) if not is_tp_sharded(infos[i].tp)]
        if whole:
            _broadcast_slices(handle, handle.tp_group, whole)


def _broadcast_slices(handle: FlatParamHandle, group: dist.ProcessGroup, slices: list[torch.Tensor]) -> None:
    # the full copy lives on the shard's device (the CPU under offload): communicate on the group's
    comm = _collectives.comm_device(group, handle.device)
    packed = torch.cat(slices).to(comm) if len(slices) > 1 else slices[0].to(comm, copy=True)
    what = f"broadcast of unit '{handle.unit_fqn or '<root>'}'"
    _rank_agreement.agree_before(group, Op.BROADCAST, packed.numel(), packed.dtype, what)
    dist.broadcast(packed, src=dist.get_global_rank(group, 0), group=group)
    with torch.no_grad():
        offset = 0
        for s in slices:
            s.copy_(packed[offset : offset + s.numel()])
            offset += s.numel()


def _reset_inside_unshard_params(
    module: nn.Module, target: _Target, name: str, selected: list[tuple[_FSDPState, FlatParamHandle, list[int]]]
) -> Any:
    """Inside ``unshard_params``: the parameters have their full shapes already (unless a rank holds
    only its shard, ``rank0_only``); run the reset and broadcast what it drew."""
    for _, handle, indices in selected:
        if handle.training_state is not HandleTrainingState.SUMMON_FULL_PARAMS or any(
            local_of(handle.params[i]).shape != handle.layout.infos[i].shape for i in indices
        ):
            raise RuntimeError(
                f"reset_parameters() of module {name} was called inside unshard_params, which does not give "
                "this rank its full parameters (rank0_only=True, or recurse=False on another module). Call it "
                "outside unshard_params: it unshards what it needs itself"
            )
    with _rank_agreement.entry_point(_ENTRY):
        handles = [h for _, h, _ in selected]
        result = _run_everywhere(module, target, handles)
        for _, handle, indices in selected:
            params = [handle.params[i] for i in indices]
            for group in _groups([handle]):
                for param in params:
                    local = local_of(param)
                    data = local.contiguous().to(_collectives.comm_device(group, handle.device))
                    what = f"broadcast of unit '{handle.unit_fqn or '<root>'}'"
                    _rank_agreement.agree_before(group, Op.BROADCAST, data.numel(), data.dtype, what)
                    dist.broadcast(data, src=dist.get_global_rank(group, 0), group=group)
                    if data.data_ptr() != local.data_ptr():
                        with torch.no_grad():
                            local.copy_(data)
    return result
