"""CPU offload's uploads of the pinned host shards to the compute device, checked on CPU: no copy
that waits for the device per unit (NO_SHARD included), and the one host synchronisation that lets
the host write the shards after a step whose uploads may still read them (a forward with no backward
too). ``meta`` stands in for the CUDA compute device; the copies are seen by a dispatch mode."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from models import Block, TinyGPT, gpt_batch, gpt_loss
from stream_recorder import host_device_copy
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_composable as fc
from fsdp_composable._comm import _collectives
from fsdp_composable._flat_param import FlatParamHandle
from fsdp_composable._grads import _offload_copies, _reduce_utils

META = torch.device("meta")


class CrossCopies(TorchDispatchMode):
    """Records ("device" or "host", non_blocking) for every copy between the host and another device."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        crossing = host_device_copy(func, args, kwargs or {})
        if crossing is not None:
            self.seen.append(crossing)
        return func(*args, **(kwargs or {}))


def _no_shard_offloaded_handle() -> Any:
    """The state `FlatParamHandle.unshard` reads for a NO_SHARD unit whose shard is offloaded (on the
    host) and whose compute device is ``meta``, its unsharded buffer allocated."""
    return SimpleNamespace(
        is_unsharded=False,
        extensions=None,
        _unshard_work=None,
        _needs_buffer=True,
        _unsharded=torch.empty(6, device=META),
        flat_param=SimpleNamespace(data=torch.ones(6)),
        layout=SimpleNamespace(world_size=1),
        device=META,
        upload_pending=False,
        _storage_stream=None,
        _wait_freed=lambda stream: None,
        _alloc_unsharded=lambda: False,
        unit_fqn="blocks.0",
    )


def test_no_shard_offload_uploads_without_waiting() -> None:
    """NO_SHARD with CPU offload copies the pinned shard into the device buffer non-blocking (a
    blocking copy made the host wait for the device once per unit per step), and marks the upload
    pending so that the end of the step synchronises before the host may write the shard."""
    handle = _no_shard_offloaded_handle()
    with CrossCopies() as copies:
        FlatParamHandle.unshard(handle)  # type: ignore[arg-type]
    assert copies.seen == [("device", True)]
    assert handle.upload_pending and handle.is_unsharded


def test_pending_uploads_synchronised_once_at_the_end_of_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The end of a step with offloaded uploads (a forward with no backward: no gradient copies)
    synchronises the compute stream of their device once, and only while an upload is pending."""
    synced: list[torch.device] = []
    monkeypatch.setattr(
        _collectives, "compute_stream", lambda device: SimpleNamespace(synchronize=lambda: synced.append(device))
    )
    handles: list[Any] = [SimpleNamespace(upload_pending=True, device=META) for _ in range(3)]
    handles.append(SimpleNamespace(upload_pending=False, device=torch.device("cpu")))  # not offloaded
    _offload_copies.sync_offload_copies([], handles)
    assert synced == [META] and not any(h.upload_pending for h in handles)
    _offload_copies.sync_offload_copies([], handles)  # nothing pending: no synchronisation
    assert synced == [META]


def _syncs_per_step() -> list[int]:
    """How many handles each end-of-step synchronisation was offered: a trained step, then a forward
    with no backward (no gradient copies, but uploads may be pending)."""
    torch.manual_seed(0)
    model = fc.fully_shard(TinyGPT(), fc.ModuleWrapPolicy({Block}))
    offered: list[int] = []
    real = _reduce_utils.sync_offload_copies

    def spy(reductions: Any, handles: Any) -> None:
        offered.append(len(handles))
        real(reductions, handles)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_reduce_utils, "sync_offload_copies", spy)
        gpt_loss(model, gpt_batch(0, 4)).backward()
        with torch.no_grad():
            model(gpt_batch(1, 4)[0])
    return offered


def test_every_step_end_offers_its_uploads_to_the_sync(dist_run) -> None:
    """The end of every step, a forward with no backward too, hands every unit to the one offload
    synchronisation (which synchronises only where an upload is pending)."""
    for offered in dist_run(2, _syncs_per_step):
        assert offered == [3, 3], offered
