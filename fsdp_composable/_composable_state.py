"""The registry of composable APIs: which API was applied to which module, and with what state.

[Note: why a registry and not a wrapper]
A composable API attaches to the user's module instead of wrapping it, so the module's type and
every FQN stay as they were and several APIs (``fully_shard``, ``checkpoint``) can be applied to the
same module in either order. Each module holds its own ``{api: state}`` as a plain attribute (``_STATES``,
as torch's composable APIs keep theirs), which never appears in ``named_modules()``/``state_dict()``;
the registry only lists those modules, weakly. A weak map from module to state cannot be used: every
state refers to its module (and a unit's handles to its members), so a value would keep its own key
alive and no sharded model would ever be freed; from the module's side the cycle is an ordinary one,
which the garbage collector frees with the model.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Generic, Optional, TypeVar

from torch import nn

__all__: list[str] = []

_S = TypeVar("_S")

class _Registry:
    """The package's only module-level mutable state: which API was applied to which module, what
    this rank knows about each process group's collectives (the header protocol's per-group record,
    [Note: collective headers] in `_rank_agreement`: a group outlives every model using it, and torch's
    ProcessGroup takes no attributes of ours), the subgroups ``reshard_after_forward=<int>`` made of
    each group (for the same reason), how many parameters and submodules were registered on any
    module since import (the cheap change detector of [Note: cheap edit checks] in `_model_edit_checks`),
    the CPU companion group made for a set of ranks ([Note: presence flags agreed on the host] in
    `_host_flags`: torch names it by its ranks alone, so one per set of ranks per process), what the
    optimizer step pre-hook found on each optimizer, the names wrapper modules hide from their
    state-dict keys, and the benchmark-only safety switches ([Note: safety switches] in `_safety`;
    None: every check on)."""

    def __init__(self) -> None:
        # every module an API was applied to, by registration number (so in that order; each holds its
        # own states: [Note: why a registry and not a wrapper])
        self.modules: "weakref.WeakValueDictionary[int, nn.Module]" = weakref.WeakValueDictionary()
        self.applied = 0
        # process group -> its record (weak: a destroyed group's record goes with it)
        self.groups: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
        # process group -> {k: this rank's group of k of its ranks}: made once, shared by every call
        # with reshard_after_forward=k (see [Note: resharding to a smaller group] in `_post_forward_group`)
        self.subgroups: "weakref.WeakKeyDictionary[Any, dict[int, Any]]" = weakref.WeakKeyDictionary()
        # default group -> {global ranks: the CPU group over them made for the presence flags}
        # (`_host_flags`; weak: a world torn down and initialised again gets new groups)
        self.companions: "weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Any]]" = weakref.WeakKeyDictionary()
        # optimizer -> (how many of our parameters it held when it was last checked, the units they
        # belong to): [Note: optimizers built before fully_shard] in `_torch_interop` (weak: torch's
        # optimizer outlives no user reference, and takes no attributes of ours)
        self.optimizers: "weakref.WeakKeyDictionary[Any, tuple[int, tuple[Any, ...]]]" = weakref.WeakKeyDictionary()
        # wrapper module -> the attribute name its state-dict prefix hooks hide (`_state_dict_keys`)
        self.hidden_attrs: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()
        self.registrations = 0
        self.safety: Any = None  # a frozen `_safety.SafetyChecks`, replaced whole, or None


_REGISTRY = _Registry()
_STATES = "_fsdp_composable_states"  # the attribute in which a module holds its {api: state}


def count_registration(*args: object) -> None:
    """A module registered a parameter or a submodule (a torch registration hook)."""
    _REGISTRY.registrations += 1


def group_record(group: Any, new: Callable[[], _S]) -> _S:
    """The record kept for ``group`` (made by ``new`` the first time it is asked for)."""
    record = _REGISTRY.groups.get(group)
    if record is None:
        record = _REGISTRY.groups[group] = new()
    return record  # type: ignore[no-any-return]


def subgroup(group: Any, k: int, new: Callable[[], _S]) -> _S:
    """This rank's subgroup of ``k`` ranks of ``group`` (made by ``new`` the first time it is asked for)."""
    per_size = _REGISTRY.subgroups.get(group)
    if per_size is None:
        per_size = _REGISTRY.subgroups[group] = {}
    if k not in per_size:
        per_size[k] = new()
    return per_size[k]  # type: ignore[no-any-return]


def companion_group(world: Any, ranks: tuple[Any, ...], new: Callable[[], _S]) -> _S:
    """The CPU group over ``ranks`` of the default group ``world`` (made by ``new`` the first time;
    ``ranks`` may also be a (shard ranks, replicate ranks) pair, for the group over their mesh)."""
    per_world = _REGISTRY.companions.get(world)
    if per_world is None:
        per_world = _REGISTRY.companions[world] = {}
    if ranks not in per_world:
        per_world[ranks] = new()
    return per_world[ranks]  # type: ignore[no-any-return]


def optimizer_check(optim: Any) -> Optional[tuple[int, tuple[Any, ...]]]:
    """What the optimizer step pre-hook recorded for ``optim`` (None: not checked since it was reset)."""
    return _REGISTRY.optimizers.get(optim)


def set_optimizer_check(optim: Any, record: Optional[tuple[int, tuple[Any, ...]]]) -> None:
    if record is None:
        _REGISTRY.optimizers.pop(optim, None)
    else:
        _REGISTRY.optimizers[optim] = record


def hide_attr(module: nn.Module, name: str) -> None:
    """``module``'s state-dict keys leave out its attribute ``name`` (a wrapper's inner module)."""
    _REGISTRY.hidden_attrs[module] = name


def hidden_attr(module: nn.Module) -> Optional[str]:
    return _REGISTRY.hidden_attrs.get(module)


def group_records() -> list[Any]:
    """Every process group's record."""
    return list(_REGISTRY.groups.values())


def safety_setting() -> Any:
    """The safety switches set by `_safety.switched_off` (None: every check on)."""
    return _REGISTRY.safety


def set_safety_setting(setting: Any) -> None:
    _REGISTRY.safety = setting


def registrations() -> int:
    """How many parameters and submodules were registered on any module so far."""
    return _REGISTRY.registrations


def _states_of(module: nn.Module) -> dict[str, Any]:
    """``module``'s {api: state} (empty: nothing applied); read from its ``__dict__``, so that a module's
    own ``__getattr__`` (nn.Module's looks through parameters, buffers and children) is never asked."""
    return module.__dict__.get(_STATES, {})  # type: ignore[no-any-return]


def _insert_module_state(module: nn.Module, api: str, state: Any) -> None:
    states = module.__dict__.get(_STATES)
    if states is None:
        states = {}
        setattr(module, _STATES, states)
        _REGISTRY.modules[_REGISTRY.applied] = module
        _REGISTRY.applied += 1
    if api in states:
        raise RuntimeError(
            f"{api} was already applied to this {type(module).__name__}; apply it once per module "
            "(for nested units, call it on the children first, then on the parent)"
        )
    states[api] = state


def _get_module_state(module: nn.Module, api: str) -> Optional[Any]:
    return _states_of(module).get(api)


def _modules_with(api: str) -> list[tuple[nn.Module, Any]]:
    """Every live module ``api`` was applied to, with its state."""
    return [(m, states[api]) for m in list(_REGISTRY.modules.values()) if api in (states := _states_of(m))]


def _all_states() -> list[dict[str, Any]]:
    """Every live module's {api: state} (empty: nothing was applied in this process, or all is freed)."""
    return [_states_of(m) for m in list(_REGISTRY.modules.values())]


def _any_applied() -> bool:
    """Whether a module this process applied an API to is alive (cheap: every optimizer step asks)."""
    return len(_REGISTRY.modules) > 0


def _applied_apis(module: nn.Module) -> tuple[str, ...]:
    return tuple(_states_of(module))


def _structure_of(module: nn.Module) -> tuple[type, list[str], list[str], list[str]]:
    return (
        type(module),
        [n for n, _ in module.named_modules(remove_duplicate=False)],
        [n for n, _ in module.named_parameters(remove_duplicate=False)],
        [n for n, _ in module.named_buffers(remove_duplicate=False)],
    )


class _Contract(Generic[_S]):
    """A composable API: the function plus ``.state(module)`` to read what it attached."""

    def __init__(self, name: str, fn: Callable[..., nn.Module], several: str = "", groups: bool = False) -> None:
        self.name = name
        self.several = several  # what to do instead of passing a list of modules
        self.groups = groups  # ``fn`` takes a list of modules too (several modules as one unit)
        self._fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        if self.groups and isinstance(module, (list, tuple)):
            return self._call_group(list(module), *args, **kwargs)
        if isinstance(module, (list, tuple)) and module and all(isinstance(m, nn.Module) for m in module):
            names = ", ".join(type(m).__name__ for m in module)
            raise TypeError(
                f"{self.name} got a {type(module).__name__} of {len(module)} modules ({names}), not one module: "
                f"{self.several or f'call {self.name} on each of them'}"
            )
        if not isinstance(module, nn.Module):
            raise TypeError(f"{self.name} expects an nn.Module as its first argument, got {type(module).__name__}")
        before = _structure_of(module)
        out = self._fn(module, *args, **kwargs)
        if out is not module:
            raise AssertionError(f"{self.name} must return the module it was given")
        after = _structure_of(module)
        if before != after:
            raise AssertionError(f"{self.name} changed the module's type or FQNs, which composable APIs must not do")
        return module

    def _call_group(self, modules: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
        if not modules or not all(isinstance(m, nn.Module) for m in modules):
            got = ", ".join(type(m).__name__ for m in modules) or "nothing"
            raise TypeError(f"{self.name} expects an nn.Module or a non-empty list of them, got a list of {got}")
        before = [_structure_of(m) for m in modules]
        out = self._fn(modules, *args, **kwargs)
        if out is not modules:
            raise AssertionError(f"{self.name} must return the list of modules it was given")
        if before != [_structure_of(m) for m in modules]:
            raise AssertionError(f"{self.name} changed a module's type or FQNs, which composable APIs must not do")
        return modules

    def state(self, module: nn.Module) -> _S:
        """Return the state ``self`` attached to ``module``; raise if it was not applied there."""
        state = _get_module_state(module, self.name)
        if state is None:
            raise ValueError(
                f"{self.name} was not applied to this {type(module).__name__}; "
                f"call {self.name}(module) first (APIs applied: {list(_applied_apis(module)) or 'none'})"
            )
        return state  # type: ignore[no-any-return]


def contract(
    name: str, several: str = "", groups: bool = False
) -> Callable[[Callable[..., Any]], _Contract[Any]]:
    """Decorate a composable API so it is checked to keep the module's type and FQNs. ``several``: what
    the error for a list of modules tells the user to do instead; ``groups``: the API takes a list of
    modules itself (every module's structure is checked)."""

    def decorator(fn: Callable[..., Any]) -> _Contract[Any]:
        return _Contract(name, fn, several, groups)

    return decorator
