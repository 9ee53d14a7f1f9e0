"""CPU offload's real path on CPU: two fake CUDA devices whose tensors hold data on the CPU, with a
ledger of which tensors are "on the device", of every copy between host and device, and of the host
synchronisations ([Note: the offload ledger]); used by test_offload_one_sync.py.

[Note: the offload ledger]
``meta`` cannot stand in for the device under CPU offload: a parameter's ``.data`` cannot move
between meta and the CPU (torch refuses the swap), so a meta world never builds an offloaded unit.
Here the device-index fake ([Note: the device-index fake] in device_index_fake.py) makes CUDA
tensors on the CPU, so the whole offload path runs (construction, uploads, reductions, downloads,
the optimizer on host shards) with real values, and a second torch-function mode keeps the ledger:
a tensor is on the device if a factory made it there, ``.to(<cuda>)`` moved it there, or an
operation computed it from one that is (a view shares its storage); ``.to("cpu")``, ``.cpu()`` and
``copy_`` between a device tensor and a host one are crossings, recorded with their
``non_blocking``, the stream current then, whether backward was running, and whether the host side
is pinned (``pin_memory`` is faked: a copy marked pinned). Streams and events are fakes that run
nothing (all of it ran already) and count each ``synchronize()`` as a host synchronisation, as a
blocking crossing is one. ``loss.backward()`` is itself a torch function: a mode handles it with
itself (and every mode above it) switched off, so no mode would see the backward hooks' work. The
ledger's mode therefore runs a ``backward()`` through autograd's engine itself, with both modes
on; backward on CPU tensors runs in the calling thread, so the library's pre- and post-backward work
and its final callback are seen (`in_backward`).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import pytest
import torch
from device_index_fake import Seen, two_fake_cuda_devices
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

HOST = torch.device("cpu")


@dataclass
class Crossing:
    direction: str  # "device" (an upload) or "host" (a download)
    stream: str
    non_blocking: bool
    in_backward: bool
    pinned: bool  # the host side


@dataclass
class Ledger:
    seen: Seen
    on_device: set[int] = field(default_factory=set)  # storages
    crossings: list[Crossing] = field(default_factory=list)
    host_syncs: int = 0
    stream: str = "compute"

    def key(self, t: torch.Tensor) -> int:
        return int(t.untyped_storage()._cdata)

    def is_device(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and self.key(t) in self.on_device

    def mark(self, t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0 and not self.is_device(t):
            k = self.key(t)
            self.on_device.add(k)
            weakref.finalize(t.untyped_storage(), self.on_device.discard, k)

    def cross(self, direction: str, non_blocking: bool, host_side: torch.Tensor) -> None:
        pinned = self.key(host_side) in self.seen.pinned
        in_backward = torch._C._current_graph_task_id() != -1
        self.crossings.append(Crossing(direction, self.stream, non_blocking, in_backward, pinned))
        if not non_blocking:
            self.host_syncs += 1  # a blocking copy waits for the device


def _device_arg(seen: Seen, args: Any, kwargs: dict[str, Any]) -> Optional[bool]:
    """For ``Tensor.to``: True if it goes to a CUDA device, False to the CPU, None: no device given."""
    for a in [*args[1:], kwargs.get("device")]:
        if isinstance(a, (str, torch.device)):
            try:
                d = torch.device(a)
            except RuntimeError:
                continue
            return seen.index(d) is not None if d.type != "cpu" else False
    return None


class _LedgerMode(TorchFunctionMode):
    def __init__(self, ledger: Ledger) -> None:
        super().__init__()
        self.ledger = ledger

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        led = self.ledger
        if func is torch.Tensor.backward:  # with both modes on: see [Note: the offload ledger]
            loss = args[0]
            given = [*args[1:], *(v for v in kwargs.values() if v not in (None, False))]
            assert not given, f"a plain loss.backward() only, not {args[1:]} {kwargs}"
            with self:
                grad = torch.ones_like(loss)
                engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
                engine.run_backward((loss,), (grad,), False, False, (), True, True)
            return None
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1]
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if led.is_device(dst) != led.is_device(src):
                led.cross("device" if led.is_device(dst) else "host", non_blocking, src if led.is_device(dst) else dst)
            return func(*args, **kwargs)
        to_device = _device_arg(led.seen, args, kwargs) if func is torch.Tensor.to else None
        if func is torch.Tensor.cpu:
            to_device = False
        out = func(*args, **kwargs)
        source = args[0] if args else None
        crossing = to_device is not None and led.is_device(source) != to_device
        if crossing and led.key(out) == led.key(source):  # both really on the CPU: a copy, as across devices
            out = out.clone()
        if to_device is True:
            if crossing:
                led.cross("device", bool(kwargs.get("non_blocking", False)), source)
            led.mark(out)
        elif to_device is False:
            if crossing:
                led.cross("host", bool(kwargs.get("non_blocking", False)), out)
        elif "device" in kwargs and led.seen.index(kwargs["device"]) is not None:
            for t in tree_leaves(out):
                led.mark(t)
        elif any(led.is_device(a) for a in tree_leaves((args, kwargs))):
            for t in tree_leaves(out):
                led.mark(t)
        return out


class FakeStream:
    def __init__(self, ledger: Ledger, name: str, device: torch.device) -> None:
        self.ledger, self.name, self.device = ledger, name, device

    def wait_stream(self, other: "FakeStream") -> None:
        pass

    def wait_event(self, event: "FakeEvent") -> None:
        pass

    def record_event(self, event: "Optional[FakeEvent]" = None) -> "FakeEvent":
        return event or FakeEvent(self.ledger)

    def synchronize(self) -> None:
        self.ledger.host_syncs += 1


class FakeEvent:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def record(self, stream: Optional[FakeStream] = None) -> None:
        pass

    def wait(self, stream: Optional[FakeStream] = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.ledger.host_syncs += 1


@contextlib.contextmanager
def fake_cuda_with_data(monkeypatch: pytest.MonkeyPatch) -> Iterator[Ledger]:
    """Two fake CUDA devices (current 0) holding data on the CPU, with the ledger of [Note: the
    offload ledger]."""
    with two_fake_cuda_devices(monkeypatch, target=HOST) as seen:
        ledger = Ledger(seen)
        computes: dict[int, FakeStream] = {}
        made = [0]

        def stream(device: Any = None, priority: int = 0) -> FakeStream:
            made[0] += 1
            index = seen.index(device if device is not None else "cuda")
            return FakeStream(ledger, f"side{made[0]}", torch.device("cuda", index))

        def current_stream(device: Any = None) -> FakeStream:
            index = seen.index(device if device is not None else "cuda")
            assert index is not None
            if index not in computes:
                computes[index] = FakeStream(ledger, "compute", torch.device("cuda", index))
            return computes[index]

        @contextlib.contextmanager
        def on(s: Optional[FakeStream]) -> Iterator[None]:
            before, ledger.stream = ledger.stream, (s.name if s is not None else ledger.stream)
            try:
                yield
            finally:
                ledger.stream = before

        monkeypatch.setattr(torch.cuda, "Stream", stream)
        monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
        monkeypatch.setattr(torch.cuda, "stream", on)
        monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent(ledger))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: current_stream(device).synchronize())
        with _LedgerMode(ledger):
            yield ledger
