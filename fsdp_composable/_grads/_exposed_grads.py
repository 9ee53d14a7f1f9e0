"""A unit's sharded gradient as the user sees it between steps: the original parameters' ``.grad``
views of ``flat_param.grad`` (``expose``), what the user left there folded back in (``stash``), and
the gradient freed once every exposed ``.grad`` was cleared. The lifecycle of the unsharded gradient
is `_reduce_utils`' ([Note: the gradient lifecycle])."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_composable._base import _safety
from fsdp_composable._comm._tensor_parallel import local_of
from fsdp_composable._flat_param import FlatParamHandle
from fsdp_composable.api import ModelEditedAfterShardingError

__all__: list[str] = []


def stash_sharded_grads(handle: FlatParamHandle) -> None:
    """Fold what the user left in the original parameters' ``.grad`` into ``flat_param.grad``.

    Between steps ``.grad`` is a view of the sharded gradient; ``zero_grad(set_to_none=True)`` sets
    it to None, and a user may assign a tensor of their own, or repoint ours (``p.grad.data = t``):
    torch would then accumulate the next backward into that tensor, so we copy it in. Clears the
    parameters' ``.grad`` afterwards."""
    grads = handle.grads
    if not grads.expose_orig:
        return
    ours = grads.exposed
    if not _safety.current().grad_bookkeeping:  # trusted: see [Note: safety switches]
        if _first_exposed_cleared(handle):
            handle.flat_param.grad = None
        for param in handle.faces:
            param.grad = None
        grads.exposed = []
        return
    current = [p.grad for p in handle.faces]
    untouched = len(ours) == len(current) and all(g is v for g, v in zip(current, ours))
    if not ours and all(g is None for g in current):
        pass  # nothing was shown (the unit stayed unsharded after backward): the gradient stays as it is
    elif all(g is None for g in current):
        handle.flat_param.grad = None
        grads.missing = frozenset()
    elif not untouched or _any_rebound(handle, current):
        flat_grad = handle.flat_param.grad
        if flat_grad is None:
            flat_grad = torch.zeros_like(handle.flat_param)
        views = handle.sharded_views_of(flat_grad)
        missing = set(grads.missing) if handle.flat_param.grad is not None else set(range(len(views)))
        with torch.no_grad():
            for i, (grad, view) in enumerate(zip(current, views)):
                mine = ours[i] if ours else None
                if grad is None:
                    view.zero_()
                    missing.add(i)
                elif grad is not mine or _rebound(grad, view):
                    view.copy_(local_of(grad).reshape(view.shape))
                    missing.discard(i)
        handle.flat_param.grad = flat_grad
        grads.missing = frozenset(missing)
    for param, grad in zip(handle.faces, current):
        if grad is not None:
            param.grad = None
    grads.exposed = []


def wrapper_storage(grad: Optional[torch.Tensor]) -> int:
    """The address of a `DTensor` gradient's own storage (see ``UnitGrads.exposed_storage``); 0 for others."""
    return torch._C._storage_address(grad) if isinstance(grad, DTensor) else 0  # type: ignore[attr-defined]


def refuse_replaced_grad_data(handles: "Sequence[FlatParamHandle]") -> None:
    """``p.grad.data = t`` on a `DTensor` gradient replaces its wrapper and leaves its local tensor,
    which views the flat gradient, alone: the write would be lost. Refuse it (at the next optimizer
    step or forward), with every gradient shown again as it was: one address comparison per gradient."""
    for handle in handles:
        grads = handle.grads
        for i, (face, grad, mark) in enumerate(zip(handle.faces, grads.exposed, grads.exposed_storage)):
            if mark == 0 or face.grad is not grad or wrapper_storage(grad) == mark:
                continue
            expose_sharded_grads(handle)
            fqn = f"{handle.unit_fqn}.{handle.layout.infos[i].fqn}" if handle.unit_fqn else handle.layout.infos[i].fqn
            raise ModelEditedAfterShardingError(
                f"the gradient of parameter '{fqn}' had its .data replaced after backward (p.grad.data = t): a "
                "DTensor gradient keeps its local tensor, so the write would be lost. Write in place "
                "(p.grad.mul_(2), p.grad.to_local().copy_(t)), or assign a DTensor of the same layout (p.grad = g). "
                "The gradients were shown again as they were"
            )


def _rebound(grad: torch.Tensor, view: torch.Tensor) -> bool:
    """A ``.grad`` we exposed whose storage the user replaced (``p.grad.data = t``): still the same
    object, so torch's next backward would accumulate into ``t`` unless we copy ``t`` in."""
    local = local_of(grad)
    return local.numel() > 0 and local.data_ptr() != view.data_ptr()


def _any_rebound(handle: FlatParamHandle, current: list[Optional[torch.Tensor]]) -> bool:
    flat_grad = handle.flat_param.grad
    if flat_grad is None:
        return False
    return any(g is not None and _rebound(g, v) for g, v in zip(current, handle.sharded_views_of(flat_grad)))


def _first_exposed_cleared(handle: FlatParamHandle) -> bool:
    """The first ``.grad`` the runtime exposed is None now (the others are trusted to follow it)."""
    exposed = handle.grads.exposed
    return next((p.grad is None for p, g in zip(handle.faces, exposed) if g is not None), False)


def release_cleared_grads(handle: FlatParamHandle) -> None:
    """Free the sharded gradient as soon as the user cleared every ``.grad`` we exposed
    (``zero_grad(set_to_none=True)``), rather than at this unit's next backward."""
    grads = handle.grads
    if not grads.exposed:
        return
    cleared = (
        all(p.grad is None for p in handle.faces)
        if _safety.current().grad_bookkeeping
        else _first_exposed_cleared(handle)  # trusted: see [Note: safety switches]
    )
    if cleared:
        handle.flat_param.grad = None
        grads.exposed = []
        grads.missing = frozenset()


def expose_sharded_grads(handle: FlatParamHandle) -> None:
    """Show ``flat_param.grad`` as the faces' ``.grad`` (``DTensor``s over their chunks of it).

    A parameter with no element on this rank gets an empty gradient (as FSDP2 gives it), not None:
    the optimizer then steps it on every rank alike (Adam's ``step`` agrees across ranks and in
    checkpoints). Only while sharded (a view's shape must match ``.data``'s)."""
    grads = handle.grads
    flat_grad = handle.flat_param.grad
    if not grads.expose_orig or flat_grad is None or handle.is_unsharded or grads.in_backward():
        return
    exposed: list[Optional[torch.Tensor]] = []
    for i, (param, grad) in enumerate(zip(handle.faces, handle.face_grads(flat_grad))):
        if param.requires_grad and i not in grads.missing:
            assign_grad(param, grad)
            exposed.append(grad)
        else:
            param.grad = None
            exposed.append(None)
    grads.exposed = exposed
    grads.exposed_storage = [wrapper_storage(g) for g in exposed]


def accumulate_sharded_grad(handle: FlatParamHandle, reduced: torch.Tensor, present: Optional[list[bool]]) -> None:
    """Add a reduced shard gradient to ``flat_param.grad`` and expose views of it.

    The gradient is cast back to the parameter dtype unless ``keep_low_precision_grads``. With CPU
    offload on CUDA, ``reduced`` is already the host copy ([Note: offloaded gradients reach the
    host]); otherwise it is moved here (a CPU compute device: nothing to wait for)."""
    device, dtype = handle.shard_device, handle.config.grad_dtype(handle.dtype)
    grad = reduced if reduced.dtype == dtype and reduced.device == device else reduced.to(device=device, dtype=dtype)
    flat_grad = handle.flat_param.grad
    absent = frozenset(i for i, p in enumerate(present or ()) if not p)
    if flat_grad is None or flat_grad.dtype != grad.dtype:
        assign_grad(handle.flat_param, grad)
        handle.grads.missing = absent
    else:
        flat_grad.add_(grad)
        handle.grads.missing = handle.grads.missing & absent
    expose_sharded_grads(handle)


def assign_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Set ``param.grad``, also when ``grad``'s dtype differs (``keep_low_precision_grads``).

    Autograd only checks dtype/shape when ``.grad`` is assigned, so for a low-precision gradient we
    point ``.data`` at the gradient for the assignment and then restore it."""
    if grad.dtype == param.dtype:
        param.grad = grad
        return
    data = param.data
    param.data = grad
    param.grad = grad
    param.data = data
