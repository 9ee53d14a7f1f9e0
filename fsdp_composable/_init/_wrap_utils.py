"""Wrap policies and `_get_submodule_to_states`: auto-wrapping that picks units without wrapping.

[Note: which unit owns a parameter]
The policy picks unit modules (ours are asked module by module, bottom-up; torch FSDP1's decide over
the whole tree, see `_torch_policies`); the root of the call is always one. Each original parameter belongs
to the deepest unit module that is an ancestor of *every* module registering it, so a parameter
shared by several modules (tied embeddings) lands in their lowest common ancestor's unit and is
flattened once. Modules already managed by an earlier `fully_shard` call (manual bottom-up nesting)
and ignored modules are skipped with their whole subtree, and so are parameters already flattened.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NoReturn, Optional, Union

import torch
from torch import nn

from fsdp_composable._common_utils import FSDP_FLATTENED, _get_fsdp_state
from fsdp_composable._names._torch_policies import Children, Counted, TorchPolicy, read_torch_policy
from fsdp_composable.api import MixedPrecision, ShardingStrategy

__all__ = ["CustomPolicy", "ModuleWrapPolicy", "Policy", "SizeBasedPolicy"]

# The per-unit settings a `CustomPolicy` may override, with the type each must have.
UNIT_OVERRIDES: dict[str, tuple[type, ...]] = {
    "strategy": (ShardingStrategy,),
    "mixed_precision": (MixedPrecision, type(None)),
}


class Policy:
    """Decides which submodules own a unit. Subclass and implement `_unit_overrides`."""

    def _unit_overrides(self, module: nn.Module, fqn: str, unassigned_numel: int) -> Optional[dict[str, Any]]:
        """``None``: not a unit. A dict (possibly empty): a unit, with these setting overrides.

        ``unassigned_numel`` counts the parameters in ``module``'s subtree not yet owned by a unit
        found deeper down (the policy sees modules bottom-up)."""
        raise NotImplementedError

    def _select_units(
        self, root: nn.Module, fqns: dict[nn.Module, str], children: Children, counted: Counted
    ) -> Optional[dict[nn.Module, dict[str, Any]]]:
        """A policy that decides over the whole tree at once returns the unit modules other than
        ``root`` (with overrides); ``None`` (the default) means: ask `_unit_overrides` per module."""
        return None


@dataclass(frozen=True)
class ModuleWrapPolicy(Policy):
    """Make every module whose class is in ``module_classes`` a unit (e.g. transformer blocks)."""

    module_classes: frozenset[type]

    def __init__(self, module_classes: Iterable[type]) -> None:
        if isinstance(module_classes, type):
            name = module_classes.__name__
            raise TypeError(
                f"ModuleWrapPolicy expects an iterable of nn.Module subclasses, got the class {name}; "
                f"write ModuleWrapPolicy({{{name}}})"
            )
        if isinstance(module_classes, str) or not isinstance(module_classes, Iterable):
            raise TypeError(
                f"ModuleWrapPolicy expects an iterable of nn.Module subclasses, got {type(module_classes).__name__}"
            )
        classes = frozenset(module_classes)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(f"ModuleWrapPolicy expects nn.Module subclasses, got {bad!r}")
        if not classes:
            raise ValueError(
                "ModuleWrapPolicy needs at least one nn.Module subclass; pass policy=None to make the whole "
                "module one unit"
            )
        object.__setattr__(self, "module_classes", classes)

    def __repr__(self) -> str:  # used in messages: class names, not their full paths
        return f"ModuleWrapPolicy({{{', '.join(sorted(c.__name__ for c in self.module_classes))}}})"

    def _unit_overrides(self, module: nn.Module, fqn: str, unassigned_numel: int) -> Optional[dict[str, Any]]:
        return {} if type(module) in self.module_classes else None


@dataclass(frozen=True)
class SizeBasedPolicy(Policy):
    """Make a module a unit once the parameters below it that no deeper unit owns reach
    ``min_num_params``."""

    min_num_params: int = int(1e8)

    def __post_init__(self) -> None:
        if not isinstance(self.min_num_params, int) or self.min_num_params < 1:
            raise ValueError(f"SizeBasedPolicy.min_num_params must be a positive int, got {self.min_num_params!r}")

    def _unit_overrides(self, module: nn.Module, fqn: str, unassigned_numel: int) -> Optional[dict[str, Any]]:
        return {} if unassigned_numel >= self.min_num_params else None


@dataclass(frozen=True)
class CustomPolicy(Policy):
    """``fn(module)`` returns ``True``/``False``, or a dict of per-unit overrides (keys: ``strategy``,
    ``mixed_precision``) that makes the module a unit with those settings."""

    fn: Callable[[nn.Module], Union[bool, dict[str, Any]]]

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(
                "CustomPolicy expects a callable(module) returning a bool or a dict of per-unit overrides, "
                f"got {type(self.fn).__name__}"
            )

    def _unit_overrides(self, module: nn.Module, fqn: str, unassigned_numel: int) -> Optional[dict[str, Any]]:
        result = self.fn(module)
        if isinstance(result, dict):
            _check_overrides(result, fqn)
            return dict(result)
        if not isinstance(result, bool):
            raise TypeError(
                f"CustomPolicy's function returned {type(result).__name__} for module '{fqn}'; "
                "return a bool or a dict of per-unit overrides"
            )
        return {} if result else None


@dataclass(frozen=True)
class _CallablePolicy(Policy):
    fn: Callable[[nn.Module], bool]
    where: str = "policy"  # how messages name it, e.g. "fully_shard argument 'policy'"

    def _unit_overrides(self, module: nn.Module, fqn: str, unassigned_numel: int) -> Optional[dict[str, Any]]:
        result = self.fn(module)
        if isinstance(result, dict):  # truthy, so it would silently mean "a unit, no overrides"
            raise TypeError(
                f"{self.where} returned a dict for module '{fqn}'; per-unit overrides need CustomPolicy(fn), "
                "a plain callable must return True or False"
            )
        if not isinstance(result, bool):
            raise TypeError(
                f"{self.where} returned {type(result).__name__} for module '{fqn}'; return True or False "
                "(or use CustomPolicy for per-unit overrides)"
            )
        return {} if result else None


@dataclass(frozen=True)
class _FromTorch(Policy):
    """One of torch FSDP1's policies, picking the units FSDP1 would wrap (see `_torch_policies`)."""

    torch_policy: TorchPolicy

    def __repr__(self) -> str:
        return repr(self.torch_policy)

    def _unit_overrides(self, module: nn.Module, fqn: str, unassigned_numel: int) -> Optional[dict[str, Any]]:
        raise AssertionError("torch policies pick units with _select_units")

    def _select_units(
        self, root: nn.Module, fqns: dict[nn.Module, str], children: Children, counted: Counted
    ) -> Optional[dict[nn.Module, dict[str, Any]]]:
        chosen = self.torch_policy.select(root, fqns, children, counted)
        for module, overrides in chosen.items():
            _check_overrides(overrides, fqns[module])
        return chosen


@dataclass(frozen=True)
class _BatchNormInFullPrecision(Policy):
    """Under mixed precision every BatchNorm becomes its own full-precision unit: low-precision
    running statistics drift (see `_init_utils._warn_batchnorm_under_mixed_precision`)."""

    inner: Optional[Policy]

    def _unit_overrides(self, module: nn.Module, fqn: str, unassigned_numel: int) -> Optional[dict[str, Any]]:
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return {"mixed_precision": None}
        return self.inner._unit_overrides(module, fqn, unassigned_numel) if self.inner is not None else None

    def _select_units(
        self, root: nn.Module, fqns: dict[nn.Module, str], children: Children, counted: Counted
    ) -> Optional[dict[nn.Module, dict[str, Any]]]:
        chosen = self.inner._select_units(root, fqns, children, counted) if self.inner is not None else None
        if chosen is None:
            return None
        for module in fqns:
            if module is not root and isinstance(module, nn.modules.batchnorm._BatchNorm):
                chosen[module] = {"mixed_precision": None}
        return chosen


def _check_overrides(overrides: dict[str, Any], fqn: str) -> None:
    for key, value in overrides.items():
        if key not in UNIT_OVERRIDES:
            raise ValueError(
                f"CustomPolicy returned an unknown override {key!r} for module '{fqn}'; "
                f"allowed keys: {sorted(UNIT_OVERRIDES)}"
            )
        if not isinstance(value, UNIT_OVERRIDES[key]):
            raise TypeError(
                f"CustomPolicy override {key!r} for module '{fqn}' must be "
                f"{' or '.join(t.__name__ for t in UNIT_OVERRIDES[key])}, got {type(value).__name__}"
            )


_POLICY_EXAMPLES = {
    "ModuleWrapPolicy": "ModuleWrapPolicy({MyBlock, ...})",
    "SizeBasedPolicy": "SizeBasedPolicy(min_num_params)",
    "CustomPolicy": "CustomPolicy(fn)",
}


def _as_policy(policy: Any, where: str = "policy") -> Optional[Policy]:
    """``policy`` as a `Policy`; ``where`` names it in messages (e.g. "fully_shard argument 'policy'")."""
    if policy is None or isinstance(policy, Policy):
        return policy
    torch_policy = read_torch_policy(policy)
    if torch_policy is not None:
        return _FromTorch(torch_policy)
    if isinstance(policy, type):  # classes are callable, so they would pass for a policy function
        _raise_policy_class(policy, where)
    if callable(policy):
        return _CallablePolicy(policy, where)
    raise TypeError(
        f"{where} must be None, ModuleWrapPolicy, SizeBasedPolicy, CustomPolicy or a callable(module) -> bool, "
        f"got {type(policy).__name__}"
    )


def _raise_policy_class(cls: type, where: str) -> NoReturn:
    name = cls.__name__
    if issubclass(cls, nn.Module):
        raise TypeError(
            f"{where} is the module class {name}; pass ModuleWrapPolicy({{{name}}}) to make every {name} a unit"
        )
    if issubclass(cls, Policy):
        raise TypeError(
            f"{where} is the class {name}, not an instance; pass {_POLICY_EXAMPLES.get(name, name + '(...)')}"
        )
    raise TypeError(
        f"{where} must be None, ModuleWrapPolicy, SizeBasedPolicy, CustomPolicy or a callable(module) -> bool, "
        f"got the class {name}"
    )


@dataclass
class SubmoduleState:
    """What one unit module will manage: its parameters, where each is registered, and overrides."""

    fqn: str
    params: list[nn.Parameter] = field(default_factory=list)
    # per parameter: every (module, attribute name, FQN relative to the unit module) registering it
    holders: list[list[tuple[nn.Module, str, str]]] = field(default_factory=list)
    overrides: dict[str, Any] = field(default_factory=dict)


def _flat_groups(sub: SubmoduleState) -> list[tuple[list[nn.Parameter], list[list[tuple[nn.Module, str, str]]]]]:
    """Split a unit's parameters into flat-parameter groups of one dtype and one ``requires_grad``.

    [Note: one flat parameter per group]
    A flat parameter is one tensor, so it has one dtype; and a frozen parameter sharing a flat
    parameter with trainable ones would get a slot in the gradient buffer and the reduction. So each
    unit gets one handle per (dtype, requires_grad) group, in order of first appearance. The unit's
    handles unshard, reshard and reduce together, driven by the same hooks."""
    groups: dict[tuple[torch.dtype, bool], tuple[list[nn.Parameter], list[list[tuple[nn.Module, str, str]]]]] = {}
    for param, holders in zip(sub.params, sub.holders):
        params, all_holders = groups.setdefault((param.dtype, param.requires_grad), ([], []))
        params.append(param)
        all_holders.append(holders)
    return list(groups.values())


def _managed_tree(
    root: nn.Module, skip: set[nn.Module]
) -> tuple[dict[nn.Module, str], dict[nn.Module, Optional[nn.Module]]]:
    """Modules under ``root`` (pre-order) that this call manages, with each one's parent."""
    fqns: dict[nn.Module, str] = {root: ""}
    parents: dict[nn.Module, Optional[nn.Module]] = {root: None}
    stack: list[tuple[nn.Module, str]] = [(root, "")]
    while stack:
        module, prefix = stack.pop()
        children = []
        for name, child in module.named_children():
            if child in skip or child in fqns or _get_fsdp_state(child) is not None:
                continue
            fqns[child] = f"{prefix}{name}"
            parents[child] = module
            children.append((child, f"{prefix}{name}."))
        stack.extend(reversed(children))
    return fqns, parents


def _get_submodule_to_states(
    root: nn.Module,
    policy: Any,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    batchnorm_full_precision: bool = False,
) -> dict[nn.Module, SubmoduleState]:
    """Map each unit module under ``root`` (the root first, then pre-order) to what it manages.

    No module is wrapped or moved; see [Note: which unit owns a parameter]."""
    pol = _as_policy(policy)
    if batchnorm_full_precision:
        pol = _BatchNormInFullPrecision(pol)
    fqns, parents = _managed_tree(root, ignored_modules)
    overrides = _pick_units(root, pol, fqns, parents, ignored_params)
    states = {m: SubmoduleState(fqns[m], overrides=overrides[m]) for m in fqns if m in overrides}
    owner_of: dict[nn.Parameter, nn.Module] = {}
    holders_of: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
    for module in fqns:
        for name, param in module._parameters.items():
            if param is None or param in ignored_params or getattr(param, FSDP_FLATTENED, False):
                continue
            holders_of.setdefault(param, []).append((module, name))
            unit = _nearest_unit(module, parents, states)
            owner_of[param] = unit if param not in owner_of else _common_unit(owner_of[param], unit, parents, states)
    for param, where in holders_of.items():
        unit = owner_of[param]
        sub = states[unit]
        prefix = f"{sub.fqn}." if sub.fqn else ""
        sub.params.append(param)
        sub.holders.append([(m, n, _join(fqns[m], n)[len(prefix) :]) for m, n in where])
    return {m: s for m, s in states.items() if s.params or m is root}


def _pick_units(
    root: nn.Module,
    policy: Optional[Policy],
    fqns: dict[nn.Module, str],
    parents: dict[nn.Module, Optional[nn.Module]],
    ignored_params: set[nn.Parameter],
) -> dict[nn.Module, dict[str, Any]]:
    """Ask the policy about each managed module bottom-up, tracking unassigned parameter counts."""
    chosen: dict[nn.Module, dict[str, Any]] = {root: {}}
    if policy is None:
        return chosen
    whole_tree = policy._select_units(
        root,
        fqns,
        lambda m: [c for c in m.children() if c in fqns and parents[c] is m],
        lambda m: _counted_params(m, ignored_params),
    )
    if whole_tree is not None:
        chosen.update(whole_tree)
        return chosen
    unassigned: dict[nn.Module, int] = {m: 0 for m in fqns}
    seen: set[nn.Parameter] = set()
    for module in reversed(list(fqns)):  # reversed pre-order visits children before parents
        for param in _counted_params(module, ignored_params):
            if param in seen:
                continue
            seen.add(param)
            unassigned[module] += param.numel()
        if module is not root:
            result = policy._unit_overrides(module, fqns[module], unassigned[module])
            if result is not None:
                chosen[module] = result
                continue  # its parameters are assigned: do not count them upward
        parent = parents[module]
        if parent is not None:
            unassigned[parent] += unassigned[module]
    return chosen


def _counted_params(module: nn.Module, ignored_params: set[nn.Parameter]) -> list[nn.Parameter]:
    """``module``'s own parameters that a unit may take: not ignored, not in an earlier call's unit."""
    return [
        p
        for p in module._parameters.values()
        if p is not None and p not in ignored_params and not getattr(p, FSDP_FLATTENED, False)
    ]


def _nearest_unit(
    module: nn.Module, parents: dict[nn.Module, Optional[nn.Module]], states: dict[nn.Module, Any]
) -> nn.Module:
    current: Optional[nn.Module] = module
    while current is not None and current not in states:
        current = parents[current]
    assert current is not None, "the root is always a unit"
    return current


def _unit_chain(
    unit: nn.Module, parents: dict[nn.Module, Optional[nn.Module]], states: dict[nn.Module, Any]
) -> list[nn.Module]:
    chain = []
    current: Optional[nn.Module] = unit
    while current is not None:
        if current in states:
            chain.append(current)
        current = parents[current]
    return chain[::-1]


def _common_unit(
    a: nn.Module, b: nn.Module, parents: dict[nn.Module, Optional[nn.Module]], states: dict[nn.Module, Any]
) -> nn.Module:
    common = a
    for x, y in zip(_unit_chain(a, parents, states), _unit_chain(b, parents, states)):
        if x is not y:
            break
        common = x
    return common


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
