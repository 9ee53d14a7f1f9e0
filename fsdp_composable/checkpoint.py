"""Activation checkpointing: the composable `checkpoint`, and `CheckpointWrapper`, `checkpoint_wrapper` and
`apply_activation_checkpointing`.

[Note: composable checkpoint is a pair of hooks]
`checkpoint(module)` wraps nothing: a forward pre-hook opens a non-reentrant checkpoint region (torch's
saved-tensor hooks replace every tensor autograd saves inside the forward by a placeholder) and a forward
hook closes it. When backward first needs one of those tensors, the region calls ``module(*inputs)``
again under enable_grad to recompute them. Because the recomputation goes through ``module.__call__``,
every other hook on the module runs again too: that is what `fully_shard` needs, since its pre-forward
of a unit in backward (see [Note: one step] in `_runtime_utils`) unshards instead of starting a new
forward. Our own hooks switch off for the recomputation, or it would open a region inside itself.

[Note: hook order with fully_shard]
The region must sit *inside* `fully_shard`'s hooks, whichever API was applied first, so that the
all-gather, input casting and post-backward trigger happen outside it and are not recomputed. The
pre-hook is appended and `fully_shard` prepends a unit's pre-forward; the forward hook is prepended and
`fully_shard` appends its post-forward. So on a unit the order is: fully_shard pre-forward, region
open, forward, region close, fully_shard post-forward. (One exception: `fully_shard(module)` applied
after `checkpoint(module)` appends the pre-forward of ``module``'s own unit after ours. That is harmless:
it saves no tensor for backward, and in recomputation it only unshards.)

[Note: checkpoint and the fully_shard root]
`fully_shard`'s runtime treats every forward that runs while autograd runs a backward as a
recomputation: its hooks only make the unit's parameters whole again, and the root hooks do nothing.
So `checkpoint` may wrap the `fully_shard` root, a unit, or a module whose units are not yet in backward
when the recomputation reaches them.

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

import contextlib
import enum
import functools
import inspect
import sys
from typing import Any, Callable, Generator, Iterator, Optional

import torch
from torch import nn
from torch.utils import checkpoint as _torch_ckpt
from torch.utils.checkpoint import checkpoint as _torch_checkpoint
from torch.utils.hooks import RemovableHandle

from fsdp_composable._composable_state import _Contract, _get_module_state, _insert_module_state, contract
from fsdp_composable._init._wrap_utils import _get_submodule_to_states
from fsdp_composable._state._state_dict_utils import _register_prefix_hooks

__all__ = ["CheckpointImpl", "CheckpointWrapper", "apply_activation_checkpointing", "checkpoint", "checkpoint_wrapper"]

API_NAME = "checkpoint"

WRAPPED = "_checkpoint_wrapped_module"


_REENTRANT_IN_NESTED_BACKWARD = (
    "reentrant checkpointing recomputes the forward inside a nested backward that fully_shard's backward hooks "
    "cannot see"
)


def _check_use_reentrant(use_reentrant: Any, where: str, why: str) -> None:
    """Only non-reentrant checkpointing is offered; ``why`` completes the message for ``where``."""
    if not isinstance(use_reentrant, bool):
        raise TypeError(f"{where} argument 'use_reentrant' must be True or False, got {use_reentrant!r}")
    if use_reentrant:
        raise ValueError(f"{where}(use_reentrant=True) is not supported{why}. Use use_reentrant=False (the default).")


class CheckpointImpl(enum.Enum):
    """FSDP1's names for the two checkpointing implementations; only ``NO_REENTRANT`` is offered
    (see [Note: why not reentrant checkpointing]). Torch's own ``CheckpointImpl`` is accepted too."""

    REENTRANT = enum.auto()
    NO_REENTRANT = enum.auto()


def _reentrant_of(checkpoint_impl: Any, use_reentrant: Optional[bool], where: str) -> Any:
    """FSDP1's ``checkpoint_impl`` (ours or torch's enum, read by name) and our ``use_reentrant``, as
    one ``use_reentrant`` value (checked by `_check_use_reentrant`). A bool in ``checkpoint_impl``'s
    place is the ``use_reentrant`` our earlier signature took second."""
    if isinstance(checkpoint_impl, bool):
        checkpoint_impl, use_reentrant = None, checkpoint_impl if use_reentrant is None else use_reentrant
    name = getattr(checkpoint_impl, "name", None)
    if checkpoint_impl is not None and (type(checkpoint_impl).__name__ != "CheckpointImpl" or name not in _IMPLS):
        raise TypeError(
            f"{where} argument 'checkpoint_impl' must be CheckpointImpl.NO_REENTRANT, got {checkpoint_impl!r}"
        )
    if name == "REENTRANT":
        raise ValueError(
            f"{where}(checkpoint_impl=CheckpointImpl.REENTRANT) is not supported: {_REENTRANT_IN_NESTED_BACKWARD}. "
            "Use CheckpointImpl.NO_REENTRANT (the default)."
        )
    from_impl = None if checkpoint_impl is None else False
    if from_impl is not None and use_reentrant is not None and from_impl != use_reentrant:
        raise ValueError(
            f"{where} got checkpoint_impl={name} and use_reentrant={use_reentrant}, which disagree; pass one"
        )
    if from_impl is not None:
        return from_impl
    return False if use_reentrant is None else use_reentrant


_IMPLS = ("REENTRANT", "NO_REENTRANT")
# torch.utils.checkpoint.checkpoint's options a wrapper passes on (FSDP1's ``**checkpoint_fn_kwargs``)
_CHECKPOINT_OPTIONS = ("preserve_rng_state", "context_fn", "determinism_check", "debug")


class CheckpointWrapper(nn.Module):
    """Run ``module`` under non-reentrant activation checkpointing: its activations are freed after
    forward and recomputed in backward.

    FSDP1's signature: ``checkpoint_impl`` (``CheckpointImpl.NO_REENTRANT``, ours or torch's) or our
    ``use_reentrant=False``; ``checkpoint_fn_kwargs`` are options of ``torch.utils.checkpoint.checkpoint``
    (e.g. ``preserve_rng_state=False``). Attribute access falls through to the wrapped module, and
    state-dict keys have no wrapper prefix, so a plain module's state dict loads into the wrapper and
    the reverse.
    """

    def __init__(
        self,
        module: nn.Module,
        checkpoint_impl: Any = None,
        checkpoint_fn: Optional[Callable[..., Any]] = None,
        *,
        use_reentrant: Optional[bool] = None,
        **checkpoint_fn_kwargs: Any,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"CheckpointWrapper argument 'module' must be an nn.Module, got {type(module).__name__}")
        reentrant = _reentrant_of(checkpoint_impl, use_reentrant, "CheckpointWrapper")
        _check_use_reentrant(
            reentrant, "CheckpointWrapper", f": {_REENTRANT_IN_NESTED_BACKWARD} (and drops keyword arguments)"
        )
        if checkpoint_fn is not None:
            raise ValueError(
                "CheckpointWrapper argument 'checkpoint_fn' is not supported: the wrapper always runs "
                "torch.utils.checkpoint.checkpoint(use_reentrant=False); pass its options as keywords "
                f"({', '.join(_CHECKPOINT_OPTIONS)}), or use the composable checkpoint(module)"
            )
        unknown = sorted(set(checkpoint_fn_kwargs) - set(_CHECKPOINT_OPTIONS))
        if unknown:
            raise TypeError(
                f"CheckpointWrapper got unexpected keyword arguments {unknown}; the options of "
                f"torch.utils.checkpoint.checkpoint it passes on are {list(_CHECKPOINT_OPTIONS)}"
            )
        super().__init__()
        self._checkpoint_wrapped_module = module
        self.use_reentrant = reentrant
        self.checkpoint_impl = CheckpointImpl.NO_REENTRANT
        self._checkpoint_options = dict(checkpoint_fn_kwargs)
        _register_prefix_hooks(self, WRAPPED)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _torch_checkpoint(
            self._checkpoint_wrapped_module, *args, use_reentrant=False, **self._checkpoint_options, **kwargs
        )

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

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """As ``nn.Module.named_parameters``, without the wrapper's attribute: the FQNs the state dict uses."""
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            yield _strip_wrapped(name), param

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """As ``nn.Module.named_buffers``, without the wrapper's attribute."""
        for name, buf in super().named_buffers(prefix, recurse, remove_duplicate):
            yield _strip_wrapped(name), buf


def _strip_wrapped(name: str) -> str:
    return name.replace(f"{WRAPPED}.", "")


def checkpoint_wrapper(
    module: nn.Module,
    checkpoint_impl: Any = None,
    checkpoint_fn: Optional[Callable[..., Any]] = None,
    *,
    use_reentrant: Optional[bool] = None,
    **checkpoint_fn_kwargs: Any,
) -> CheckpointWrapper:
    """Wrap ``module`` in a `CheckpointWrapper` (FSDP1's signature; see there)."""
    return CheckpointWrapper(
        module, checkpoint_impl, checkpoint_fn, use_reentrant=use_reentrant, **checkpoint_fn_kwargs
    )


def _check_all(module: nn.Module) -> bool:
    return True


def apply_activation_checkpointing(
    model: nn.Module,
    check_fn: Callable[[nn.Module], bool] = _check_all,
    checkpoint_wrapper_fn: Callable[[nn.Module], nn.Module] = checkpoint_wrapper,
    auto_wrap_policy: Any = None,
) -> nn.Module:
    """Replace, in place, every submodule of ``model`` for which ``check_fn(submodule)`` is true by
    ``checkpoint_wrapper_fn(submodule)``; returns ``model``.

    FSDP1's keywords work as written (``check_fn`` defaults to every submodule, as there).
    ``auto_wrap_policy`` (any policy `fully_shard` takes, torch's included) picks the modules instead of
    ``check_fn``: those it would make units.

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
    if auto_wrap_policy is not None:
        chosen = set(_get_submodule_to_states(model, auto_wrap_policy, set(), set())) - {model}
        check_fn = chosen.__contains__
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


# ---------------------------------------------------------------------------- composable checkpoint
class _CheckpointState:
    """What `checkpoint` attached to one module. It holds no reference to the module (the registry is
    keyed weakly by the module, so a strong reference here would keep it alive)."""

    def __init__(self) -> None:
        # False while this module's forward is being recomputed: the recomputation runs plain.
        self.enabled = True
        # Regions opened by the pre-hook and not yet closed, innermost last (a module may call itself).
        self.regions: list[Generator[None, None, None]] = []
        self.hook_handles: list[RemovableHandle] = []


@contract(API_NAME)
def checkpoint(module: nn.Module, *, use_reentrant: bool = False) -> nn.Module:
    """Recompute ``module``'s forward in backward instead of keeping its activations, without wrapping it.

    Returns ``module`` itself: its type and every FQN and state-dict key are unchanged. Composes with
    `fully_shard` in either order, around a unit (``checkpoint(block)`` where ``block`` is a unit) or
    inside one (``checkpoint(block.mlp)``), and with a module called several times per forward. Every
    forward hook of ``module`` runs again during recomputation. Read the attached state with
    ``checkpoint.state(module)``. Only non-reentrant checkpointing is offered (see [Note: why not
    reentrant checkpointing]).
    """
    name = type(module).__name__
    _check_use_reentrant(
        use_reentrant,
        "checkpoint",
        f" (module {name}): reentrant checkpointing must run the forward inside an autograd Function, which "
        "hooks cannot do without wrapping the module, and it recomputes in a nested backward that fully_shard's "
        "backward hooks cannot see",
    )
    if _get_module_state(module, API_NAME) is not None:
        raise RuntimeError(
            f"checkpoint was already applied to this {name}; apply it once per module (a second application "
            "would recompute its forward twice)"
        )
    if isinstance(module, CheckpointWrapper):
        raise ValueError(
            f"checkpoint was called on a CheckpointWrapper (wrapping {type(module.module).__name__}), whose forward "
            "is already checkpointed; apply either checkpoint or the wrapper, not both"
        )
    state = _CheckpointState()
    _insert_module_state(module, API_NAME, state)
    pre, post = functools.partial(_pre_forward, state), functools.partial(_post_forward, state)
    state.hook_handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
    state.hook_handles.append(module.register_forward_hook(post, prepend=True, always_call=True))
    return module


# Both hooks open or close torch's checkpoint region (saved-tensor hooks, RNG state): eager under
# torch.compile, as fully_shard's are ([Note: fully_shard under torch.compile] in _runtime/_runtime_utils.py),
# and disabled as whole calls, so dynamo compiles no frame of its own around them (dynamo is imported at
# their first call, not at import).
@torch._disable_dynamo
def _pre_forward(state: _CheckpointState, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if not state.enabled:  # this is the recomputation: run the forward plain
        return
    region = _open_region(state, module, args, kwargs)
    next(region)  # runs up to the point where the forward belongs inside the region
    state.regions.append(region)


@torch._disable_dynamo
def _post_forward(state: _CheckpointState, module: nn.Module, args: Any, output: Any) -> None:
    if not state.enabled or not state.regions:
        return
    region = state.regions.pop()
    if sys.exc_info()[1] is not None:  # registered with always_call: the forward raised
        region.close()  # leave the region so its saved-tensor hooks stop applying
        return
    try:
        next(region)
    except StopIteration:
        return
    raise RuntimeError(f"checkpoint: the region of {type(module).__name__} did not end after its forward")


def _open_region(
    state: _CheckpointState, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Generator[None, None, None]:
    """Torch's non-reentrant checkpoint as a generator: code before its first yield sets up the region
    and stashes the RNG state and inputs, code after closes it. The function it recomputes is the module
    itself, so the recomputation goes through ``module.__call__`` and re-runs its other hooks."""

    def contexts() -> tuple[contextlib.AbstractContextManager[None], _Recomputing]:
        return contextlib.nullcontext(), _Recomputing(state)

    options = {
        "preserve_rng_state": True,  # dropout recomputes the same mask
        "context_fn": contexts,
        "determinism_check": _torch_ckpt._DEFAULT_DETERMINISM_MODE,
        "debug": False,
        "early_stop": True,  # stop recomputing once every saved tensor is back
    }
    # keyword arguments are bound here so none can collide with the generator's own parameter names
    fn = functools.partial(module, **kwargs) if kwargs else module
    generator: Callable[..., Generator[None, None, None]] = _torch_ckpt._checkpoint_without_reentrant_generator
    return generator(fn, *(options[name] for name in _region_parameters()), *args)


# [Note: torch's private checkpoint generator]
# `_checkpoint_without_reentrant_generator` is private and takes its options positionally before
# ``*args``, and torch versions differ in which options exist (``early_stop`` is recent). Binding them by
# the names this torch declares keeps an option from landing in the module's arguments, and an option we
# do not know fails loudly at the first forward instead of silently.
@functools.cache
def _region_parameters() -> tuple[str, ...]:
    """The generator's option names, in order, between its function and the function's arguments."""
    params = inspect.signature(_torch_ckpt._checkpoint_without_reentrant_generator).parameters.values()
    names = tuple(p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)[1:]
    known = ("preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise RuntimeError(
            f"checkpoint does not know the options {unknown} of torch.utils.checkpoint."
            f"_checkpoint_without_reentrant_generator in torch {torch.__version__}; use checkpoint_wrapper instead"
        )
    return names


class _Recomputing:
    """Switch ``state``'s hooks off while the region recomputes. A class, not a generator context
    manager: the region enters the same object once per backward that needs it (``retain_graph``)."""

    def __init__(self, state: _CheckpointState) -> None:
        self._state = state
        self._saved: list[bool] = []

    def __enter__(self) -> None:
        self._saved.append(self._state.enabled)
        self._state.enabled = False

    def __exit__(self, *exc: object) -> None:
        self._state.enabled = self._saved.pop()


# `checkpoint.state(module)` is typed by the contract; this alias documents the return type.
_Checkpoint = _Contract[_CheckpointState]
