"""Recording CUDA streams and events for CPU-run checks of the stream rules (see [Note: the stream
recorder]); used by device_audit_world.py."""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_composable import _flat_param
from fsdp_composable._base import _param_major
from fsdp_composable._comm import _collectives
from fsdp_composable._grads import _reduce_utils
from fsdp_composable._runtime import _forward_methods, _grad_utils, _runtime_utils

META = torch.device("meta")


# [Note: the stream recorder]
# torch.cuda's Stream, Event, current_stream and stream() are replaced by fakes that keep a vector
# clock per stream: each tracked operation advances its stream's own entry, an event snapshots its
# stream's clock, and wait_event / wait_stream merge a clock into the waiting stream's. "A happens
# before B on another stream" is then "B's stream has seen A's entry". The side streams are handed
# to the root at lazy init (this world's device is meta, so the library creates none itself), and
# the library's own code paths run unchanged. Checked: the compute stream reads an unsharded
# buffer only after the all-gather that wrote it, and a reduced gradient only after its
# collectives; a side stream reads gradients only after the compute stream produced them; the
# all-reduce across replicas runs after the reduce-scatter, on its own stream; storage is freed only
# when its allocating stream has seen every other stream's use of it (every storage a recorded
# operation makes: its allocating stream is the stream current then, and its death is seen by a
# finaliser, so a tensor dropped too early is a violation); the unshard stream waits for the compute
# stream once per root forward, not before each all-gather; a collective reads a tensor only after
# the stream that made it was waited for; every stream is asked for by the unit's device; no host
# synchronisation in a steady-state step (a host read, a stream or event synchronisation, a blocking
# copy between host and device: `host_syncs`; a host scalar written into a device tensor:
# `host_writes`). The memory account: the reduce-scatter inputs still alive when the end of backward
# commits the gradients (`Recorder.held_at_commit`).
class Recorder:
    def __init__(self) -> None:
        self.violations: list[str] = []
        self.host_syncs = 0
        self.unshard_waits_on_compute = 0
        self.root_forward_wait = False  # the unshard stream just waited for compute (a root forward)
        self.streams: list[FakeStream] = []
        self.compute = FakeStream(self, "compute")
        self.current = self.compute
        self.written: dict[int, tuple[str, int]] = {}  # storage -> (stream, time) of the last collective write
        self.owner: dict[int, FakeStream] = {}  # storage -> the stream that allocated it
        self.made: dict[int, tuple[str, int]] = {}  # storage -> (stream, time) of the operation that made it
        self.uses: dict[int, dict[str, int]] = {}  # storage -> stream -> last use time
        self.tracked: set[int] = set()  # storages with a finaliser (forgotten when they die)
        self.reduce_inputs: dict[int, int] = {}  # storage -> bytes, of reduce-scatter inputs alive
        self.held_at_commit: list[int] = []  # reduce-scatter input bytes alive at each end of backward
        # copies between the host and the device: (to "device" or "host", stream, non_blocking, in backward)
        self.copies: list[tuple[str, str, bool, bool]] = []
        self.host_writes: list[str] = []  # host scalars written into device tensors (a blocking copy each)
        self.collectives: list[tuple[str, str, int]] = []  # (collective, stream, output numel), as issued
        # param-major outputs of all-gathers whose copy-out has not run yet: storage -> the gather's stream
        self.copy_pending: dict[int, str] = {}

    def fail(self, text: str) -> None:
        if text not in self.violations:
            self.violations.append(text)

    def use(self, stream: "FakeStream", t: torch.Tensor) -> int:
        self.track(t)
        time = stream.tick()
        self.uses.setdefault(storage_key(t), {})[stream.name] = time
        return time

    def track(self, t: torch.Tensor, owner: "Optional[FakeStream]" = None) -> None:
        """Watch ``t``'s storage: who allocated it (``owner``, if first seen now) and when it dies."""
        k = storage_key(t)
        if k in self.tracked:
            return
        self.tracked.add(k)
        if owner is not None:
            self.owner.setdefault(k, owner)
            self.made.setdefault(k, (owner.name, owner.clock[owner.name]))
        weakref.finalize(t.untyped_storage(), self.died, k)

    def died(self, k: int) -> None:
        """A storage was freed: every other stream's use of it must have been seen by its owner."""
        owner = self.owner.pop(k, self.compute)
        for other, time in self.uses.pop(k, {}).items():
            if other != owner.name and owner.seen(other) < time:
                self.fail(f"a tensor was freed while the {other} stream may still use it")
        self.written.pop(k, None)
        self.made.pop(k, None)
        self.reduce_inputs.pop(k, None)
        self.tracked.discard(k)


def storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


class FakeStream:
    def __init__(self, rec: Recorder, name: str = "") -> None:
        self.rec = rec
        self.name = name or f"side{len(rec.streams)}"
        self.clock: dict[str, int] = {self.name: 0}
        self.device = META
        rec.streams.append(self)

    def tick(self) -> int:
        self.clock[self.name] += 1
        return self.clock[self.name]

    def seen(self, other: str) -> int:
        return self.clock.get(other, 0)

    def merge(self, clock: dict[str, int]) -> None:
        for k, v in clock.items():
            self.clock[k] = max(self.clock.get(k, 0), v)

    def wait_stream(self, other: "FakeStream") -> None:
        if other is self.rec.compute and self.name == "unshard":
            self.rec.unshard_waits_on_compute += 1
            self.rec.root_forward_wait = True
        self.merge(other.clock)

    def wait_event(self, event: "FakeEvent") -> None:
        self.merge(event.clock)

    def record_event(self, event: "Optional[FakeEvent]" = None) -> "FakeEvent":
        event = event or FakeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.rec.host_syncs += 1


class FakeEvent:
    rec: Recorder

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.clock: dict[str, int] = {}

    def record(self, stream: Optional[FakeStream] = None) -> None:
        self.clock = dict((stream or FakeEvent.rec.current).clock)

    def synchronize(self) -> None:
        FakeEvent.rec.host_syncs += 1

    def query(self) -> bool:
        return True


class Ticking(TorchDispatchMode):
    """Every tensor operation advances the clock of the stream it is issued on (the model's own
    compute included), so "waited for all compute issued before it" is visible."""

    def __init__(self, rec: Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.rec.current.tick()
        kwargs = kwargs or {}
        if func is torch.ops.aten.scalar_tensor.default:  # `t[i] = x`: a host scalar copied to the device
            self.rec.host_writes.append(str(func))
        crossing = host_device_copy(func, args, kwargs)
        if crossing is not None:
            direction, non_blocking = crossing
            in_backward = torch._C._current_graph_task_id() != -1
            self.rec.copies.append((direction, self.rec.current.name, non_blocking, in_backward))
            if not non_blocking:
                self.rec.host_syncs += 1  # a blocking copy waits for the device
        out = func(*args, **kwargs)
        inputs = {storage_key(a) for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0 and storage_key(t) not in inputs:
                self.rec.track(t, self.rec.current)  # a new storage (not a view) belongs to the current stream
        return out


def host_device_copy(func: Any, args: Any, kwargs: dict[str, Any]) -> Optional[tuple[str, bool]]:
    """("device" or "host", non_blocking) for a copy between the host and another device, else None."""
    if func is torch.ops.aten.copy_.default:
        src, to = args[1], args[0].device.type
        non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    elif func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None:
        src, to = args[0], torch.device(kwargs["device"]).type
        non_blocking = bool(kwargs.get("non_blocking", False))
    else:
        return None
    if not isinstance(src, torch.Tensor) or (src.device.type == "cpu") == (to == "cpu"):
        return None
    return ("host" if to == "cpu" else "device"), non_blocking


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    rec = Recorder()
    FakeEvent.rec = rec
    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def current_stream(device: Any = None) -> FakeStream:
        if device is None:
            rec.fail("torch.cuda.current_stream() asked without the unit's device")
        elif torch.device(device) != META:  # this world's units compute on meta
            rec.fail(f"torch.cuda.current_stream() asked for {device}, not the unit's device")
        return rec.current

    @contextlib.contextmanager
    def stream(s: Optional[FakeStream]) -> Iterator[None]:
        before, rec.current = rec.current, (s or rec.current)
        try:
            yield
        finally:
            rec.current = before

    patch(torch.cuda, "current_stream", current_stream)
    patch(torch.cuda, "stream", stream)
    patch(torch.cuda, "Event", FakeEvent)
    patch(torch.cuda, "Stream", lambda *a, **k: FakeStream(rec))

    lazy_init = _runtime_utils._lazy_init

    def lazy_init_with_streams(state: Any, root: Any) -> None:
        fresh = state.is_root is None
        lazy_init(state, root)
        if fresh and state.ctx is not None and state.ctx.unshard_stream is None:
            ctx = state.ctx
            ctx.unshard_stream, ctx.reduce_stream = FakeStream(rec, "unshard"), FakeStream(rec, "reduce")
            ctx.all_reduce_stream = FakeStream(rec, "all_reduce")

    for module in (_runtime_utils, _grad_utils, _forward_methods):  # every caller of the root's lazy init
        patch(module, "_lazy_init", lazy_init_with_streams)

    def collective(name: str, reads_first: bool) -> None:
        original = getattr(_collectives, name)

        def run(*args: Any, **kwargs: Any) -> Any:
            s = rec.current
            out = args[0]
            inputs = [args[1]] if name != "all_reduce" else [out]
            if name == "reduce_scatter" and not isinstance(args[1], torch.Tensor):
                inputs = list(args[1])
            for t in [out, *inputs]:
                k = storage_key(t)
                if k in rec.written and rec.written[k][0] != s.name and s.seen(rec.written[k][0]) < rec.written[k][1]:
                    rec.fail(f"{name} on {s.name} used a tensor before the {rec.written[k][0]} stream's write")
                for other, time in rec.uses.get(k, {}).items():
                    if other != s.name and s.seen(other) < time and s is not rec.compute:
                        rec.fail(f"{name} on {s.name} used a tensor before {other} finished with it")
                maker, made = rec.made.get(k, (s.name, 0))
                if maker != s.name and s.seen(maker) < made:
                    rec.fail(f"{name} on {s.name} used a tensor before the {maker} stream made it")
            if name == "all_gather" and s.name == "unshard":
                latest = rec.compute.clock["compute"]
                if not rec.root_forward_wait and latest > 0 and s.seen("compute") >= latest:
                    rec.fail("an all-gather waited for all compute issued before it (no overlap)")
                rec.root_forward_wait = False
            time = s.tick()
            rec.collectives.append((name, s.name, out.numel()))
            if name == "all_gather" and kwargs.get("regions", args[5] if len(args) > 5 else None) is not None:
                rec.copy_pending[storage_key(out)] = s.name  # a native gather lands rank-major: copied out next
            for t in [out, *inputs]:
                rec.track(t)
            rec.written[storage_key(out)] = (s.name, time)
            for t in inputs:
                rec.uses.setdefault(storage_key(t), {})[s.name] = time
                if name == "reduce_scatter":
                    rec.reduce_inputs[storage_key(t)] = t.untyped_storage().nbytes()
            return original(*args, **kwargs)

        patch(_collectives, name, run)

    for name in ("all_gather", "reduce_scatter", "all_reduce"):
        collective(name, True)
    copy_out = _param_major.copy_out

    def recorded_copy_out(gathered: torch.Tensor, regions: Any) -> None:
        s = rec.current
        if regions:
            k = storage_key(regions[0])
            stream = rec.copy_pending.pop(k, None)
            if stream is not None and stream != s.name:
                rec.fail(f"a copy-out ran on the {s.name} stream, not on the {stream} stream after its all-gather")
            rec.written[k] = (s.name, s.tick())  # what the compute stream reads is the copy-out's write
        copy_out(gathered, regions)

    patch(_param_major, "copy_out", recorded_copy_out)

    def reading(method: Callable[..., Any], what: Callable[[Any], list[torch.Tensor]]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = method(self, *args, **kwargs)
            for t in what(self):
                k = storage_key(t)
                if k in rec.copy_pending:
                    rec.fail(f"{method.__name__}: the compute stream read a buffer whose copy-out never ran")
                if k in rec.written:
                    src, time = rec.written[k]
                    if src != "compute" and rec.compute.seen(src) < time:
                        rec.fail(f"{method.__name__}: the compute stream read a tensor before the {src} stream's event")
                rec.use(rec.compute, t)
            return result

        return run

    handle_cls = _flat_param.FlatParamHandle
    patch(
        handle_cls,
        "wait_unshard",
        reading(handle_cls.wait_unshard, lambda h: [h._unsharded] if h._needs_buffer else []),
    )
    pending_cls = _reduce_utils.PendingReduce
    patch(pending_cls, "commit", reading(pending_cls.commit, lambda p: [p.out]))

    def tracking_storage(method: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            buf = self._unsharded
            before = buf.untyped_storage().size() if buf is not None else 0
            if method.__name__ == "reshard" and buf is not None and before > 0:
                rec.use(rec.compute, buf)  # the unit's compute used it up to here
            result = method(self, *args, **kwargs)
            after = buf.untyped_storage().size() if buf is not None else 0
            k = storage_key(buf) if buf is not None else 0
            if before == 0 and after > 0:
                rec.owner[k] = rec.current
            if before > 0 and after == 0:
                owner = rec.owner.get(k, rec.compute)
                for other, time in rec.uses.get(k, {}).items():
                    if other != owner.name and owner.seen(other) < time:
                        rec.fail(f"{method.__name__}: freed storage the {other} stream may still use")
                rec.uses.pop(k, None)
                rec.written.pop(k, None)
            return result

        return run

    for name in ("_alloc_unsharded", "reshard", "release_freed"):
        if hasattr(handle_cls, name):
            patch(handle_cls, name, tracking_storage(getattr(handle_cls, name)))
    start_reduce = _reduce_utils.start_reduce

    def start_reduce_after_grads(handle: Any, *args: Any) -> Any:
        rec.compute.tick()  # the gradients were produced on the compute stream up to here
        if handle.grads.buffer is not None:
            rec.use(rec.compute, handle.grads.buffer)
        return start_reduce(handle, *args)

    patch(_reduce_utils, "start_reduce", start_reduce_after_grads)
    patch(_runtime_utils.grads, "start_reduce", start_reduce_after_grads)
    host_values = _collectives.host_values

    def counted_host_values(t: torch.Tensor) -> torch.Tensor:
        rec.host_syncs += 1
        return host_values(t)  # type: ignore[no-any-return]

    patch(_collectives, "host_values", counted_host_values)
    finish_all = _reduce_utils.finish_all

    def counted_finish_all(*args: Any) -> None:
        gc.collect()  # only what the library still references counts
        rec.held_at_commit.append(sum(rec.reduce_inputs.values()))
        finish_all(*args)

    patch(_reduce_utils, "finish_all", counted_finish_all)
    try:
        with Ticking(rec):
            yield rec
    finally:
        for owner, name, value in reversed(patches):
            setattr(owner, name, value)


def check_streams(rec: Recorder, forwards: int) -> None:
    problems = list(rec.violations)
    for i, (name, stream, numel) in enumerate(rec.collectives):
        # a reduce-scatter's presence flags are summed on the host ([Note: presence flags agreed on the
        # host]): no small all-reduce of them follows it on its stream
        after = [c for c in rec.collectives[i + 1 :] if c[1] == stream][:1]
        if name == "reduce_scatter" and after and after[0][0] == "all_reduce" and after[0][2] < numel:
            problems.append(f"a reduce-scatter on {stream} followed there by a device all-reduce of its flags: {after}")
    if rec.unshard_waits_on_compute != forwards:
        problems.append(
            f"the unshard stream waited for the compute stream {rec.unshard_waits_on_compute} times in {forwards} "
            "root forwards (once per root forward, not before each all-gather)"
        )
    assert not problems, "; ".join(problems)
