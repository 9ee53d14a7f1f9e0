"""`fully_shard`: the composable API. It attaches state and hooks and wraps nothing."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from fsdp_composable._common_utils import API_NAME, _FSDPState, _registrations_of
from fsdp_composable._composable_state import _get_module_state, _insert_module_state, contract
from fsdp_composable._config import ShardConfig
from fsdp_composable._grads._reduce_utils import init_grads
from fsdp_composable._guards._dtype_casts import mark_faces
from fsdp_composable._init import _init_utils as init
from fsdp_composable._init._default_device import default_device_not_meta
from fsdp_composable._init._group_units import check_members
from fsdp_composable._init._post_forward_group import (
    init_post_forward_groups,
    reshard_root_if_given,
    resolve_post_forward_ranks,
)
from fsdp_composable._init._reset_params import install_reset_hooks
from fsdp_composable._init._to_empty import install_to_empty
from fsdp_composable._names._fsdp1_names import as_ours
from fsdp_composable._names._fsdp2_names import OurArgs, map_fsdp2_names
from fsdp_composable._runtime._runtime_utils import _register_hooks
from fsdp_composable._state._state_dict_utils import _register_state_dict_hooks
from fsdp_composable._state._torch_interop import _install_process_changes, _register_torch_api_hooks
from fsdp_composable.api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy

__all__ = ["fully_shard"]


@contract(API_NAME, groups=True)
def fully_shard(
    module: Union[nn.Module, list[nn.Module]],
    policy: Any = None,
    *,
    process_group: Any = None,
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
    mixed_precision: Optional[MixedPrecision] = None,
    cpu_offload: Optional[CPUOffload] = None,
    ignored_modules: Optional[Iterable[nn.Module]] = None,
    device_id: Union[int, torch.device, None] = None,
    param_init_fn: Optional[Callable[[nn.Module], None]] = None,
    sync_module_states: bool = False,
    forward_prefetch: Optional[bool] = None,
    backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE,
    limit_all_gathers: bool = True,
    mesh: Any = None,
    reshard_after_forward: Union[bool, int, None] = None,
    mp_policy: Any = None,
    offload_policy: Any = None,
    ignored_params: Any = None,
    shard_placement_fn: Any = None,
) -> Any:
    """Shard ``module``'s parameters across the ranks of ``process_group``, in place.

    ``policy`` picks which submodules own a unit (all-gathered and freed together); the rest go to
    ``module``'s own unit. Returns ``module`` itself: its type and every parameter, buffer and module
    FQN are unchanged, and its parameters are the same objects (views of this rank's shard between
    steps), so build the optimizer after calling this. Read the attached state with
    ``fully_shard.state(module)``.

    ``module`` may be a list of modules: their parameters become one unit (one all-gather, one
    reduction), see [Note: several modules as one unit] in `_group_units`. The list is returned.

    FSDP2's names are accepted too: ``mesh`` (for ``process_group``; 2-D means HYBRID_SHARD),
    ``reshard_after_forward`` (False is SHARD_GRAD_OP), ``mp_policy``, ``offload_policy`` and
    ``ignored_params`` (see [Note: FSDP2 names] in `_fsdp2_names`). FSDP1's enums and configs from
    ``torch.distributed.fsdp`` are taken as ours (see [Note: torch's FSDP1 objects] in `_fsdp1_names`).
    """
    given = module
    members: tuple[nn.Module, ...] = ()
    if isinstance(module, list):
        members = check_members(module, policy)
        module = members[0]
    assert isinstance(module, nn.Module)  # the contract checked it
    # FSDP1's classes from torch.distributed.fsdp: see [Note: torch's FSDP1 objects]
    strategy = as_ours("fully_shard argument 'strategy'", strategy)
    mixed_precision = as_ours("fully_shard argument 'mixed_precision'", mixed_precision)
    cpu_offload = as_ours("fully_shard argument 'cpu_offload'", cpu_offload)
    backward_prefetch = as_ours("fully_shard argument 'backward_prefetch'", backward_prefetch)
    with default_device_not_meta():  # see [Note: fully_shard under a meta default device]
        ours = map_fsdp2_names(
            module,
            OurArgs(process_group, strategy, mixed_precision, cpu_offload, ignored_modules),
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            ignored_params=ignored_params,
            shard_placement_fn=shard_placement_fn,
        )
        _register_torch_api_hooks(module)  # before the state's own hooks: see [Note: torch's model state-dict API]
        args = ShardConfig(
            policy=policy,
            process_group=ours.process_group,
            strategy=ours.strategy,
            mixed_precision=ours.mixed_precision,
            cpu_offload=ours.cpu_offload,
            ignored_modules=ours.ignored_modules,
            ignored_params=ours.ignored_params,
            device_id=device_id if device_id is not None else mesh_device(mesh, module),
            param_init_fn=param_init_fn,
            sync_module_states=sync_module_states,
            forward_prefetch=forward_prefetch,
            backward_prefetch=backward_prefetch,
            limit_all_gathers=limit_all_gathers,
            reshard_after_forward_ranks=ours.reshard_after_forward_ranks,
        )
        for member in members[1:]:
            _register_torch_api_hooks(member)
        state = _build_state(module, args, members)
        reshard_root_if_given(state, reshard_after_forward)
    return given


def _check_placement_first(
    module: nn.Module, device_id: Any, group: dist.ProcessGroup, api: str
) -> Optional[torch.device]:
    """The placement check before the first collective (the ignored-modules check), which would fail
    inside torch ("No backend type associated with device type cpu") for a model on a device the
    group does not serve; the check runs again per unit once meta modules are materialised. Returns
    the device the unit computes on as far as it is known now (``device_id``'s, else the first
    materialised parameter's), which that collective communicates on."""
    if device_id is not None:
        given = init._check_device_id(api, device_id)
        init._check_comm_device(group, given, api)
        return given
    found = [p.device for p in module.parameters() if not p.is_meta]
    if len(set(found)) == 1:
        init._check_comm_device(group, found[0], api)
    return found[0] if found else None


def _build_state(module: nn.Module, args: ShardConfig, members: tuple[nn.Module, ...] = ()) -> _FSDPState:
    """The constructor shared with the wrapper class: a short sequence of `_init_*` calls. ``args.api``
    names the caller in error messages (see [Note: API names in messages] in `_init_utils`)."""
    applied = [m for m in (module, *members) if _get_module_state(m, API_NAME) is not None]
    if applied:
        raise RuntimeError(
            f"fully_shard was already applied to this {type(applied[0]).__name__} (directly or as a unit of "
            "a parent's policy); apply it once per module"
        )
    api = args.api
    unit_policy = init._validate_args(args)
    group, replicate_group, _, world_size = init._init_process_group_state(args.process_group, args.strategy, api)
    args = resolve_post_forward_ranks(module, args, world_size)  # reshard_after_forward=<int>
    # before the first collective, and the device that collective communicates on (as known so far)
    hint = _check_placement_first(module, args.device_id, group, api)
    ignored_mods, ignored_params = init._init_ignored_module_states(
        module, args.ignored_modules, api, (group, replicate_group), hint
    )
    single = _registrations_of(module, args.ignored_params, ignored_mods)  # parameters ignored by themselves
    ignored_params |= {p for m, name in single if (p := m._parameters[name]) is not None}
    device = init._init_device(module, args.device_id, ignored_params, api)
    state = init._init_core_state(module, args, group, replicate_group, device)
    state.ignored_modules, state.ignored_params = ignored_mods, ignored_params
    state.ignored_param_holders = single
    init._init_buffer_state(state, module)
    init._init_param_handles_from_module(
        state, unit_policy, args.param_init_fn, args.sync_module_states, api, device_id=args.device_id, members=members
    )
    for handle in state.handles:  # fully_shard([m1, m2]): one unit of every member
        handle.members = members or handle.members
    init_post_forward_groups(state, args.reshard_after_forward_ranks)
    for handle in state.handles:
        init_grads(handle, expose_orig=args.use_orig_params)
    for unit_module in {module, *members, *(h.module for h in state.handles)}:
        _insert_module_state(unit_module, API_NAME, state)
    _register_hooks(state)
    _register_state_dict_hooks(state)
    _install_process_changes()  # once per process: see `_torch_interop`
    install_reset_hooks(state)  # after param_init_fn ran: see [Note: reset_parameters after sharding]
    install_to_empty(state)  # see [Note: to_empty after sharding]
    for handle in state.handles:
        mark_faces(handle)  # see [Note: edits of a sharded model]
    return state


def mesh_device(mesh: Any, module: nn.Module) -> Optional[torch.device]:
    """FSDP2's placement for ``mesh=`` without ``device_id``: a model with parameters on the CPU
    computes on the mesh's device (CUDA: the current device), one unit moved at a time, its shards
    offloaded if ``offload_policy`` says so; None where nothing is to be moved."""
    if mesh is None or mesh.device_type == "cpu" or not any(p.device.type == "cpu" for p in module.parameters()):
        return None
    return torch.device(mesh.device_type)  # no index: the current device (`_init_utils._check_device_id`)
