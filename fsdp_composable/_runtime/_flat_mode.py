"""The wrapper's flat-parameter mode (``use_orig_params=False``): each unit module registers its flat
parameter in place of its original parameters. Switched by the wrapper, and around `unshard_params`."""

from __future__ import annotations

from torch import nn

from fsdp_composable._common_utils import FLAT_MODE, _FSDPState
from fsdp_composable._flat_param import FlatParamHandle
from fsdp_composable._guards._dtype_casts import adopt_cast

__all__: list[str] = []


def _registrations(handle: FlatParamHandle) -> list[tuple[nn.Module, str, nn.Parameter]]:
    return [(m, name, p) for p, info in zip(handle.params, handle.layout.infos) for m, name, _ in info.holders]


def _use_flat_params(state: _FSDPState) -> None:
    """Unregister original parameters (kept reachable as plain attributes for forward) and
    register each unit's flat parameter on its module."""
    for handle in state.handles:
        handle.flat_mode = True
        for param in handle.params:
            setattr(param, FLAT_MODE, True)
        for module, name, param in _registrations(handle):
            module._parameters.pop(name, None)
            object.__setattr__(module, name, param)
        handle.module.register_parameter(handle.name, handle.flat_param)


def _use_orig_params(state: _FSDPState) -> None:
    """The reverse of `_use_flat_params`, in the original registration order."""
    for handle in state.handles:
        adopt_cast(handle)  # ``model.double()`` cast the registered flat parameter, not the faces
        handle.module._parameters.pop(handle.name, None)
        for module, name, param in _registrations(handle):
            module.__dict__.pop(name, None)
            module._parameters[name] = param
        handle.flat_mode = False
        handle.use_unsharded_views() if handle.is_unsharded else handle.use_sharded_views()
