"""Activation checkpointing: `CheckpointWrapper`, `checkpoint_wrapper` and `apply_activation_checkpointing`.

[Note: checkpoint wrappers keep state-dict keys]
A wrapper module inserts ``_checkpoint_wrapped_module`` into the FQN of everything below it. Module
FQNs change (by design: the wrapper is a real module), but state-dict keys must not, or a checkpoint
saved with activation checkpointing would not load without it. `_register_prefix_hooks` strips the
attribute from saved keys and adds it back on load, so the wrapped and the plain module's state
dicts are interchangeable, with or without `fully_shard` applied afterwards.

[Note: why not reentrant checkpointing]
Reentrant checkpointing runs the wrapped forward under ``torch.no_grad()`` and recomputes it inside a
nested ``torch.autograd.backward`` call. The recomputed graph is invisible to the outer backward, so
`fully_shard`'s pre-backward hooks (which unshard parameters) and post-backward reduction would not
run for it, and keyword arguments or inputs that do not require grad break it. Non-reentrant
checkpointing (``use_reentrant=False``) recomputes inside the same backward and has none of these
problems, so it is the only mode we offer.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from fsdp_composable._state_dict_utils import _register_prefix_hooks

__all__ = ["CheckpointWrapper", "apply_activation_checkpointing", "checkpoint_wrapper"]

WRAPPED = "_checkpoint_wrapped_module"


def _check_use_reentrant(use_reentrant: Any, where: str) -> None:
    if not isinstance(use_reentrant, bool):
        raise TypeError(f"{where} argument 'use_reentrant' must be True or False, got {use_reentrant!r}")
    if use_reentrant:
        raise ValueError(
            f"{where}(use_reentrant=True) is not supported: reentrant checkpointing recomputes the forward "
            "inside a nested backward that fully_shard's backward hooks cannot see (and drops keyword "
            "arguments). Use use_reentrant=False (the default)."
        )


class CheckpointWrapper(nn.Module):
    """Run ``module`` under non-reentrant activation checkpointing: its activations are freed after
    forward and recomputed in backward.

    Attribute access falls through to the wrapped module, and state-dict keys have no wrapper prefix,
    so a plain module's state dict loads into the wrapper and the reverse.
    """

    def __init__(self, module: nn.Module, use_reentrant: bool = False) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"CheckpointWrapper argument 'module' must be an nn.Module, got {type(module).__name__}")
        _check_use_reentrant(use_reentrant, "CheckpointWrapper")
        super().__init__()
        self._checkpoint_wrapped_module = module
        self.use_reentrant = use_reentrant
        _register_prefix_hooks(self, WRAPPED)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _torch_checkpoint(self._checkpoint_wrapped_module, *args, use_reentrant=False, **kwargs)

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._checkpoint_wrapped_module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == WRAPPED:  # not set yet (during __init__): do not recurse
                raise
            return getattr(self._checkpoint_wrapped_module, name)

    def __getitem__(self, index: int) -> Any:
        return self._checkpoint_wrapped_module.__getitem__(index)  # type: ignore[operator]


def checkpoint_wrapper(module: nn.Module, use_reentrant: bool = False) -> CheckpointWrapper:
    """Wrap ``module`` in a `CheckpointWrapper`."""
    return CheckpointWrapper(module, use_reentrant=use_reentrant)


def apply_activation_checkpointing(
    model: nn.Module,
    check_fn: Callable[[nn.Module], bool],
    checkpoint_wrapper_fn: Callable[[nn.Module], nn.Module] = checkpoint_wrapper,
) -> nn.Module:
    """Replace, in place, every submodule of ``model`` for which ``check_fn(submodule)`` is true by
    ``checkpoint_wrapper_fn(submodule)``; returns ``model``.

    The outermost match wins (its descendants are not wrapped again), ``model`` itself is never
    replaced, and modules that are already a `CheckpointWrapper` are left alone, so applying it twice
    changes nothing. Module FQNs gain ``_checkpoint_wrapped_module``; state-dict keys do not. Call it
    before `fully_shard` (it builds units from the modules it finds) and before building the optimizer.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"apply_activation_checkpointing argument 'model' must be an nn.Module, got {type(model).__name__}"
        )
    for name, fn in (("check_fn", check_fn), ("checkpoint_wrapper_fn", checkpoint_wrapper_fn)):
        if not callable(fn):
            raise TypeError(f"apply_activation_checkpointing argument {name!r} must be callable, got {fn!r}")
    _wrap_children(model, "", check_fn, checkpoint_wrapper_fn)
    return model


def _wrap_children(
    parent: nn.Module,
    parent_fqn: str,
    check_fn: Callable[[nn.Module], bool],
    wrapper_fn: Callable[[nn.Module], nn.Module],
) -> None:
    if isinstance(parent, CheckpointWrapper):
        return
    for name, child in list(parent._modules.items()):
        if child is None or isinstance(child, CheckpointWrapper):
            continue
        fqn = f"{parent_fqn}.{name}" if parent_fqn else name
        if check_fn(child):
            wrapped = wrapper_fn(child)
            if not isinstance(wrapped, nn.Module):
                raise TypeError(
                    f"checkpoint_wrapper_fn returned {type(wrapped).__name__} for submodule '{fqn}'; "
                    "it must return an nn.Module"
                )
            setattr(parent, name, wrapped)
        else:
            _wrap_children(child, fqn, check_fn, wrapper_fn)
