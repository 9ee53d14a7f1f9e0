"""Lightning strategies that shard with `fully_shard`: `FabricStrategy` (Fabric) and `TrainerStrategy` (Trainer).

Requires the optional extra: ``pip install 'fsdp_composable[lightning]'``.

[Note: why our own Lightning strategies]
Lightning's ``ModelParallelStrategy`` runs a user's ``parallelize_fn`` (or ``configure_model``), so
`fully_shard` already trains under it, but its checkpointing looks for ``DTensor`` parameters and
refuses our model (ours are plain tensors, views of the shard), and its ``no_backward_sync`` only
knows FSDP2 modules, so it silently reduces every micro-batch. These subclasses keep everything else
of that strategy (process group and device mesh set-up, launcher, collectives, meta-device init)
and replace three things:
- parallelize: the user's ``parallelize_fn(module, device_mesh)``, or ``fully_shard(module, policy,
  process_group=device_mesh["data_parallel"], **fully_shard_kwargs)``;
- save/load: the model's SHARDED state dict and `optim_state_dict` through
  ``torch.distributed.checkpoint`` (a directory, loadable at another world size), plus ``meta.pt``
  from rank 0 with everything else; with ``save_distributed_checkpoint=False`` one file from rank 0
  with the FULL state dicts (Lightning's single-file layout), which loads at any world size too;
- gradient accumulation: `no_sync` on the sharded model.
The data-parallel size defaults to the world size (Lightning's defaults are made for tensor
parallelism inside a node).
"""

from __future__ import annotations

import contextlib
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping, Optional, Union

import torch
import torch.distributed.checkpoint as dcp

try:
    import lightning  # noqa: F401
except ImportError as e:  # a clear message instead of "No module named 'lightning'" further down
    raise ImportError(
        "fsdp_composable.lightning needs Lightning: pip install 'fsdp_composable[lightning]' "
        "(or pip install lightning)",
        name="lightning",  # the missing module, as Python's own ImportError names it
    ) from e
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy as _FabricModelParallel
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.pytorch.strategies import ModelParallelStrategy as _TrainerModelParallel
from lightning.pytorch.strategies.parallel import ParallelStrategy as _TrainerParallelStrategy
from torch import nn
from torch.optim import Optimizer

from fsdp_composable._common_utils import _get_fsdp_states
from fsdp_composable._compat.fsdp1._fsdp1_static import OptimStateKeyType, rekey_optim_state_dict
from fsdp_composable._runtime._forward_methods import register_fsdp_forward_method
from fsdp_composable._runtime._grad_utils import no_sync
from fsdp_composable._state._optim_utils import init_optim_state, optim_state_dict, optim_state_dict_to_load
from fsdp_composable._state._state_dict_utils import state_dict_type
from fsdp_composable.api import FullStateDictConfig, StateDictType
from fsdp_composable.fully_shard import fully_shard

__all__ = ["FabricStrategy", "TrainerStrategy"]

ParallelizeFn = Callable[[nn.Module, Any], nn.Module]
Size = Union[Literal["auto"], int]
META_FILENAME = "meta.pt"  # rank 0's file in the checkpoint directory: everything but model and optimizers
_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


# ---------------------------------------------------------------------------------------------------
# Shared by both strategies: arguments, parallelize, checkpoints


def _check_args(name: str, policy: Any, parallelize_fn: Optional[ParallelizeFn], kwargs: Mapping[str, Any],
                tensor_parallel_size: Size, save_distributed_checkpoint: bool) -> None:
    if parallelize_fn is not None and (policy is not None or kwargs):
        raise ValueError(
            f"{name}: pass either parallelize_fn (which calls fully_shard itself) or a policy and fully_shard "
            f"arguments, not both (got parallelize_fn and {sorted(kwargs) or 'policy'})"
        )
    if "process_group" in kwargs or "mesh" in kwargs:
        raise ValueError(
            f"{name}: the strategy passes process_group=device_mesh['data_parallel'] to fully_shard; to shard "
            "over another group, pass parallelize_fn(module, device_mesh) and call fully_shard there"
        )
    if tensor_parallel_size not in ("auto", 1) and parallelize_fn is None:
        raise ValueError(
            f"{name}: tensor_parallel_size={tensor_parallel_size} needs a parallelize_fn(module, device_mesh) "
            "that applies tensor parallelism on device_mesh['tensor_parallel'] and fully_shard on "
            "device_mesh['data_parallel']"
        )


def _mesh_sizes(data_parallel_size: Size, tensor_parallel_size: Size,
                world_size: int) -> tuple[int, int]:
    """Lightning's "auto" means one node per data-parallel replica; ours: data parallel over every rank."""
    tp = 1 if tensor_parallel_size == "auto" else int(tensor_parallel_size)
    dp = world_size // tp if data_parallel_size == "auto" else int(data_parallel_size)
    return dp, tp


def _parallelize(name: str, module: nn.Module, mesh: Any, policy: Any,
                 parallelize_fn: Optional[ParallelizeFn], kwargs: Mapping[str, Any]) -> nn.Module:
    if parallelize_fn is not None:
        module = parallelize_fn(module, mesh)
    else:
        fully_shard(module, policy, process_group=mesh["data_parallel"], **kwargs)
    if not isinstance(module, nn.Module) or not _get_fsdp_states(module):
        raise TypeError(
            f"{name}: parallelize_fn must call fully_shard on the module (or its submodules) and return the "
            f"module, got {type(module).__name__} with no fully_shard state"
        )
    return module


def _only_sharded_module(name: str, objects: Mapping[str, Any]) -> tuple[str, nn.Module]:
    found = [(k, m) for k, m in objects.items() if isinstance(m, nn.Module) and _get_fsdp_states(m)]
    if len(found) != 1:
        raise ValueError(
            f"{name}: a checkpoint holds exactly one model sharded by fully_shard, found "
            f"{[k for k, _ in found] or 'none'} in the state's keys {sorted(objects)}; pass the model set up by "
            "the strategy as one of the values, and save several models to several paths"
        )
    return found[0]


def _sharded_state(module_key: str, module: nn.Module, optimizers: Mapping[str, Optimizer], *,
                   template: bool) -> dict[str, Any]:
    """The model's SHARDED state dict and each optimizer's, as DCP saves them (or loads into them)."""
    if template:
        for optim in optimizers.values():
            init_optim_state(optim)  # a fresh optimizer has no state for DCP to load into
    with state_dict_type(module, StateDictType.SHARDED_STATE_DICT):
        out = {module_key: module.state_dict()}
        out.update({key: optim_state_dict(module, optim) for key, optim in optimizers.items()})
    return out


def _load_sharded(path: Path, module_key: str, module: nn.Module, optimizers: Mapping[str, Optimizer],
                  strict: bool) -> None:
    state = _sharded_state(module_key, module, optimizers, template=True)
    dcp.load(state, checkpoint_id=path)
    with state_dict_type(module, StateDictType.SHARDED_STATE_DICT):
        module.load_state_dict(state[module_key], strict=strict)
        for key, optim in optimizers.items():
            optim.load_state_dict(optim_state_dict_to_load(module, optim, state[key]))


def _check_is_sharded_checkpoint(name: str, path: Path) -> None:
    if not _is_sharded_checkpoint(path):
        raise ValueError(
            f"{name}: {str(path)!r} is not a checkpoint saved by this strategy (a directory with DCP's "
            f"'.metadata' and '{META_FILENAME}', or one file saved with save_distributed_checkpoint=False)"
        )


def _is_sharded_checkpoint(path: Path) -> bool:
    return (path / META_FILENAME).is_file() and (path / ".metadata").is_file()


def _full_state(module: nn.Module, optim: Optional[Optimizer] = None) -> dict[str, Any]:
    """The model's FULL state dict, or ``optim``'s (FQN-keyed), on the CPU, on rank 0 only (other ranks
    take part in the gathers and get an empty dict): what a single-file checkpoint holds."""
    with state_dict_type(module, StateDictType.FULL_STATE_DICT, FullStateDictConfig(True, rank0_only=True)):
        return module.state_dict() if optim is None else optim_state_dict(module, optim)


def _check_single_file_path(path: Path) -> None:
    """On every rank, before any gather: a single file may replace a sharded checkpoint at ``path``, as
    Lightning's does, but no other directory."""
    if path.is_dir() and not _is_sharded_checkpoint(path):
        raise IsADirectoryError(f"The checkpoint path exists and is a directory: {path}")


def _prepare_single_file(path: Path) -> None:
    """Rank 0, just before writing the file: remove the sharded checkpoint it replaces."""
    if path.is_dir():
        shutil.rmtree(path)


def _load_full(module: nn.Module, optimizers: Mapping[str, Optimizer], model_state: Mapping[str, Any],
               optim_states: Mapping[str, Any], strict: bool) -> None:
    """Every rank loads the whole file: the model's FULL state dict, then each optimizer's (keyed by FQN,
    or by position as Lightning's Trainer saves it)."""
    with state_dict_type(module, StateDictType.FULL_STATE_DICT):
        module.load_state_dict(model_state, strict=strict)
    for key, optim in optimizers.items():
        osd = optim_states[key]
        if any(isinstance(k, int) for g in osd.get("param_groups", []) for k in g["params"]):
            osd = rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, module, optim=optim)
        optim.load_state_dict(optim_state_dict_to_load(module, optim, osd))


class _NoSyncControl(_BackwardSyncControl):
    """Lightning's gradient-accumulation switch, mapped to `no_sync` on the sharded model."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return no_sync(module) if enabled else contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------------
# Fabric


class FabricStrategy(_FabricModelParallel):
    """A Fabric strategy that shards with `fully_shard`.

    ``FabricStrategy(policy, **fully_shard_kwargs)`` calls ``fully_shard(module, policy,
    process_group=<data-parallel group>, **fully_shard_kwargs)`` in ``fabric.setup_module``;
    ``FabricStrategy(parallelize_fn=fn)`` calls ``fn(module, device_mesh)`` instead, which must call
    `fully_shard` and return the module. ``fabric.save`` / ``fabric.load`` write and read a DCP
    directory (SHARDED model and optimizer state; loadable at another world size) and
    ``fabric.no_backward_sync`` is `no_sync`.
    """

    def __init__(
        self,
        policy: Any = None,
        *,
        parallelize_fn: Optional[ParallelizeFn] = None,
        data_parallel_size: Size = "auto",
        tensor_parallel_size: Size = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        **fully_shard_kwargs: Any,
    ) -> None:
        name = type(self).__name__
        _check_args(name, policy, parallelize_fn, fully_shard_kwargs, tensor_parallel_size,
                    save_distributed_checkpoint)
        self._policy, self._user_parallelize_fn, self._fully_shard_kwargs = policy, parallelize_fn, fully_shard_kwargs
        super().__init__(
            parallelize_fn=self._shard,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._backward_sync_control = _NoSyncControl()

    def _shard(self, module: nn.Module, mesh: Any) -> nn.Module:
        return _parallelize(type(self).__name__, module, mesh, self._policy, self._user_parallelize_fn,
                            self._fully_shard_kwargs)

    def setup_environment(self) -> None:
        self._data_parallel_size, self._tensor_parallel_size = _mesh_sizes(
            self._data_parallel_size, self._tensor_parallel_size, self.num_nodes * self.num_processes
        )
        super().setup_environment()

    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        name = type(self).__name__
        if storage_options is not None or filter is not None:
            raise TypeError(f"{name}.save_checkpoint takes no storage_options or filter: it saves with DCP")
        path = Path(self.broadcast(path))
        key, module = _only_sharded_module(name, state)
        optimizers = {k: o for k, o in state.items() if isinstance(o, Optimizer)}
        meta = {k: _plain(v) for k, v in state.items() if not isinstance(v, (nn.Module, Optimizer))}
        if not self._save_distributed_checkpoint:  # one file: Lightning's {key: model, optimizers, meta}
            _check_single_file_path(path)
            full = {key: _full_state(module), **{k: _full_state(module, o) for k, o in optimizers.items()}}
            if self.global_rank == 0:
                _prepare_single_file(path)
                torch.save({**full, **meta}, path)
            self.barrier()
            return
        converted = _sharded_state(key, module, optimizers, template=False)
        if path.is_file() and self.global_rank == 0:  # a directory replaces an earlier single file
            path.unlink()
        self.barrier()
        path.mkdir(parents=True, exist_ok=True)
        dcp.save(converted, checkpoint_id=path)
        if self.global_rank == 0:
            torch.save(meta, path / META_FILENAME)
        self.barrier()

    def load_checkpoint(
        self,
        path: Any,
        state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        name = type(self).__name__
        if not isinstance(state, dict):
            raise TypeError(
                f"{name}.load_checkpoint needs the state as a dict that holds the model, e.g. "
                f"fabric.load(path, {{'model': model, 'optimizer': optimizer}}), got {type(state).__name__}"
            )
        path = Path(self.broadcast(path))
        key, module = _only_sharded_module(name, state)
        optimizers = {k: o for k, o in state.items() if isinstance(o, Optimizer)}
        if path.is_file():  # saved with save_distributed_checkpoint=False
            meta = torch.load(path, map_location="cpu", weights_only=weights_only)
            _load_full(module, optimizers, meta.pop(key), {k: meta.pop(k) for k in optimizers}, strict)
        else:
            _check_is_sharded_checkpoint(name, path)
            _load_sharded(path, key, module, optimizers, strict)
            meta = torch.load(path / META_FILENAME, weights_only=weights_only)
        for k, value in state.items():
            if isinstance(value, (nn.Module, Optimizer)):
                continue
            if k not in meta:
                if strict:
                    raise KeyError(f"{name}: '{k}' was requested but is not in the checkpoint {str(path)!r}")
                continue
            if _is_stateful(value):
                value.load_state_dict(meta.pop(k))
            else:
                state[k] = meta.pop(k)
        return meta


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _plain(value: Any) -> Any:
    return value.state_dict() if _is_stateful(value) else value


# ---------------------------------------------------------------------------------------------------
# Trainer


class TrainerStrategy(_TrainerModelParallel):
    """A Trainer strategy that shards with `fully_shard`.

    The LightningModule is sharded in ``trainer.fit`` after ``configure_model``: if ``configure_model``
    already called `fully_shard` (on the module or its submodules) that is kept; else
    ``parallelize_fn(lightning_module, device_mesh)`` runs if given; else ``fully_shard(lightning_module,
    policy, process_group=<data-parallel group>, **fully_shard_kwargs)``, and the module's
    ``*_step`` methods are registered with `register_fsdp_forward_method`. Checkpoints are DCP
    directories (SHARDED model and optimizer state, ``meta.pt`` with the loops and callbacks), so
    ``trainer.fit(ckpt_path=...)`` resumes; ``accumulate_grad_batches`` skips the reduction with
    `no_sync` on all but the last micro-batch.
    """

    def __init__(
        self,
        policy: Any = None,
        *,
        parallelize_fn: Optional[ParallelizeFn] = None,
        data_parallel_size: Size = "auto",
        tensor_parallel_size: Size = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        **fully_shard_kwargs: Any,
    ) -> None:
        _check_args(type(self).__name__, policy, parallelize_fn, fully_shard_kwargs, tensor_parallel_size,
                    save_distributed_checkpoint)
        self._policy, self._user_parallelize_fn, self._fully_shard_kwargs = policy, parallelize_fn, fully_shard_kwargs
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    def setup_environment(self) -> None:
        self._data_parallel_size, self._tensor_parallel_size = _mesh_sizes(
            self._data_parallel_size, self._tensor_parallel_size, self.num_nodes * self.num_processes
        )
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        module = self.lightning_module
        assert module is not None
        if not _get_fsdp_states(module):
            sharded = _parallelize(type(self).__name__, module, self.device_mesh, self._policy,
                                   self._user_parallelize_fn, self._fully_shard_kwargs)
            if sharded is not module:
                raise TypeError(f"{type(self).__name__}: parallelize_fn must return the LightningModule it was given")
            if self._user_parallelize_fn is None:
                for method in _STEP_METHODS:  # Lightning calls these, not forward
                    if callable(getattr(module, method, None)):
                        register_fsdp_forward_method(module, method)
        # ModelParallelStrategy.setup insists on configure_model and materialises meta tensors, which
        # fully_shard already did; the generic set-up (precision, device, optimizers) is all we need.
        _TrainerParallelStrategy.setup(self, trainer)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        assert self.model is not None
        with no_sync(self.model):
            yield

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        if not self._save_distributed_checkpoint:  # FULL, on rank 0 only (a single file)
            return _full_state(self.model)
        with state_dict_type(self.model, StateDictType.SHARDED_STATE_DICT):
            return self.model.state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.model is not None
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        if not self._save_distributed_checkpoint:  # FULL on rank 0, keyed by position as Lightning saves it
            osd = _full_state(self.model, optimizer)
            return rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_ID, self.model, optim=optimizer) if osd else osd
        with state_dict_type(self.model, StateDictType.SHARDED_STATE_DICT):
            return optim_state_dict(self.model, optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options: it saves with DCP")
        path = Path(self.broadcast(filepath))
        if not self._save_distributed_checkpoint:  # rank 0 writes the one file, as Lightning does
            _check_single_file_path(path)
            if self.global_rank == 0:
                _prepare_single_file(path)
                torch.save(checkpoint, path)
            return
        if path.is_file() and self.global_rank == 0:  # a directory replaces an earlier single file
            path.unlink()
        self.barrier()
        converted = {"state_dict": checkpoint.pop("state_dict")}
        converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        path.mkdir(parents=True, exist_ok=True)
        dcp.save(converted, checkpoint_id=path)
        if self.global_rank == 0:
            torch.save(checkpoint, path / META_FILENAME)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        name = type(self).__name__
        path = Path(self.broadcast(checkpoint_path))
        assert self.model is not None and self.lightning_module is not None
        optimizers = {f"optimizer_{i}": getattr(o, "_optimizer", o) for i, o in enumerate(self.optimizers)}
        if path.is_file():  # saved with save_distributed_checkpoint=False
            checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only)
            saved = dict(zip(optimizers, checkpoint.get("optimizer_states", [])))
            _load_full(self.model, optimizers, checkpoint.pop("state_dict"), saved,
                       strict=self.lightning_module.strict_loading)
            return checkpoint  # type: ignore[no-any-return]
        _check_is_sharded_checkpoint(name, path)
        _load_sharded(path, "state_dict", self.model, optimizers, strict=self.lightning_module.strict_loading)
        return torch.load(path / META_FILENAME, weights_only=weights_only)  # type: ignore[no-any-return]
