"""The per-call state `_FSDPState` and its `TrainingState` (the seeds' path: both are defined in
`_root_context`, beside the `RootContext` they and it point at), and the traversal helpers.

Imports flow one way: this module uses `_root_context`, `_flat_param` and `_composable_state`, none of
which imports it back."""

from __future__ import annotations

from typing import Iterable, Optional

from torch import nn

from fsdp_composable._base._state_machine import StateTransitionError
from fsdp_composable._composable_state import _get_module_state
from fsdp_composable._config import UnitConfig
from fsdp_composable._flat_param import FSDP_FLATTENED
from fsdp_composable._runtime._root_context import TrainingState, _FSDPState, _set_training_state

__all__ = [
    "FSDP_FLATTENED",
    "StateTransitionError",
    "TrainingState",
    "UnitConfig",
    "_FSDPState",
    "_set_training_state",
]

API_NAME = "fully_shard"

# Set on original parameters while a wrapper exposes flat parameters instead (use_orig_params=False).
FLAT_MODE = "_fsdp_flat_mode"


def _get_fsdp_state(module: nn.Module) -> Optional[_FSDPState]:
    return _get_module_state(module, API_NAME)  # type: ignore[no-any-return]


def _get_fsdp_states(module: nn.Module) -> list[_FSDPState]:
    """Every distinct state in ``module``'s subtree, outermost first."""
    seen: dict[int, _FSDPState] = {}
    for submodule in module.modules():
        state = _get_fsdp_state(submodule)
        if state is not None and id(state) not in seen:
            seen[id(state)] = state
    return list(seen.values())


def _is_inside_unit(module: nn.Module) -> bool:
    """``module`` has no state of its own but its parameters are managed by an enclosing unit."""
    return any(getattr(p, FSDP_FLATTENED, False) for p in module.parameters())


def _registrations_of(
    module: nn.Module, params: Iterable[nn.Parameter], skip: set[nn.Module]
) -> list[tuple[nn.Module, str]]:
    """Every (module, name) under ``module`` (outside ``skip``) registering one of ``params``: where
    parameters ignored by themselves live, since initialisation may replace the objects."""
    wanted = {id(p) for p in params}
    return [
        (m, name)
        for m in module.modules()
        if m not in skip and wanted
        for name, p in m._parameters.items()
        if p is not None and id(p) in wanted
    ]
