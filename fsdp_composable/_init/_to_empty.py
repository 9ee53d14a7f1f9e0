"""``to_empty(device=...)`` on a sharded module keeps every parameter a view of its unit's shard.

[Note: to_empty after sharding]
The meta-device recipe builds a model under ``torch.device("meta")``, calls `fully_shard`, then
``model.to_empty(device=d)`` and re-initialises it (``model.reset_parameters()``, a loop calling each
module's ``reset_parameters()``, or ``nn.init`` over ``model.parameters()``). Our `fully_shard`
already materialises meta units (see [Note: param_init_fn is called per module] in `_init_utils`),
so the shards exist when ``to_empty`` runs. Left alone, ``nn.Module.to_empty`` would swap every
face's contents ([Note: parameter faces]) for a ``DTensor`` over new uninitialised storage outside the
unit's flat shard (``torch.utils.swap_tensors``, as for any ``DTensor`` parameter): an init loop right
after it (``nn.init`` over ``model.parameters()``, FSDP2's recipe) would write into tensors no unit
manages, and nothing could tell those writes from a swap to undo. Torch offers no hook on ``_apply``.

So at the end of `fully_shard` every module whose subtree holds a parameter a unit manages gets an
instance attribute ``to_empty`` (the way `_reset_params` installs ``reset_parameters``): it runs torch's
own ``to_empty`` (buffers and parameters no unit manages get new storage, as in a plain model) and then
points each face, original parameter, the flat parameter and their gradients back at the storage they
had (a face also gets back the attributes the swap took). That is a valid result of ``to_empty``, whose
values are unspecified: the shards keep the values they hold, and an initialisation that follows writes
into them. ``device`` must be where the shards live or the unit's compute device (the CPU-offload recipe
calls ``to_empty(device="cuda")``); any other device is refused before anything changes, with an error
naming the unit. Moving a sharded model is not what ``to_empty`` is for here: move or materialise it
before `fully_shard` (``device_id=``). No collective runs, so a call on some ranks only is harmless.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn

from fsdp_composable._comm._tensor_parallel import local_of, point_at
from fsdp_composable._common_utils import API_NAME, _FSDPState
from fsdp_composable._composable_state import _get_module_state
from fsdp_composable._flat_param import FlatParamHandle
from fsdp_composable._grads import _exposed_grads
from fsdp_composable._guards._dtype_casts import mark_faces
from fsdp_composable._init._group_units import unit_roots_named_modules

__all__ = ["install_to_empty", "to_empty_keeping_shards"]

_STATES = "_fsdp_to_empty_states"  # on the module: the states whose units it holds parameters of


def install_to_empty(state: _FSDPState) -> None:
    """Give every module under ``state.module`` whose subtree holds a parameter of ``state``'s units
    the wrapper (see [Note: to_empty after sharding])."""
    holders = {m for h in state.handles for info in h.layout.infos for m, _, _ in info.holders}
    if not holders:
        return
    for _, module in unit_roots_named_modules(state):  # every member of fully_shard([m1, m2])
        if not holders.intersection(module.modules()):
            continue
        states = module.__dict__.get(_STATES)
        if states is None:
            states = module.__dict__[_STATES] = []
            module.__dict__["to_empty"] = _make_wrapper(module, module.__dict__.get("to_empty"))
        if state not in states:
            states.append(state)


def _make_wrapper(module: nn.Module, original: Optional[Callable[..., Any]]) -> Callable[..., nn.Module]:
    ref = weakref.ref(module)  # no cycle through the module's own __dict__

    def to_empty(*, device: Any, recurse: bool = True) -> nn.Module:
        m = ref()
        assert m is not None  # the method is looked up on the module, so it is alive
        return to_empty_keeping_shards(m, original, device, recurse)

    return to_empty


def _handles_under(module: nn.Module, recurse: bool) -> list[FlatParamHandle]:
    """Every handle holding a parameter that ``module`` (with ``recurse``, its subtree) registers: of
    the states installed on it (its own and enclosing ones) and of states below it (bottom-up calls)."""
    scope = list(module.modules()) if recurse else [module]
    states: dict[int, _FSDPState] = {id(s): s for s in module.__dict__.get(_STATES, [])}
    for m in scope:
        state = _get_module_state(m, API_NAME)
        if state is not None:
            states.setdefault(id(state), state)
    members = set(scope)
    return [
        h
        for s in states.values()
        for h in s.handles
        if any(m in members for info in h.layout.infos for m, _, _ in info.holders)
    ]


def to_empty_keeping_shards(
    module: nn.Module, original: Optional[Callable[..., Any]], device: Any, recurse: bool
) -> nn.Module:
    """torch's ``to_empty``, then every unit tensor under ``module`` back on its shard storage."""
    target = torch.device(device) if device is not None else None
    handles = _handles_under(module, recurse)
    for handle in handles:
        allowed = {handle.shard_device, handle.device}
        if target is not None and not any(_same_device(target, d) for d in allowed):
            raise RuntimeError(
                f"to_empty(device={device!r}) was called on a fully_shard model whose unit "
                f"'{handle.unit_fqn or '<root>'}' keeps its shards on {handle.shard_device}: after fully_shard "
                "to_empty only re-creates storage in place. Build or move the model on its device before "
                "fully_shard (or pass device_id=), then call to_empty with that device"
            )
    saved = [(t, local_of(t)) for h in handles for t in _unit_tensors(h)]
    if original is not None:
        original(device=device, recurse=recurse)
    else:
        nn.Module.to_empty(module, device=device, recurse=recurse)
    for tensor, data in saved:
        if local_of(tensor) is not data:
            point_at(tensor, data)
    for handle in handles:
        mark_faces(handle)
        # the swap also gave each DTensor gradient a new wrapper (what ``p.grad.data = t`` does): show
        # the gradients again over the flat gradient, so the refusal of such writes sees none
        _exposed_grads.expose_sharded_grads(handle)
    return module


def _unit_tensors(handle: FlatParamHandle) -> list[torch.Tensor]:
    # the faces too: torch's to_empty swaps a DTensor face's contents for an empty DTensor
    tensors: list[torch.Tensor] = [handle.flat_param, *handle.params, *handle.faces]
    grads = [t.grad for t in tensors if t.grad is not None]
    return tensors + grads


def _same_device(a: torch.device, b: torch.device) -> bool:
    return _normal(a) == _normal(b)


def _normal(d: torch.device) -> torch.device:
    # "cuda" means the current CUDA device
    return torch.device("cuda", torch.cuda.current_device()) if d.type == "cuda" and d.index is None else d
