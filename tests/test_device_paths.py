"""The CUDA path, checked on CPU: which device every collective's tensors live on, the order of
stream waits and events, the host synchronisations of a step, the offload copies, self-copies.

No GPU runs here. Each check drives the library's real code paths with a stand-in for what only a
GPU has: a process group that serves one device type only (as NCCL serves CUDA only), recording
stream and event objects, and a counter of host reads.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from device_index_fake import two_fake_cuda_devices
from expecttest import TestCase
from forked_scripts import Preloaded
from models import Block, TinyGPT
from offload_comm_spy import offload_entry_points

from fsdp_composable import ModuleWrapPolicy, fully_shard
from fsdp_composable._comm import _collectives
from fsdp_composable._flat_param import FSDP_FLATTENED
from fsdp_composable._init import _init_utils

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)

# ---------------------------------------------------------------------------- device audit
# device_audit_world.py runs real steps and every collective entry point in a world whose group
# serves only `meta` (see its docstring): a collective handed a tensor on another device fails as
# on NCCL. One fresh interpreter runs every check (the test process has its own gloo groups).
_AUDIT_CHECKS = [
    "training_full_shard",
    "training_strategies",
    "training_hybrid",
    "no_sync_then_sync",
    "clip_ours",
    "clip_torch",
    "sync_module_states",
    "reset_after_sharding",
    "unshard_params",
    "state_dict_full_state_dict",
    "state_dict_sharded_state_dict",
    "state_dict_local_state_dict",
    "optim_state",
]
_STREAM_CHECKS = [
    "streams_full_shard",
    "streams_prefetch_and_mixed_precision",
    "streams_hybrid",
    "streams_no_sync",
    "streams_memory_between_steps",
    "streams_unit_called_alone",
    "streams_all_reduce_hook_and_post_optim_event",
    "streams_strategies_and_hooks",
    "hook_offload_copy_on_the_stream",
]


_RESULTS: dict[str, str] = {}


@pytest.fixture(scope="module")
def audit() -> dict[str, str]:
    return _run_audit()


def _run_audit() -> dict[str, str]:
    if _RESULTS:
        return _RESULTS
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # forked from an interpreter that imported torch already ([Note: docs examples in forked interpreters])
    server = Preloaded(env)
    try:
        script = Path(TESTS_DIR) / "device_audit_world.py"
        proc = server.run(script, env, 500, cwd=Path(REPO), out=Path(tempfile.mkdtemp()))
    finally:
        server.close()
    assert proc.returncode == 0, proc.stderr[-4000:]
    _RESULTS.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return _RESULTS


@pytest.mark.parametrize("check", _AUDIT_CHECKS)
def test_collectives_use_the_groups_device(audit: dict[str, str], check: str) -> None:
    """Every collective of ours, in training and at every entry point, gets tensors on the device
    the group serves (the first iteration's order check used to build them on the CPU)."""
    assert audit[check] == "ok", audit[check]


@pytest.mark.parametrize("check", _STREAM_CHECKS)
def test_stream_order(audit: dict[str, str], check: str) -> None:
    """Real steps with recording CUDA streams and events ([Note: the stream recorder] in
    stream_recorder.py): no tensor read on one stream before the event of the stream that wrote
    it, no storage freed while another stream may use it, streams asked for by device, the unshard
    stream waiting for compute once per root forward, HYBRID_SHARD's all-reduce on its own stream and
    its reduce-scatter inputs freed once each reduce-scatter is done (not at the end of backward)."""
    assert audit[check] == "ok", audit[check]


def test_no_host_sync_in_a_steady_state_step(audit: dict[str, str]) -> None:
    """After the first iteration, a step without CPU offload reads nothing back on the host and
    synchronises no stream or event (a read of a meta tensor would raise as well)."""
    assert audit["no_host_sync_in_steady_state"] == "ok", audit["no_host_sync_in_steady_state"]


def test_no_host_sync_for_parameters_without_gradient(audit: dict[str, str]) -> None:
    """A parameter without a gradient on this rank (an unused branch, an MoE expert): its presence
    flag is written by device-side fills (no host scalar copied to the device), and the flags of every
    unit are read in one host read per step (whether a ``.grad`` is None is host state), not one per
    unit; a blocking copy between host and device counts as a synchronisation too."""
    check = "no_host_sync_for_parameters_without_gradient"
    assert audit[check] == "ok", audit[check]


def test_no_gradient_copied_onto_itself(audit: dict[str, str]) -> None:
    """Autograd accumulates into the flat buffer's views; the reduction takes them as they are
    instead of copying each one onto itself every backward (FULL_SHARD and NO_SHARD)."""
    assert audit["no_self_copies"] == "ok", audit["no_self_copies"]


def test_no_unit_sized_copy_for_the_presence_flags(audit: dict[str, str]) -> None:
    """The presence flags travel without a copy of a unit's gradient on the native-collective path
    (FULL_SHARD, NO_SHARD, HYBRID_SHARD)."""
    assert audit["no_unit_sized_copy_for_the_flags"] == "ok", audit["no_unit_sized_copy_for_the_flags"]


def test_no_device_collective_for_the_presence_flags(audit: dict[str, str]) -> None:
    """Off the CPU the flags are summed on the host: a unit's reduction issues no device all-reduce for
    them (FULL_SHARD: the reduce-scatter alone; HYBRID_SHARD: and the shard's all-reduce across
    replicas). It issued one per unit before, whose result nothing read."""
    assert audit["no_device_collective_for_the_flags"] == "ok", audit["no_device_collective_for_the_flags"]


def test_root_inputs_moved_to_the_compute_device(audit: dict[str, str]) -> None:
    """A CPU batch (integer token ids) reaches the model on its compute device."""
    assert audit["cpu_inputs_moved"] == "ok", audit["cpu_inputs_moved"]


class TestPlacementError(TestCase):
    def test_model_on_a_device_the_group_does_not_serve(self) -> None:
        """A model left on the CPU with a group serving another device type only (NCCL: CUDA) is
        refused before any collective, naming the fix."""
        self.assertExpectedInline(
            _run_audit()["model_on_a_device_the_group_does_not_serve"],
            """fully_shard: the module's parameters are on cpu, but its process group (backend 'auditmeta') communicates meta tensors only; pass device_id=torch.device('meta') (it moves the model one unit at a time) or move the model there first""",  # noqa: E501
        )


def test_offload_entry_points_communicate_on_the_comm_device(dist_run) -> None:
    """CPU offload with a group serving another device than the shards' ([Note: the offload spy] in
    offload_comm_spy.py): every entry point copies its CPU values to the communication device for
    each collective (FULL state dicts, optimizer-state conversion, unshard_params, reset
    after sharding, both clip_grad_norm_ routes)."""
    expected = {
        "full_state_dict": ["all_gather_into_tensor:meta"],
        "sharded_state_dict": [],  # its values are the faces, and its load copies into them: nothing to gather
        "optim_state": ["all_gather_into_tensor:meta"],
        "unshard_params": ["all_gather_into_tensor:meta"],
        "reset_parameters": ["all_gather_into_tensor:meta", "all_reduce:meta", "broadcast:meta"],
        "clip_ours": ["all_reduce:meta"],
        "clip_torch": ["all_reduce:meta"],
    }
    for seen in dist_run(2, offload_entry_points):
        assert seen == expected


def _placement_order() -> list[str]:
    """With ``device_id=1`` on a CPU model (two fake CUDA devices, the current one 0: [Note: the
    device-index fake] in device_index_fake.py, making CUDA tensors on the CPU so that they can become
    the parameters' data), what happens to the parameters while fully_shard builds its units: "move
    <unit> to cuda:<k>" when a unit's parameters are copied to a CUDA device (with how many parameters
    were flattened by then: the units below it); "apply <module>" whenever a module moves its
    parameters as a whole (``.to()``, ``.cuda()``, ``to_empty`` all go through ``nn.Module._apply``)."""
    torch.manual_seed(0)
    model = TinyGPT()
    params = list(model.parameters())
    fqns = {p.untyped_storage()._cdata: n for n, p in model.named_parameters()}
    originals = [p.detach() for p in params]  # their storages stay, so no other tensor takes their address
    names = {m: n or "<root>" for n, m in model.named_modules()}
    events: list[str] = []
    real_apply = torch.nn.Module._apply

    def apply(module: torch.nn.Module, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if module in names and fn.__name__ != "compute_should_use_set_data":
            events.append(f"apply {names[module]}")
        return real_apply(module, fn, *args, **kwargs)

    def unit(fqn: str) -> str:
        return next((b for b in ("blocks.0", "blocks.1") if fqn.startswith(b + ".")), "<root>")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_init_utils, "_check_comm_device", lambda *args: None)  # the pool's gloo serves the CPU
        mp.setattr(torch.nn.Module, "_apply", apply)
        with two_fake_cuda_devices(mp, target=torch.device("cpu")) as seen:
            seen.context = lambda: sum(1 for p in params if getattr(p, FSDP_FLATTENED, False))
            fully_shard(model, ModuleWrapPolicy({Block}), device_id=1)
    del originals
    for storage, index, built in seen.moves:
        if storage in fqns:  # an original parameter (not a flat shard or buffer made from them)
            event = f"move {unit(fqns[storage])} to cuda:{index} ({built} parameters built before)"
            if not events or events[-1] != event:
                events.append(event)
    return events


def test_device_id_moves_one_unit_at_a_time(dist_run) -> None:
    """``device_id=1`` (not the current device): each unit's parameters are moved to cuda:1 right
    before the unit is flattened and sharded, bottom-up (peak device memory about one unit unsharded);
    the model is never moved as a whole."""
    for events in dist_run(2, _placement_order):
        assert events == [
            "move blocks.1 to cuda:1 (0 parameters built before)",
            "move blocks.0 to cuda:1 (10 parameters built before)",
            "move <root> to cuda:1 (20 parameters built before)",
        ], events


def test_meta_model_lands_on_the_chosen_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The placement decisions for a meta-device model, with CUDA faked as present (current device 1):
    without ``device_id`` it computes on the current CUDA device, with a CUDA ``device_id`` there; its
    modules are materialised on that device (``to_empty``), never on the CPU first; and a
    ``param_init_fn`` that materialises the first unit somewhere else decides the compute device (the
    model is not copied back to where it was assumed to go). The rest needs a GPU: tests/test_cuda.py."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    cuda1 = torch.device("cuda", 1)
    with torch.device("meta"):
        model = TinyGPT()
    assert _init_utils._init_device(model, None, set()) == cuda1
    assert _init_utils._init_device(model, cuda1, set()) == cuda1

    asked: list[torch.device] = []
    real_to_empty = torch.nn.Module.to_empty

    def to_empty(module: torch.nn.Module, *, device: Any, recurse: bool = True) -> torch.nn.Module:
        asked.append(torch.device(device))
        return real_to_empty(module, device="cpu", recurse=recurse)  # no CUDA memory here

    monkeypatch.setattr(torch.nn.Module, "to_empty", to_empty)
    _init_utils._materialize_meta_module(model.blocks[0].fc1, "blocks.0.fc1", None, cuda1)
    assert asked and set(asked) == {cuda1}, asked

    # a param_init_fn put the first unit on another device than the assumed one: that device wins
    state = SimpleNamespace(device=cuda1, module=model)
    _init_utils._adopt_materialised_device(state, SimpleNamespace(params=list(model.blocks[0].fc1.parameters())))  # type: ignore[arg-type]
    assert state.device == torch.device("cpu")


# ---------------------------------------------------------------------------- collective tensors
# Functions that hand tensors to a torch.distributed collective and may build one without device=
# or read a tensor it sent with .item()/.tolist()/.cpu(), and why each is right (see [Note: the communication
# device] in _collectives.py: collective tensors are built on `comm_device`, read with `host_values`).
_ALLOWED = {
    "_rank_agreement.py:_post_recv torch.empty": "the headers travel on gloo groups only, on the CPU",
    "_tensor_parallel.py:_mesh_from_groups torch.full": "the mesh layout, built from gathered values",
    "_rank_agreement.py:begin .tolist()": "this rank's header, on the CPU (gloo groups only)",
    "demo.py:train_step .item()": "the demo's reported loss, read once per step for printing",
    "_host_flags.py:issue torch.tensor": "the presence flags are summed over a CPU group, on the CPU",
}
_COLLECTIVES = {
    "all_reduce", "broadcast", "all_gather", "all_to_all_single", "isend", "irecv", "send", "recv",
    "reduce_scatter", "all_gather_into_tensor", "reduce_scatter_tensor", "scatter", "gather",
}  # fmt: skip
_FACTORIES = {"tensor", "as_tensor", "empty", "zeros", "ones", "full", "arange", "rand", "randn"}


def _collective_tensor_findings() -> list[str]:
    import ast

    package = os.path.join(REPO, "fsdp_composable")
    found = []
    for path in sorted(glob.glob(os.path.join(package, "**", "*.py"), recursive=True)):  # subpackages too
        name = os.path.basename(path)
        with open(path) as f:
            tree = ast.parse(f.read())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
            # DTensor's collectives take its local tensor where it is: `_tensor_parallel.full_tensor`
            # moves it to the mesh's device first
            if not (name == "_tensor_parallel.py" and fn.name == "full_tensor"):
                found += [
                    f"{name}:{fn.name} .full_tensor()"
                    for c in calls
                    if c.func.attr == "full_tensor"  # type: ignore[attr-defined]
                    and not (isinstance(c.func.value, ast.Name) and c.func.value.id == "_tensor_parallel")  # type: ignore[attr-defined]
                ]
            collectives: list[ast.Call] = [c for c in calls if c.func.attr in _COLLECTIVES]  # type: ignore[attr-defined]
            # a collective imported by name (``from torch.distributed import all_reduce``) counts too
            collectives += [
                n
                for n in ast.walk(fn)
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in _COLLECTIVES
            ]
            if not collectives:
                continue
            # the names of tensors handed to a collective (directly or in a list)
            sent = {
                n.id
                for c in collectives
                for a in (*c.args, *(k.value for k in c.keywords))
                for n in ([a] if isinstance(a, ast.Name) else a.elts if isinstance(a, ast.List) else [])
                if isinstance(n, ast.Name)
            }
            for c in calls:
                func = c.func
                assert isinstance(func, ast.Attribute)
                base = func.value.id if isinstance(func.value, ast.Name) else None
                if base == "torch" and func.attr in _FACTORIES and not any(k.arg == "device" for k in c.keywords):
                    found.append(f"{name}:{fn.name} torch.{func.attr}")
                elif func.attr in ("item", "tolist", "cpu") and base in sent:
                    found.append(f"{name}:{fn.name} .{func.attr}()")
    return sorted(set(found) - set(_ALLOWED))


def test_no_collective_tensor_on_the_default_device() -> None:
    """No function of the package that calls a collective builds a tensor without ``device=`` (it would
    land on the default device, the CPU, which NCCL does not serve) or reads a tensor it handed to a
    collective with ``.item()``, ``.tolist()`` or ``.cpu()`` instead of `_collectives.host_values`,
    unless listed with its reason; and no DTensor is gathered with ``.full_tensor()`` but through
    `_tensor_parallel.full_tensor` (which communicates on the mesh's device)."""
    assert _collective_tensor_findings() == []


def _full_tensor_devices() -> dict[str, Any]:
    """A DTensor whose local tensor is on the CPU (an offloaded value) over a mesh of another device
    type (``meta`` stands in for CUDA): the devices DTensor's gather gets, and the result's device."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from fsdp_composable._comm import _tensor_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    value = DTensor.from_local(torch.ones(2), mesh, [Shard(0)], run_check=False)
    mesh._device_type = "meta"  # the group this mesh stands for serves meta (CUDA) tensors only
    seen: list[str] = []
    real = DTensor.full_tensor

    def spy(self: DTensor, **kwargs: Any) -> torch.Tensor:
        seen.append(f"local on {self._local_tensor.device.type}, mesh of {self.device_mesh.device_type}")
        return torch.zeros(self.shape)  # no data moves on meta

    DTensor.full_tensor = spy  # type: ignore[method-assign]
    try:
        out = _tensor_parallel.full_tensor(value, torch.device("meta"))  # the unit's device
    finally:
        DTensor.full_tensor = real  # type: ignore[method-assign]
        mesh._device_type = "cpu"
    return {"seen": seen, "result": str(out.device), "shape": list(out.shape)}


def test_dtensor_gathered_on_its_meshs_device(dist_run) -> None:
    """The tensor-parallel paths (FULL / SHARDED state dicts, optimizer-state conversion, loading a
    user's DTensors) gather a DTensor on its mesh's device even when its local tensor is a CPU-offloaded
    value, and give the result back on the CPU."""
    for r in dist_run(2, _full_tensor_devices):
        assert r == {"seen": ["local on meta, mesh of meta"], "result": "cpu", "shape": [4]}


def test_comm_device_skips_device_types_this_process_cannot_use() -> None:
    """torch's fake process group serves every device type it knows (xpu, hpu, cuda, cpu); on a
    machine with none of the accelerators its collectives take CPU tensors, not an ``xpu`` tensor
    that torch cannot make here."""

    class Group:
        _device_types = [torch.device(t) for t in ("xpu", "hpu", "cuda", "cpu")]

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert _collectives.comm_device(Group()).type == expected  # type: ignore[arg-type]
    assert _collectives.comm_device(Group(), torch.device("cpu")).type == "cpu"  # type: ignore[arg-type]

    class MetaOnly:
        _device_types = [torch.device("meta")]

    assert _collectives.comm_device(MetaOnly()).type == "meta"  # type: ignore[arg-type]
