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
from fsdp_composable._config import ShardConfig
from fsdp_composable._flat_mode import _use_flat_params, _use_orig_params
from fsdp_composable._grad_utils import clip_grad_norm_, no_sync
from fsdp_composable._state_dict_utils import _register_prefix_hooks
from fsdp_composable._torch_interop import _register_torch_api_hooks
from fsdp_composable._unshard_param_utils import unshard_params
from fsdp_composable.api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from fsdp_composable.fully_shard import _build_state

__all__ = ["FullyShardedDataParallel"]

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
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        device_mesh: Any = None,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"FullyShardedDataParallel expects an nn.Module, got {type(module).__name__}")
        if not isinstance(use_orig_params, bool):
            raise TypeError(
                f"FullyShardedDataParallel argument 'use_orig_params' must be True or False, got {use_orig_params!r}"
            )
        process_group = _group_or_mesh(process_group, device_mesh)
        _check_flat_mode_without_tensor_parallel(module, use_orig_params)
        super().__init__()
        self._fsdp_wrapped_module = module
        strategy = ShardingStrategy.FULL_SHARD if sharding_strategy is None else sharding_strategy
        args = ShardConfig(
            policy=auto_wrap_policy,
            process_group=process_group,
            strategy=strategy,
            mixed_precision=mixed_precision,
            cpu_offload=cpu_offload,
            ignored_modules=ignored_modules,
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

    def unshard_params(self, **kwargs: Any) -> contextlib.AbstractContextManager[None]:
        """See `fsdp_composable.unshard_params`."""
        return _unshard_in_orig_mode(self, **kwargs)

    summon_full_params = unshard_params

    @staticmethod
    def state_dict_type(
        module: nn.Module, state_dict_type: Any, state_dict_config: Any = None
    ) -> contextlib.AbstractContextManager[None]:
        """See `fsdp_composable.state_dict_type` (a `StateDictType` and its matching config)."""
        from fsdp_composable._state_dict_utils import state_dict_type as _state_dict_type

        return _state_dict_type(module, state_dict_type, state_dict_config)

    @staticmethod
    def optim_state_dict(module: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
        """See `fsdp_composable.optim_state_dict`; works with flat parameters (``use_orig_params=False``)."""
        from fsdp_composable._optim_utils import optim_state_dict as _optim_state_dict

        return _optim_state_dict(module, optim)

    @staticmethod
    def optim_state_dict_to_load(
        module: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict[str, Any]
    ) -> dict[str, Any]:
        """See `fsdp_composable.optim_state_dict_to_load`."""
        from fsdp_composable._optim_utils import optim_state_dict_to_load as _to_load

        return _to_load(module, optim, optim_state_dict)


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
