"""`_init_<intent>_state` functions: the constructor, shared by `fully_shard` and the wrapper class.

Each function validates one group of arguments (naming the argument and what to do on bad input)
and fills in one part of the `_FSDPState`.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from fsdp_composable._comm import _collectives, _rank_agreement, _tensor_parallel
from fsdp_composable._comm._rank_agreement import Op
from fsdp_composable._common_utils import FSDP_FLATTENED, _FSDPState, _get_fsdp_state
from fsdp_composable._config import ShardConfig
from fsdp_composable._flat_param import FLAT_PARAM_NAME, FlatParamHandle
from fsdp_composable._init._applied_checks import check_not_applied_below_parent
from fsdp_composable._init._group_units import unit_subtrees
from fsdp_composable._init._ignored_checks import check_no_param_tied_to_ignored, check_ranks_ignore_alike
from fsdp_composable._init._wrap_utils import ModuleWrapPolicy, Policy, SubmoduleState, _as_policy, _flat_groups, _join
from fsdp_composable._runtime._prefetch import default_forward_prefetch
from fsdp_composable.api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy

__all__: list[str] = []

# the strategies that replicate across a second group (FSDP1's _HYBRID_SHARD_ZERO2 keeps parameters after forward)
_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)

# [Note: API names in messages]
# `fully_shard` and the wrapper class share these functions; each passes its own name as ``api`` so that a
# message names the argument the user wrote (the wrapper's differ for two of them).
_ARG_NAMES: dict[str, dict[str, str]] = {
    "FullyShardedDataParallel": {"strategy": "sharding_strategy", "policy": "auto_wrap_policy"},
}


def _arg(api: str, name: str) -> str:
    """``"<api> argument '<name>'"``, with the API's own name for the argument."""
    return f"{api} argument {_ARG_NAMES.get(api, {}).get(name, name)!r}"


def _check_type(api: str, name: str, value: Any, types: Union[type, tuple[type, ...]], hint: str) -> None:
    if not isinstance(value, types):
        raise TypeError(f"{_arg(api, name)} must be {hint}, got {type(value).__name__}: {value!r}")


def _validate_args(args: ShardConfig) -> Optional[Policy]:
    """Check the plain arguments' types; returns ``policy`` as a `Policy` (its messages name ``api``)."""
    api, strategy, mixed_precision, cpu_offload = args.api, args.strategy, args.mixed_precision, args.cpu_offload
    backward_prefetch, forward_prefetch = args.backward_prefetch, args.forward_prefetch
    limit_all_gathers, sync_module_states = args.limit_all_gathers, args.sync_module_states
    param_init_fn, policy = args.param_init_fn, args.policy
    _check_type(api, "strategy", strategy, ShardingStrategy, "a ShardingStrategy (e.g. ShardingStrategy.FULL_SHARD)")
    _check_type(api, "mixed_precision", mixed_precision, (MixedPrecision, type(None)), "a MixedPrecision or None")
    _check_type(api, "cpu_offload", cpu_offload, (CPUOffload, type(None)), "a CPUOffload or None")
    _check_type(
        api, "backward_prefetch", backward_prefetch, (BackwardPrefetch, type(None)), "a BackwardPrefetch or None"
    )
    if forward_prefetch is not None:
        _check_type(api, "forward_prefetch", forward_prefetch, bool, "True, False or None")
    for name, value in (
        ("limit_all_gathers", limit_all_gathers),
        ("sync_module_states", sync_module_states),
    ):
        _check_type(api, name, value, bool, "True or False")
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(f"{_arg(api, 'param_init_fn')} must be a callable(module) or None, got {param_init_fn!r}")
    return _as_policy(policy, _arg(api, "policy"))


def _init_process_group_state(
    process_group: Any, strategy: ShardingStrategy, api: str = "fully_shard"
) -> tuple[dist.ProcessGroup, Optional[dist.ProcessGroup], int, int]:
    """(shard group, replicate group or None, rank and world size in the shard group).

    ``process_group`` is a ProcessGroup, a 1-D DeviceMesh, or for HYBRID_SHARD a
    ``(shard_group, replicate_group)`` pair or a 2-D DeviceMesh laid out (replicate, shard)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs an initialised default process group: call "
            "torch.distributed.init_process_group('gloo' or 'nccl', ...) first (torchrun sets the "
            "environment for you)"
        )
    shard, replicate = _split_process_group(process_group, api)
    hybrid = strategy in _HYBRID
    if hybrid and replicate is None:
        raise ValueError(
            "ShardingStrategy.HYBRID_SHARD needs process_group=(shard_group, replicate_group) or a 2-D "
            "DeviceMesh (replicate, shard): say which ranks shard together and which replicate"
        )
    if not hybrid and replicate is not None:
        raise ValueError(
            f"a (shard, replicate) process_group or 2-D DeviceMesh is only for HYBRID_SHARD, not {strategy.name}; "
            "pass one ProcessGroup"
        )
    if hybrid and shard is not None and replicate is not None:
        _check_hybrid_groups(api, shard, replicate)
    group = shard if shard is not None else dist.group.WORLD
    assert group is not None
    return group, replicate, dist.get_rank(group), dist.get_world_size(group)


def _split_process_group(
    process_group: Any, api: str = "fully_shard"
) -> tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]:
    from torch.distributed.device_mesh import DeviceMesh

    _check_member(api, process_group)
    if process_group is None or isinstance(process_group, dist.ProcessGroup):
        return process_group, None
    if isinstance(process_group, DeviceMesh):
        if process_group.ndim == 1:
            return process_group.get_group(), None
        if process_group.ndim == 2:
            return process_group.get_group(1), process_group.get_group(0)
        raise ValueError(
            f"{_arg(api, 'process_group')} must be a 1-D DeviceMesh (or a 2-D (replicate, shard) one for "
            f"HYBRID_SHARD), got a {process_group.ndim}-D DeviceMesh; slice or flatten it"
        )
    if isinstance(process_group, tuple) and len(process_group) == 2:
        for g in process_group:
            _check_member(api, g)
        if all(isinstance(g, dist.ProcessGroup) for g in process_group):
            return process_group[0], process_group[1]
    raise TypeError(
        f"{_arg(api, 'process_group')} must be a ProcessGroup, a DeviceMesh, a "
        f"(shard_group, replicate_group) tuple or None, got {type(process_group).__name__}"
    )


def _check_member(api: str, group: Any) -> None:
    # `dist.new_group(ranks)` returns this int sentinel, not a group, on the ranks it leaves out
    if isinstance(group, int) and not isinstance(group, bool) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{_arg(api, 'process_group')} does not contain this rank ({dist.get_rank()}); call {api} only on "
            "the group's ranks"
        )


def _check_hybrid_groups(api: str, shard: dist.ProcessGroup, replicate: dist.ProcessGroup) -> None:
    """HYBRID_SHARD reduce-scatters in the shard group, then all-reduces across the replicate group:
    unless the two cross only at this rank, some gradient contributions are summed twice or never."""
    shard_ranks = dist.get_process_group_ranks(shard)
    replicate_ranks = dist.get_process_group_ranks(replicate)
    common = sorted(set(shard_ranks) & set(replicate_ranks))
    if common != [dist.get_rank()]:
        raise ValueError(
            f"{_arg(api, 'process_group')}: for HYBRID_SHARD the shard group (ranks {shard_ranks}) and the "
            f"replicate group (ranks {replicate_ranks}) must have exactly one rank in common, this one; they "
            f"share {common}. Pass groups that cross at this rank, e.g. a 2-D DeviceMesh "
            "init_device_mesh(device_type, (num_replicas, shard_size)) laid out (replicate, shard)"
        )


def _init_ignored_module_states(
    module: nn.Module,
    ignored_modules: Optional[Iterable[nn.Module]],
    api: str = "fully_shard",
    groups: tuple[Optional[dist.ProcessGroup], ...] = (), device: Optional[torch.device] = None,
) -> tuple[set[nn.Module], set[nn.Parameter]]:
    """The ignored modules (with their submodules) and their parameters; ``groups``: where every rank
    must ignore the same modules ([Note: ignored modules across ranks]), checked on ``device``'s."""
    where = _arg(api, "ignored_modules")
    if ignored_modules is None:
        check_ranks_ignore_alike(module, set(), groups, where, device)
        return set(), set()
    if isinstance(ignored_modules, nn.Module) or not isinstance(ignored_modules, Iterable):
        raise TypeError(
            f"{where} must be an iterable of submodules (e.g. a list), got {type(ignored_modules).__name__}"
        )
    ignored = set(ignored_modules)
    submodules = set(module.modules())
    for m in ignored:
        if not isinstance(m, nn.Module):
            raise TypeError(f"{where} must contain nn.Module instances, got {type(m).__name__}")
        if m is module:
            raise ValueError(f"{where} cannot contain the module {api} is applied to")
        if m not in submodules:
            raise ValueError(
                f"{where} contains a {type(m).__name__} that is not a submodule of the "
                f"{type(module).__name__} passed to {api}; pass only its submodules"
            )
    check_ranks_ignore_alike(module, ignored, groups, where, device)
    expanded = {sub for m in ignored for sub in m.modules()}
    check_no_param_tied_to_ignored(module, expanded, where)
    params = {p for m in expanded for p in m.parameters(recurse=False)}
    return expanded, params


def _init_device(
    module: nn.Module, device_id: Union[int, torch.device, None], ignored: set[nn.Parameter], api: str = "fully_shard"
) -> torch.device:
    """The compute device: ``device_id``, or where the parameters are (a model all on the meta
    device: the current CUDA device where there is one, as FSDP1 materialises it, else the CPU; a
    ``param_init_fn`` that puts it elsewhere decides, see `_adopt_materialised_device`).

    [Note: placement one unit at a time]
    With ``device_id`` nothing is moved here: each unit's parameters are moved when the unit is
    built (`_move_unit_params`, bottom-up, right before they are flattened and sharded), and what
    is left (buffers, ignored modules) at the end (`_move_rest`), so device memory peaks near one
    unit unsharded, as with FSDP1, instead of the whole model first. Meta tensors are materialised
    on the device (``to_empty``), never copied."""
    if device_id is not None:
        return _check_device_id(api, device_id)
    devices = {p.device for p in module.parameters() if p not in ignored}
    devices.discard(torch.device("meta"))
    if not devices and any(True for _ in module.parameters()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if len(devices) > 1:
        raise ValueError(
            f"fully_shard found parameters of {type(module).__name__} on several devices "
            f"({sorted(str(d) for d in devices)}); move the module to one device or pass device_id"
        )
    return devices.pop() if devices else torch.device("cpu")


def _check_device_id(api: str, device_id: Any) -> torch.device:
    where = _arg(api, "device_id")
    if isinstance(device_id, bool) or not isinstance(device_id, (int, torch.device)):
        raise TypeError(f"{where} must be an int, a torch.device or None, got {device_id!r}")
    if isinstance(device_id, int):
        if device_id < 0:
            raise ValueError(f"{where} must be a CUDA device index >= 0 or a torch.device, got {device_id}")
        if not torch.cuda.is_available():
            raise ValueError(
                f"{where}={device_id} means cuda:{device_id} but CUDA is not available; on CPU pass "
                "device_id=None or torch.device('cpu')"
            )
        return torch.device("cuda", device_id)
    if device_id.type == "meta":
        raise ValueError(
            f"{where} must be a real device, got meta; to defer initialisation build the model on the meta "
            "device and pass param_init_fn"
        )
    if device_id.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{where} is {device_id} but CUDA is not available; on CPU pass device_id=None")
    if device_id.type == "cuda" and device_id.index is None:  # the current one, as FSDP1 reads it
        return torch.device("cuda", torch.cuda.current_device())  # (moved parameters carry an index)
    return device_id


def _init_core_state(
    module: nn.Module,
    args: ShardConfig,
    process_group: dist.ProcessGroup,
    replicate_group: Optional[dist.ProcessGroup],
    device: torch.device,
) -> _FSDPState:
    """The state of one call, with its runtime and prefetching settings; handles come later."""
    rank, world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
    return _FSDPState(
        module=module,
        process_group=process_group,
        rank=rank,
        world_size=world_size,
        device=device,
        config=args.unit_config(world_size),
        backward_prefetch=args.backward_prefetch,
        forward_prefetch=default_forward_prefetch(args.forward_prefetch, process_group, device),
        limit_all_gathers=args.limit_all_gathers,
        use_orig_params=args.use_orig_params,
        replicate_group=replicate_group,
    )


def _init_buffer_state(state: _FSDPState, module: nn.Module) -> None:
    """Record every buffer's original dtype under its clean FQN (see [Note: buffer casting] in `_lazy_init`)."""
    state.buffer_name_to_orig_dtype = {
        name: buf.dtype for name, buf in module.named_buffers() if not _in_ignored(module, name, state)
    }


def _in_ignored(module: nn.Module, buffer_fqn: str, state: _FSDPState) -> bool:
    owner = module.get_submodule(buffer_fqn.rpartition(".")[0]) if "." in buffer_fqn else module
    return owner in state.ignored_modules


def _materialize_meta_module(
    unit_module: nn.Module,
    fqn: str,
    param_init_fn: Optional[Callable[[nn.Module], None]],
    device: torch.device,
    api: str = "fully_shard",
) -> None:
    """Materialise a unit's meta parameters and buffers, one module at a time (parents first).

    [Note: param_init_fn is called per module]
    As in FSDP1 since torch 2.1, ``param_init_fn(m)`` (or, without it, ``m.to_empty(device,
    recurse=False); m.reset_parameters()``) is called for each module of the unit that directly holds a
    meta parameter or buffer, so the common
    ``lambda m: (m.to_empty(device=d, recurse=False), m.reset_parameters())`` works. Modules of deeper
    units were materialised before (units are built bottom-up) and are skipped, and a module is skipped
    if an earlier call (e.g. a recursive ``to_empty`` on its parent) already materialised it.
    """
    modules = _meta_modules(unit_module)
    if not modules:
        return
    names = {m: n for n, m in unit_module.named_modules(prefix=fqn)}
    if param_init_fn is not None:
        _check_param_init_fn_arity(api, param_init_fn, modules[0], names.get(modules[0], fqn))
        for m in modules:
            if _holds_meta(m):
                param_init_fn(m)
        return
    missing = [m for m in modules if not callable(getattr(m, "reset_parameters", None))]
    if missing:
        name = names.get(missing[0], "")
        kind, tensor = next(
            (kind, n)
            for kind, named in (
                ("parameter", missing[0].named_parameters(prefix=name, recurse=False)),
                ("buffer", missing[0].named_buffers(prefix=name, recurse=False)),
            )
            for n, t in named
            if t.is_meta
        )
        raise ValueError(
            f"unit '{fqn or '<root>'}' has {kind}s on the meta device and module '{name or '<root>'}' "
            f"({type(missing[0]).__name__}, {kind} '{tensor}') has no reset_parameters(); pass "
            f"param_init_fn= to {api} to materialise them"
        )
    for m in modules:
        m.to_empty(device=device, recurse=False)
        with torch.no_grad():
            getattr(m, "reset_parameters")()  # noqa: B009 (checked callable above)


def _holds_meta(module: nn.Module) -> bool:
    """``module`` directly holds a meta parameter or buffer that no unit has flattened yet."""
    params = (p for p in module.parameters(recurse=False) if not getattr(p, FSDP_FLATTENED, False))
    return any(t.is_meta for t in params) or any(b.is_meta for b in module.buffers(recurse=False))


def _meta_modules(unit_module: nn.Module) -> list[nn.Module]:
    """Modules of the unit holding meta tensors, breadth-first from the unit module (FSDP1's order)."""
    out, queue, seen = [], [unit_module], {unit_module}
    while queue:
        module = queue.pop(0)
        if _holds_meta(module):
            out.append(module)
        for child in module.children():
            if child not in seen and (child is unit_module or _get_fsdp_state(child) is None):
                seen.add(child)
                queue.append(child)
    return out


def _check_param_init_fn_arity(
    api: str, param_init_fn: Callable[[nn.Module], None], unit_module: nn.Module, fqn: str
) -> None:
    """Bind before calling: a TypeError from inside the user's function must stay the user's."""
    try:
        signature = inspect.signature(param_init_fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): let the call decide
        return
    try:
        signature.bind(unit_module)
    except TypeError as e:
        raise TypeError(
            f"{_arg(api, 'param_init_fn')} cannot be called with module '{fqn or '<root>'}' "
            f"({type(unit_module).__name__}): it must take one argument, the module to materialise"
        ) from e


def _init_param_handles_from_module(
    state: _FSDPState,
    policy: Any,
    param_init_fn: Optional[Callable[[nn.Module], None]],
    sync_module_states: bool = False,
    api: str = "fully_shard",
    device_id: Union[int, torch.device, None] = None,
    members: tuple[nn.Module, ...] = (),
) -> dict[nn.Module, SubmoduleState]:
    """Create one handle per unit, bottom-up. Each unit is materialised (if on the meta device),
    synchronised from rank 0 (if asked) and sharded before the next one is touched, so peak memory
    stays near one unit unsharded."""
    module = state.module
    check_not_applied_below_parent(module, state.ignored_params)
    _warn_policy_matches_nothing(state, policy, api)
    bn = _warn_batchnorm_under_mixed_precision(state)
    submodule_states = unit_subtrees(module, members, policy, state.ignored_modules, state.ignored_params, bn)
    for member in members[1:]:  # fully_shard([m1, m2]): the first is materialised as its unit, below
        _materialize_meta_module(member, "", param_init_fn, state.device, api)
    _check_unit_overrides(state, submodule_states, api)
    handles: dict[nn.Module, list[FlatParamHandle]] = {}
    tp_group = _tensor_parallel.model_tp_group(module)
    move = device_id is not None  # see [Note: placement one unit at a time]
    for unit_module, sub in reversed(list(submodule_states.items())):
        _materialize_meta_module(unit_module, sub.fqn, param_init_fn, state.device, api)
        _retie_and_refresh(sub)
        if not move:
            _adopt_materialised_device(state, sub)
        _check_comm_device(state.process_group, state.device, api)
        if move:
            _move_unit_params(sub, state.device)
        if sync_module_states:
            _broadcast_from_rank0(state, [_tensor_parallel.local_of(p).detach() for p in sub.params])
            if tp_group is not None:  # what every tensor-parallel rank holds whole must agree across them too
                whole = [p for p in sub.params if not _tensor_parallel.is_tp_sharded(_tensor_parallel.spec_of(p))]
                _broadcast_over(tp_group, [_tensor_parallel.local_of(p).detach() for p in whole])
        _check_unit_params(sub)
        config = state.config.with_overrides(sub.overrides)
        fqns = [_join(sub.fqn, holders[0][2]) for holders in sub.holders]
        _tensor_parallel.check_supported(sub.fqn, sub.params, fqns, config.strategy in _HYBRID)
        handles[unit_module] = [
            FlatParamHandle(
                unit_module,
                sub.fqn,
                params,
                holders,
                state.process_group,
                config,
                state.device,
                state.replicate_group,
                name=FLAT_PARAM_NAME if i == 0 else f"{FLAT_PARAM_NAME}_{i}",
            )
            for i, (params, holders) in enumerate(_flat_groups(sub))
        ]
    for group in handles.values():
        for handle in group:
            handle.tp_group = tp_group
    if move:
        _move_rest(module, state.device)
    _check_comm_device(state.process_group, state.device, api)
    if sync_module_states:
        buffers = [b for n, b in module.named_buffers() if not _in_ignored(module, n, state)]
        _broadcast_from_rank0(state, buffers)
        if tp_group is not None:
            _broadcast_over(tp_group, buffers)
    state.handles.extend(h for m in submodule_states for h in handles.get(m, []))  # root first, pre-order
    # initialisation may have replaced the ignored modules' parameter objects too
    state.ignored_params = {p for m in state.ignored_modules for p in m.parameters(recurse=False)}
    state.ignored_params |= {p for m, n in state.ignored_param_holders if (p := m._parameters.get(n)) is not None}
    return submodule_states


def _adopt_materialised_device(state: _FSDPState, sub: SubmoduleState) -> None:
    """A meta model without ``device_id`` whose ``param_init_fn`` materialised it on another device
    (e.g. CUDA) computes there: nothing is copied back to where the meta model was assumed to go."""
    devices = {p.device for p in sub.params if not p.is_meta}
    built = any(getattr(p, FSDP_FLATTENED, False) for p in state.module.parameters())  # not the first unit
    if len(devices) == 1 and not built:
        state.device = devices.pop()


def _check_comm_device(group: dist.ProcessGroup, device: torch.device, api: str) -> None:
    """A model on a device its process group does not serve (e.g. left on the CPU with an NCCL
    group) is refused before any collective, with the fix, instead of failing inside one."""
    types = sorted({d.type for d in _collectives.served_devices(group)})
    if device.type in types or device.type == "meta":
        return
    fix = "torch.cuda.current_device()" if "cuda" in types else f"torch.device({types[0]!r})"
    raise ValueError(
        f"{api}: the module's parameters are on {device}, but its process group (backend "
        f"{dist.get_backend(group)!r}) communicates {' and '.join(types)} tensors only; pass device_id={fix} "
        "(it moves the model one unit at a time) or move the model there first"
    )


def _move_unit_params(sub: SubmoduleState, device: torch.device) -> None:
    """Move one unit's parameters to ``device`` before they are flattened (see [Note: placement one
    unit at a time]); a tensor-parallel DTensor already lives on its mesh's device."""
    with torch.no_grad():
        for param in sub.params:
            if not param.is_meta and param.device != device and not _tensor_parallel.spec_of(param):
                param.data = param.data.to(device)


def _move_rest(module: nn.Module, device: torch.device) -> None:
    """After every unit is built: the buffers and the parameters no unit manages (ignored modules)."""
    with torch.no_grad():
        for m in module.modules():
            for param in m._parameters.values():
                if param is not None and not getattr(param, FSDP_FLATTENED, False) and param.device != device:
                    param.data = param.data.to(device)
            for name, buf in m._buffers.items():
                if buf is not None and buf.device != device:
                    m._buffers[name] = buf.to(device)


def _retie_and_refresh(sub: SubmoduleState) -> None:
    """Initialisation (``to_empty``, a user's init function) may replace parameter objects: make every
    holder of a parameter register the first holder's object again (tied weights stay tied)."""
    for i, holders in enumerate(sub.holders):
        first_module, first_name, _ = holders[0]
        param = first_module._parameters[first_name]
        assert param is not None
        for m, name, _ in holders[1:]:
            if m._parameters.get(name) is not param:
                m._parameters[name] = param
        sub.params[i] = param


def _broadcast_from_rank0(state: _FSDPState, tensors: list[torch.Tensor]) -> None:
    """``sync_module_states``: every rank starts from rank 0's values."""
    for group in (state.process_group, state.replicate_group):
        if group is not None:  # shard group first, then across replicas: every rank gets rank 0's
            _broadcast_over(group, tensors)


def _broadcast_over(group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in tensors:
            _rank_agreement.agree_before(group, Op.BROADCAST, t.numel(), t.dtype, "broadcast", "sync_module_states")
            dist.broadcast(t, src=src, group=group)


def _check_unit_overrides(
    state: _FSDPState, submodule_states: dict[nn.Module, SubmoduleState], api: str = "fully_shard"
) -> None:
    """Before any unit is built: an override needing a group the call did not get is an error."""
    for sub in submodule_states.values():
        if sub.overrides.get("strategy") in _HYBRID and state.replicate_group is None:
            raise ValueError(
                f"CustomPolicy override strategy=HYBRID_SHARD for module '{sub.fqn}' needs a replicate group: "
                f"pass process_group=(shard_group, replicate_group) or a 2-D DeviceMesh to {api}"
            )


def _warn_policy_matches_nothing(state: _FSDPState, policy: Any, api: str) -> None:
    """A ModuleWrapPolicy naming classes the model does not have is almost always a mistake (a class
    from another module of the same name, a typo'd import); the model silently becomes one unit."""
    if not isinstance(policy, ModuleWrapPolicy):
        return
    if any(type(m) in policy.module_classes for m in state.module.modules()):
        return
    warnings.warn(
        f"{api}: {policy!r} matched no submodule of {type(state.module).__name__}, so the whole module is "
        "one unit; check the classes",
        stacklevel=4,
    )


def _check_unit_params(sub: SubmoduleState) -> None:
    if not sub.params:
        return
    first = sub.params[0]
    for param, holders in zip(sub.params, sub.holders):
        where = f"'{sub.fqn}.{holders[0][2]}'" if sub.fqn else f"'{holders[0][2]}'"
        if param.is_meta:
            raise ValueError(f"parameter {where} is still on the meta device after initialisation; check param_init_fn")
        if not param.is_floating_point():
            raise ValueError(
                f"parameter {where} has dtype {param.dtype}; fully_shard shards floating-point parameters only. "
                "Register it as a buffer, or keep it whole on every rank: pass it in ignored_params (or its "
                "module in ignored_modules)"
            )
        if param.device != first.device:
            raise ValueError(
                f"unit '{sub.fqn or '<root>'}' has parameters on different devices: {where} is on "
                f"{param.device}, others on {first.device}; move the module to one device first"
            )


def _warn_batchnorm_under_mixed_precision(state: _FSDPState) -> bool:
    """True (with a warning) when BatchNorm modules must become their own full-precision units."""
    if not state.config.low_precision_compute:
        return False
    names = [name for name, m in state.module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if names:
        warnings.warn(
            f"fully_shard under mixed precision gives each BatchNorm module its own unit in full precision "
            f"({', '.join(repr(n) for n in names[:3])}{', ...' if len(names) > 3 else ''}): low-precision "
            "running statistics are inaccurate. Its inputs keep their dtype",
            stacklevel=4,
        )
    return bool(names)
