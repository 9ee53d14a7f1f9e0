"""State-dict keys: wrapper modules' prefix hooks and module FQNs as state-dict keys spell them."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from fsdp_composable._composable_state import hidden_attr, hide_attr

__all__: list[str] = []


# ---------------------------------------------------------------------------- wrapper prefixes
def _register_prefix_hooks(module: nn.Module, inner: str) -> None:
    """Hide the ``inner`` attribute name of a wrapper module from its state-dict keys.

    Saving strips ``<prefix><inner>.``; loading adds it back, so a wrapped module's state dict loads
    into the plain module and the reverse.
    """
    hide_attr(module, inner)  # so the FQN helpers hide it too
    module._register_state_dict_hook(functools.partial(_strip_prefix_hook, inner))
    module._register_load_state_dict_pre_hook(functools.partial(_add_prefix_hook, inner))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _clean_module_fqns(root: nn.Module) -> dict[nn.Module, str]:
    """Every module under ``root`` with its FQN as state-dict keys spell it (no wrapper attributes)."""
    out: dict[nn.Module, str] = {}
    stack = [(root, "")]
    while stack:
        module, fqn = stack.pop()
        if module in out:
            continue
        out[module] = fqn
        hidden = hidden_attr(module)
        children = [(c, fqn if n == hidden else _join(fqn, n)) for n, c in module._modules.items() if c is not None]
        stack.extend(reversed(children))
    return out


def _strip_prefix_hook(
    inner: str, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    # The subtree's keys are the last ones added, so re-inserting them keeps the overall order.
    full = f"{prefix}{inner}."
    for key in [k for k in state_dict if k.startswith(full)]:
        state_dict[prefix + key[len(full) :]] = state_dict.pop(key)
    _rename_metadata(state_dict, full, prefix)


def _add_prefix_hook(inner: str, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    full = f"{prefix}{inner}."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(full)]:
        state_dict[full + key[len(prefix) :]] = state_dict.pop(key)


def _rename_metadata(state_dict: Any, old: str, new: str) -> None:
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is None:
        return
    for key in [k for k in metadata if k == old[:-1] or k.startswith(old)]:
        renamed = new[:-1] if key == old[:-1] else new + key[len(old) :]
        metadata.setdefault(renamed, metadata.pop(key))
