"""CPU offload's entry points with a communication device other than the shard's, on CPU.

[Note: the offload spy]
With ``CPUOffload(offload_params=True)`` on NCCL the flat shards, their gradients and the optimizer
state live on the CPU while every collective must take CUDA tensors. The device audit world
(device_audit_world.py) cannot hold a CPU shard behind its ``meta`` parameters, so this check runs
in the gloo pool instead: a model with offloaded shards trains for real, then every entry point
(FULL / SHARDED state dicts saved and loaded, optimizer-state conversion both ways,
``unshard_params``, ``reset_parameters`` after sharding, our ``clip_grad_norm_`` and torch's routed
one) runs while `_collectives.comm_device` reports ``meta`` and every ``torch.distributed``
collective is replaced by a spy that records the devices of the tensors it is handed and moves no
data (as torch's fake process group does). A tensor built on the shard's device (or a bare
``torch.tensor`` on the default one) shows up as a ``cpu`` entry. Values read back are meaningless
here: a dispatch mode hands out zeros for copies from ``meta`` to the host, and `host_values` reads
zeros (every rank agreeing). The values themselves are checked by the offload parity tests on gloo.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from models import Block, TinyGPT, gpt_batch, gpt_loss
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_composable as fc
from fsdp_composable._comm import _collectives, _rank_agreement

META = torch.device("meta")
# every torch.distributed collective the package calls (by attribute, so patching dist reaches it)
_DIST = ("all_reduce", "broadcast", "all_gather", "all_to_all_single", "isend", "irecv", "reduce_scatter")


class _Done:
    def wait(self, *args: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _HostCopies(TorchDispatchMode):
    """Copies of ``meta`` tensors to the host give zeros (meta tensors carry shapes only)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0].is_meta and kwargs.get("device") not in (None, META):
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype, device=kwargs["device"])
        if func is torch.ops.aten.copy_.default and not args[0].is_meta and args[1].is_meta:
            return args[0].zero_()
        return func(*args, **kwargs)


@contextlib.contextmanager
def _spied(seen: dict[str, set[str]], where: list[str]) -> Iterator[None]:
    def spy(name: str) -> Callable[..., Any]:
        def record(*args: Any, **kwargs: Any) -> Any:
            flat = [*args, *kwargs.values()]
            tensors = [a for a in flat if isinstance(a, torch.Tensor)]
            tensors += [t for a in flat if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
            seen.setdefault(where[0], set()).update(f"{name}:{t.device.type}" for t in tensors)
            return _Done() if kwargs.get("async_op") or name in ("isend", "irecv") else None

        return record

    patched: list[tuple[Any, str, Any]] = [(dist, name, getattr(dist, name)) for name in _DIST]
    patched += [(_collectives, name, getattr(_collectives, name)) for name in ("_all_gather", "_reduce_scatter")]
    patched += [
        (_collectives, "comm_device", _collectives.comm_device),
        (_collectives, "host_values", _collectives.host_values),
        (_rank_agreement, "checks", _rank_agreement.checks),  # gloo-only headers, never on NCCL
    ]
    try:
        for owner, name, _ in patched[: len(_DIST)]:
            setattr(owner, name, spy(name))
        _collectives._all_gather = spy("all_gather_into_tensor")  # type: ignore[assignment]
        _collectives._reduce_scatter = spy("reduce_scatter_tensor")  # type: ignore[assignment]
        _collectives.comm_device = lambda group, compute_device=None: META  # type: ignore[assignment]
        _collectives.host_values = lambda t: torch.zeros(t.shape, dtype=t.dtype)  # type: ignore[assignment]
        _rank_agreement.checks = lambda group: False  # type: ignore[assignment]
        with _HostCopies():
            yield
    finally:
        for owner, name, real in patched:
            setattr(owner, name, real)


def offload_entry_points() -> dict[str, list[str]]:
    """The devices (``op:device``) each entry point handed to torch.distributed with offloaded shards."""
    torch.manual_seed(0)
    model = fc.fully_shard(TinyGPT(), fc.ModuleWrapPolicy({Block}), cpu_offload=fc.CPUOffload(offload_params=True))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    gpt_loss(model, gpt_batch(0, 2 * dist.get_world_size())).backward()
    opt.step()  # real steps on gloo: gradients and optimizer state exist, on the CPU

    def state_dict(kind: str) -> Callable[[], None]:
        def run() -> None:
            with fc.state_dict_type(model, fc.StateDictType[kind]):
                model.load_state_dict(model.state_dict())

        return run

    def optim() -> None:
        osd = fc.optim_state_dict(model, opt)
        fc.optim_state_dict_to_load(model, opt, osd)

    def unshard() -> None:
        with fc.unshard_params(model):
            pass
        with fc.unshard_params(model, rank0_only=True, writeback=False):
            pass
        with fc.unshard_params(model, offload_to_cpu=True):
            pass

    def reset() -> None:
        model.blocks[0].fc1.reset_parameters()  # type: ignore[union-attr, index, operator]
        model.head.reset_parameters()  # type: ignore[union-attr, operator]
        with fc.unshard_params(model, offload_to_cpu=True):  # full parameters on the CPU: broadcast them
            model.head.reset_parameters()  # type: ignore[union-attr, operator]

    seen: dict[str, set[str]] = {}
    where = [""]
    for name, call in (
        ("full_state_dict", state_dict("FULL_STATE_DICT")),
        ("sharded_state_dict", state_dict("SHARDED_STATE_DICT")),
        ("optim_state", optim),
        ("unshard_params", unshard),
        ("reset_parameters", reset),
        ("clip_ours", lambda: fc.clip_grad_norm_(model, 1.0)),
        ("clip_torch", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)),
    ):
        where[0] = name
        seen[name] = set()
        with _spied(seen, where):
            call()
    return {name: sorted(devices) for name, devices in seen.items()}
