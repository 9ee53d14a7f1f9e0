"""Peak live tensor bytes of one step, tracked per tensor storage.

[Note: how live bytes are tracked]
A ``TorchDispatchMode`` sees every op (forward, backward on the autograd thread, optimizer, and the
c10d collective ops). Each storage is tracked once, keyed by its ``StorageImpl``
(``UntypedStorage._cdata``) with its size in bytes; a ``weakref.finalize`` on the storage's Python
object (which torch keeps alive exactly as long as the storage) removes it when the last tensor
using it dies. Views share their base's storage, so they are never counted twice.

- Storages that exist before the step: the ones handed to `add_existing` at the start (parameters,
  gradients, optimizer state, buffers, flat parameters) form the baseline.
- A storage first seen as an op output is an allocation at that moment.
- A storage first seen as an op *input* was allocated where the mode cannot see: it is decided at
  the end of the step (see [Note: storages found during the step]).
- ``UntypedStorage.resize_`` is how FSDP implementations free and regrow unsharded parameters; it is
  not an op, so it is wrapped while the tracker is active and its size change recorded.

peak = baseline + the maximum over time of (bytes allocated - bytes freed since the start).
Not seen: temporaries of ops that run inside a tensor subclass's own ``__torch_dispatch__`` and do
not surface as outputs (DTensor's inner ops: the mode sees only the DTensor-level op), and buffers
gloo allocates internally and never hands back to Python.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytesTracker"]

OpObserver = Callable[[Any, tuple[Any, ...], dict[str, Any]], None]


def _plain_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors that own storage: a wrapper subclass (DTensor) is replaced by its inner tensors."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        for attr in attrs:
            inner = getattr(t, attr)
            if isinstance(inner, torch.Tensor):  # DTensor also lists its DeviceMesh
                yield from _plain_tensors(inner)
    else:
        yield t


def _storage_of(t: torch.Tensor) -> Optional[torch.UntypedStorage]:
    if t.is_sparse or t.device.type == "meta":
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


class LiveBytesTracker(TorchDispatchMode):
    """``with LiveBytesTracker() as tr: tr.add_existing(...); step()`` then read ``tr.peak_bytes``."""

    def __init__(self, on_op: Optional[OpObserver] = None) -> None:
        super().__init__()
        self.on_op = on_op
        self.baseline = 0  # bytes alive at the start of the step (final once the tracker exits)
        self.peak_bytes = 0
        self.live_bytes = 0
        # bytes of storages first seen as an op input, by op: found_alive stayed alive to the end of
        # the step (counted from the start), found_transient died during it (counted when seen)
        self.found_alive: dict[str, int] = {}
        self.found_transient: dict[str, int] = {}
        self._sizes: dict[int, int] = {}
        self._events: list[int] = []  # size changes in order; a found storage's entry is decided at exit
        self._event_ops: list[str] = []  # the op running when each change happened
        self._marks: list[tuple[int, str]] = []
        self.peak_op = ""  # the op during which the peak was reached
        self.phase_peaks: dict[str, int] = {}  # peak within each phase that `mark` closed
        self._found: dict[int, tuple[int, int, str]] = {}  # key -> (event index, bytes when found, op)
        self._finalizers: list[weakref.finalize] = []
        self._resize_saved: Optional[tuple[bool, Any]] = None
        self._current_op = "add_existing"

    # ------------------------------------------------------------------ bookkeeping
    def _event(self, change: int) -> None:
        self._events.append(change)
        self._event_ops.append(self._current_op)

    def _on_free(self, key: int) -> None:
        self._event(-self._sizes.pop(key, 0))

    def mark(self, phase: str) -> None:
        """Close a phase of the step: ``phase_peaks[phase]`` is the peak since the previous mark."""
        self._marks.append((len(self._events), phase))

    def _track(self, storage: torch.UntypedStorage, how: str) -> None:
        """Start tracking ``storage``; ``how`` is 'existing', 'new' (an op output) or 'found' (an op input)."""
        key = storage._cdata
        if key in self._sizes:
            return
        nbytes = storage.nbytes()
        self._sizes[key] = nbytes
        if how == "existing":
            self.baseline += nbytes
        elif how == "new":
            self._event(nbytes)
        else:
            self._found[key] = (len(self._events), nbytes, self._current_op)
            self._event(0)
        self._finalizers.append(weakref.finalize(storage, self._on_free, key))

    def _see(self, x: Any, how: str) -> None:
        if isinstance(x, torch.UntypedStorage):
            self._track(x, how)
        elif isinstance(x, torch.Tensor):
            for t in _plain_tensors(x):
                storage = _storage_of(t)
                if storage is None:
                    continue
                key = storage._cdata
                if key not in self._sizes:
                    self._track(storage, how)
                elif how == "new" and storage.nbytes() != self._sizes[key]:  # aten.resize_ and friends
                    self._resized(storage)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        old = self._sizes[key]
        self._sizes[key] = storage.nbytes()
        self._event(self._sizes[key] - old)

    def add_existing(self, tensors: Iterable[Optional[torch.Tensor]]) -> None:
        """Count tensors that are alive before the step (None entries are skipped)."""
        for t in tensors:
            if t is not None:
                self._see(t, "existing")

    def _finish(self) -> None:
        """Decide each found storage, then replay the size changes for the peak.

        [Note: storages found during the step]
        A storage first seen as an op input was not allocated by any op the mode saw. If it is still
        alive at the end of the step it is persistent (DDP's gradient buckets): it was alive from the
        start, so it joins the baseline. If it dies during the step it is a temporary made where the
        mode cannot see (gloo allocates reduce-scatter buffers on its own threads and splits them in
        ``wait()``): it counts from when it was first seen, which may be later than its allocation.
        """
        for key, (index, nbytes, op) in self._found.items():
            if key in self._sizes:
                self.baseline += nbytes
                self.found_alive[op] = self.found_alive.get(op, 0) + nbytes
            else:
                self._events[index] = nbytes
                self.found_transient[op] = self.found_transient.get(op, 0) + nbytes
        live = peak = phase_peak = self.baseline
        marks = list(self._marks)
        for i, (change, op) in enumerate(zip(self._events, self._event_ops)):
            while marks and marks[0][0] == i:
                self.phase_peaks[marks.pop(0)[1]] = phase_peak
                phase_peak = live
            live += change
            phase_peak = max(phase_peak, live)
            if live > peak:
                peak, self.peak_op = live, op
        for _, phase in marks:
            self.phase_peaks[phase] = phase_peak
            phase_peak = live
        self.peak_bytes, self.live_bytes = peak, live

    # ------------------------------------------------------------------ mode
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        kwargs = kwargs or {}
        self._current_op = str(func)
        for x in tree_leaves((args, kwargs)):
            self._see(x, "found")
        if self.on_op is not None:
            self.on_op(func, args, kwargs)
        out = func(*args, **kwargs)
        for x in tree_leaves(out):
            self._see(x, "new")
        return out

    def __enter__(self) -> LiveBytesTracker:
        cls = torch.UntypedStorage
        own = "resize_" in cls.__dict__
        original = cls.__dict__["resize_"] if own else cls.resize_
        self._resize_saved = (own, original)
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            tracker._current_op = "UntypedStorage.resize_"
            tracker._track(storage, "found")
            result = original(storage, size)
            tracker._resized(storage)
            return result

        cls.resize_ = resize_  # type: ignore[method-assign,assignment]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        assert self._resize_saved is not None
        own, original = self._resize_saved
        if own:
            torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]
        else:
            del torch.UntypedStorage.resize_
        self._resize_saved = None
        self._current_op = "after the step"
        for f in self._finalizers:  # stop counting frees that happen after the step
            f.detach()
        self._finalizers = []
        self._finish()
