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

[Note: what is alive at a peak]
Every storage carries a source from when it was first tracked: the label given to `add_existing`
(what it was between steps), or the phase it was made in and the op that made it ("found" for one
first seen as an input), except that a storage empty when first seen and grown by
`UntypedStorage.resize_` is
"regrown by resize_" (the unsharded parameters of both FSDPs, whose storages live across steps, empty
between steps). `peak_sources[phase]` adds up the bytes alive at that phase's peak by
source, so each term of a peak has a name and a maker. A storage keeps its first source when it is
regrown.
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


def _source(op: str, found: bool) -> str:
    """How a storage came to be tracked, for `peak_sources`."""
    return f"found ({op})" if found else op


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
        self._ids: dict[int, int] = {}  # StorageImpl address -> serial of the storage tracked there now
        self._sizes: dict[int, int] = {}  # serial -> bytes, while the storage lives (an address is reused)
        self._serials = 0
        self._empty_when_seen: set[int] = set()  # serials of storages empty when first tracked
        self._regrown: set[int] = set()  # those of them grown by UntypedStorage.resize_
        self._events: list[int] = []  # size changes in order; a found storage's entry is decided at exit
        self._event_ops: list[str] = []  # the op running when each change happened
        self._event_keys: list[int] = []  # the serial of the storage each change is of
        self._sources: dict[int, tuple[int, str]] = {}  # event index where a storage was first tracked -> source
        self.peak_sources: dict[str, dict[str, int]] = {}  # phase -> source -> bytes alive at its peak
        self._marks: list[tuple[int, str]] = []
        self.peak_op = ""  # the op during which the peak was reached
        self.phase_peaks: dict[str, int] = {}  # peak within each phase that `mark` closed
        self._found: dict[int, tuple[int, int, str]] = {}  # serial -> (event index, bytes when found, op)
        self._existing: dict[int, tuple[int, str]] = {}  # serial -> (bytes, label) of the storages alive at the start
        self._finalizers: list[weakref.finalize] = []
        self._resize_saved: Optional[tuple[bool, Any]] = None
        self._current_op = "add_existing"

    # ------------------------------------------------------------------ bookkeeping
    def _event(self, change: int, key: int) -> None:
        self._events.append(change)
        self._event_ops.append(self._current_op)
        self._event_keys.append(key)

    def _on_free(self, address: int, key: int) -> None:
        if self._ids.get(address) == key:
            del self._ids[address]
        self._event(-self._sizes.pop(key, 0), key)

    def mark(self, phase: str) -> None:
        """Close a phase of the step: ``phase_peaks[phase]`` is the peak since the previous mark."""
        self._marks.append((len(self._events), phase))

    def _track(self, storage: torch.UntypedStorage, how: str, label: str = "before the step") -> None:
        """Start tracking ``storage``; ``how`` is 'existing' (named by ``label``), 'new' (an op output) or
        'found' (an op input)."""
        address = storage._cdata
        if address in self._ids:
            return
        key = self._ids[address] = self._serials
        self._serials += 1
        nbytes = storage.nbytes()
        self._sizes[key] = nbytes
        if nbytes == 0:
            self._empty_when_seen.add(key)
        if how == "existing":
            self.baseline += nbytes
            self._existing[key] = (nbytes, label)
        else:
            self._sources[len(self._events)] = (len(self._marks), _source(self._current_op, how == "found"))
            if how == "new":
                self._event(nbytes, key)
            else:
                self._found[key] = (len(self._events), nbytes, self._current_op)
                self._event(0, key)
        self._finalizers.append(weakref.finalize(storage, self._on_free, address, key))

    def _see(self, x: Any, how: str, label: str = "before the step") -> None:
        if isinstance(x, torch.UntypedStorage):
            self._track(x, how, label)
        elif isinstance(x, torch.Tensor):
            for t in _plain_tensors(x):
                storage = _storage_of(t)
                if storage is None:
                    continue
                key = self._ids.get(storage._cdata)
                if key is None:
                    self._track(storage, how, label)
                elif how == "new" and storage.nbytes() != self._sizes[key]:  # aten.resize_ and friends
                    self._resized(storage)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = self._ids[storage._cdata]
        old = self._sizes[key]
        self._sizes[key] = storage.nbytes()
        self._event(self._sizes[key] - old, key)

    def add_existing(self, tensors: Iterable[Optional[torch.Tensor]], label: str = "before the step") -> None:
        """Count tensors that are alive before the step (None entries are skipped); ``label`` names them
        in `peak_sources` (a storage reached twice keeps its first label)."""
        for t in tensors:
            if t is not None:
                self._see(t, "existing", label)

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
        phase_peak_at = 0  # events replayed when the open phase's peak was reached
        peak_at: dict[str, int] = {}
        for i, (change, op) in enumerate(zip(self._events, self._event_ops)):
            while marks and marks[0][0] == i:
                phase = marks.pop(0)[1]
                self.phase_peaks[phase], peak_at[phase] = phase_peak, phase_peak_at
                phase_peak, phase_peak_at = live, i
            live += change
            if live > phase_peak:
                phase_peak, phase_peak_at = live, i + 1
            if live > peak:
                peak, self.peak_op = live, op
        for _, phase in marks:
            self.phase_peaks[phase], peak_at[phase] = phase_peak, phase_peak_at
            phase_peak, phase_peak_at = live, len(self._events)
        self.peak_bytes, self.live_bytes = peak, live
        self.peak_sources = self._sources_at(peak_at)

    def _sources_at(self, peak_at: dict[str, int]) -> dict[str, dict[str, int]]:
        """Bytes alive after each of ``peak_at``'s event counts, by source ([Note: what is alive at a peak])."""
        phases = [name for _, name in self._marks]
        alive_at_start = {key: self._existing[key] for key in self._existing}
        for key, (_, nbytes, op) in self._found.items():
            if key in self._sizes:  # found, alive to the end: it was there from the start
                label = "regrown by resize_" if key in self._regrown else f"found alive ({op})"
                alive_at_start[key] = (nbytes, label)
        live: dict[int, list[Any]] = {key: [n, label] for key, (n, label) in alive_at_start.items()}
        wanted = sorted((i, phase) for phase, i in peak_at.items())
        out: dict[str, dict[str, int]] = {}
        for i in range(len(self._events) + 1):
            while wanted and wanted[0][0] == i:
                by_source: dict[str, int] = {}
                for nbytes, label in live.values():
                    if nbytes:
                        by_source[label] = by_source.get(label, 0) + nbytes
                out[wanted.pop(0)[1]] = dict(sorted(by_source.items(), key=lambda kv: -kv[1]))
            if i == len(self._events):
                break
            key, change = self._event_keys[i], self._events[i]
            if i in self._sources:
                made_in, op = self._sources[i]
                where = phases[made_in] if made_in < len(phases) else "after the last mark"
                if key in self._found and key in self._sizes:
                    continue  # found alive: already in `live` from the start
                live[key] = [change, "regrown by resize_" if key in self._regrown else f"{where}: {op}"]
            elif key in live:  # a resize or a free
                live[key][0] += change
        return out

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
            key = tracker._ids[storage._cdata]
            if key in tracker._empty_when_seen and size > 0:  # an unsharded parameter, regrown
                tracker._regrown.add(key)
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
