"""Several modules as one unit: ``fully_shard([m1, m2])``.

[Note: several modules as one unit]
``fully_shard([m1, m2, ...])`` makes one state and one unit of every member's parameters (no
policy: each member's whole subtree, less units already made inside it). The unit's handle is owned
by the first member (``handle.module``) and lists every member in ``handle.members``; its hooks are
registered on every member:
- forward: the first member's pre-forward unshards and marks every member as still to run
  (``UnitStep.group_left``); each member's post-forward strikes itself off, and the one that empties
  the set reshards, so ``[embedding, head]`` is gathered once per forward even with blocks between
  them. A member that never runs leaves the set non-empty: the root's post-forward finishes the
  unit's forward then (`finish_group_forwards`).
- backward: every member call attaches a post-backward trigger, so the unit reduces once, after the
  backward of every member call (see [Note: when post-backward runs] in `_runtime_utils`).
- names: each parameter's holders are (module, attribute) pairs, named from the enclosing root's
  ``named_modules()`` by the state dict, the optimizer state dict and `describe`; the state-dict
  hooks are registered on every member, which opens the unit around its own subtree.
- the ``reset_parameters`` and ``to_empty`` wrappers go on the modules under every member
  (`unit_roots_named_modules`), not only under the first.
LOCAL_STATE_DICT keys a unit's flat shard by its module's prefix, which a unit of several modules
does not have: it is refused (`check_no_local_state_dict`); FULL and SHARDED work.
The members have no common module until an enclosing ``fully_shard`` is applied, so the unit runs
only under one: forward of a member before that raises (`check_not_root`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fsdp_composable._common_utils import _FSDPState
from fsdp_composable._init._wrap_utils import SubmoduleState, _get_submodule_to_states

__all__: list[str] = []


def check_members(modules: list[nn.Module], policy: Any) -> tuple[nn.Module, ...]:
    """The members of ``fully_shard([m1, m2, ...])``, checked (same outcome on every rank: no communication)."""
    names = ", ".join(type(m).__name__ for m in modules)
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError(f"fully_shard got the same module twice in its list ({names}); list each module once")
    for i, outer in enumerate(modules):
        for j, inner in enumerate(modules):
            if i != j and any(m is inner for m in outer.modules()):
                raise ValueError(
                    f"fully_shard got a list ({names}) where module {j} ({type(inner).__name__}) is inside "
                    f"module {i} ({type(outer).__name__}); list only modules that do not contain each other "
                    "(the outer one's unit already holds the inner one's parameters)"
                )
    if policy is not None:
        raise ValueError(
            f"fully_shard got a list of modules ({names}) and a policy: a list is one unit, so it takes no "
            "policy. Call fully_shard on the submodules that should be units of their own first"
        )
    return tuple(modules)


def unit_subtrees(
    module: nn.Module,
    members: tuple[nn.Module, ...],
    policy: Any,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    batchnorm_full_precision: bool,
) -> dict[nn.Module, SubmoduleState]:
    """What each unit of a ``fully_shard`` call manages: ``module``'s policy units, or, for a list of
    ``members`` (``module`` is the first), one unit of all their subtrees."""
    if not members:
        return _get_submodule_to_states(module, policy, ignored_modules, ignored_params, batchnorm_full_precision)
    subs = [_get_submodule_to_states(m, None, ignored_modules, ignored_params)[m] for m in members]
    return {module: merge_members(subs)}


def merge_members(subs: list[SubmoduleState]) -> SubmoduleState:
    """One unit of every member's parameters; a parameter several members register (tied) appears once,
    with every holder."""
    merged = SubmoduleState(subs[0].fqn)
    where: dict[int, int] = {}
    for sub in subs:
        for param, holders in zip(sub.params, sub.holders):
            k = where.get(id(param))
            if k is None:
                where[id(param)] = len(merged.params)
                merged.params.append(param)
                merged.holders.append(list(holders))
            else:
                merged.holders[k].extend(holders)
    return merged


def check_no_local_state_dict(handle: Any) -> None:
    """LOCAL_STATE_DICT has no key for the flat shard of a unit of several modules."""
    if len(handle.members) > 1:
        names = ", ".join(type(m).__name__ for m in handle.members)
        raise ValueError(
            f"LOCAL_STATE_DICT cannot save or load the unit fully_shard made of several modules ({names}): "
            "its flat shard has no single module to be keyed under. Use FULL_STATE_DICT or SHARDED_STATE_DICT"
        )


def unit_roots_named_modules(state: _FSDPState) -> list[tuple[str, nn.Module]]:
    """Every module under the state's module and, for ``fully_shard([m1, m2])``, under each member (the
    later members are not below the first), each once, named from its own root."""
    roots: list[nn.Module] = [state.module]
    for handle in state.handles:
        roots.extend(m for m in handle.members if all(m is not r for r in roots))
    seen: set[int] = set()
    out: list[tuple[str, nn.Module]] = []
    for root in roots:
        for fqn, module in root.named_modules():
            if id(module) not in seen:
                seen.add(id(module))
                out.append((fqn, module))
    return out
