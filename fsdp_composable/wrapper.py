"""`FullyShardedDataParallel`: the wrapper-class API, built from the same `_init_*` functions.

For users migrating from ``torch.distributed.fsdp.FullyShardedDataParallel``. It wraps only the
module it is given; the policy's units are attached to submodules exactly as `fully_shard` does.
With ``use_orig_params=False`` (the default, as in FSDP1) each unit module registers its flat
parameter as ``_flat_param`` in place of its original parameters, so ``named_parameters()`` and the
optimizer see flat parameters; with ``True`` they see the original parameters.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_composable._common_utils import _FSDPState
from fsdp_composable._compat.fsdp1 import _fsdp1_static, _register_comm_hook
from fsdp_composable._compat.fsdp2 import _module_switches
from fsdp_composable._config import ShardConfig
from fsdp_composable._init._default_device import default_device_not_meta
from fsdp_composable._init._to_empty import to_empty_keeping_shards
from fsdp_composable._names._fsdp1_names import as_ours
from fsdp_composable._names._fsdp2_names import split_ignored_params
from fsdp_composable._runtime._flat_mode import _use_flat_params, _use_orig_params
from fsdp_composable._runtime._grad_utils import clip_grad_norm_, no_sync
from fsdp_composable._runtime._module_controls import UnshardHandle, reshard, sharded_modules, unshard
from fsdp_composable._runtime._unshard_param_utils import unshard_params
from fsdp_composable._state._optim_utils import optim_state_dict as _optim_state_dict
from fsdp_composable._state._optim_utils import optim_state_dict_to_load as _to_load
from fsdp_composable._state._state_dict_utils import _register_prefix_hooks, state_dict_type_with_optim
from fsdp_composable._state._torch_interop import _register_torch_api_hooks
from fsdp_composable.api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from fsdp_composable.fully_shard import _build_state

__all__ = ["FullyShardedDataParallel", "OptimStateKeyType", "StateDictSettings"]

OptimStateKeyType = _fsdp1_static.OptimStateKeyType
StateDictSettings = _fsdp1_static.StateDictSettings

WRAPPED = "_fsdp_wrapped_module"


def _group_or_mesh(process_group: Any, device_mesh: Any) -> Any:
    """FSDP1's ``device_mesh`` is our ``process_group`` (which takes a DeviceMesh: 1-D, or 2-D
    (replicate, shard) for HYBRID_SHARD); giving both is ambiguous."""
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise ValueError(
            "FullyShardedDataParallel got both process_group and device_mesh; pass one (device_mesh=mesh['dp'] "
            "for data parallelism over one mesh dimension, e.g. next to tensor parallelism on mesh['tp'])"
        )
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(
            f"FullyShardedDataParallel argument 'device_mesh' must be a DeviceMesh, got {type(device_mesh).__name__}"
        )
    return device_mesh


def _check_flat_mode_without_tensor_parallel(module: nn.Module, use_orig_params: bool) -> None:
    """Flat parameters mix every tensor-parallel rank's pieces under one name, so their optimizer
    state could not be saved or resharded per piece: flat mode is refused before anything changes."""
    if use_orig_params:
        return
    name = next((n for n, p in module.named_parameters() if isinstance(p, DTensor)), None)
    if name is not None:
        raise ValueError(
            f"FullyShardedDataParallel(use_orig_params=False) cannot shard tensor-parallel (DTensor) parameter "
            f"'{name}': pass use_orig_params=True, or use fully_shard (see docs/two_d.md)"
        )


class FullyShardedDataParallel(nn.Module):
    """Shard ``module`` across ranks; same runtime as `fully_shard`, FSDP1-style constructor."""

    def __init__(
        self,
        module: nn.Module,
        process_group: Optional[dist.ProcessGroup] = None,
        sharding_strategy: Optional[ShardingStrategy] = None,
        cpu_offload: Optional[CPUOffload] = None,
        auto_wrap_policy: Any = None,
        backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: Optional[MixedPrecision] = None,
        ignored_modules: Optional[Iterable[nn.Module]] = None,
        param_init_fn: Optional[Callable[[nn.Module], None]] = None,
        device_id: Union[int, torch.device, None] = None,
        sync_module_states: bool = False,
        forward_prefetch: Optional[bool] = None,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Optional[Iterable[Union[nn.Parameter, nn.Module]]] = None,
        device_mesh: Any = None,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"FullyShardedDataParallel expects an nn.Module, got {type(module).__name__}")
        if not isinstance(use_orig_params, bool):
            raise TypeError(
                f"FullyShardedDataParallel argument 'use_orig_params' must be True or False, got {use_orig_params!r}"
            )
        process_group = _group_or_mesh(process_group, device_mesh)
        ignored_modules, ignored_params = _ignored_from_states(module, ignored_modules, ignored_states)
        _check_flat_mode_without_tensor_parallel(module, use_orig_params)
        super().__init__()
        self._fsdp_wrapped_module = module
        strategy = ShardingStrategy.FULL_SHARD if sharding_strategy is None else sharding_strategy
        # FSDP1's classes from torch.distributed.fsdp: see [Note: torch's FSDP1 objects]
        where = "FullyShardedDataParallel argument"
        strategy = as_ours(f"{where} 'sharding_strategy'", strategy)
        mixed_precision = as_ours(f"{where} 'mixed_precision'", mixed_precision)
        cpu_offload = as_ours(f"{where} 'cpu_offload'", cpu_offload)
        backward_prefetch = as_ours(f"{where} 'backward_prefetch'", backward_prefetch)
        args = ShardConfig(
            policy=auto_wrap_policy,
            process_group=process_group,
            strategy=strategy,
            mixed_precision=mixed_precision,
            cpu_offload=cpu_offload,
            ignored_modules=ignored_modules,
            ignored_params=ignored_params,
            device_id=device_id,
            param_init_fn=param_init_fn,
            sync_module_states=sync_module_states,
            forward_prefetch=forward_prefetch,
            backward_prefetch=backward_prefetch,
            limit_all_gathers=limit_all_gathers,
            use_orig_params=use_orig_params,
            api="FullyShardedDataParallel",
        )
        _register_torch_api_hooks(self)  # torch's get_state_dict on the wrapper: sharded by default, as fully_shard
        with default_device_not_meta():  # see [Note: fully_shard under a meta default device]
            state = _build_state(module, args)
            object.__setattr__(self, "_fsdp_state", state)
            _register_prefix_hooks(self, WRAPPED)
            if not use_orig_params:
                _register_flat_mode_hooks(self, state)
                _use_flat_params(state)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._fsdp_wrapped_module(*args, **kwargs)

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    # FSDP1's public attributes, read from the state (FSDP1 sets them on the instance)
    @property
    def process_group(self) -> dist.ProcessGroup:
        return _state_of(self).process_group

    @property
    def rank(self) -> int:
        return _state_of(self).rank

    @property
    def world_size(self) -> int:
        return _state_of(self).world_size

    @property
    def compute_device(self) -> torch.device:
        return _state_of(self).device

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        """The root unit's strategy (``NO_SHARD`` on a group of one rank, as in FSDP1)."""
        return _state_of(self).config.strategy

    @property
    def mixed_precision(self) -> MixedPrecision:
        return _state_of(self).config.mixed_precision or MixedPrecision()

    @property
    def cpu_offload(self) -> CPUOffload:
        return CPUOffload(offload_params=_state_of(self).config.offload_params)

    @property
    def backward_prefetch(self) -> Optional[BackwardPrefetch]:
        return _state_of(self).backward_prefetch

    @property
    def forward_prefetch(self) -> bool:
        return _state_of(self).forward_prefetch

    @property
    def limit_all_gathers(self) -> bool:
        return _state_of(self).limit_all_gathers

    @property
    def use_orig_params(self) -> bool:
        return _state_of(self).use_orig_params

    @property
    def params(self) -> list[nn.Parameter]:
        """Every unit's flat parameter (FSDP1 lists those of this instance's own unit)."""
        return [h.flat_param for h in _state_of(self).handles]

    @property
    def training_state(self) -> Any:
        """The state's `TrainingState` (ours: IDLE, FORWARD_BACKWARD, SUMMON_FULL_PARAMS)."""
        return _state_of(self).training_state

    def to_empty(self, *, device: Any, recurse: bool = True) -> "FullyShardedDataParallel":
        """torch's ``to_empty`` keeping every unit's shards ([Note: to_empty after sharding]): the inner
        module's own ``to_empty`` is not called by ``nn.Module.to_empty`` of the wrapper."""
        to_empty_keeping_shards(self, None, device, recurse)
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, index: int) -> Any:
        return self._fsdp_wrapped_module.__getitem__(index)  # type: ignore[operator]

    def _fqn_modifiers(self) -> dict[str, str]:
        """For torch's ``torch.distributed.checkpoint.state_dict``: its walk of the module tree drops
        ``_fsdp_wrapped_module.`` from FQNs, as our state dicts and ``named_parameters()`` do (torch's
        API recognises only torch's own FSDP class by type). Maps each top-level name to the child
        that holds it."""
        inner = self._fsdp_wrapped_module
        return {name: WRAPPED for name in (*inner._modules, *inner._parameters, *inner._buffers)}

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        inner = f"{prefix}{'.' if prefix else ''}{WRAPPED}."
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            yield (prefix + ("." if prefix else "") + name[len(inner) :] if name.startswith(inner) else name), param

    def clip_grad_norm_(self, max_norm: Union[float, int], norm_type: Union[float, int, str] = 2.0) -> torch.Tensor:
        """FSDP1's method: see `fsdp_composable.clip_grad_norm_`."""
        return clip_grad_norm_(self, max_norm, norm_type)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """FSDP1's method: see `fsdp_composable.no_sync`."""
        return no_sync(self)

    # FSDP2's per-module controls (see docs/api.md "Per-module controls"), for this wrapper's unit
    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        return unshard(self, async_op)

    def reshard(self) -> None:
        reshard(self)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        _module_switches.set_requires_gradient_sync(self, requires_gradient_sync, recurse)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        _module_switches.set_requires_all_reduce(self, requires_all_reduce, recurse)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        _module_switches.set_reshard_after_forward(self, reshard_after_forward, recurse)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        _module_switches.set_reshard_after_backward(self, reshard_after_backward, recurse)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        _module_switches.set_unshard_in_backward(self, unshard_in_backward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        _module_switches.set_is_last_backward(self, is_last_backward)

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        _module_switches.set_modules_to_forward_prefetch(self, modules)

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        _module_switches.set_modules_to_backward_prefetch(self, modules)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """As ``nn.Module.named_buffers``, without ``_fsdp_wrapped_module.`` (FSDP1's FQNs)."""
        inner = f"{prefix}{'.' if prefix else ''}{WRAPPED}."
        for name, buf in super().named_buffers(prefix, recurse, remove_duplicate):
            yield (prefix + ("." if prefix else "") + name[len(inner) :] if name.startswith(inner) else name), buf

    def unshard_params(
        self,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> contextlib.AbstractContextManager[None]:
        """See `fsdp_composable.unshard_params` (FSDP1's order, so positional arguments work too). As in
        FSDP1, ``FullyShardedDataParallel.summon_full_params(module)`` also takes any module holding
        wrappers: every wrapper in its tree is unsharded."""
        if not isinstance(self, FullyShardedDataParallel):  # FSDP1's static call on a plain module
            return unshard_params(
                self,
                recurse=recurse,
                writeback=writeback,
                rank0_only=rank0_only,
                offload_to_cpu=offload_to_cpu,
                with_grads=with_grads,
            )
        return _unshard_in_orig_mode(
            self,
            recurse=recurse,
            writeback=writeback,
            rank0_only=rank0_only,
            offload_to_cpu=offload_to_cpu,
            with_grads=with_grads,
        )

    summon_full_params = unshard_params

    def apply(self, fn: Callable[[nn.Module], None]) -> "FullyShardedDataParallel":
        """FSDP1's ``apply``: ``fn`` on every submodule and self (as ``nn.Module.apply``), with every
        parameter unsharded to its full shape and written back afterwards (inside `unshard_params`).
        Call it between steps, on every rank."""
        with _unshard_in_orig_mode(self, writeback=True):
            nn.Module.apply(self, fn)
        return self

    def check_is_root(self) -> bool:
        """Whether this wrapper is the outermost sharded module (before the first forward: whether no
        forward has made it part of another)."""
        return _state_of(self).is_root is not False

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[nn.Module]:
        """Every unit in ``module`` (itself included), in pre-order, as FSDP1 lists every wrapped module:
        a wrapper instance, or a module an ``auto_wrap_policy`` made a unit (it keeps its class: not a
        wrapper, so FSDP1's attributes are the root wrapper's). ``root_only`` keeps those not inside
        another."""
        found = sharded_modules(module)
        if not root_only:
            return found
        inner = {id(sub) for m in found for sub in m.modules() if sub is not m}
        return [m for m in found if id(m) not in inner]

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """FSDP1's communication hook: ``hook(state, grad, output)`` (sharded strategies) or
        ``hook(state, grad)`` (NO_SHARD) reduces every unit's gradient in place of ours; torch's default
        hooks work. On the root, before the first forward, once."""
        _register_comm_hook.register_comm_hook(self, state, hook)

    # FSDP1's static methods for state dicts and optimizer state: see [Note: FSDP1's optimizer-state methods]
    set_state_dict_type = staticmethod(_fsdp1_static.set_state_dict_type)
    get_state_dict_type = staticmethod(_fsdp1_static.get_state_dict_type)
    full_optim_state_dict = staticmethod(_fsdp1_static.full_optim_state_dict)
    sharded_optim_state_dict = staticmethod(_fsdp1_static.sharded_optim_state_dict)
    shard_full_optim_state_dict = staticmethod(_fsdp1_static.shard_full_optim_state_dict)
    flatten_sharded_optim_state_dict = staticmethod(_fsdp1_static.flatten_sharded_optim_state_dict)
    scatter_full_optim_state_dict = staticmethod(_fsdp1_static.scatter_full_optim_state_dict)
    rekey_optim_state_dict = staticmethod(_fsdp1_static.rekey_optim_state_dict)

    @staticmethod
    def state_dict_type(
        module: nn.Module, state_dict_type: Any, state_dict_config: Any = None, optim_state_dict_config: Any = None
    ) -> contextlib.AbstractContextManager[None]:
        """See `fsdp_composable.state_dict_type` (a `StateDictType` and its matching config). Optimizer
        state dicts follow ``optim_state_dict_config`` where given (torch's FSDP1 type), else
        ``state_dict_config``."""
        config = as_ours("state_dict_type argument 'config'", state_dict_config)
        kind = as_ours("state_dict_type argument 'state_dict_type'", state_dict_type)
        optim_config = _fsdp1_static.optim_config_of(optim_state_dict_config, kind, "state_dict_type")
        return state_dict_type_with_optim(module, kind, config, optim_config)

    @staticmethod
    def optim_state_dict(
        module: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: Any = None, group: Any = None
    ) -> dict[str, Any]:
        """See `fsdp_composable.optim_state_dict`; works with flat parameters (``use_orig_params=False``).
        FSDP1's ``optim_state_dict`` (for its ``NamedOptimizer``) and ``group`` are not supported."""
        _refuse("optim_state_dict", optim_state_dict=optim_state_dict, group=group)
        return _optim_state_dict(module, optim)

    @staticmethod
    def optim_state_dict_to_load(
        module: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: Any = None,
    ) -> dict[str, Any]:
        """See `fsdp_composable.optim_state_dict_to_load`; ``load_directly=True`` also loads it into ``optim``."""
        _refuse("optim_state_dict_to_load", is_named_optimizer=is_named_optimizer or None, group=group)
        result = _to_load(module, optim, optim_state_dict)
        if load_directly:
            optim.load_state_dict(result)
        return result


def _refuse(where: str, **given: Any) -> None:
    """FSDP1 keywords we do not offer: an error naming the keyword if one was given."""
    for name, value in given.items():
        if value is not None:
            raise ValueError(
                f"FullyShardedDataParallel.{where}: {name} is not supported (the model's own process groups and "
                "a plain torch.optim.Optimizer are used); leave it out"
            )


def _state_of(wrapper: FullyShardedDataParallel) -> _FSDPState:
    state: _FSDPState = object.__getattribute__(wrapper, "_fsdp_state")
    return state


def _ignored_from_states(
    module: nn.Module, ignored_modules: Optional[Iterable[nn.Module]], ignored_states: Any
) -> tuple[Optional[Iterable[nn.Module]], tuple[nn.Parameter, ...]]:
    """FSDP1's ``ignored_states`` (modules and/or parameters) as ``ignored_modules`` and parameters
    ignored by themselves, as `fully_shard`'s ``ignored_params``."""
    if ignored_states is None:
        return ignored_modules, ()
    where = "FullyShardedDataParallel argument 'ignored_states'"
    if ignored_modules is not None:
        raise ValueError(f"{where} and 'ignored_modules' were both given; pass one")
    if isinstance(ignored_states, (torch.Tensor, nn.Module)) or not isinstance(ignored_states, Iterable):
        raise TypeError(f"{where} must be a list of parameters and/or modules, got {type(ignored_states).__name__}")
    states = list(ignored_states)
    modules = [m for m in states if isinstance(m, nn.Module)]
    params = [p for p in states if not isinstance(p, nn.Module)]
    if not params:
        return modules, ()
    try:
        whole, single = split_ignored_params(module, None, params)
        return [*modules, *(whole or [])], single
    except (TypeError, ValueError) as e:
        message = str(e).replace("fully_shard argument 'ignored_params'", where).replace("ignored_params ", "it ")
        raise type(e)(message.replace("fully_shard ", "FullyShardedDataParallel ")) from None


@contextlib.contextmanager
def _unshard_in_orig_mode(wrapper: FullyShardedDataParallel, **kwargs: Any) -> Iterator[None]:
    state: _FSDPState = object.__getattribute__(wrapper, "_fsdp_state")
    flat = not state.use_orig_params
    if flat:
        _use_orig_params(state)
    try:
        with unshard_params(wrapper.module, **kwargs):
            yield
    finally:
        if flat:
            _use_flat_params(state)


def _register_flat_mode_hooks(wrapper: nn.Module, state: _FSDPState) -> None:
    """State dicts always speak original FQNs: switch to original parameters around save and load."""
    wrapper.register_state_dict_pre_hook(lambda *args: _use_orig_params(state))
    wrapper._register_state_dict_hook(lambda *args: _use_flat_params(state))
    wrapper._register_load_state_dict_pre_hook(lambda sd, *args: _drop_own_flat_params(state, sd))
    wrapper._register_load_state_dict_pre_hook(lambda *args: _use_orig_params(state))
    wrapper.register_load_state_dict_post_hook(lambda *args: _use_flat_params(state))


def _drop_own_flat_params(state: _FSDPState, state_dict: dict[str, Any]) -> None:
    """torch's ``set_model_state_dict(..., full_state_dict=True)`` adds every registered parameter,
    here our flat parameters themselves, to the full state dict it loads; they are not state-dict
    keys (the original parameters are), so drop entries that are one of our live flat parameters."""
    flat = {id(h.flat_param) for h in state.handles}
    for key in [k for k, v in state_dict.items() if id(v) in flat]:
        del state_dict[key]
