"""Is a parameter of a module given to `fully_shard` already sharded by an earlier call: by a parent's
(apply `fully_shard` bottom-up) or, tied, by another module's (one unit per parameter)."""

from __future__ import annotations

from typing import Optional

from torch import nn

from fsdp_composable._common_utils import API_NAME, FSDP_FLATTENED, _get_fsdp_state
from fsdp_composable._composable_state import _modules_with

__all__ = ["check_not_applied_below_parent"]


def check_not_applied_below_parent(module: nn.Module, ignored: set[nn.Parameter]) -> None:
    for name, param in module.named_parameters():
        if getattr(param, FSDP_FLATTENED, False) and param not in ignored and _owning_state_is_ancestor(module, name):
            owner = _owner_of(param)
            if owner is not None and not any(m is module for m in owner[0].modules()):
                raise RuntimeError(
                    f"parameter '{name}' of this {type(module).__name__} is shared (tied) with "
                    f"{type(owner[0]).__name__}'s parameter '{owner[1]}', which an earlier fully_shard call "
                    "already sharded: a parameter belongs to one unit. Shard the modules that share it in "
                    "one call (fully_shard([m1, m2])), or leave them to their common parent's fully_shard"
                )
            raise RuntimeError(
                f"parameter '{name}' of this {type(module).__name__} is already managed by fully_shard "
                "applied to a parent module. Apply fully_shard bottom-up: first to the children, then "
                "to the parent (or give the parent a policy)"
            )


def _owner_of(param: nn.Parameter) -> Optional[tuple[nn.Module, str]]:
    """The module an existing fully_shard call was applied to that manages ``param``, and its name there."""
    for module, state in _modules_with(API_NAME):
        if module is not state.module:
            continue
        for handle in state.handles:
            # the owner registers the parameter's face between steps, the original inside a step
            pairs = zip(handle.params, handle.faces or handle.params)
            forms = next(((p, f) for p, f in pairs if param is p or param is f), None)
            if forms is not None:
                name = next((n for n, p in module.named_parameters() if p is forms[0] or p is forms[1]), "?")
                return module, name
    return None


def _owning_state_is_ancestor(module: nn.Module, param_fqn: str) -> bool:
    """True when the flattened parameter is not managed by a state inside ``module``'s subtree."""
    parts = param_fqn.split(".")[:-1]
    current = module
    for part in parts:
        current = current.get_submodule(part)
        if _get_fsdp_state(current) is not None:
            return False
    return True
