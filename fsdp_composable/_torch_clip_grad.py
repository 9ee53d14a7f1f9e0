"""``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` on a sharded model: the global norm.

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
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as clip_grad

from fsdp_composable._common_utils import FSDP_FLATTENED
from fsdp_composable._flat_param import FlatParameter
from fsdp_composable._grad_utils import NormPieces
from fsdp_composable._optim_utils import _handles_holding

__all__: list[str] = []

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
