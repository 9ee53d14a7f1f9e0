"""Every change this library makes to torch's own behaviour.

[Note: torch's clip_grad_norm_]
Between steps each original parameter's ``.grad`` is this rank's slice of the reduced gradient, so
torch's function would compute and clip with this rank's local norm, silently. FSDP2 gets the global
norm because its gradients are DTensors; ours are plain tensors. So `fully_shard` routes torch's
function through `_clip_grad_norm_`: when one of the given parameters is ours it computes the norm
over every shard (each sharded unit's term summed over its shard group, everything else counted
once), the same on every rank, and clips with it; otherwise it is torch's function, unchanged. The
routing replaces the function torch's public wrapper calls (its closure), so it holds however the
user imported it (``from torch.nn.utils import clip_grad_norm_`` before `fully_shard` included); if
torch's wrapper ever changes shape, the module attributes are replaced instead. With our
parameters it is a collective: call it on every rank with the same parameters, as our own
`clip_grad_norm_(model, ...)` (the one to prefer: it also checks its arguments).

[Note: torch's model state-dict API]
torch's API calls ``model.state_dict()`` / ``model.load_state_dict()`` and post-processes the result
by its ``StateDictOptions``; it only switches torch FSDP's own state-dict type, which it finds by
type. Our default type is FULL (the unsharded model's state dict), so left alone it would gather
the whole model on every rank even for the default options, which torch (and DCP) mean to be
sharded. So while torch's API runs on a root we manage, the root's state-dict pre-hooks set the
type its options ask for, the way torch does for its own FSDP:
- ``full_state_dict=False`` (the default): SHARDED, ``DTensor``s of the original shapes that DCP
  saves at N ranks and loads at M;
- ``full_state_dict=True``: FULL (full tensors; ``cpu_offload=True`` also means ``offload_to_cpu``
  and ``rank0_only``, as torch sets for its FSDP).
A one-shot post-hook puts the previous type back. A call is torch's when one of the frames above
the hook runs torch's ``_get_model_state_dict`` / ``_load_model_state_dict`` with this module as its
``model``; were torch to rename them, nothing is switched and the default FULL state dict still
saves and loads correctly with DCP at any world size (full tensors on every rank), just not sharded.
The optimizer's half needs no detection: see [Note: torch's optimizer state dict] in `_optim_utils`.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from collections.abc import Mapping
from types import CodeType, FrameType
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as clip_grad
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp_composable._common_utils import FLAT_MODE, FSDP_FLATTENED, _FSDPState, _get_fsdp_states
from fsdp_composable._flat_param import FlatParameter
from fsdp_composable._grad_utils import NormPieces
from fsdp_composable._optim_convert import (
    STEP,
    _check_same_on_all_ranks,
    _collect,
    _export_entries,
    _flat_global,
    _flat_local,
    _handles_holding,
    _in_global_form,
    _local_state,
    _optimizer_params,
    _unit_of,
)
from fsdp_composable.api import (
    FullStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictType,
)

__all__: list[str] = []


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


_original: Optional[Callable[..., torch.Tensor]] = None


def _is_ours(p: Any) -> bool:
    return isinstance(p, torch.Tensor) and (getattr(p, FSDP_FLATTENED, False) or type(p) is FlatParameter)


def _install() -> None:
    """Route torch's clip_grad_norm_ through `_clip_grad_norm_` (once per process)."""
    global _original
    if _original is not None:
        return
    public = clip_grad.clip_grad_norm_
    cells = dict(zip(public.__code__.co_freevars, public.__closure__ or ()))
    inner = cells.get("func")
    if inner is not None and callable(inner.cell_contents):
        _original = inner.cell_contents  # torch's function without its no_grad wrapper
        inner.cell_contents = _clip_grad_norm_
        return
    _original = public
    routed = functools.wraps(public)(_clip_grad_norm_)
    clip_grad.clip_grad_norm_ = routed
    torch.nn.utils.clip_grad_norm_ = routed


def _clip_grad_norm_(
    parameters: Union[torch.Tensor, Any],
    max_norm: float,
    norm_type: Union[float, str] = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
) -> torch.Tensor:
    assert _original is not None
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if not any(_is_ours(p) for p in params):
        return _original(params, max_norm, norm_type, error_if_nonfinite, foreach)
    with torch.no_grad():
        total = _global_norm(params, float(norm_type))
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
                "set `error_if_nonfinite=False`"
            )
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total


def _global_norm(params: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    ids = {id(p) for p in params}
    grads = [p.grad for p in params if p.grad is not None]
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    pieces = NormPieces()
    counted: set[int] = set()
    for handle in _handles_holding(params):
        if id(handle.flat_param) in ids:  # a flat-mode wrapper's parameter: its whole shard
            counted.add(id(handle.flat_param))
            pieces.add_unit(handle, handle.flat_param.grad)
        else:
            counted.update(id(p) for p in handle.params if id(p) in ids)
            pieces.add_unit(handle, None, ids)
    for p in params:
        if id(p) not in counted and p.grad is not None:
            counted.add(id(p))
            pieces.add_whole(p.grad)
    return pieces.norm(norm_type, dtype, params[0].device)


_hooked_modules: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


# root module -> the (state, type, config) to put back when torch's call finishes
_saved: "weakref.WeakKeyDictionary[nn.Module, list[tuple[_FSDPState, StateDictType, Optional[StateDictConfig]]]]" = (
    weakref.WeakKeyDictionary()
)


def _torch_codes() -> tuple[CodeType, ...]:
    try:
        from torch.distributed.checkpoint import state_dict as dsd
    except ImportError:  # pragma: no cover - torch without DCP
        return ()
    fns = [getattr(dsd, name, None) for name in ("_get_model_state_dict", "_load_model_state_dict")]
    return tuple(inspect.unwrap(fn).__code__ for fn in fns if fn is not None)


_CODES: Optional[tuple[CodeType, ...]] = None


def _torch_call_options(module: nn.Module) -> Optional[tuple[Any, bool]]:
    """(``_StateDictInfo``, is a load) of the torch API call working on ``module`` right now, or None."""
    global _CODES
    if _CODES is None:
        _CODES = _torch_codes()
    frame: Optional[FrameType] = sys._getframe(2)
    while frame is not None:
        if frame.f_code in _CODES and frame.f_locals.get("model") is module:
            return frame.f_locals.get("info"), frame.f_code is _CODES[-1]
        frame = frame.f_back
    return None


def _register_torch_api_hooks(module: nn.Module) -> None:
    """Called by `fully_shard` before it builds its state, so that on the root these pre-hooks run
    before the state-dict hooks of `_state_dict_utils` read the type."""
    if module in _hooked_modules:
        return
    _hooked_modules.add(module)
    module.register_state_dict_pre_hook(_state_dict_pre_hook)
    module.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)


class _OneShot:
    """A post-hook that restores the previous type once, then removes itself."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.handle: Any = None

    def __call__(self, *args: Any) -> None:
        _restore(self.module)
        self.handle.remove()


def _state_dict_pre_hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    if _switch(module):
        hook = _OneShot(module)
        hook.handle = module.register_state_dict_post_hook(hook)


def _load_state_dict_pre_hook(module: nn.Module, *args: Any) -> None:
    if _switch(module):
        hook = _OneShot(module)
        hook.handle = module.register_load_state_dict_post_hook(hook)


def _switch(module: nn.Module) -> bool:
    """Set the type torch's options ask for on every state under ``module``, if torch's API is the
    caller; True if it did (the caller then registers the one-shot hook that restores it)."""
    _restore(module)  # a previous call that raised halfway
    call = _torch_call_options(module)
    states = _get_fsdp_states(module)
    if call is None or not states:
        return False
    info, is_load = call
    config: StateDictConfig
    if getattr(info, "full_state_dict", False):
        # On load torch has already given every rank the full tensors (or broadcast them).
        rank0 = bool(getattr(info, "cpu_offload", False)) and not is_load
        kind, config = StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=rank0, rank0_only=rank0)
    else:
        kind, config = StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()
    _saved[module] = [(s, s.state_dict_type, s.state_dict_config) for s in states]
    for s in states:
        s.state_dict_type, s.state_dict_config = kind, config
    return True


def _restore(module: nn.Module) -> None:
    for s, kind, config in _saved.pop(module, []):
        s.state_dict_type, s.state_dict_config = kind, config
