"""Checks, at the root's next forward, that nothing changed the sharded model behind fully_shard's back.

[Note: edits of a sharded model]
Between steps every module registers its parameters' faces ([Note: parameter faces]), each viewing its
slice of the unit's flat shard. ``nn.Module`` methods and assignments can break that silently:
``model.half()`` / ``.to(dtype)`` / ``.to(device)`` swap a face's contents for a tensor outside the shard
(a whole-unit cast is adopted: [Note: casts after sharding]); ``p.data = t`` on a ``DTensor`` face
replaces its wrapper's storage (and maybe its shape) and writes nothing into the shard, so the write
would be lost; ``module.weight = nn.Parameter(...)``, a new submodule, or tying a parameter to one in
``ignored_modules`` registers a tensor no unit manages, so each rank would train its own copy. We do
not rebuild units on the fly; instead the root pre-forward (and `unshard_params`) calls
`check_model_unchanged`, which points the faces back at the shard and raises an error naming the
parameter's FQN and what to do (write in place, in ``unshard_params``, or with ``load_state_dict``).
Every rank decides alike with no collective: the face's global shape and its own storage are the
same kind of fact on every rank, also where this rank's slice is empty. A unit left unsharded
between steps registers its original parameters, which are compared with the unsharded views. The
checks are identity and pointer comparisons: no collective, a few microseconds per parameter.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from fsdp_composable._base import _safety
from fsdp_composable._comm._tensor_parallel import local_of
from fsdp_composable._common_utils import FSDP_FLATTENED, _FSDPState
from fsdp_composable._composable_state import registrations
from fsdp_composable._flat._faces import face_value
from fsdp_composable._flat._flat_layout import _saved_shape
from fsdp_composable._flat_param import FlatParameter, FlatParamHandle
from fsdp_composable._grads import _exposed_grads
from fsdp_composable._guards._dtype_casts import adopt_casts, mark_faces, storage_of
from fsdp_composable._runtime._state_dict_keys import _join
from fsdp_composable._runtime._state_dict_open import close_stale_units
from fsdp_composable.api import ModelEditedAfterShardingError

__all__ = ["check_data_writes", "check_model_unchanged"]


# [Note: cheap edit checks]
# A full scan (every holder's registration, every module's parameters) costs milliseconds on a large
# model, too much for every forward. Registering a parameter or a submodule goes through
# ``nn.Module.register_parameter`` / ``register_module`` (also ``m.w = nn.Parameter(...)`` and
# ``m.sub = nn.Linear(...)``), whose global registration hooks count registrations in the registry
# (`_composable_state.registrations`); the full scan runs only when that count moved since the root's
# last check, which the root context records (``RootContext.checked_registrations``). ``.data``
# assignments (``.half()``, ``.to()``, ``p.data = t``) have no hook, so every forward compares each
# parameter's data pointer with its view's: two C calls per parameter. `_torch_interop` installs the
# hooks with the first `fully_shard` call: registrations before it concern no sharded model.


def check_model_unchanged(root: _FSDPState) -> None:
    """Raise `ModelEditedAfterShardingError` if a parameter of any state under ``root`` was cast, moved,
    reassigned or replaced, or a parameter was added, since `fully_shard` (see [Note: cheap edit checks]);
    nothing when a benchmark switched the checks off ([Note: safety switches])."""
    if not _safety.current().edit_checks:
        return
    states = root.all_states or [root]
    for state in states:
        close_stale_units(state)  # a state_dict()/load_state_dict() that raised midway
    adopt_casts(states)  # model.half(), .to(dtype): see [Note: casts after sharding]
    ctx = root.ctx
    if ctx is None or ctx.checked_registrations != registrations():
        for state in states:
            for handle in state.handles:
                mark_faces(handle)  # what `_apply` took with a face's contents
                _check_handle(handle)
        _check_no_new_parameters(root, states)
        if ctx is not None:
            ctx.checked_registrations = registrations()
    check_data_writes(states)


def check_data_writes(states: list[_FSDPState]) -> None:
    """Point back at the shard, and refuse, whatever no longer views it: a face whose contents a partial
    cast or a move swapped (``_apply``), an original parameter whose ``.data`` was replaced while
    registered (also at the entry of `unshard_params`, which would otherwise gather the shard
    without it). A unit whose every tensor still views its shard costs one comparison per parameter."""
    edited = [h for state in states for h in state.handles if not _views_intact(h)]
    if edited:
        _restore_views(edited)
    _exposed_grads.refuse_replaced_grad_data([h for state in states for h in state.handles])




def _exposed(handle: FlatParamHandle) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """What the holders register now (the faces between steps) and the views their memory must be."""
    if handle.is_unsharded:
        return handle.params, handle._unsharded_views
    if handle.registered is handle.faces:
        return handle.faces, handle._sharded_views
    return handle.params, handle._sharded_views


def _same_data(param: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``param.data`` is still ``view``. Every empty tensor has data pointer 0, so for a
    parameter whose slice of this rank's shard is empty compare the storages as well; otherwise
    ``p.data = t`` goes unnoticed on exactly the ranks that hold none of ``p``, they run the next
    forward while the others raise, and the ranks' collectives no longer match."""
    # a plain parameter's own pointers are its ``.data``'s, without making that tensor (every step)
    data = param if type(param) is nn.Parameter else local_of(param)
    if data.data_ptr() != view.data_ptr():
        return False
    return view.numel() > 0 or data.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()


def _intact(param: torch.Tensor, view: torch.Tensor) -> bool:
    data = local_of(param)
    if not (_same_data(param, view) and data.dtype == view.dtype and data.numel() == view.numel()):
        return False
    # a face: ``p.data = t`` leaves the local tensor alone and replaces the wrapper's storage (and shape)
    mark = getattr(param, "_fsdp_storage", None)
    return mark is None or (mark == storage_of(param) and param.dtype == view.dtype)


def _views_intact(handle: FlatParamHandle) -> bool:
    exposed, views = _exposed(handle)
    if exposed is handle.faces and any(f.shape != _saved_shape(i) for f, i in zip(exposed, handle.layout.infos)):
        return False
    return all(_intact(p, v) for p, v in zip(exposed, views))


def _fqn(handle: FlatParamHandle, fqn: str) -> str:
    return _join(handle.unit_fqn, fqn)


def _check_handle(handle: FlatParamHandle) -> None:
    flat = handle.flat_param
    if flat.dtype != handle.dtype or flat.device != handle.shard_device:
        # flat-parameter mode: `.half()`/`.to()` cast the registered flat parameter itself
        _raise_cast(handle, handle.unit_fqn or "<root>", flat, "flat parameter of unit", restored=False)
    for param, registered, info in zip(handle.params, handle.registered, handle.layout.infos):
        for module, attr, fqn in info.holders:
            # flat-parameter mode keeps original parameters as plain attributes instead
            if module._parameters.get(attr) is not registered and module.__dict__.get(attr) is not param:
                _raise_replaced(_fqn(handle, fqn), module._parameters.get(attr))


def _point_faces_back(handle: FlatParamHandle) -> None:
    """Swap each face that no longer views its slice of the shard back to a ``DTensor`` that does
    (``_apply`` swapped its contents: [Note: casts after sharding]; ``p.data = t`` replaced its storage);
    a gradient it had is exposed again."""
    layout = handle.layout
    had_grads = False
    specs = handle.face_specs(handle.dtype)
    for face, info, spec, view in zip(handle.faces, layout.infos, specs, handle._sharded_views):
        if _intact(face, view) and face.shape == _saved_shape(info):
            continue
        had_grads |= face.grad is not None
        face.grad = None
        value = face_value(view.view(layout.local_shape(info)), spec)
        torch.utils.swap_tensors(face, nn.Parameter(value, requires_grad=face.requires_grad))
    mark_faces(handle)
    if had_grads:  # not when zero_grad() cleared them: the next forward releases that gradient
        _exposed_grads.expose_sharded_grads(handle)


def _restore_views(handles: list[FlatParamHandle]) -> None:
    """Point every tensor that no longer views its slice back at it; raise for the first one."""
    first: Optional[tuple[FlatParamHandle, str, torch.Tensor]] = None
    for handle in handles:
        exposed, views = _exposed(handle)
        faces = exposed is handle.faces
        for param, info, view in zip(exposed, handle.layout.infos, views):
            if first is None and not (_intact(param, view) and (not faces or param.shape == _saved_shape(info))):
                first = (handle, _fqn(handle, info.fqn), local_of(param))
        if faces:
            _point_faces_back(handle)
        else:
            handle.use_unsharded_views() if handle.is_unsharded else handle.use_sharded_views()
    if first is not None:
        _raise_cast(*first, "parameter", restored=True)


def _raise_cast(handle: FlatParamHandle, fqn: str, data: torch.Tensor, what: str, restored: bool) -> None:
    if data.dtype != handle.dtype:
        raise ModelEditedAfterShardingError(
            f"{what} '{fqn}' was cast from {handle.dtype} to {data.dtype} after fully_shard, but not together "
            "with every parameter of its unit (or the unit has tensor-parallel parameters). A cast after "
            "fully_shard must cover whole units alike: cast the model or a unit's module (model.half(), "
            f".to(dtype)); or pass mixed_precision=MixedPrecision(param_dtype={data.dtype}) to compute in "
            f"{data.dtype}, or cast before calling fully_shard."
            + (f" The parameters were put back to {handle.dtype}" if restored else "")
        )
    if data.device != handle.shard_device:
        raise ModelEditedAfterShardingError(
            f"{what} '{fqn}' was moved from {handle.shard_device} to {data.device} after fully_shard "
            "(model.to(device), .cuda(), .cpu()). Move the model before calling fully_shard (or pass device_id=)."
            + (f" The parameters were put back on {handle.shard_device}" if restored else "")
        )
    raise ModelEditedAfterShardingError(
        f"{what} '{fqn}' had its .data replaced after fully_shard (p.data = t). Between steps a parameter is a "
        "DTensor viewing this rank's shard, which such an assignment does not write. Write values in place "
        "(p.copy_(t) with a DTensor t, p.to_local().copy_(...)), inside `with unshard_params(model, "
        "writeback=True):` (p.data = t there), or with load_state_dict. The assignment was undone"
    )


def _raise_replaced(fqn: str, current: object) -> None:
    now = "nothing" if current is None else f"a new {type(current).__name__}"
    raise ModelEditedAfterShardingError(
        f"parameter '{fqn}' was replaced after fully_shard (its module now registers {now}), so the units "
        "no longer manage it and each rank would train its own copy. Build the model completely (new "
        "parameters, tied weights, swapped submodules) before calling fully_shard, or assign values in place "
        "inside `with unshard_params(model, writeback=True):`"
    )


def _check_no_new_parameters(root: _FSDPState, states: list[_FSDPState]) -> None:
    # A parameter tied (before fully_shard) to one in ignored_modules is ignored everywhere, like FSDP1.
    ignored_modules = {m for s in states for m in s.ignored_modules}
    ignored_params = {p for s in states for p in s.ignored_params}
    for name, module in root.module.named_modules():
        if module in ignored_modules:
            continue
        for attr, param in module._parameters.items():
            if param is None or type(param) is FlatParameter or getattr(param, FSDP_FLATTENED, False):
                continue
            if param not in ignored_params:
                _raise_added(_join(name, attr), module)


def _raise_added(fqn: str, module: nn.Module) -> None:
    raise ModelEditedAfterShardingError(
        f"parameter '{fqn}' ({type(module).__name__}) was added or replaced after fully_shard, so no unit manages it "
        "and each "
        "rank would train its own copy. Add parameters and submodules before calling fully_shard, or put the "
        "new module in ignored_modules of a fully_shard call made after adding it"
    )
