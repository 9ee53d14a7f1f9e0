"""Torch FSDP1's auto-wrap policies, read as they are: which modules FSDP1 would wrap becomes which
modules own a unit.

[Note: recognising torch's policies without importing them]
This package must not import ``torch.distributed.fsdp``, so a torch policy is recognised by what it
is, not by ``isinstance``:
- an object whose class is named ``ModuleWrapPolicy`` or ``CustomPolicy`` and is defined under
  ``torch.distributed.fsdp``, read through the attribute FSDP1 keeps its argument in
  (``_module_classes``, ``_lambda_fn``);
- a callable with FSDP1's policy signature ``(module, recurse, nonwrapped_numel)``: torch's own
  ``transformer_auto_wrap_policy``, ``size_based_auto_wrap_policy``, ``lambda_auto_wrap_policy`` (as
  ``functools.partial``s with their keywords), ``always_wrap_policy`` (any callable defined under
  ``torch.distributed.fsdp``), and a user's function with those parameter names.
Such a callable is not translated into one of our classes parameter by parameter: it is *run* the way
FSDP1 runs it (`_fsdp1_recursion`), so its every keyword (``force_leaf_modules``,
``exclude_wrap_modules``, ...) and any user logic mean what they mean in FSDP1.

[Note: FSDP1's recursion]
FSDP1 asks a callable policy twice per module. Top-down, ``recurse=True`` with the parameter count of
the whole subtree: may we look inside? (``size_based_auto_wrap_policy`` says no below
``min_num_params`` and for ``force_leaf_modules``.) Then, after the children were decided,
``recurse=False`` with what the subtree holds outside the units chosen below it: is this module a
unit? The root is never asked the second question (it is always a unit). Counts skip ignored
parameters, and a parameter shared inside one subtree counts once there. ``ModuleWrapPolicy`` and
``CustomPolicy`` instead look at every module, with ``isinstance`` for the classes.
"""

from __future__ import annotations

import enum
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import nn

from fsdp_composable._names._fsdp1_names import as_ours
from fsdp_composable.api import MixedPrecision, ShardingStrategy

__all__ = ["TorchPolicy", "read_torch_policy"]

_TORCH_FSDP = "torch.distributed.fsdp"
_TORCH_WRAP = "torch.distributed.fsdp.wrap"  # where FSDP1's policies live
# FSDP1's CustomPolicy keyword -> ours; values are converted by `_override_value`
_OVERRIDE_NAMES = {"sharding_strategy": "strategy", "strategy": "strategy", "mixed_precision": "mixed_precision"}

# What `TorchPolicy.select` is told about the module tree: the root, each managed module's FQN (pre-order),
# its managed children, and the parameters counted as FSDP1 counts them (ignored ones left out).
Children = Callable[[nn.Module], list[nn.Module]]
Counted = Callable[[nn.Module], list[nn.Parameter]]


class Kind(enum.Enum):
    RECURSIVE = enum.auto()  # a callable run as FSDP1 runs it (``fn``)
    CLASSES = enum.auto()  # FSDP1's ``ModuleWrapPolicy`` (``classes``)
    CUSTOM = enum.auto()  # FSDP1's ``CustomPolicy`` (``fn``)


@dataclass(frozen=True)
class TorchPolicy:
    """A torch FSDP1 policy of one `Kind`; ``name`` says which in messages."""

    kind: Kind
    name: str
    fn: Optional[Callable[..., Any]] = None
    classes: tuple[type, ...] = ()

    def __repr__(self) -> str:
        return self.name

    def select(
        self, root: nn.Module, fqns: dict[nn.Module, str], children: Children, counted: Counted
    ) -> dict[nn.Module, dict[str, Any]]:
        """The unit modules other than ``root``, each with our per-unit overrides."""
        if self.kind is Kind.RECURSIVE:
            assert self.fn is not None
            return _fsdp1_recursion(self.fn, root, children, counted)
        if self.kind is Kind.CLASSES:
            return {m: {} for m in fqns if m is not root and isinstance(m, self.classes)}
        assert self.fn is not None
        return _custom(self.fn, root, fqns)


def read_torch_policy(policy: Any) -> Optional[TorchPolicy]:
    """``policy`` as a `TorchPolicy` if it is one of torch FSDP1's (or has FSDP1's callable signature),
    else ``None``. See [Note: recognising torch's policies without importing them]."""
    cls = type(policy)
    if cls.__module__.startswith(_TORCH_FSDP) and not isinstance(policy, (type, functools.partial)):
        if cls.__name__ == "ModuleWrapPolicy" and hasattr(policy, "_module_classes"):
            classes = tuple(sorted(policy._module_classes, key=lambda c: c.__name__))
            names = ", ".join(c.__name__ for c in classes)
            return TorchPolicy(Kind.CLASSES, f"torch ModuleWrapPolicy({{{names}}})", classes=classes)
        if cls.__name__ == "CustomPolicy" and callable(getattr(policy, "_lambda_fn", None)):
            return TorchPolicy(Kind.CUSTOM, "torch CustomPolicy", fn=policy._lambda_fn)
        if not callable(policy) and cls.__module__ == _TORCH_WRAP:
            raise TypeError(
                f"the torch policy {cls.__name__} is not supported; use ModuleWrapPolicy, SizeBasedPolicy or "
                "CustomPolicy from fsdp_composable, or torch's ModuleWrapPolicy, CustomPolicy or a function "
                "policy(module, recurse, nonwrapped_numel)"
            )
    if callable(policy) and not isinstance(policy, type) and _has_fsdp1_signature(policy):
        return TorchPolicy(Kind.RECURSIVE, _describe_callable(policy), fn=policy)
    return None


def _target(policy: Callable[..., Any]) -> Any:
    while isinstance(policy, functools.partial):
        policy = policy.func
    return policy


def _has_fsdp1_signature(policy: Callable[..., Any]) -> bool:
    if getattr(_target(policy), "__module__", None) and _target(policy).__module__.startswith(_TORCH_FSDP):
        return True
    try:
        params = inspect.signature(policy).parameters
    except (TypeError, ValueError):  # builtins without a signature: not FSDP1's
        return False
    return "recurse" in params and "nonwrapped_numel" in params


def _describe_callable(policy: Callable[..., Any]) -> str:
    name = getattr(_target(policy), "__name__", type(policy).__name__)
    keywords = policy.keywords if isinstance(policy, functools.partial) else {}
    shown = ", ".join(f"{k}={_short(v)}" for k, v in keywords.items())
    return f"{name}({shown})" if isinstance(policy, functools.partial) else name


def _short(value: Any) -> str:
    if isinstance(value, (set, frozenset, list, tuple)):
        return "{" + ", ".join(sorted(getattr(v, "__name__", repr(v)) for v in value)) + "}"
    return getattr(value, "__name__", repr(value))


def _fsdp1_recursion(
    fn: Callable[..., Any], root: nn.Module, children: Children, counted: Counted
) -> dict[nn.Module, dict[str, Any]]:
    """See [Note: FSDP1's recursion]."""
    chosen: dict[nn.Module, dict[str, Any]] = {}

    def subtree_numel(module: nn.Module) -> int:
        seen: set[nn.Parameter] = set()
        stack = [module]
        while stack:
            current = stack.pop()
            seen.update(counted(current))
            stack.extend(children(current))
        return sum(p.numel() for p in seen)

    def visit(module: nn.Module) -> int:  # the parameters of the subtree now inside units
        numel = subtree_numel(module)
        if not fn(module=module, recurse=True, nonwrapped_numel=numel):
            return 0
        inside = sum(visit(child) for child in children(module))
        if module is not root and fn(module=module, recurse=False, nonwrapped_numel=numel - inside):
            chosen[module] = {}
            return numel
        return inside

    visit(root)
    return chosen


def _custom(fn: Callable[[nn.Module], Any], root: nn.Module, fqns: dict[nn.Module, str]) -> dict[nn.Module, dict]:
    """FSDP1's ``CustomPolicy``: ``fn(module)`` is False, True, or a dict of constructor keywords for
    that unit; the keywords we can honour per unit are translated, others are refused."""
    chosen: dict[nn.Module, dict[str, Any]] = {}
    for module, fqn in fqns.items():
        if module is root:
            continue
        result = fn(module)
        if not isinstance(result, (bool, dict)):
            raise ValueError(
                f"torch CustomPolicy's function returned {type(result).__name__} for module '{fqn}'; "
                "return a bool or a dict of keyword overrides"
            )
        if not result:  # as FSDP1: False and an empty dict both mean "not a unit"
            continue
        if result is True:
            chosen[module] = {}
        else:
            chosen[module] = {_override_name(k, fqn): _override_value(k, v, fqn) for k, v in result.items()}
    return chosen


def _override_name(key: str, fqn: str) -> str:
    if key not in _OVERRIDE_NAMES:
        raise ValueError(
            f"torch CustomPolicy returned the keyword {key!r} for module '{fqn}', which cannot differ per unit "
            f"here; per-unit keywords: {sorted(_OVERRIDE_NAMES)} (set the others on the call)"
        )
    return _OVERRIDE_NAMES[key]


def _override_value(key: str, value: Any, fqn: str) -> Any:
    """torch's ``ShardingStrategy`` / ``MixedPrecision`` as ours (same names and fields)."""
    if _OVERRIDE_NAMES[key] == "strategy" and not isinstance(value, ShardingStrategy):
        ours = getattr(ShardingStrategy, getattr(value, "name", ""), None)
        if ours is None:
            raise ValueError(
                f"torch CustomPolicy returned {key}={value!r} for module '{fqn}'; expected a ShardingStrategy"
            )
        return ours
    if key == "mixed_precision" and value is not None and not isinstance(value, MixedPrecision):
        ours = as_ours(f"torch CustomPolicy's mixed_precision for module '{fqn}'", value)  # see `_fsdp1_names`
        if not isinstance(ours, MixedPrecision):
            raise ValueError(
                f"torch CustomPolicy returned mixed_precision={value!r} for module '{fqn}'; expected a MixedPrecision"
            )
        return ours
    return value
