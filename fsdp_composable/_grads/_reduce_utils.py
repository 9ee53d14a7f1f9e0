"""A unit's gradients: the gradient buffer's lifecycle (`GradState`, checked transitions), the
divide factors, the reduce-scatter / all-reduce, and `PendingReduce`.

Every function takes the handle first; the per-unit record is `UnitGrads` (``handle.grads``).

[Note: gradients land in the flat buffer]
Two ways, chosen by what the reduction sends (`_collectives.point_to_point`) and by the layout:
- FLAT, on every backend but our gloo exchange, for a unit whose param-major buffer is the
  reduce-scatter input itself (`FlatLayout.same_order_in`: one parameter, or NO_SHARD, where this
  was about 1% ahead of AUTOGRAD plus a concatenation on the benchmark GPT), whose reduction takes
  the param-major buffer (a ``no_sync`` sum kept so far, a communication hook), or with a parameter
  ``_chunk_cat`` cannot cut (0-dim, empty, tensor-parallel): before the unit's backward each
  trainable original parameter's ``.grad`` is pointed at a view of one zeroed, padded, unsharded
  gradient buffer, which autograd accumulates into in place. A ``.grad`` the user replaced is
  copied in before the reduction.
- AUTOGRAD: ``.grad`` is left to autograd, which allocates each gradient when it is produced (no
  zero fill, no read-modify-write through a temporary). Our gloo exchange sends the gradients
  themselves, plus a zero tail for the padding. Elsewhere one ``_chunk_cat`` (`FlatLayout.cat_in`)
  writes them straight into the rank-major reduce-scatter input, padding and reduce-dtype cast
  included: one kernel instead of zero fill, accumulation and copy-in, and none of the buffer's
  views or accumulation hooks on the host. A unit's gradient memory grows parameter by parameter
  instead of being allocated whole at its start, and peaks as FLAT's (gradients plus input).
Units reduced in the final callback (their trigger never fires) take AUTOGRAD on any backend (nothing could be
reduced before the end of backward, so there is no point holding a buffer through it). On CUDA every tensor a
reduction reads is made on the compute stream before it is issued and kept until the compute stream waited for it
([Note: streams without record_stream]), which is why only CPU tensors on gloo are sent in parts.

[Note: the gradient lifecycle]
``GradState`` says where a unit's *unsharded* gradient is; the sharded gradient is always
``flat_param.grad`` (and, exposing original parameters, ``.grad`` views of it between steps):
- NONE: no unsharded gradient.
- FLAT / AUTOGRAD: the unit's backward is running; ``.grad`` of its original parameters are
  unsharded (a buffer's views, or autograd's own tensors).
- STAGED: inside ``no_sync``, the unit's backward is done; its gradient waits, apart from what earlier
  micro-batches accumulated (``kept``), for the whole backward to succeed.
- KEPT_FOR_NO_SYNC: between ``no_sync`` micro-batches: ``kept`` holds their sum; the next backward
  adds to it (STAGED) or reduces it together with its own gradient (REDUCING).
- REDUCING: the reduction was issued; its result is added to ``flat_param.grad`` when the whole
  backward has succeeded (``commit``).
Nothing of a backward reaches ``.grad`` or ``kept`` before that backward completes: a backward that
raises midway is dropped whole by `abort` (reductions already issued are waited for, so every rank's
collectives stay matched, and their results discarded), and training goes on exactly as if the
failed step never ran. The price: inside ``no_sync`` a unit holds its ``kept`` sum and this
micro-batch's gradient at once until the end of the backward, and a reduced shard waits (1/N of
the unit) until then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from fsdp_composable._base._grad_mode import NoGrad
from fsdp_composable._base._grad_records import GradState, ReduceControls, UnitGrads
from fsdp_composable._base._state_machine import Transitions, check_transition
from fsdp_composable._comm import _collectives, _custom_comms, _trace
from fsdp_composable._comm._header_fields import for_unit
from fsdp_composable._comm._tensor_parallel import as_local_grad
from fsdp_composable._flat_param import FlatParamHandle
from fsdp_composable._grads import _comm_hooks, _grad_presence, _host_flags
from fsdp_composable._grads import _reduce_inputs as inputs
from fsdp_composable._grads._exposed_grads import accumulate_sharded_grad, stash_sharded_grads
from fsdp_composable._grads._offload_copies import offload_copy, sync_offload_copies

__all__ = ["GradState", "PendingReduce", "ReduceControls", "UnitGrads", "divide_factors"]


_G = GradState
_GRAD_TRANSITIONS: Transitions = {
    _G.NONE: frozenset({_G.FLAT, _G.AUTOGRAD}),
    _G.KEPT_FOR_NO_SYNC: frozenset({_G.FLAT, _G.AUTOGRAD, _G.REDUCING}),
    # to NONE / KEPT_FOR_NO_SYNC: `abort`
    _G.FLAT: frozenset({_G.STAGED, _G.REDUCING, _G.NONE, _G.KEPT_FOR_NO_SYNC}),
    _G.AUTOGRAD: frozenset({_G.STAGED, _G.REDUCING, _G.NONE, _G.KEPT_FOR_NO_SYNC}),
    _G.STAGED: frozenset({_G.KEPT_FOR_NO_SYNC, _G.NONE}),
    _G.REDUCING: frozenset({_G.NONE, _G.KEPT_FOR_NO_SYNC}),
}


def init_grads(handle: FlatParamHandle, expose_orig: bool) -> None:
    handle.grads = UnitGrads(expose_orig)


def _set_state(handle: FlatParamHandle, new: GradState) -> None:
    grads = handle.grads
    if new in _GRAD_TRANSITIONS[grads.state]:  # the common case, without building the message
        grads.state = new
        return
    check_transition("GradState", f"unit '{handle.unit_fqn or '<root>'}'", grads.state, new, _GRAD_TRANSITIONS)
    grads.state = new


def divide_factors(world: int, reduce_dtype: torch.dtype, factor: Optional[float] = None) -> tuple[float, float]:
    """(pre, post): the gradient sum is divided by the number of ranks it averages over (or by the
    user's ``factor``, see `set_gradient_divide_factor`), once.

    Before the sum in float16, whose range the sum of N gradients can overflow; after it otherwise,
    so the result is rounded once (the same bits either way when N is a power of two)."""
    divisor = float(world) if factor is None else factor
    if divisor == 1 or (factor is None and world <= 1):
        return 1, 1
    return (divisor, 1) if reduce_dtype == torch.float16 else (1, divisor)


def takes_autograd_grads(handle: FlatParamHandle) -> bool:
    """Whether backward leaves gradients where autograd puts them, to be sent piece by piece or
    concatenated once into the rank-major reduce-scatter input ([Note: gradients land in the flat buffer])."""
    layout = handle.layout
    if layout.world_size == 1 or _collectives.point_to_point(handle.process_group, handle.device):
        return layout.world_size > 1
    kept_or_hooked = handle.grads.kept is not None or _comm_hooks.registered(handle) is not None
    return not (layout.same_order_in or kept_or_hooked) and layout.cats_params_in


# ---------------------------------------------------------------------------- one backward
def begin_backward(handle: FlatParamHandle, lazy: bool, early: list[Optional[torch.Tensor]]) -> None:
    """Pre-backward of a trainable unit (parameters already unsharded): take the user's ``.grad``
    edits into the sharded gradient, then let this backward's gradients land unsharded, starting
    from ``early`` (by parameter: what a backward of part of the model accumulated since forward).

    ``lazy``: autograd allocates each gradient as it is produced (AUTOGRAD) instead of a zeroed
    buffer being held from now on (FLAT); see [Note: gradients land in the flat buffer]."""
    grads = handle.grads
    for param, grad in zip(handle.params, early):
        if grad is not None:
            param.grad = None  # not the user's edit of the sharded gradient: kept out of the stash
    stash_sharded_grads(handle)
    if lazy:
        _set_state(handle, GradState.AUTOGRAD)
        for param, grad in zip(handle.params, early):
            param.grad = grad if grad is not None else param.grad
        return
    _set_state(handle, GradState.FLAT)
    _grad_presence.watch_accumulation(handle, grads.touched, grads.hooks)
    grads.buffer = inputs.grad_buffer(handle, handle.compute_dtype)
    views = handle.views_of(grads.buffer)
    grads.views = (grads.buffer, views)
    for i, (param, view) in enumerate(zip(handle.params, views)):
        if param.requires_grad:
            param.grad = view
        grad = early[i] if i < len(early) else None
        if grad is not None:
            view.copy_(grad)
            grads.touched[i] = True


def _take_backward_grads(
    handle: FlatParamHandle, alone: Optional[list[bool]] = None
) -> tuple[list[Optional[torch.Tensor]], list[bool]]:
    """This backward's gradient of each original parameter (None: it got none), detached from the
    parameters, and whether it got one (see [Note: which parameters got a gradient]). In FLAT mode
    a gradient that is not the buffer's view is copied into the buffer. ``alone`` gets, for each,
    whether nothing else holds autograd's gradient (`_reduce_inputs.held_here_alone`)."""
    grads = handle.grads
    out: list[Optional[torch.Tensor]] = []
    got: list[bool] = []
    views: Optional[list[torch.Tensor]] = None
    if grads.buffer is not None:
        made = grads.views
        views = made[1] if made is not None and made[0] is grads.buffer else handle.views_of(grads.buffer)
    grads.views = None
    with NoGrad():
        for i, param in enumerate(handle.params):
            grad, param.grad = param.grad, None
            if grad is not None:
                grad = as_local_grad(param, grad)
            if alone is not None:  # this frame's ``grad`` is the one reference expected
                alone.append(views is None and grad is not None and inputs.held_here_alone(grad, 1))
            if views is not None:
                # the view pre-backward set, accumulated into: the same object (else compare memory)
                replaced = grad is not None and grad is not views[i] and not _same_memory(grad, views[i])
                if grad is not None and replaced:
                    views[i].copy_(grad)
                out.append(views[i])
                got.append(replaced or (i < len(grads.touched) and grads.touched[i]))
            else:
                out.append(grad)
                got.append(grad is not None)
    grads.touched[:] = []
    return out, got


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` is ``b``'s memory (autograd accumulated into the view we gave it), for a ``.grad``
    that is not the view object itself (e.g. ``views_of`` was called again)."""
    return (
        a.untyped_storage()._cdata == b.untyped_storage()._cdata
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def stage_for_no_sync(handle: FlatParamHandle) -> None:
    """Post-backward inside ``no_sync``: hold this backward's gradient until the backward succeeds."""
    grads = handle.grads
    parts, grads.staged_got = _take_backward_grads(handle)
    grads.buffer = inputs.flat_of(handle, parts)
    _set_state(handle, GradState.STAGED)


@_trace.method("reduce")
def start_reduce(
    handle: FlatParamHandle,
    stream: Optional[torch.cuda.Stream] = None,
    all_reduce_stream: Optional[torch.cuda.Stream] = None,
) -> "PendingReduce":
    """Post-backward: issue this backward's gradient reduction (plus the ``no_sync`` sum kept so far).

    On CUDA (``stream``: the reduce stream) the division, HYBRID_SHARD's all-reduce across replicas
    (on ``all_reduce_stream``, after the reduce-scatter) and a CPU-offloaded gradient's copy to the
    host are issued now, on the side streams; see [Note: streams without record_stream] and
    [Note: offloaded gradients reach the host]. On the CPU, `PendingReduce.wait` (in the next unit's
    post-backward) finishes the reduce-scatter, divides and issues the all-reduce across replicas,
    which `finish` waits for at the end of backward.

    The kept sum stays as it is until `commit`: if the backward fails, it survives unchanged."""
    grads = handle.grads
    world = handle.group_size * handle.replicas
    pre, post = divide_factors(world, handle.reduce_dtype, grads.controls.divide_factor)
    hook = _comm_hooks.registered(handle)  # a user's hook replaces the collective: [Note: communication hooks]
    # the user's reduce-scatter ([Note: custom collectives]): it takes one rank-major tensor
    custom = grads.controls.reduce_scatter_comm if handle.layout.world_size > 1 else None
    sends_pieces = _collectives.point_to_point(handle.process_group, handle.device)
    alone: list[bool] = []  # per parameter: autograd's gradient is held by nothing else
    writable: list[torch.Tensor] = []  # what the exchange may receive into ([Note: the reduce-scatter's scratch])
    if grads.state is GradState.KEPT_FOR_NO_SYNC:  # a unit not run in this synced backward
        parts: list[Optional[torch.Tensor]] = []
        flat: Optional[torch.Tensor] = grads.kept
        got = grads.kept_got
    else:
        # only gloo's exchange over 3 ranks or more has later chunks to receive into them
        late_chunks = sends_pieces and custom is None and handle.layout.world_size > 2 and handle.layout.direct
        parts, mine = _take_backward_grads(handle, alone if late_chunks else None)
        got = _grad_presence.union(mine, grads.kept_got)
        flat = None
        as_they_are = grads.buffer is None and grads.kept is None and takes_autograd_grads(handle)
        if not as_they_are or hook is not None or (custom is not None and sends_pieces):
            flat = inputs.flat_of(handle, parts)
            if grads.kept is not None:  # a fresh tensor: the kept sum itself stays as it is
                flat = _plus_kept(handle, flat, grads.kept)
    _set_state(handle, GradState.REDUCING)
    grads.buffer = None
    if hook is not None:
        assert flat is not None
        host: list[Optional[torch.Tensor]] = []  # CPU offload on CUDA: copied on the stream, not blocking
        copy = (lambda out: host.append(offload_copy(handle, out))) if stream is not None else None
        hooked, result, keep = _comm_hooks.start(hook, handle, flat, grads.kept, stream, copy)
        return PendingReduce(handle, hooked, result, keep, numel=result.numel(), host=host[0] if host else None)
    group, rdtype = handle.process_group, handle.reduce_dtype
    with NoGrad():
        layout = handle.layout
        # gloo sends each parameter's rows from where they are ([Note: moving chunks]), kept sum or not alike
        p2p = custom is None and sends_pieces
        pieces = layout.world_size > 1 and layout.direct and p2p
        partial_only = _partial_only(handle)
        # off the CPU the host sums the flags ([Note: presence flags agreed on the host]), and a partial
        # sum kept apart reads none: no device all-reduce (nor host-to-device copy) for them
        device_flags = not (_host_flags.on_host(handle.device) or partial_only)
        rides = False  # the flags in the reduce-scatter's input
        if flat is None and p2p:  # AUTOGRAD on gloo: the gradients in rank-major order, as they are or in one copy
            scaled: list[Optional[torch.Tensor]] = [inputs.scaled_part(handle, g, i, pre) for i, g in enumerate(parts)]
            send = inputs.rank_major_pieces(handle, scaled)
            if layout.direct:
                writable = inputs.writable_parts(parts, scaled, alone) if alone else []
            else:
                send = [torch.cat(send)]
                # our copy, but a 0-dim gradient's copies no longer share memory: keep them out
                writable = [] if any(i.replicated for i in layout.infos) else send
        elif flat is None:  # AUTOGRAD elsewhere: autograd's gradients into the rank-major input, one kernel
            # on the CPU the flags ride at the end of every rank's chunk: [Note: which parameters got a gradient]
            rides = custom is None and device_flags
            one = inputs.cat_in(handle, parts, rdtype, got if rides else None)
            if pre != 1:
                one.div_(pre)
            send = [one]
        else:
            one = flat
            if not (layout.same_order_in or pieces):  # the one copy-in: [Note: rank-major flat shards]
                one = layout.copy_in(flat, out=inputs.grad_buffer(handle, rdtype, zero=False))
            elif flat.dtype != rdtype or flat is grads.kept:  # a copy: the kept sum itself stays as it is
                one = inputs.grad_buffer(handle, rdtype, zero=False)
                one.copy_(flat)
            if pre != 1:
                one.div_(pre)
            send = [one]
            if pieces:
                send = inputs.rank_major_pieces(handle, [one[i.offset : i.offset + i.numel] for i in layout.infos])
        assert got is not None
        # set_requires_all_reduce(False): no all-reduce across replicas; the result is kept apart
        replicas = handle.replicate_group if handle.switches.all_reduce_grads else None
        pending = PendingReduce(handle, _collectives.InFlight(), send[0], send, replicas, post)
        pending.partial_only = partial_only
        # CPU: in `wait`/`finish`; CUDA: on the last stream; once, on the all-reduced sum (as FSDP2)
        pending.hook = None if pending.partial_only else grads.controls.all_reduce_hook
        pending.got = got
        numel = pending.numel = handle.layout.shard_numel
        # how the flags travel: [Note: which parameters got a gradient]
        if handle.layout.world_size == 1:  # NO_SHARD: every rank keeps the whole, all-reduced
            room = inputs.flag_room(handle)
            whole = _grad_presence.with_room(send[0], room) if room else send[0]
            assert whole is not None, "a NO_SHARD gradient buffer without room for the flags"
            out = whole
            if room:  # the flags ride after the gradient, in the same all-reduce
                _grad_presence.write_flags(got, out[numel:])
            pending.own_flags = not room  # no other rank: this rank's flags are the answer
            shard_world = handle.group_size

            def collective(async_op: bool) -> Optional[_collectives.Waitable]:
                return _collectives.all_reduce(whole, group, dist.ReduceOp.SUM, async_op) if shard_world > 1 else None

        elif p2p:  # gloo: the flags end every chunk's pieces
            flag = _grad_presence.flags(got, rdtype, handle.device)
            out = torch.empty(numel + flag.numel(), dtype=rdtype, device=handle.device)
            full = _grad_presence.with_presence(send, handle.layout.world_size, flag)
            send = [*send, flag]

            def collective(async_op: bool) -> Optional[_collectives.Waitable]:
                return _collectives.reduce_scatter(out, full, group, async_op, writable)

        else:  # the flat gradient as it is, then (on the CPU) the flags by a small all-reduce on the same stream
            assert len(send) == 1
            out = torch.empty(numel + (len(got) if device_flags else 0), dtype=rdtype, device=handle.device)
            reduced, flags = out[:numel], out[numel:]
            grad = send[0]
            if device_flags and not rides:
                _grad_presence.write_flags(got, flags)

            def collective(async_op: bool) -> Optional[_collectives.Waitable]:
                if custom is not None:
                    scatter = lambda: _custom_comms.reduce_scatter(custom, reduced, grad, group, async_op)  # noqa: E731
                elif rides:
                    return _collectives.reduce_scatter(out, grad, group, async_op)
                else:
                    scatter = lambda: _collectives.reduce_scatter(reduced, grad, group, async_op)  # noqa: E731
                if not device_flags:
                    return scatter()
                return _collectives.in_order(
                    scatter,
                    lambda: _collectives.all_reduce(flags, group, dist.ReduceOp.SUM, async_op),
                )

        pending.out = out
        pending.send = send  # read on the reduce stream (CUDA): kept until the compute stream waited
        if _host_flags.on_host(handle.device) and not (pending.own_flags or pending.partial_only):
            # no device read at the end of backward: [Note: presence flags agreed on the host]
            pending.host_flags = _host_flags.issue(got, group, replicas)
        if stream is None:  # CPU: `wait` divides, all-reduces across replicas and runs the user's hook
            pending.work = _collectives.issue(None, collective, unit=handle.root_fqn)
            return pending
        pending.post_divide = 1  # divided on the reduce stream
        last = replicas is None or all_reduce_stream is None
        unit = handle.root_fqn
        pending.work = _collectives.issue(
            stream, collective, then=lambda: _after_reduce(pending, post, copy_out=last), unit=unit
        )
        if not last:
            assert replicas is not None and all_reduce_stream is not None
            pending.replica = _collectives.issue(
                all_reduce_stream,
                lambda async_op: _collectives.all_reduce(out, replicas, dist.ReduceOp.SUM, async_op),
                after=stream,
                then=lambda: _after_reduce(pending, 1, copy_out=True),
                unit=unit,
            )
            pending.replicate_group = None  # issued
    return pending


def _after_reduce(pending: "PendingReduce", divide: float, copy_out: bool) -> None:
    """On the side stream, once the reduced value is final: divide, run the user's all-reduce hook,
    and start its copy to the host."""
    if divide != 1:
        pending.out.div_(divide)
    pending.add_partial()
    if copy_out:
        _run_hook(pending)
        pending.host = offload_copy(pending.handle, pending.out)


def _run_hook(pending: "PendingReduce") -> None:
    """The user's all-reduce hook, once, on the final reduced shard gradient (in place)."""
    hook, pending.hook = pending.hook, None
    if hook is not None:  # the gradient only, not the presence flags after it
        hook(pending.out[: pending.numel] if pending.numel else pending.out)


def finish_all(reductions: "list[PendingReduce]", handles: "list[FlatParamHandle]") -> None:
    """End of a step: the compute stream waits for every reduction's last collective, the host for
    the offload copies, once, and for the flags summed on the host (off the CPU); the flags of units
    where this rank lacked a gradient are read at once on the CPU."""
    for reduction in reductions:
        reduction.finish()
    sync_offload_copies(reductions, handles)
    on_host = [(r, r.host_flags) for r in reductions if r.host_flags is not None]
    _host_flags.finish_many([summed for _, summed in on_host])
    for reduction, summed in on_host:
        reduction.present = _host_flags.present(summed)
    unknown = [r for r in reductions if _reads_flags(r)]
    flags = [(r.host if r.host is not None else r.out)[r.numel :] for r in unknown]
    for reduction, present in zip(unknown, _grad_presence.present_of_many(flags)):
        reduction.present = present


def _reads_flags(r: "PendingReduce") -> bool:
    """Its commit needs the reduced flags: this rank lacked a gradient (else nothing is read), and
    they were not summed on the host."""
    return not (r.partial_only or r.own_flags or r.got is None or all(r.got) or r.host_flags is not None)


def _partial_only(handle: FlatParamHandle) -> bool:
    """A partial sum kept apart from the replicas' all-reduce (``set_requires_all_reduce(False)``)."""
    return handle.replicate_group is not None and not handle.switches.all_reduce_grads


@dataclass(eq=False)
class PendingReduce:
    """A gradient reduction: `wait` finishes the collective (and divides); `finish` also the
    all-reduce across replicas; `commit` adds the result into the sharded gradient once the backward
    has succeeded."""

    handle: FlatParamHandle
    work: _collectives.InFlight
    out: torch.Tensor
    send: list[torch.Tensor]  # kept alive until the collective completes
    replicate_group: Optional[dist.ProcessGroup] = None  # CPU: all-reduce across it, issued in `wait`
    post_divide: float = 1
    done: bool = False
    # HYBRID_SHARD: the all-reduce across replicas in flight (CUDA: issued with the reduce-scatter;
    # CPU: by `wait`, once the reduce-scatter is done); `finish` waits for it
    replica: Optional[_collectives.InFlight] = None
    host: Optional[torch.Tensor] = None  # CUDA + CPU offload: the pinned copy of the result
    partial_only: bool = False  # not all-reduced across replicas: committed to ``grads.partial``
    partial_added: bool = False
    hook: Optional[Callable[[torch.Tensor], None]] = None  # the user's all-reduce hook, until it ran
    numel: int = 0  # of ``out``: the gradient; after it, the reduced flags of which parameters got one
    got: Optional[list[bool]] = None  # this rank's flags (None: unknown, all count as present)
    own_flags: bool = False  # no other rank: ``got`` is the answer, no reduced flags follow ``numel``
    present: Optional[list[bool]] = None  # read by `finish_all` (None: all present, or not read there)
    host_flags: Optional[_host_flags.HostFlags] = None  # off the CPU: the flags summed on the host

    @_trace.method("finish_reduce", "out", unit=lambda self: self.handle.unit_fqn)
    def wait(self) -> None:
        if self.done:
            return
        unit = self.handle.unit_fqn or "<root>"
        kind = "all-reduce" if self.handle.layout.world_size == 1 else "reduce-scatter"
        self.done = True
        self.work.wait(f"the gradient {kind} of unit '{unit}'")
        # the reduction's input goes now: HYBRID_SHARD's all-reduce across replicas reads the output only
        # (keeping it to the end of backward held a whole unsharded gradient per unit, as FSDP2 does not)
        self.send = []
        if self.post_divide != 1:
            self.out.div_(self.post_divide)
        self.add_partial()
        if self.replicate_group is not None:
            # HYBRID_SHARD on the CPU: the shard's sum over replicas is issued now and left in flight, so
            # it overlaps the next units' backward; `finish` waits for it (the end of backward)
            group, self.replicate_group = self.replicate_group, None
            with for_unit(self.handle.root_fqn):
                self.replica = _collectives.InFlight(work=_collectives.all_reduce(self.out, group))
        if self.replica is None:  # nothing more in flight (CUDA: `_after_reduce` ran it on the last stream)
            _run_hook(self)

    def finish(self) -> None:
        """`wait`, and then for the all-reduce across replicas (the compute stream on CUDA; where FSDP2
        waits for it: at the end of backward, or when the step is abandoned)."""
        self.wait()
        if self.replica is not None:
            replica, self.replica = self.replica, None
            replica.wait(f"the gradient all-reduce across replicas of unit '{self.handle.unit_fqn or '<root>'}'")
            self.send = []
            _run_hook(self)  # CPU: once the all-reduce across replicas is done (CUDA: it already ran)

    def add_partial(self) -> None:
        """Before the all-reduce across replicas: add the shards earlier backwards kept apart
        (``set_requires_all_reduce(False)``); the kept sum itself stays until `commit`."""
        partial = self.handle.grads.partial
        if partial is not None and not self.partial_only and not self.partial_added:
            self.out.add_(partial)
            self.partial_added = True

    def commit(self) -> None:
        """Add the reduced shard into ``flat_param.grad`` (or, not all-reduced, into the partial sum);
        the kept ``no_sync`` sum and partial sum it included go."""
        self.finish()
        handle = self.handle
        grads = handle.grads
        grads.kept = None
        grads.kept_got = None
        _set_state(handle, GradState.NONE)
        if self.partial_only:
            grads.partial = self.out if grads.partial is None else grads.partial.add_(self.out)
            return
        if self.partial_added:
            grads.partial = None
        reduced = self.host if self.host is not None else self.out
        flags = reduced[self.numel :] if _reads_flags(self) and self.present is None else None  # not read yet
        present = self.present if self.present is not None else _grad_presence.present(self.got, flags)
        accumulate_sharded_grad(handle, reduced[: self.numel], present)


def _plus_kept(handle: FlatParamHandle, flat: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``flat`` plus the ``no_sync`` sum, in the sum's dtype: the reduce dtype, as FSDP2 accumulates."""
    if flat.dtype == kept.dtype:
        return flat.add_(kept)
    return torch.add(kept, flat, out=inputs.grad_buffer(handle, kept.dtype, zero=False))


def commit_staged(handle: FlatParamHandle) -> None:
    """End of a ``no_sync`` backward: add the staged gradient to the kept sum (in the reduce dtype)."""
    grads = handle.grads
    staged, grads.buffer = grads.buffer, None
    assert staged is not None
    if grads.kept is None:
        grads.kept = staged.to(handle.reduce_dtype)
    else:
        grads.kept.add_(staged)
    grads.kept_got, grads.staged_got = _grad_presence.union(grads.kept_got, grads.staged_got), None
    _set_state(handle, GradState.KEPT_FOR_NO_SYNC)


def abort(handle: FlatParamHandle) -> None:
    """Drop everything this backward produced for the unit (its reduction, if any, was waited for
    by the caller); keep what completed micro-batches accumulated under ``no_sync``."""
    grads = handle.grads
    if grads.in_backward():
        for param in handle.params:
            param.grad = None
    grads.buffer = None
    grads.views = None
    grads.staged_got = None
    grads.touched[:] = []
    if grads.kept is None:
        grads.kept_got = None
    back = GradState.KEPT_FOR_NO_SYNC if grads.kept is not None else GradState.NONE
    if grads.state is not back:
        _set_state(handle, back)
