"""torch's ``clip_grad_norm_`` given our parameters: the global norm (change 3. of `_torch_interop`).

[Note: torch's clip_grad_norm_]
Between steps the faces' gradients are DTensors, and for them alone torch's function gives the global
norm (a ``Replicate`` DTensor), as with FSDP2. It does not for the rest of what a sharded model
holds: the wrapper's flat parameters (``use_orig_params=False``: plain tensors, this rank's shard),
a model with tensor parallelism inside (2-D faces next to the other units' 1-D ones: torch stacks
norms of DTensors over different meshes, which it refuses), and ignored parameters next to faces
(plain gradients mixed with DTensors, which torch refuses). So `fully_shard` routes torch's
function through `_clip_grad_norm_`: when one of the given parameters is ours it computes the norm
over every shard (each sharded unit's term summed over its shard group, everything else counted
once), the same on every rank, and clips with it; otherwise it is torch's function, unchanged. The
routing replaces the function torch's public wrapper calls (its closure cell): torch 2.13 offers no
extension point for it (no hook; the flat gradients are plain tensors, so no ``__torch_function__``),
and replacing the cell is the one way that holds however the user imported it (``from torch.nn.utils
import clip_grad_norm_`` before `fully_shard` included). The cell holds a `_RoutedClip`, which keeps
torch's function to fall back on; if torch's wrapper ever changes shape (no ``func`` cell), the module
attributes are replaced instead. With our parameters it is a collective: call it on every rank with
the same parameters, as our own `clip_grad_norm_(model, ...)` (the one to prefer: it also checks its
arguments).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as clip_grad
from torch.distributed.tensor import DTensor

from fsdp_composable._common_utils import FSDP_FLATTENED
from fsdp_composable._flat_param import FlatParameter
from fsdp_composable._runtime._grad_utils import NormPieces
from fsdp_composable._state._optim_convert import _handles_holding

__all__: list[str] = []


def _is_ours(p: Any) -> bool:
    return isinstance(p, torch.Tensor) and (getattr(p, FSDP_FLATTENED, False) or type(p) is FlatParameter)


class _RoutedClip:
    """What torch's ``clip_grad_norm_`` calls once routed: the global norm for our parameters,
    torch's own function (``original``, kept here) for any other."""

    def __init__(self, original: Callable[..., torch.Tensor]) -> None:
        self.original = original
        functools.update_wrapper(self, original)

    def __call__(
        self,
        parameters: Union[torch.Tensor, Any],
        max_norm: float,
        norm_type: Union[float, str] = 2.0,
        error_if_nonfinite: bool = False,
        foreach: Optional[bool] = None,
    ) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if not any(_is_ours(p) for p in params):
            return self.original(params, max_norm, norm_type, error_if_nonfinite, foreach)
        return _clip_grad_norm_(params, max_norm, float(norm_type), error_if_nonfinite, foreach)


def _route_torch_clip_grad_norm() -> None:
    """Route torch's clip_grad_norm_ through a `_RoutedClip` (once per process: the cell, or the
    module attribute, already holding one says it was done)."""
    public = clip_grad.clip_grad_norm_
    cells = dict(zip(public.__code__.co_freevars, public.__closure__ or ())) if hasattr(public, "__code__") else {}
    inner = cells.get("func")
    if inner is not None and callable(inner.cell_contents):  # torch's ``_no_grad`` wrapper (2.5 to 2.13)
        if not isinstance(inner.cell_contents, _RoutedClip):
            inner.cell_contents = _RoutedClip(inner.cell_contents)  # torch's function without its no_grad wrapper
        return
    if not isinstance(public, _RoutedClip):  # another shape: replace the module attributes
        routed = _RoutedClip(public)
        clip_grad.clip_grad_norm_ = routed  # type: ignore[assignment]
        torch.nn.utils.clip_grad_norm_ = routed  # type: ignore[assignment]


def _clip_grad_norm_(
    params: list[torch.Tensor], max_norm: float, norm_type: float, error_if_nonfinite: bool, foreach: Optional[bool]
) -> torch.Tensor:
    with torch.no_grad():
        total = _global_norm(params, norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
                "set `error_if_nonfinite=False`"
            )
        # torch scales a list of DTensors with one foreach op, which needs one mesh: a group per mesh
        # (2-D faces of tensor-parallel units beside the other units' 1-D ones)
        groups: dict[Any, list[torch.Tensor]] = {}
        for p in params:
            grad = p.grad
            groups.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(p)
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach)
    return total


def _global_norm(params: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    ids = {id(p) for p in params}
    grads = [p.grad for p in params if p.grad is not None]
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    pieces = NormPieces()
    counted: set[int] = set()
    handles = _handles_holding(params)
    for handle in handles:
        if id(handle.flat_param) in ids:  # a flat-mode wrapper's parameter: its whole shard
            counted.add(id(handle.flat_param))
            pieces.add_unit(handle, handle.flat_param.grad)
        else:
            counted.update(id(p) for p in handle.faces if id(p) in ids)
            pieces.add_unit(handle, None, ids)
    # gradients of parameters no unit manages are each rank's own: [Note: clipping ignored parameters]
    groups = (handles[0].process_group, handles[0].replicate_group) if handles else ()
    replicated_over = tuple(g for g in groups if g is not None)
    for p in params:
        if id(p) not in counted:
            counted.add(id(p))
            pieces.add_whole(p, replicated_over)
    # the units' compute device, where their groups communicate (CPU-offloaded gradients included);
    # torch's clip_grads_with_norm_ then scales each gradient with the coefficient on its own device
    return pieces.norm(norm_type, dtype, handles[0].device if handles else params[0].device)
