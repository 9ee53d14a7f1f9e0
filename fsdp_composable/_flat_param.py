"""`FlatParameter` and `FlatParamHandle`: flatten, shard, unshard and reshard one unit's parameters.

[Note: original parameters are views]
A unit's original parameters are concatenated into one 1-D tensor, padded to a multiple of the
world size, and each rank keeps its contiguous 1/N shard in a `FlatParameter`. The original
``nn.Parameter`` objects are never replaced: we only repoint their ``.data``.

- sharded: each original parameter is a 1-D view of its slice of the local shard (possibly empty),
  so the optimizer steps original parameters in place and writes through to the shard.
- unsharded: each original parameter is a view, with its original shape, into the padded unsharded
  buffer that the all-gather wrote (no copy-out).

Because the parameter objects stay the same, autograd's saved tensors and gradient accumulators
survive every transition: backward reads ``param.data`` after the pre-backward unshard has
repointed it. Reshard frees the unsharded buffer's storage (``resize_(0)``) and unshard regrows the
same storage, so any view autograd saved of it is valid again once the all-gather lands.

[Note: gradients land in the flat buffer]
Two ways, chosen by what the reduction can send (`_collectives.point_to_point`):
- NCCL and other backends reduce one flat tensor. Before a unit's backward we point each trainable
  original parameter's ``.grad`` at a view of one zeroed, padded, unsharded gradient buffer;
  autograd accumulates in place into it, and it is exactly the reduce-scatter input: no
  gather-into-flat copy. A gradient autograd created some other way (the user replaced ``.grad``)
  is copied in before the reduction.
- gloo (our point-to-point exchange) sends any list of pieces. ``.grad`` is left to autograd, which
  allocates each gradient when it is produced (no zero fill, no read-modify-write accumulation),
  and post-backward hands the gradients themselves, plus a zero tail for the padding, to
  `_collectives.reduce_scatter`. So a unit's gradient memory grows parameter by parameter during its
  backward instead of being allocated whole at its start.
Units reduced in the final callback (their trigger never fires) take autograd's gradients on any
backend (nothing could be reduced before the end of backward, so there is no point holding a buffer
through it); on NCCL they are added into the flat buffer there. So are ``no_sync`` micro-batches'
gradients, into the buffer that the next backward keeps accumulating into.
On CUDA every tensor a collective reads is made on the compute stream before it is issued
([Note: streams without record_stream]), which is why only CPU tensors on gloo are sent in parts.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_composable import _collectives, _trace
from fsdp_composable._common_utils import FSDP_FLATTENED, UnitConfig, _check_transition
from fsdp_composable.api import ShardingStrategy

__all__ = ["FlatParameter", "FlatParamHandle", "HandleTrainingState", "ParamInfo"]

FLAT_PARAM_NAME = "_flat_param"


class HandleTrainingState(enum.Enum):
    """What one unit's handle is doing; transitions are checked."""

    IDLE = enum.auto()
    FORWARD = enum.auto()
    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()
    SUMMON_FULL_PARAMS = enum.auto()


_H = HandleTrainingState
_HANDLE_TRANSITIONS: dict[Any, frozenset[Any]] = {
    _H.IDLE: frozenset({_H.FORWARD, _H.BACKWARD_PRE, _H.SUMMON_FULL_PARAMS}),
    _H.FORWARD: frozenset({_H.IDLE}),
    _H.BACKWARD_PRE: frozenset({_H.BACKWARD_POST, _H.IDLE}),
    _H.BACKWARD_POST: frozenset({_H.IDLE}),
    _H.SUMMON_FULL_PARAMS: frozenset({_H.IDLE}),
}


@dataclass(frozen=True)
class ParamInfo:
    """One original parameter of a unit. ``holders`` lists every (module, attribute, FQN) that
    registers it: more than one for tied parameters. FQNs are relative to the unit's module."""

    fqn: str
    shape: torch.Size
    numel: int
    offset: int
    holders: tuple[tuple[nn.Module, str, str], ...]


@dataclass(frozen=True)
class FlatLayout:
    """Where each original parameter lives in the flat parameter, and how it is sharded."""

    infos: tuple[ParamInfo, ...]
    unpadded_numel: int
    padded_numel: int
    shard_numel: int
    rank: int
    world_size: int

    def shard_range(self, info: ParamInfo) -> tuple[int, int]:
        """``info``'s slice of this rank's shard, as [start, end) offsets into the shard."""
        lo = self.rank * self.shard_numel
        start = min(max(info.offset - lo, 0), self.shard_numel)
        end = min(max(info.offset + info.numel - lo, 0), self.shard_numel)
        return start, max(start, end)


class FlatParameter(nn.Parameter):
    """This rank's 1-D shard of a unit's flattened, padded original parameters.

    Test for it with ``type(p) is FlatParameter``: other tensor subclasses that are parameters make
    ``isinstance`` true for any parameter subclass.
    """


def _build_layout(
    params: list[nn.Parameter], holders: list[list[tuple[nn.Module, str, str]]], rank: int, world_size: int
) -> FlatLayout:
    infos = []
    offset = 0
    for param, param_holders in zip(params, holders):
        infos.append(ParamInfo(param_holders[0][2], param.shape, param.numel(), offset, tuple(param_holders)))
        offset += param.numel()
    padded = max(math.ceil(offset / world_size) * world_size, world_size)
    return FlatLayout(tuple(infos), offset, padded, padded // world_size, rank, world_size)


class FlatParamHandle:
    """Owns one unit's flat parameter, its unsharded buffer and gradient buffer, and their transitions.

    The runtime decides *when* (`_runtime_utils`); the handle knows *how*.
    """

    def __init__(
        self,
        module: nn.Module,
        unit_fqn: str,
        params: list[nn.Parameter],
        holders: list[list[tuple[nn.Module, str, str]]],
        process_group: dist.ProcessGroup,
        config: UnitConfig,
        device: torch.device,
        replicate_group: Optional[dist.ProcessGroup] = None,
        name: str = "_flat_param",
    ) -> None:
        self.module = module
        # the attribute the flat parameter is registered under on ``module`` when a wrapper exposes
        # flat parameters, and its key in LOCAL state dicts
        self.name = name
        self.replicate_group = replicate_group
        self.unit_fqn = unit_fqn
        self.params = params
        self.process_group = process_group
        self.config = config
        self.device = device
        # CPUOffload: the shard, its gradient and the optimizer live on the CPU; compute stays on `device`
        self.shard_device = torch.device("cpu") if config.offload_params else device
        self.training_state = HandleTrainingState.IDLE
        sharded = config.strategy is not ShardingStrategy.NO_SHARD
        rank, world = (dist.get_rank(process_group), dist.get_world_size(process_group)) if sharded else (0, 1)
        self.layout = _build_layout(params, holders, rank, world)
        self.dtype = params[0].dtype if params else torch.float32
        mp = config.mixed_precision
        self.compute_dtype = (mp.param_dtype if mp and mp.param_dtype else None) or self.dtype
        self.reduce_dtype = (mp.reduce_dtype if mp and mp.reduce_dtype else None) or self.compute_dtype
        self.flat_param = self._flatten_and_shard()
        self.requires_grad = any(p.requires_grad for p in params)
        # The all-gather writes straight into the padded buffer the original parameters view, unless
        # there is nothing to gather or cast (NO_SHARD in full precision): then the shard is the whole.
        self._needs_buffer = sharded or self.compute_dtype != self.dtype or self.shard_device != device
        self._unsharded: Optional[torch.Tensor] = None
        self._unsharded_views: list[torch.Tensor] = []
        self._sharded_views: list[torch.Tensor] = []
        self._grad_buffer: Optional[torch.Tensor] = None
        self._grad_views: list[torch.Tensor] = []
        self._lazy_grads = False  # see prepare_gradient_buffer
        self._grads_pending = False
        self._sharded_grad_views: list[torch.Tensor] = []
        self._unshard_work: Optional[_collectives.InFlight] = None
        self._unshard_src: Optional[torch.Tensor] = None  # the all-gather input, alive until it is done
        # CUDA side streams for all-gathers and gradient reductions (set at lazy init; None on CPU)
        self.unshard_stream: Optional[torch.cuda.Stream] = None
        self.reduce_stream: Optional[torch.cuda.Stream] = None
        self.is_unsharded = False
        self.expose_orig_grads = True
        # per-backward bookkeeping, reset by the final callback
        self.ran_pre_backward = False
        self.pending_triggers = 0
        self.untriggered_calls = 0
        # the handles of the same unit (one per dtype/requires_grad group), this one included
        self.siblings: list[FlatParamHandle] = [self]
        self._init_views()
        self.use_sharded_views()

    # ---------------------------------------------------------------- construction
    def _flatten_and_shard(self) -> FlatParameter:
        layout = self.layout
        with torch.no_grad():
            pieces = [p.detach().reshape(-1).to(self.device) for p in self.params]
            pad = layout.padded_numel - layout.unpadded_numel
            pieces.append(torch.zeros(pad, dtype=self.dtype, device=self.device))
            flat = torch.cat(pieces)
            lo = layout.rank * layout.shard_numel
            shard = flat[lo : lo + layout.shard_numel].clone().to(self.shard_device)
            if self.shard_device != self.device and torch.cuda.is_available():
                shard = shard.pin_memory()  # lets the host-to-device copy of unshard run asynchronously
        flat_param = FlatParameter(shard, requires_grad=any(p.requires_grad for p in self.params))
        for param, info in zip(self.params, self.layout.infos):
            setattr(param, FSDP_FLATTENED, True)
            param._fsdp_fqn = f"{self.unit_fqn}.{info.fqn}" if self.unit_fqn else info.fqn  # type: ignore[attr-defined]
        return flat_param

    def _init_views(self) -> None:
        layout = self.layout
        shard = self.flat_param.data
        keep_shape = layout.world_size == 1
        self._sharded_views = []
        for info in layout.infos:
            start, end = layout.shard_range(info)
            view = shard[start:end]
            self._sharded_views.append(view.view(info.shape) if keep_shape else view)
        if self._needs_buffer:
            self._unsharded = torch.empty(layout.padded_numel, dtype=self.compute_dtype, device=self.device)
            self._unsharded_views = self._views_of(self._unsharded)
            self._free_unsharded()
        else:
            self._unsharded_views = list(self._sharded_views)

    def _views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[i.offset : i.offset + i.numel].view(i.shape) for i in self.layout.infos]

    # ---------------------------------------------------------------- state machine
    def set_training_state(self, new: HandleTrainingState) -> None:
        _check_transition(
            "HandleTrainingState",
            f"unit '{self.unit_fqn or '<root>'}'",
            self.training_state,
            new,
            _HANDLE_TRANSITIONS,
        )
        self.training_state = new

    # ---------------------------------------------------------------- views
    def _point_params_at(self, views: list[torch.Tensor]) -> None:
        for param, view in zip(self.params, views):
            param.data = view

    def use_sharded_views(self) -> None:
        self._point_params_at(self._sharded_views)

    def use_unsharded_views(self) -> None:
        self._point_params_at(self._unsharded_views)

    # ---------------------------------------------------------------- unshard / reshard
    @property
    def unshard_in_flight(self) -> bool:
        return self._unshard_work is not None

    @_trace.method("unshard", "_unsharded")
    def unshard(self) -> None:
        """Start gathering (and casting) the full flat parameter; `wait_unshard` finishes it."""
        if self.is_unsharded or self._unshard_work is not None or not self._needs_buffer:
            return
        assert self._unsharded is not None
        self._alloc_unsharded()
        shard = self.flat_param.data
        if self.layout.world_size == 1:
            self._unsharded.copy_(shard)
            self.is_unsharded = True
            return
        src = shard.to(self.device, non_blocking=True) if shard.device != self.device else shard
        src = src if src.dtype == self.compute_dtype else src.to(self.compute_dtype)
        self._unshard_src = src
        unsharded = self._unsharded
        self._unshard_work = _collectives.issue(
            self.unshard_stream, lambda: _collectives.all_gather(unsharded, src, self.process_group)
        )

    @_trace.method("wait_unshard")
    def wait_unshard(self) -> None:
        """Finish a pending unshard and point the original parameters at the unsharded views."""
        if self._unshard_work is not None:
            self._finish_unshard()
            self.is_unsharded = True
        elif not self._needs_buffer:
            self.is_unsharded = True
        if not self.is_unsharded:
            self.unshard()
            self.wait_unshard()
            return
        self.use_unsharded_views()

    @_trace.method("reshard", "_unsharded")
    def reshard(self) -> None:
        """Point the original parameters back at the shard and free the unsharded storage."""
        if self._unshard_work is not None:  # never free memory a collective is still writing
            self._finish_unshard()
        self.use_sharded_views()
        if self._needs_buffer:
            self._free_unsharded()
        self.is_unsharded = False

    def _finish_unshard(self) -> None:
        assert self._unshard_work is not None
        work, self._unshard_work = self._unshard_work, None
        work.wait(f"the all-gather of unit '{self.unit_fqn or '<root>'}'")
        self._unshard_src = None

    def _alloc_unsharded(self) -> None:
        assert self._unsharded is not None
        storage = self._unsharded.untyped_storage()
        nbytes = self._unsharded.numel() * self._unsharded.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)

    def _free_unsharded(self) -> None:
        assert self._unsharded is not None
        self._unsharded.untyped_storage().resize_(0)

    # ---------------------------------------------------------------- gradients
    def stash_sharded_grads(self) -> None:
        """Fold what the user left in the original parameters' ``.grad`` into the sharded gradient.

        Between steps ``.grad`` is a view of the sharded gradient; ``zero_grad(set_to_none=True)``
        sets it to None, and a user may assign a tensor of its own. Called before a backward
        repoints ``.grad`` at the unsharded gradient buffer.
        """
        if not self.expose_orig_grads:
            return
        grads = [p.grad for p in self.params]
        ours = self._sharded_grad_views
        if all(g is None for g in grads):
            self.flat_param.grad = None
        elif not (len(ours) == len(grads) and all(g is v for g, v in zip(grads, ours))):
            flat_grad = self.flat_param.grad
            if flat_grad is None:
                flat_grad = torch.zeros_like(self.flat_param)
            views = self._sharded_views_of(flat_grad)
            with torch.no_grad():
                for i, (grad, view) in enumerate(zip(grads, views)):
                    mine = ours[i] if ours else None
                    if grad is None:
                        view.zero_()
                    elif grad is not mine:
                        view.copy_(grad.reshape(view.shape))
            self.flat_param.grad = flat_grad
        for param in self.params:
            param.grad = None
        self._sharded_grad_views = []

    def release_cleared_grads(self) -> None:
        """Free the sharded gradient as soon as the user cleared every ``.grad`` we exposed
        (``zero_grad(set_to_none=True)``), rather than at this unit's next backward."""
        if self._sharded_grad_views and all(p.grad is None for p in self.params):
            self.flat_param.grad = None
            self._sharded_grad_views = []

    def _sharded_views_of(self, flat_shard: torch.Tensor) -> list[torch.Tensor]:
        keep_shape = self.layout.world_size == 1
        out = []
        for info in self.layout.infos:
            start, end = self.layout.shard_range(info)
            view = flat_shard[start:end]
            out.append(view.view(info.shape) if keep_shape else view)
        return out

    def prepare_gradient_buffer(self, lazy: bool = False) -> None:
        """Point each trainable parameter's ``.grad`` at a zeroed unsharded gradient buffer.

        ``lazy``: the unit reduces only at the end of backward (its post-backward trigger cannot
        run, e.g. the root, whose inputs are token ids). Allocating its whole buffer now would hold it
        through the memory peak at the start of backward; instead autograd allocates each gradient
        as it is produced and `_collect_gradients` folds them into the buffer at the end."""
        self._lazy_grads = lazy
        if lazy:
            self._grads_pending = True
            return
        self._ensure_grad_buffer()
        for param, view in zip(self.params, self._grad_views):
            if param.requires_grad:
                param.grad = view

    def _ensure_grad_buffer(self) -> torch.Tensor:
        if self._grad_buffer is None:
            self._grad_buffer = torch.zeros(self.layout.padded_numel, dtype=self.compute_dtype, device=self.device)
            self._grad_views = self._views_of(self._grad_buffer)
        return self._grad_buffer

    def _collect_gradients(self) -> torch.Tensor:
        """Gather every unsharded gradient into the buffer and detach it from the parameters.

        A gradient that is not a view of the buffer was allocated by autograd (lazy mode: added, so
        ``no_sync`` micro-batches sum) or assigned by the user (copied)."""
        buffer = self._ensure_grad_buffer()
        with torch.no_grad():
            for param, view in zip(self.params, self._grad_views):
                grad = param.grad
                if grad is not None and grad is not view:
                    view.add_(grad) if self._lazy_grads else view.copy_(grad)
                param.grad = None
        self._grads_pending = False
        return buffer

    def keep_gradient_buffer(self) -> None:
        """Detach the unsharded gradient buffer from the parameters but keep it for the next backward
        (``no_sync``), and show the user the sharded gradient again."""
        self._collect_gradients()
        self.expose_sharded_grads()

    def discard_gradient_buffer(self) -> None:
        """Drop a partially filled unsharded gradient buffer (after a failed backward)."""
        if self._grad_buffer is not None or self._grads_pending:
            for param in self.params:
                param.grad = None
            self._grad_buffer = None
            self._grad_views = []
            self._grads_pending = False
            self.expose_sharded_grads()

    def has_gradient_buffer(self) -> bool:
        return self._grad_buffer is not None or self._grads_pending

    @property
    def takes_autograd_grads(self) -> bool:
        """Whether backward leaves gradients where autograd puts them, to be sent piece by piece
        (see [Note: gradients land in the flat buffer])."""
        return self.layout.world_size > 1 and _collectives.point_to_point(self.process_group, self.device)

    @_trace.method("reduce")
    def start_reduce(self) -> "PendingReduce":
        """Issue the gradient reduction asynchronously and release the parameters' unsharded grads."""
        world = dist.get_world_size(self.process_group) * self.replicas
        if self._lazy_grads and self._grad_buffer is None and self.takes_autograd_grads:
            return self._start_reduce_parts(world)
        buffer = self._collect_gradients()
        with torch.no_grad():
            send = buffer if buffer.dtype == self.reduce_dtype else buffer.to(self.reduce_dtype)
            if world > 1:
                send.div_(world)  # pre-divide: exact for powers of two, no overflow in low precision
            if self.layout.world_size == 1:
                shard_world = dist.get_world_size(self.process_group)
                group = self.process_group
                work = _collectives.issue(
                    self.reduce_stream, lambda: _collectives.all_reduce(send, group) if shard_world > 1 else None
                )
                out = send
            else:
                out = torch.empty(self.layout.shard_numel, dtype=self.reduce_dtype, device=self.device)
                group, output = self.process_group, out
                work = _collectives.issue(self.reduce_stream, lambda: _collectives.reduce_scatter(output, send, group))
        self._grad_buffer = None
        self._grad_views = []
        return PendingReduce(self, work, out, [send], self.replicate_group)

    def _start_reduce_parts(self, world: int) -> "PendingReduce":
        """Reduce autograd's own gradients without gathering them into a flat buffer first."""
        # fp16 overflows where the sum of N gradients is large: divide before summing, as above
        pre_divide = self.reduce_dtype == torch.float16
        with torch.no_grad():
            parts = []
            for param, info in zip(self.params, self.layout.infos):
                grad, param.grad = param.grad, None
                if grad is None:  # unused in this backward: zero, as for every other unit
                    part = torch.zeros(info.numel, dtype=self.reduce_dtype, device=self.device)
                else:
                    part = grad.reshape(-1).to(self.reduce_dtype)
                    part = part / world if pre_divide else part
                parts.append(part)
            padding = self.layout.padded_numel - self.layout.unpadded_numel
            if padding:
                parts.append(torch.zeros(padding, dtype=self.reduce_dtype, device=self.device))
            out = torch.empty(self.layout.shard_numel, dtype=self.reduce_dtype, device=self.device)
            group = self.process_group
            work = _collectives.issue(self.reduce_stream, lambda: _collectives.reduce_scatter(out, parts, group))
        self._grads_pending = False
        divide = 1 if pre_divide else world
        return PendingReduce(self, work, out, parts, self.replicate_group, divide)

    @property
    def replicas(self) -> int:
        return dist.get_world_size(self.replicate_group) if self.replicate_group is not None else 1

    def accumulate_sharded_grad(self, reduced: torch.Tensor) -> None:
        """Add a reduced shard gradient to the flat parameter's ``.grad`` and expose views of it.

        The gradient is cast back to the parameter dtype unless ``keep_low_precision_grads``. With
        CPU offload it is copied to the host *blocking*: the optimizer steps on the CPU right after
        backward and must never read a partially copied gradient (NO_SHARD made this race visible).
        """
        mp = self.config.mixed_precision
        dtype = reduced.dtype if mp is not None and mp.keep_low_precision_grads else self.dtype
        grad = reduced.to(device=self.shard_device, dtype=dtype, non_blocking=False)
        flat_grad = self.flat_param.grad
        if flat_grad is None or flat_grad.dtype != grad.dtype:
            _assign_grad(self.flat_param, grad)
        else:
            flat_grad.add_(grad)
        self.expose_sharded_grads()

    def expose_sharded_grads(self) -> None:
        flat_grad = self.flat_param.grad
        if not self.expose_orig_grads or flat_grad is None:
            return
        self._sharded_grad_views = self._sharded_views_of(flat_grad)
        for param, view in zip(self.params, self._sharded_grad_views):
            if param.requires_grad:
                _assign_grad(param, view)


def _assign_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Set ``param.grad``, also when ``grad``'s dtype differs (``keep_low_precision_grads``).

    Autograd only checks dtype/shape when ``.grad`` is assigned, so for a low-precision gradient we
    point ``.data`` at the gradient for the assignment and then restore it."""
    if grad.dtype == param.dtype:
        param.grad = grad
        return
    data = param.data
    param.data = grad
    param.grad = grad
    param.data = data


@dataclass
class PendingReduce:
    """A gradient reduction in flight: wait for ``work``, then accumulate ``out`` into the shard."""

    handle: FlatParamHandle
    work: _collectives.InFlight
    out: torch.Tensor
    send: list[torch.Tensor]  # kept alive until the collective completes
    replicate_group: Optional[dist.ProcessGroup] = None
    divide: int = 1  # by the world size here when the input was not pre-divided

    @_trace.method("finish_reduce", "out", unit=lambda self: self.handle.unit_fqn)
    def finish(self) -> None:
        unit = self.handle.unit_fqn or "<root>"
        kind = "all-reduce" if self.handle.layout.world_size == 1 else "reduce-scatter"
        self.work.wait(f"the gradient {kind} of unit '{unit}'")
        self.send = []
        if self.divide > 1:
            self.out.div_(self.divide)
        if self.replicate_group is not None:  # HYBRID_SHARD: the shard's sum over replicas
            work = _collectives.all_reduce(self.out, self.replicate_group)
            _collectives.wait(work, f"the gradient all-reduce across replicas of unit '{unit}'")
        self.handle.accumulate_sharded_grad(self.out)
