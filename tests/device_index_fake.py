"""Two fake CUDA devices on CPU: which device index each stream, tensor and collective of the library
asks for ([Note: the device-index fake]); used by test_device_id_index.py and offload_fake_cuda.py.

[Note: the device-index fake]
No GPU runs here and ``meta`` has no index, so a "wrong GPU" bug (every rank using cuda:0 because
the code asked for the current device instead of the unit's) is invisible to the device audit. This
fake makes CUDA present with two devices, current device 0 (as in a process that never called
``torch.cuda.set_device``), and records instead of allocating: a torch function asked for a tensor
on a CUDA device (``device=``, ``.to()``) records the index it resolves to (no index: the current
device) and gets a ``meta`` tensor (or a CPU one: ``target``); ``pin_memory``, which needs CUDA,
makes a copy the fake remembers as pinned; ``torch.cuda.Stream`` records its device and priority;
``torch.cuda.device(k)`` makes k current inside it; the collectives the code calls record the
current device when called. A group serving CUDA is a stand-in object with ``_device_types``.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
from torch.overrides import TorchFunctionMode

META = torch.device("meta")


@dataclass
class Seen:
    current: list[int] = field(default_factory=lambda: [0])  # the current device, a stack
    tensors: list[int] = field(default_factory=list)  # the index of every CUDA tensor asked for
    streams: list[tuple[int, int]] = field(default_factory=list)  # (device index, priority)
    collectives: list[tuple[str, int]] = field(default_factory=list)  # (name, current device when called)
    # (source storage, index, what ``context()`` said then) of every ``.to(<a CUDA device>)``
    moves: list[tuple[int, int, Any]] = field(default_factory=list)
    context: Callable[[], Any] = lambda: None
    target: torch.device = META  # where a CUDA tensor is really made
    pinned: set[int] = field(default_factory=set)  # storages of host tensors made "pinned"

    def index(self, device: Any) -> Optional[int]:
        """The CUDA index ``device`` resolves to (None: not a CUDA device)."""
        if isinstance(device, int) and not isinstance(device, bool):  # (a positional non_blocking is no index)
            return device
        try:
            d = torch.device(device) if isinstance(device, str) else device
        except RuntimeError:  # a string that is no device (``.to("float")`` is not asked)
            return None
        if not isinstance(d, torch.device) or d.type != "cuda":
            return None
        return d.index if d.index is not None else self.current[-1]


class _Redirect(TorchFunctionMode):
    def __init__(self, seen: Seen) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.pin_memory:  # no pinned memory without CUDA: a copy, marked pinned
            return self._pinned(args[0].clone())
        if func is torch.Tensor.is_pinned:
            return args[0].untyped_storage()._cdata in self.seen.pinned
        if kwargs.pop("pin_memory", False):  # a host tensor made pinned
            return self._pinned(func(*args, **kwargs))
        if "device" in kwargs and (k := self.seen.index(kwargs["device"])) is not None:
            self.seen.tensors.append(k)
            kwargs["device"] = self.seen.target
        if func is torch.Tensor.to:
            for a in args[1:]:
                if isinstance(a, (str, torch.device)) and (k := self.seen.index(a)) is not None:
                    self.seen.tensors.append(k)
                    self.seen.moves.append((args[0].untyped_storage()._cdata, k, self.seen.context()))
            args = tuple(self.seen.target if self.seen.index(a) is not None else a for a in args)
        return func(*args, **kwargs)


    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        self.seen.pinned.add(key)
        weakref.finalize(t.untyped_storage(), self.seen.pinned.discard, key)  # its address may be reused
        return t


class FakeStream:
    def __init__(self, seen: Seen, device: Any = None, priority: int = 0) -> None:
        index = seen.index(device if device is not None else "cuda")
        assert index is not None
        self.device = torch.device("cuda", index)
        seen.streams.append((index, priority))


class CudaGroup:
    """A process group stand-in that serves CUDA tensors only (as NCCL), of two ranks."""

    _device_types = [torch.device("cuda")]


@contextlib.contextmanager
def two_fake_cuda_devices(monkeypatch: pytest.MonkeyPatch, target: torch.device = META) -> Iterator[Seen]:
    """``target``: where CUDA tensors are really made (``meta``; the CPU where they must hold values
    or become a CPU parameter's data)."""
    seen = Seen(target=target)

    @contextlib.contextmanager
    def device(d: Any) -> Iterator[None]:
        index = seen.index(d)
        seen.current.append(seen.current[-1] if index is None else index)
        try:
            yield
        finally:
            seen.current.pop()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: seen.current[-1])
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, priority=0: FakeStream(seen, device, priority))
    with _Redirect(seen):
        yield seen


def record_collective(seen: Seen, name: str, result: Any = None) -> Any:
    """A collective that records the current device when called and returns ``result``."""

    def run(*args: Any, **kwargs: Any) -> Any:
        seen.collectives.append((name, seen.current[-1]))
        return result

    return run
