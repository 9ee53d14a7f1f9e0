"""``device_id`` and CUDA device indices, checked on CPU with CUDA faked as present."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from device_index_fake import CudaGroup, record_collective, two_fake_cuda_devices
from models import Block, TinyGPT

from fsdp_composable import ModuleWrapPolicy
from fsdp_composable._comm import _collectives, _tensor_parallel
from fsdp_composable._flat import _checkpoint_comm
from fsdp_composable._init import _ignored_checks, _init_utils
from fsdp_composable._runtime import _lazy_init

fully_shard_module = sys.modules["fsdp_composable.fully_shard"]  # the package exports the function by that name


def test_cuda_device_id_without_index_is_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``device_id=torch.device("cuda")`` means the current CUDA device, as in FSDP1: the compute
    device carries its index, so it equals the moved parameters' device (``cuda`` alone never equals
    ``cuda:1``, which made the first forward refuse the model as edited)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    cuda1 = torch.device("cuda", 1)
    assert _init_utils._check_device_id("fully_shard", torch.device("cuda")) == cuda1
    assert _init_utils._init_device(TinyGPT(), torch.device("cuda"), set()) == cuda1
    assert _init_utils._check_device_id("fully_shard", torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert _init_utils._check_device_id("fully_shard", 1) == cuda1


# ---------------------------------------------------------------------------- two fake CUDA devices
# device_id=1 in a process whose current CUDA device is 0 ([Note: the device-index fake]): what the
# library asks for must be on cuda:1, the unit's device, never on the current device.


def _unit_device() -> torch.device:
    """The compute device ``device_id=1`` gives."""
    device = _init_utils._check_device_id("fully_shard", 1)
    assert device == torch.device("cuda", 1)
    return device


def test_side_streams_on_the_units_device_at_high_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    """The unshard, reduce and all-reduce streams belong to the unit's device (not the current one)
    and have high priority, as FSDP2's: a ready collective is not queued behind compute kernels."""
    with two_fake_cuda_devices(monkeypatch) as seen:
        streams = _lazy_init.side_streams(_unit_device())
    assert [s.device for s in streams] == [torch.device("cuda", 1)] * 3  # type: ignore[union-attr]
    assert seen.streams == [(1, -1)] * 3


def test_collective_tensors_on_the_units_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group serving CUDA communicates on the unit's device: the communication device, the order
    check's tensors, and the check that every rank ignores the same modules."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with two_fake_cuda_devices(monkeypatch) as seen:
        device = _unit_device()
        group: Any = CudaGroup()
        assert _collectives.comm_device(group, device) == device
        _collectives.comm_tensor([1, 2, 3], group, device)
        monkeypatch.setattr(_collectives, "all_reduce", record_collective(seen, "all_reduce"))
        monkeypatch.setattr(_collectives, "host_values", lambda t: torch.zeros(t.shape, dtype=t.dtype))
        _ignored_checks.check_ranks_ignore_alike(torch.nn.Linear(2, 2), set(), (group,), "ignored_modules", device)
    assert seen.tensors == [1, 1], seen.tensors
    assert seen.collectives == [("all_reduce", 0)]  # a native collective takes its tensors' device


def test_object_collectives_run_with_the_units_device_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's object collectives (the order check's message, checkpoint metadata) build their
    tensors on the current CUDA device: it is the unit's device while they run."""
    with two_fake_cuda_devices(monkeypatch) as seen:
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(dist, "all_gather_object", record_collective(seen, "all_gather_object"))
        _checkpoint_comm.all_gather_object(CudaGroup(), "unit", _unit_device(), "the test")  # type: ignore[arg-type]
        with _collectives.comm_device_current(CudaGroup(), _unit_device()):  # type: ignore[arg-type]
            dist.all_gather_object([None, None], "described")
    assert seen.collectives == [("all_gather_object", 1)] * 2


def test_fsdp2_mesh_moves_a_cpu_model_to_the_meshs_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP2's ``mesh=`` (with or without ``offload_policy=``) and no ``device_id``: a model on the CPU
    computes on the mesh's device, the current CUDA device (it used to be refused, asking for
    ``device_id``); a CPU mesh, or a model already elsewhere, moves nothing."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    cuda_mesh, cpu_mesh = SimpleNamespace(device_type="cuda"), SimpleNamespace(device_type="cpu")
    device_id = fully_shard_module.mesh_device(cuda_mesh, TinyGPT())
    assert _init_utils._init_device(TinyGPT(), device_id, set()) == torch.device("cuda", 1)
    assert fully_shard_module.mesh_device(cpu_mesh, TinyGPT()) is None
    assert fully_shard_module.mesh_device(None, TinyGPT()) is None
    with torch.device("meta"):
        assert fully_shard_module.mesh_device(cuda_mesh, TinyGPT()) is None


def test_tensor_parallel_full_tensor_on_the_units_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-offloaded DTensor value on a CUDA mesh is gathered on the caller's (the unit's) device:
    ``device_id=1`` moves it to cuda:1, not to the current device 0."""
    from_local: list[Any] = []

    def fake_from_local(local: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        from_local.append(local.device)
        return SimpleNamespace(full_tensor=lambda: torch.zeros(4, device=local.device))

    mesh = SimpleNamespace(device_type="cuda")
    value: Any = SimpleNamespace(
        _local_tensor=torch.ones(2), device_mesh=mesh, placements=(), shape=torch.Size([4]), stride=lambda: (1,)
    )
    monkeypatch.setattr(_tensor_parallel, "DTensor", SimpleNamespace(from_local=fake_from_local))
    with two_fake_cuda_devices(monkeypatch, torch.device("cpu")) as seen:
        whole = _tensor_parallel.full_tensor(value, _unit_device())
    assert whole.device == torch.device("cpu")
    assert seen.tensors == [1], seen.tensors


def _built_with_cuda_device_id() -> dict[str, Any]:
    """fully_shard(device_id=torch.device("cuda")) with two fake CUDA devices, the current one 1 (CUDA
    tensors made on the CPU so that they can become the parameters' data): the real construction path,
    `_check_device_id` included."""
    torch.manual_seed(0)
    model = TinyGPT()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_init_utils, "_check_comm_device", lambda *args: None)  # the pool's gloo serves the CPU
        with two_fake_cuda_devices(mp, target=torch.device("cpu")) as seen:
            seen.current[0] = 1
            fully_shard_module.fully_shard(model, ModuleWrapPolicy({Block}), device_id=torch.device("cuda"))
    state = fully_shard_module.fully_shard.state(model)
    return {
        "compute": [str(state.device), *sorted({str(h.device) for h in state.handles})],
        "moved to": sorted({index for _, index, _ in seen.moves}),
    }


def test_cuda_device_id_without_index_builds_on_the_current_device(dist_run) -> None:
    """The whole construction with ``device_id=torch.device("cuda")``: the units compute on the current
    device with its index (what the first forward's edit check compares moved parameters with: a bare
    ``cuda`` never equals ``cuda:1``), and every parameter is moved there."""
    for r in dist_run(2, _built_with_cuda_device_id):
        assert r == {"compute": ["cuda:1", "cuda:1"], "moved to": [1]}, r
