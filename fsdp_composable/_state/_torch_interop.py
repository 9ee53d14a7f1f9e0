"""Every change this library makes to torch's own behaviour, in one place.

1. A global optimizer step pre-hook (``register_optimizer_step_pre_hook``, torch's public extension
   point), registered by the first `fully_shard` call: it catches optimizers that stepped before
   `fully_shard` or hold the wrong parameters of a flat-mode wrapper (and, on every step, a unit
   left unsharded between steps: [Note: a unit left unsharded]), and installs 2. on the
   optimizers that hold our parameters. Why: see [Note: optimizers built before fully_shard].
2. Per optimizer, a state-dict post-hook and a load-state-dict pre-hook (``Optimizer.
   register_state_dict_post_hook`` / ``register_load_state_dict_pre_hook``, public): ``optim.
   state_dict()`` and torch's ``get/set_optimizer_state_dict`` give and take the global form, through
   the same conversion as `optim_state_dict`. Why: see [Note: torch's optimizer state dict]. The
   post-hook reads (never changes) the stack for torch's ``_load_optim_state_dict``.
3. torch's ``clip_grad_norm_`` routed through `_clip_grad_norm_` when given our parameters (the global
   norm instead of this rank's), installed by the first `fully_shard` call. Why, and why a closure
   cell: see [Note: torch's clip_grad_norm_] in `_torch_clip`.
4. On each root module, a state-dict pre-hook (``nn.Module``'s public hook) that recognises torch's
   ``torch.distributed.checkpoint.state_dict`` API and switches the state-dict type its options ask
   for. Why, and why frames are read: see [Note: torch's model state-dict API].
5. ``nn.Module``'s global parameter and module registration hooks (public:
   ``register_module_parameter_registration_hook`` / ``register_module_module_registration_hook``),
   installed by the first `fully_shard` call: they count registrations in the registry, telling the
   checks of a sharded model that a parameter or submodule was registered. Why: see [Note: cheap edit
   checks] in `_model_edit_checks`.
6. One more global module registration hook (public, as 5.), installed with it: ``DistributedDataParallel``
   registering a sharded model as its ``module`` raises `ShardedModelWrappedError` on every rank
   before DDP's first collective. Why: see [Note: DDP around a sharded model] in `_ddp_guard`.
7. Read only, no change: `_entry_points._live_forward` reads the stack for torch's
   ``nn.Module._call_impl`` of a root module, to tell a forward running now from one a
   ``BaseException`` left open (which skips torch's ``always_call`` hooks); torch offers no public
   way to ask, and it is read where the import order allows (this module imports the runtime).

Nothing here keeps a process-wide table: what was installed is found where torch keeps it (its
global hook dicts, the optimizer's and the module's hook dicts, the clip function's closure cell), and
what an installed change remembers is held by the object it is installed on (5. is the exception:
the registry keeps its count). Changes 1 to 4 are tested in tests/test_torch_interop.py, 5. by the
edit-check tests, 6. by tests/test_accelerate.py, 7. by the recovery tests, on the torch we run
(2.13); code that reads torch's internals (its hook dicts, the clip closure, the frames) has a
fallback for other versions of the supported range (``torch>=2.5``).

[Note: torch's model state-dict API]
torch's API calls ``model.state_dict()`` / ``model.load_state_dict()`` and post-processes the result
by its ``StateDictOptions``; it only switches torch FSDP's own state-dict type, which it finds by
type. Loading needs no switch: the parameters are the faces, torch gives them values in their own
layout (``full_state_dict=True``: it distributes the full tensors over the faces' layout itself), and
every load copies a value of any layout into the faces ([Note: loading into the faces]). Saving
does: our default type is FULL (the unsharded model's state dict), so left alone it would gather the
whole model on every rank even for the default options, which torch (and DCP) mean to be sharded.
So while torch's API saves a root we manage, the root's state-dict pre-hook sets the type its
options ask for, the way torch does for its own FSDP:
- ``full_state_dict=False`` (the default): SHARDED, ``DTensor``s of the original shapes that DCP
  saves at N ranks and loads at M;
- ``full_state_dict=True``: FULL (full tensors; ``cpu_offload=True`` also means ``offload_to_cpu``
  and ``rank0_only``, as torch sets for its FSDP).
A one-shot post-hook puts the previous type back. A call is torch's when one of the frames above
the hook runs torch's ``_get_model_state_dict`` with this module as its ``model``: torch passes its
options to ``model.state_dict()`` by no public means (it only switches torch FSDP's own type, found
by class), so the frames are read, never changed; were torch to rename it, nothing is switched and
the default FULL state dict still saves and loads correctly with DCP at any world size (full
tensors on every rank), just not sharded.
The optimizer's half needs no detection: see [Note: torch's optimizer state dict].
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from types import CodeType, FrameType
from typing import Any, Optional, Sequence

import torch
import torch.nn.utils
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules import module as torch_module
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.optim import optimizer as torch_optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp_composable._comm import _rank_agreement
from fsdp_composable._common_utils import FLAT_MODE, FSDP_FLATTENED, _FSDPState, _get_fsdp_states
from fsdp_composable._composable_state import (
    _any_applied,
    count_registration,
    optimizer_check,
    set_optimizer_check,
)
from fsdp_composable._flat._faces import is_face
from fsdp_composable._flat_param import FlatParameter, FlatParamHandle, HandleTrainingState
from fsdp_composable._grads import _exposed_grads
from fsdp_composable._guards._ddp_guard import refuse_ddp_of_sharded
from fsdp_composable._state._optim_convert import (
    STEP,
    _check_same_on_all_ranks,
    _check_saved_same_on_all_ranks,
    _collect,
    _every_handle,
    _flat_global,
    _flat_local,
    _handles_holding,
    _in_global_form,
    _local_state,
    _optimizer_params,
    _unit_of,
)
from fsdp_composable._state._state_dict_settings import Setting, _restore_setting, _set_setting
from fsdp_composable._state._torch_clip import _route_torch_clip_grad_norm
from fsdp_composable.api import (
    FullStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictType,
)

__all__: list[str] = []


# ---------------------------------------------------------------------------- stale optimizers
# [Note: optimizers built before fully_shard]
# fully_shard registers a face in place of each original parameter, so an optimizer built before it
# holds parameters nothing steps any more. That and two more cases go wrong silently or cryptically,
# and a global step pre-hook checks for them on each optimizer's first step after a fully_shard call
# over its parameters (then not again until the next such call):
# - optimizer state whose shape is not its parameter's (state created before sharding);
# - the wrapper with use_orig_params=False: the optimizer must hold the flat parameters; original
#   parameters never receive gradients there.
# The registry remembers for each optimizer (weakly, `optimizer_check`) how many of our parameters it
# held when it was checked, and their units; a new `fully_shard` call over its parameters changes that
# number, so it is checked again. Counting is one attribute read per parameter per step; an optimizer of a process
# with no `fully_shard` state at all returns before it.


def _install_process_changes() -> None:
    """Called by every fully_shard call (and the wrapper): the global hook into torch's optimizers,
    the routing of torch's clip_grad_norm_ and the module registration hooks, each installed once per
    process."""
    _route_torch_clip_grad_norm()
    installed = getattr(torch_optimizer, "_global_optimizer_pre_hooks", None)  # torch's own record
    if installed is None or _check_optimizer_on_first_step not in installed.values():
        register_optimizer_step_pre_hook(_check_optimizer_on_first_step)
    for register, record, hook in (
        (register_module_parameter_registration_hook, "_global_parameter_registration_hooks", count_registration),
        (register_module_module_registration_hook, "_global_module_registration_hooks", count_registration),
        (register_module_module_registration_hook, "_global_module_registration_hooks", refuse_ddp_of_sharded),
    ):
        hooks = getattr(torch_module, record, None)  # torch's own record
        if hooks is None or hook not in hooks.values():
            register(hook)


def _count_ours(optim: torch.optim.Optimizer) -> int:
    # every step, per parameter: a list comprehension, not a generator resumed per parameter
    params = _optimizer_params(optim)
    return len([p for p in params if getattr(p, FSDP_FLATTENED, False) or type(p) is FlatParameter])


def _refuse_unsharded(handles: Sequence[FlatParamHandle], first: bool) -> None:
    """Raise if a unit of ``handles`` is unsharded: the optimizer would step its full-shape views.
    Later steps check only units left unsharded outside forward and backward (as the first does,
    every unsharded unit); a step between a forward and its backward is caught on the first."""
    for handle in handles:
        unsharded = handle.is_unsharded or handle.unshard_in_flight
        if not unsharded or (not first and handle.training_state is not HandleTrainingState.IDLE):
            continue
        raise RuntimeError(
            f"optimizer.step() was called while the parameters of unit '{handle.root_fqn}' are "
            "unsharded (between a forward and its backward, inside unshard_params, after unshard(module), or "
            "kept by set_reshard_after_backward(False)), so it would step their full-shape copies instead of "
            "the shard. Call reshard(module) on that unit (or step after backward); to get a state-dict "
            "template from a fresh optimizer (init_optim_state, torch's get_state_dict), call it before the "
            "forward"
        )


def _hidden_original(param: torch.Tensor) -> bool:
    """An original parameter that a face replaces between steps ([Note: parameter faces])."""
    return not is_face(param)


def _refuse_original_of_unsharded_unit(param: torch.Tensor, fqn: str) -> None:
    """Raise if ``param``'s unit is unsharded now: the optimizer was then most likely built from the
    originals that an unsharded unit registers, not before fully_shard."""
    for handle in _every_handle():
        if not any(p is param for p in handle.params) or not (handle.is_unsharded or handle.unshard_in_flight):
            continue
        raise RuntimeError(
            f"the optimizer holds parameter '{fqn}' as registered while its unit '{handle.root_fqn}' is "
            "unsharded (after unshard(module), inside unshard_params, or kept by "
            "set_reshard_after_backward(False) or reshard_after_forward=False): between steps a DTensor "
            "parameter replaces it, which the optimizer would never step. Build the optimizer while every "
            "unit is sharded, e.g. right after fully_shard or after reshard(module), from model.parameters()"
        )


def _managed_tensor_ids() -> set[int]:
    """Every flat parameter, original parameter and face of this process's units."""
    return {id(t) for h in _every_handle() for t in (h.flat_param, *h.params, *h.faces)}


def _check_optimizer_on_first_step(optim: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _any_applied():  # nothing sharded in this process is alive
        return
    ours = _count_ours(optim)
    checked = optimizer_check(optim)
    if checked is not None and checked[0] == ours:
        # a later step on a unit left unsharded would update its full-shape views, which the next
        # reshard throws away: silently no step ([Note: a unit left unsharded] in _module_controls)
        _refuse_unsharded(checked[1], first=False)
        _exposed_grads.refuse_replaced_grad_data(checked[1])
        return
    set_optimizer_check(optim, (ours, ()))
    if ours:
        _install_optimizer_hooks(optim)
        _take_back_state_loaded_early(optim)
        handles = _handles_holding(_optimizer_params(optim))
        try:
            _refuse_unsharded(handles, first=True)  # its first step would create state of the full shapes
        except RuntimeError:
            set_optimizer_check(optim, None)
            raise
        set_optimizer_check(optim, (ours, tuple(handles)))
        _exposed_grads.refuse_replaced_grad_data(handles)
    known = _managed_tensor_ids()
    for group in optim.param_groups:
        for param in group["params"]:
            if not getattr(param, FSDP_FLATTENED, False) or id(param) not in known:
                continue  # not ours (torch's FSDP1, or another copy of this library, marks the same way)
            fqn = getattr(param, "_fsdp_fqn", "?")
            if not getattr(param, FLAT_MODE, False) and _hidden_original(param):
                _refuse_original_of_unsharded_unit(param, fqn)
                raise RuntimeError(
                    f"the optimizer holds parameter '{fqn}' as it was before fully_shard: fully_shard registers a "
                    "new DTensor parameter in its place, which the optimizer would never step. Build the optimizer "
                    "after fully_shard, from model.parameters(), while no step is open (a step that raised in backward "
                    "stays open, its units registering these parameters, until the next forward or an entry point "
                    "such as unshard_params)"
                )
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
# Between steps the optimizer holds the faces ([Note: parameter faces]), so torch creates their state
# as DTensors of the parameters' shapes and a plain ``optim.state_dict()`` is already the global
# (SHARDED) form that `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` names by FQN
# and DCP saves at N ranks and loads at M (a tensor-parallel parameter's too: [Note: 2-D faces]): the
# hooks leave it as it is. What they still convert is the state of the parameters that are not faces,
# the wrapper's flat parameters (``use_orig_params=False``), presented as ``Shard(0)`` DTensors of the
# padded flat shape (no communication; they load at the same world size and wrapping only: use
# `optim_state_dict` to move between them). Every optimizer that holds our parameters gets two hooks:
# - a state-dict post-hook checks that every rank holds the same parameters and state (a collective
#   per process group) and presents the flat parameters' state in the global form;
# - a load-state-dict pre-hook takes the global form back (DTensors of any placement and mesh size,
#   or full tensors: a face's full value becomes its DTensor chunk), keyed by int ids or by FQN (as
#   torch's set_optimizer_state_dict passes it): it matches saved to current parameters by position
#   in the param groups, as ``load_state_dict`` does.
# Units are visited in the order they were built, never in the optimizer's order, so ranks that list
# parameters in different orders still run the same collectives; the presented state is ordered the
# same way (torch's API gathers DTensor values in the dict's order), and torch's full-state-dict load
# gets a template of plain tensors (see `_under_torch_full_optim_load`). Both hooks are collectives:
# the ranks first agree on which parameters the optimizer holds (saving) or on the state given for
# each parameter (loading), and any difference is an error on every rank, before any payload.
# Hooks are installed when an optimizer
# first steps after `fully_shard` (torch's get/set_optimizer_state_dict step a fresh optimizer first),
# and by `init_optim_state`, `optim_state_dict` and `optim_state_dict_to_load`; whether they are is
# read from the optimizer's own hook dict.


def _numbering(optim: torch.optim.Optimizer) -> dict[int, int]:
    """id(param) -> the number ``optim.state_dict()`` gives it."""
    out: dict[int, int] = {}
    start = 0
    for group in optim.param_groups:
        for i, p in enumerate(group["params"], start):
            out.setdefault(id(p), i)
        start += len(group["params"])
    return out


@_rank_agreement.entry_point("optimizer.state_dict()")
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
    for unit in units:
        handle = unit.handle
        # faces' state is torch's own DTensors already; ``step`` is handed out live (a plain tensor the
        # next step increments in place, which a full gather keeps as it is), so a saved dict would count on
        for face in handle.faces:
            entry = state.get(numbers.get(id(face), -1))
            if isinstance(entry, Mapping) and isinstance(entry.get(STEP), torch.Tensor):
                state[numbers[id(face)]] = {**entry, STEP: entry[STEP].clone()}
        number = numbers.get(id(handle.flat_param))  # the wrapper's flat-parameter mode
        if number is not None and isinstance(state.get(number), Mapping):
            state[number] = {
                key: _flat_global(handle, v.detach())
                if isinstance(v, torch.Tensor) and key != STEP and v.shape == handle.flat_param.shape
                else v
                for key, v in state[number].items()
            }
    # The same order on every rank: a parameter with no state here (its slice is empty and it was
    # never stepped here) was added above, and torch's API gathers DTensor values in this dict's order, so our
    # parameters come in the order the units were built, never in the optimizer's numbering (ranks
    # may list the parameters in different orders).
    built: dict[int, tuple[int, int]] = {}
    for h, handle in enumerate(handles):
        for k, param in enumerate([handle.flat_param, *handle.faces]):
            if id(param) in numbers:
                built[numbers[id(param)]] = (h, k)

    def position(key: Any) -> tuple[Any, ...]:
        return (0, *built[key]) if key in built else (1, str(type(key)), key)

    if _under_torch_full_optim_load():  # a template whose values torch replaces by full tensors
        for number in built:
            if isinstance(state.get(number), Mapping):
                state[number] = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state[number].items()}
    return {**state_dict, "state": {key: state[key] for key in sorted(state, key=position)}}


def _under_torch_full_optim_load() -> bool:
    """Whether torch's ``set_optimizer_state_dict`` (or ``set_state_dict``) asks for this state dict
    as the template of a full-state-dict load: the one call of ``optim.state_dict()`` under its
    ``_load_optim_state_dict``. torch then fills every tensor of the template from the full values,
    in the order of each rank's optimizer, with a collective per DTensor (``distribute_tensor``
    scatters from rank 0): ranks that list the parameters in different orders would run different
    collectives (a gloo abort). Plain tensors there are replaced by the full values with no
    communication, and the load pre-hook slices them. Frames are read, never changed, as in
    [Note: torch's model state-dict API]."""
    dsd = sys.modules.get("torch.distributed.checkpoint.state_dict")
    fn = getattr(dsd, "_load_optim_state_dict", None)
    if fn is None:
        return False
    code = inspect.unwrap(fn).__code__
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


@_rank_agreement.entry_point("optimizer.load_state_dict()")
def _take_back_state_hook(optim: torch.optim.Optimizer, state_dict: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Optimizer load-state-dict pre-hook: see [Note: torch's optimizer state dict]."""
    current = _optimizer_params(optim)
    handles = _handles_holding(current)
    if not handles:
        return None
    groups_in, state_in = state_dict.get("param_groups"), state_dict.get("state")
    usable = (
        isinstance(groups_in, (list, tuple))
        and isinstance(state_in, Mapping)
        and all(isinstance(g, Mapping) and "params" in g for g in groups_in)
    )
    saved_groups: list[Any] = list(groups_in) if usable else []  # type: ignore[arg-type]
    saved_state: Mapping[Any, Any] = state_in if usable else {}  # type: ignore[assignment]
    saved_keys = [key for g in saved_groups for key in g["params"]]
    # otherwise load_state_dict raises its own error (on every rank: the ranks agree below first)
    usable = usable and len(saved_groups) == len(optim.param_groups) and len(saved_keys) == len(current)
    key_of = {id(p): key for key, p in zip(saved_keys, current)}
    units = [_unit_of(h) for h in handles]
    saved_of_unit = []
    for handle in handles:
        flat_key = key_of.get(id(handle.flat_param))
        keys = [flat_key] * len(handle.faces) if flat_key is not None else [key_of.get(id(p)) for p in handle.faces]
        saved_of_unit.append([saved_state.get(key) if usable and key is not None else None for key in keys])
    _check_saved_same_on_all_ranks(units, saved_of_unit, usable)
    if not usable:
        return None
    state = dict(saved_state)
    for unit, saved in zip(units, saved_of_unit):
        handle = unit.handle
        flat_key = key_of.get(id(handle.flat_param))
        if flat_key is not None:
            entry = saved_state.get(flat_key)
            if isinstance(entry, Mapping):
                state[flat_key] = {key: _flat_local(unit, key, v) for key, v in entry.items()}
            continue
        keys = [key_of.get(id(p)) for p in handle.faces]
        for key, entry in zip(keys, _local_state(unit, [s if isinstance(s, Mapping) else None for s in saved])):
            if key is not None and entry is not None:
                state[key] = entry
    return {**state_dict, "state": state}


def _install_optimizer_hooks(optim: torch.optim.Optimizer) -> None:
    if _present_state_hook in getattr(optim, "_optimizer_state_dict_post_hooks", {}).values():
        return
    optim.register_state_dict_post_hook(_present_state_hook)
    optim.register_load_state_dict_pre_hook(_take_back_state_hook)


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


def _torch_code() -> Optional[CodeType]:
    """The code object of torch's ``_get_model_state_dict``; None if its module was never imported (then
    torch's API cannot be running)."""
    dsd = sys.modules.get("torch.distributed.checkpoint.state_dict")
    fn = getattr(dsd, "_get_model_state_dict", None)
    return inspect.unwrap(fn).__code__ if fn is not None else None


def _torch_call_options(module: nn.Module) -> Optional[Any]:
    """The ``_StateDictInfo`` of the torch API call saving ``module`` right now, or None."""
    code = _torch_code()
    if code is None:
        return None
    frame: Optional[FrameType] = sys._getframe(2)
    while frame is not None:
        if frame.f_code is code and frame.f_locals.get("model") is module:
            return frame.f_locals.get("info")
        frame = frame.f_back
    return None


def _register_torch_api_hooks(module: nn.Module) -> None:
    """Called by `fully_shard` before it builds its state, so that on the root this pre-hook runs
    before the state-dict hooks of `_state_dict_utils` read the type."""
    if _state_dict_pre_hook in getattr(module, "_state_dict_pre_hooks", {}).values():
        return
    module.register_state_dict_pre_hook(_state_dict_pre_hook)


class _OneShot:
    """A post-hook that restores the setting torch's call replaced, once, then removes itself. It is
    the one holder of that previous setting, registered on the module it belongs to."""

    def __init__(self, states: list[_FSDPState], previous: list[Setting]) -> None:
        self.states, self.previous = states, previous
        self.handle: Any = None

    def __call__(self, *args: Any) -> None:
        self.handle.remove()
        _restore_setting(self.states, self.previous)


def _state_dict_pre_hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    hook = _switch(module)
    if hook is not None:
        hook.handle = module.register_state_dict_post_hook(hook)


def _switch(module: nn.Module) -> Optional[_OneShot]:
    """Set the type torch's options ask for on every state under ``module``, if torch's API is the
    caller; then returns the one-shot hook that restores it, for the caller to register."""
    _restore(module)  # a previous call that raised halfway
    info = _torch_call_options(module)
    states = _get_fsdp_states(module)
    if info is None or not states:
        return None
    config: StateDictConfig
    if getattr(info, "full_state_dict", False):
        rank0 = bool(getattr(info, "cpu_offload", False))
        kind, config = StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=rank0, rank0_only=rank0)
    else:
        kind, config = StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()
    return _OneShot(states, _set_setting(states, kind, config))


def _restore(module: nn.Module) -> None:
    """Run the one-shot hooks a call that raised halfway left on ``module``."""
    for hook in list(getattr(module, "_state_dict_hooks", {}).values()):
        if isinstance(hook, _OneShot):
            hook()
