"""`FlatParameter` and `FlatParamHandle`: flatten, shard, unshard and reshard one unit's parameters.

[Note: original parameters are views]
A unit's original parameters are cut into dim-0 chunks and laid out in one rank-major flat
parameter, of which each rank keeps its shard ([Note: rank-major flat shards] in `_rank_major`). The
original ``nn.Parameter`` objects are never replaced: we only repoint their ``.data``.

- sharded: each original parameter is a 1-D view of its chunk in the local shard (possibly empty),
  and its modules register its face instead ([Note: parameter faces]), a ``DTensor`` viewing the same
  chunk, which the optimizer steps in place, writing through to the shard.
- unsharded: each original parameter is a view, with its original shape, into the front of its
  region of the param-major unsharded buffer, which the all-gather fills: directly where both orders
  are one tensor or gloo moves each chunk where it goes, else through one copy-out ([Note: moving
  chunks]).

Because the parameter objects stay the same, autograd's saved tensors and gradient accumulators
survive every transition: backward reads ``param.data`` after the pre-backward unshard has
repointed it. Reshard frees the unsharded buffer's storage (``resize_(0)``) and unshard regrows the
same storage, so any view autograd saved of it is valid again once the all-gather lands.

A unit's gradients are not the handle's concern: see `_reduce_utils` ([Note: the gradient
lifecycle], [Note: gradients land in the flat buffer]); the handle only provides the views.
"""

from __future__ import annotations

import enum
from typing import NoReturn, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from fsdp_composable._base._copy_guard import refusal, refuse_copies
from fsdp_composable._base._grad_records import UnitGrads
from fsdp_composable._base._state_machine import Transitions, check_transition
from fsdp_composable._base._strides import contiguous_strides
from fsdp_composable._base._unit_switches import UnitSwitches
from fsdp_composable._comm import _collectives, _custom_comms, _trace
from fsdp_composable._comm._tensor_parallel import face_spec_2d, local_of, mesh_2d, point_at
from fsdp_composable._config import UnitConfig
from fsdp_composable._flat._extensions import ExtensionParams, is_extension
from fsdp_composable._flat._faces import face_mesh, face_spec, face_value, grad_face, make_face, repoint_face
from fsdp_composable._flat._rank_major import FlatLayout, ParamInfo
from fsdp_composable._flat._rank_major import build_layout as _build_layout

__all__ = ["FlatLayout", "FlatParameter", "FlatParamHandle", "HandleTrainingState", "ParamInfo"]

FLAT_PARAM_NAME = "_flat_param"

# Attribute set on every original parameter that a unit manages, so that a later call (manual
# nesting) or another composable API never flattens it twice.
FSDP_FLATTENED = "_fsdp_flattened"


class HandleTrainingState(enum.Enum):
    """What one unit's handle is doing; transitions are checked."""

    IDLE = enum.auto()
    FORWARD = enum.auto()
    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()
    SUMMON_FULL_PARAMS = enum.auto()

    __hash__ = object.__hash__  # members are singletons: see `_state_machine`


_H = HandleTrainingState
_HANDLE_TRANSITIONS: Transitions = {
    _H.IDLE: frozenset({_H.FORWARD, _H.BACKWARD_PRE, _H.SUMMON_FULL_PARAMS}),
    _H.FORWARD: frozenset({_H.IDLE}),
    _H.BACKWARD_PRE: frozenset({_H.BACKWARD_POST, _H.IDLE}),
    _H.BACKWARD_POST: frozenset({_H.IDLE}),
    _H.SUMMON_FULL_PARAMS: frozenset({_H.IDLE}),
}


# where a reshard defers freeing the unsharded storage on CUDA (see `FlatParamHandle._free_unsharded`)
_IN_STEP = frozenset({_H.FORWARD, _H.BACKWARD_PRE, _H.BACKWARD_POST})


class FlatParameter(nn.Parameter):
    """This rank's 1-D shard of a unit's flattened, padded original parameters.

    Test for it with ``type(p) is FlatParameter``: other tensor subclasses that are parameters make
    ``isinstance`` true for any parameter subclass.
    """


class FlatParamHandle:
    """Owns one unit's flat parameter, its unsharded buffer, and their transitions.

    The runtime decides *when* (`_runtime_utils`); the handle knows *how*. Its gradients are
    ``grads``, driven by `_reduce_utils`; its per-step counters and the side streams its collectives
    run on belong to the root context (see [Note: the root context]). Its process groups are given at
    construction and never change: they define its layout (rank, world size) and its collectives.
    """

    grads: "UnitGrads"  # set by `_reduce_utils.init_grads` when the state is built

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
        # tensor-subclass parameters that define their own all-gather stay beside the flat parameter:
        # [Note: extension parameters]
        extension = [is_extension(p) for p in params]
        ext_params = [p for p, e in zip(params, extension) if e]
        ext_holders = [h for h, e in zip(holders, extension) if e]
        params = [p for p, e in zip(params, extension) if not e]
        holders = [h for h, e in zip(holders, extension) if not e]
        # every module of the unit: ``(module,)``, or the list given to fully_shard([m1, m2]) (see
        # [Note: several modules as one unit] in `_group_units`)
        self.members: tuple[nn.Module, ...] = (module,)
        # the attribute the flat parameter is registered under on ``module`` when a wrapper exposes
        # flat parameters, and its key in LOCAL state dicts
        self.name = name
        self.replicate_group = replicate_group
        self.unit_fqn = unit_fqn
        # the unit's FQN from its root's module, for messages and headers: set at the root's lazy init
        # (unit_fqn is relative to the module fully_shard was called on: "" for a unit sharded by hand)
        self.root_fqn = unit_fqn or f"<{type(module).__name__}>"
        self.params = params
        self.process_group = process_group
        self.config = config
        self.device = device
        # CPUOffload: the shard, its gradient and the optimizer live on the CPU; compute stays on `device`
        self.shard_device = config.shard_device(device)
        self.training_state = HandleTrainingState.IDLE
        # what the per-module controls flip: [Note: per-unit switches]
        self.switches: UnitSwitches[FlatParamHandle] = UnitSwitches()
        sharded = config.sharded
        # the groups never change: their sizes are asked of torch once (each ask costs microseconds)
        self._group_size = dist.get_world_size(process_group)
        rank, world = (dist.get_rank(process_group), self._group_size) if sharded else (0, 1)
        self._replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self.layout = _build_layout(params, holders, rank, world)
        # derived from the layout, which never changes, so that the views made every step cost one call
        # per parameter: [Note: views made every step]
        self._view_specs = [(i.shape, contiguous_strides(i.shape), i.offset) for i in self.layout.infos]
        self._shard_ranges = [self.layout.shard_range(i) for i in self.layout.infos]
        self.dtype = params[0].dtype if params else torch.float32
        self.compute_dtype = config.compute_dtype(self.dtype)
        self.reduce_dtype = config.reduce_dtype(self.dtype)
        self.flat_param = self._flatten_and_shard()
        self.requires_grad = any(p.requires_grad for p in params + ext_params)
        self.tensor_parallel = any(info.tp is not None for info in self.layout.infos)
        # the model's tensor-parallel group (set by init; None: no tensor parallelism), across which
        # every value that is not a tensor-parallel piece must agree
        self.tp_group: Optional[dist.ProcessGroup] = None
        # The all-gather fills the padded buffer the original parameters view (by parameter: [Note:
        # rank-major flat shards]), unless there is nothing to gather or cast (NO_SHARD in full
        # precision): then the shard is the whole.
        self._needs_buffer = config.needs_unsharded_buffer(self.dtype, device)
        self._unsharded: Optional[torch.Tensor] = None
        # its (world, chunk) region views, which the all-gather writes by parameter (made once)
        self._unsharded_regions: list[torch.Tensor] = []
        self._unsharded_views: list[torch.Tensor] = []
        self._sharded_views: list[torch.Tensor] = []
        # each parameter's DTensor face ([Note: parameter faces]; a tensor-parallel one's: [Note: 2-D faces])
        self.faces: list[nn.Parameter] = []
        self._mesh: Optional[DeviceMesh] = None  # the faces' mesh: the process group's ranks
        self._mesh_2d: Optional[DeviceMesh] = None  # a tensor-parallel unit's (dp, tp) mesh
        self._face_specs: dict[torch.dtype, list[DTensorSpec]] = {}
        self._local_shapes = [self.layout.local_shape(i) for i in self.layout.infos]
        self._local_strides = [contiguous_strides(shape) for shape in self._local_shapes]
        self.registered: list[nn.Parameter] = params  # what the holders register now: faces or params
        self.flat_mode = False  # the wrapper's use_orig_params=False: see `_flat_mode`
        # where each parameter is registered: (the holder's ``_parameters``, attribute) pairs
        self._slots = [[(m._parameters, attr) for m, attr, _ in i.holders] for i in self.layout.infos]
        self._unshard_work: Optional[_collectives.InFlight] = None
        self._unshard_src: Optional[torch.Tensor] = None  # the all-gather input, alive until it is done
        self._alloc_at_wait = False  # the pending unshard allocates the unsharded storage at its wait
        # CUDA: the side stream that allocated the unsharded storage (None: the compute stream), and
        # the event reshard recorded after the storage's last use, set while it is not yet freed
        self._storage_stream: Optional[torch.cuda.Stream] = None
        self._freed_event: Optional[torch.cuda.Event] = None
        # CPU offload: a non-blocking copy of the pinned shard to the device may still read it; the
        # host must not write the shard before the end of step synchronises ([Note: offloaded
        # gradients reach the host] in `_offload_copies`)
        self.upload_pending = False
        self.is_unsharded = False
        # reshard_after_forward=<int>: the group of k consecutive ranks the unit reshards to after
        # forward (set by `_post_forward_group`), and this rank's 1/k of the unsharded flat parameter
        # kept from post-forward to the next unshard (see [Note: resharding to a smaller group])
        self.post_forward_group: Optional[dist.ProcessGroup] = None
        self._post_forward_shard: Optional[torch.Tensor] = None
        self._post_forward_event: Optional[torch.cuda.Event] = None  # CUDA: recorded right after it was made
        self.extensions: Optional[ExtensionParams] = None
        if ext_params:
            self._init_extensions(ext_params, ext_holders)
        self._init_views()
        self.use_sharded_views()

    # ---------------------------------------------------------------- construction
    def __deepcopy__(self, memo: object) -> "FlatParamHandle":
        raise refusal(f"unit '{self.unit_fqn or '<root>'}'")  # see [Note: copying a sharded model]

    def __reduce_ex__(self, protocol: object) -> NoReturn:
        raise refusal(f"unit '{self.unit_fqn or '<root>'}'")

    def _init_extensions(self, params: list[nn.Parameter], holders: list[list[tuple[nn.Module, str, str]]]) -> None:
        fqns = [f"{self.unit_fqn}.{h[0][2]}" if self.unit_fqn else h[0][2] for h in holders]
        self._mesh = self._mesh or face_mesh(self.process_group, self.device)
        group = self.process_group if self.config.sharded else None
        self.extensions = ExtensionParams(params, holders, fqns, group, self._mesh, self.device, self.config)
        for tensor in params + self.extensions.faces:
            setattr(tensor, FSDP_FLATTENED, True)

    def _flatten_and_shard(self) -> FlatParameter:
        layout = self.layout
        with torch.no_grad():
            pieces = []
            for param, info in zip(self.params, layout.infos):
                lo, hi = layout.param_range(info)
                pieces.append(local_of(param).detach().reshape(-1)[lo:hi].to(self.device))
                pieces.append(torch.zeros(info.chunk_numel - (hi - lo), dtype=self.dtype, device=self.device))
            pieces.append(torch.zeros(layout.tail, dtype=self.dtype, device=self.device))
            shard = torch.cat(pieces).to(self.shard_device)
            if self.shard_device != self.device and torch.cuda.is_available():
                shard = shard.pin_memory()  # lets the host-to-device copy of unshard run asynchronously
        flat_param = FlatParameter(shard, requires_grad=any(p.requires_grad for p in self.params))
        for param, info in zip(self.params, self.layout.infos):
            setattr(param, FSDP_FLATTENED, True)
            param._fsdp_fqn = f"{self.unit_fqn}.{info.fqn}" if self.unit_fqn else info.fqn  # type: ignore[attr-defined]
            refuse_copies(param, param._fsdp_fqn)  # type: ignore[attr-defined]
        refuse_copies(flat_param, f"{self.unit_fqn or '<root>'}._flat_param")
        return flat_param

    def _init_views(self) -> None:
        layout = self.layout
        self._sharded_views = self.sharded_views_of(self.flat_param.data)
        self._init_faces()
        if self._needs_buffer:
            self._unsharded = torch.empty(layout.padded_numel, dtype=self.compute_dtype, device=self.device)
            self._unsharded_views = self.views_of(self._unsharded)
            self._unsharded_regions = layout.regions_of(self._unsharded)
            self._free_unsharded()
        else:
            self._unsharded_views = list(self._sharded_views)

    def _init_faces(self) -> None:
        """Make the faces, or point them at a new shard of their dtype ([Note: parameter faces])."""
        locals_ = [v.view(shape) for v, shape in zip(self._sharded_views, self._local_shapes)]
        if self.faces and all(f.dtype == v.dtype for f, v in zip(self.faces, locals_)):
            for face, local in zip(self.faces, locals_):
                repoint_face(face, local)
            return
        specs = self.face_specs(self.dtype)
        self.faces = [make_face(local, spec, p.requires_grad) for p, spec, local in zip(self.params, specs, locals_)]
        for face, param in zip(self.faces, self.params):
            face._fsdp_fqn = param._fsdp_fqn  # type: ignore[attr-defined]
            setattr(face, FSDP_FLATTENED, True)

    def face_specs(self, dtype: torch.dtype) -> list[DTensorSpec]:
        """Each parameter's face spec in ``dtype`` (made once per dtype)."""
        specs = self._face_specs.get(dtype)
        if specs is None:
            if self._mesh is None:
                self._mesh = face_mesh(self.process_group, self.device)
            mesh, layout = self._mesh, self.layout
            specs = self._face_specs[dtype] = [
                face_spec(info, layout, mesh, dtype) if info.tp is None else self._face_spec_2d(info, dtype)
                for info in layout.infos
            ]
        return specs

    def _face_spec_2d(self, info: ParamInfo, dtype: torch.dtype) -> DTensorSpec:
        assert info.tp is not None
        if self._mesh_2d is None:  # maybe a collective: made while the faces are made, on every rank
            self._mesh_2d = mesh_2d(self.process_group, info.tp, self.device)
        replicated = info.replicated or self.layout.world_size == 1
        return face_spec_2d(self._mesh_2d, info.tp, replicated, dtype)

    def face_grads(self, flat_grad: torch.Tensor) -> list[torch.Tensor]:
        """Every parameter's gradient face over ``flat_grad`` (a shard-sized flat gradient), built the
        cheap way (one ``as_strided`` each), as every backward does: a wrapper over a view at an offset,
        as FSDP2's gradients are."""
        base, specs = flat_grad.storage_offset(), self.face_specs(flat_grad.dtype)
        where = zip(self._local_shapes, self._local_strides, self._shard_ranges, specs)
        return [
            grad_face(flat_grad.as_strided(shape, stride, base + start), spec)
            for shape, stride, (start, _), spec in where
        ]

    def face_grad(self, i: int, view: torch.Tensor) -> torch.Tensor:
        """Parameter ``i``'s value (a gradient, optimizer state, a SHARDED state-dict value) as its face
        shows it, from its 1-D slice ``view`` of a flat shard."""
        return face_value(view.view(self._local_shapes[i]), self.face_specs(view.dtype)[i])

    def register_params(self) -> None:
        """Register the original parameters, whatever they view (a save or load that gives them their full shape)."""
        self._register(self.params)

    def _register(self, params: list[nn.Parameter]) -> None:
        if self.flat_mode:  # the original parameters are plain attributes, the flat parameter is registered
            self.registered = self.params
            return
        for shown, new in zip(self.registered, params):  # a freeze (requires_grad_) carries over
            if new.requires_grad != shown.requires_grad:
                new.requires_grad_(shown.requires_grad)
        self.registered = params
        for slots, param in zip(self._slots, params):
            for registered, attr in slots:
                registered[attr] = param

    def views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each original parameter's view, in its shape, of a padded unsharded flat tensor.

        [Note: views made every step]
        A gradient buffer's views are made at every unit's pre-backward: one ``as_strided`` per
        parameter gives the same view (storage, offset, shape, strides) as a slice then ``view``, at
        about a third of the dispatcher calls' cost (``view`` parses its shape). Only for a contiguous
        1-D ``flat`` (every buffer we make); any other takes the slices."""
        if flat.dim() == 1 and flat.is_contiguous():
            base = flat.storage_offset()
            return [flat.as_strided(shape, stride, base + offset) for shape, stride, offset in self._view_specs]
        return [flat[i.offset : i.offset + i.numel].view(i.shape) for i in self.layout.infos]

    def sharded_views_of(self, flat_shard: torch.Tensor) -> list[torch.Tensor]:
        """Each original parameter's slice of a local-shard-sized tensor (1-D unless one rank)."""
        if self.layout.world_size != 1:
            return [flat_shard[start:end] for start, end in self._shard_ranges]
        return [flat_shard[start:end].view(i.shape) for (start, end), i in zip(self._shard_ranges, self.layout.infos)]

    def change_dtype(self, dtype: torch.dtype, values: Optional[list[torch.Tensor]] = None) -> None:
        """Rebuild the shard, its views and the unsharded buffer in ``dtype`` after the model was cast
        ([Note: casts after sharding] in `_dtype_casts`). ``values``: each original parameter's new
        value of its slice of the shard; None: cast the shard (or keep it, if it already is in ``dtype``).
        Only between steps."""
        assert self.training_state is HandleTrainingState.IDLE
        if self.is_unsharded or self._unshard_work is not None:  # an unshard(module, async_op=True) in flight:
            self.reshard()  # its gather is of the old dtype, so it is dropped; the next use gathers anew
        self.release_freed()
        old = self.flat_param.data
        shard = old if old.dtype == dtype else old.to(dtype)
        if values is not None:
            with torch.no_grad():
                for view, value in zip(self.sharded_views_of(shard), values):
                    if value.numel() > 0:
                        view.copy_(value.reshape(view.shape))
        if shard.device != self.device and torch.cuda.is_available() and not shard.is_pinned():
            shard = shard.pin_memory()
        self.flat_param.data = shard
        self.dtype = dtype
        self.compute_dtype = self.config.compute_dtype(dtype)
        self.reduce_dtype = self.config.reduce_dtype(dtype)
        self._needs_buffer = self.config.needs_unsharded_buffer(dtype, self.device)
        self._unsharded = None
        self._storage_stream = None
        self._init_views()
        self.use_sharded_views()

    @property
    def replicas(self) -> int:
        return self._replicas

    @property
    def group_size(self) -> int:
        """The size of ``process_group`` (NO_SHARD's layout says 1 whatever it is)."""
        return self._group_size

    # ---------------------------------------------------------------- state machine
    def set_training_state(self, new: HandleTrainingState) -> None:
        if new in _HANDLE_TRANSITIONS[self.training_state]:  # the common case, without building the message
            self.training_state = new
            return
        check_transition(
            "HandleTrainingState",
            f"unit '{self.unit_fqn or '<root>'}'",
            self.training_state,
            new,
            _HANDLE_TRANSITIONS,
        )
        self.training_state = new

    # ---------------------------------------------------------------- views
    def _point_params_at(self, views: list[torch.Tensor]) -> None:
        if self.tensor_parallel:
            for param, view in zip(self.params, views):
                point_at(param, view)
            return
        for param, view in zip(self.params, views):  # plain parameters: `point_at` without its check
            param.data = view

    def use_sharded_views(self) -> None:
        self._point_params_at(self._sharded_views)
        self._register(self.faces)
        if self.extensions is not None:
            self.extensions.show_faces()

    def use_unsharded_views(self) -> None:
        self._point_params_at(self._unsharded_views)
        self._register(self.params)
        if self.extensions is not None and self.extensions.is_unsharded:
            self.extensions.show_unsharded()

    # ---------------------------------------------------------------- unshard / reshard
    @property
    def unshard_in_flight(self) -> bool:
        return self._unshard_work is not None

    @_trace.method("unshard", "_unsharded")
    def unshard(self, stream: Optional[torch.cuda.Stream] = None) -> None:
        """Start gathering (and casting) the full flat parameter on ``stream`` (the root context's
        unshard stream on CUDA; None: the compute stream, or async on the CPU); `wait_unshard`
        finishes it."""
        if self.extensions is not None:
            self.extensions.unshard(self.switches.all_gather_comm)
        if self.is_unsharded or self._unshard_work is not None or not self._needs_buffer:
            return
        assert self._unsharded is not None
        shard = self.flat_param.data
        if self.layout.world_size == 1:
            self._wait_freed(None)
            if self._alloc_unsharded():
                self._storage_stream = None
            offloaded = shard.device != self.device
            self._unsharded.copy_(shard, non_blocking=offloaded)  # pinned: no host wait per unit
            self.upload_pending |= offloaded
            self.is_unsharded = True
            return
        # input and output belong to the unshard stream: [Note: streams without record_stream]
        self._wait_freed(stream)
        kept, self._post_forward_shard = self._post_forward_shard, None
        kept_event, self._post_forward_event = self._post_forward_event, None
        # CPU through one copy ([Note: moving chunks]): the unsharded storage is allocated at the copy-out,
        # so a prefetched unit holds one buffer (its gathered shards) while the previous one computes
        self._alloc_at_wait = stream is None and not self.layout.same_order and not self.layout.direct
        with _collectives.on_stream(stream):
            allocated = False if self._alloc_at_wait else self._alloc_unsharded()
            if kept is None:
                src = shard.to(self.device, non_blocking=True) if shard.device != self.device else shard
                self.upload_pending |= shard.device != self.device
                src = src if src.dtype == self.compute_dtype else src.to(self.compute_dtype)
            else:  # gathered within the smaller group only; made on the compute stream in post-forward
                src = kept
                if stream is not None and kept_event is not None:
                    stream.wait_event(kept_event)
        if allocated:  # storage kept from before stays the allocating stream's: its free must wait as before
            self._storage_stream = stream
        self._unshard_src = src
        unsharded, origin = self._unsharded, shard.dtype
        group = self.process_group if kept is None else self.post_forward_group
        assert group is not None
        # laid out by parameter as it lands ([Note: rank-major flat shards]): unless both orders are one
        # tensor, gloo receives each chunk where it goes and a native all-gather is copied out once
        comm = self.switches.all_gather_comm  # the user's: [Note: custom collectives]
        same, direct = self.layout.same_order and comm is None, self.layout.direct
        regions = None if same else self._unsharded_regions

        def gather(async_op: bool) -> Optional[_collectives.Waitable]:
            if comm is not None:
                return _custom_comms.all_gather(comm, unsharded, src, group, async_op, origin, regions)
            return _collectives.all_gather(unsharded, src, group, async_op, origin, regions, direct)

        self._unshard_work = _collectives.issue(
            stream,
            gather,
            wait_first=kept is not None and kept_event is None,
            unit=self.root_fqn,
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
        if self.extensions is not None:
            self.extensions.wait(f"unit '{self.root_fqn}'")
        self.use_unsharded_views()

    @_trace.method("reshard", "_unsharded")
    def reshard(self) -> None:
        """Point the original parameters back at the shard and free the unsharded storage."""
        if self._unshard_work is not None:  # never free memory a collective is still writing
            self._finish_unshard()
        if self.extensions is not None:
            self.extensions.reshard(f"unit '{self.root_fqn}'")
        self.use_sharded_views()
        if self._needs_buffer:
            self._free_unsharded()
        self.is_unsharded = False
        self._post_forward_shard = self._post_forward_event = None

    def keep_unsharded_writes(self) -> None:
        """A unit left unsharded between steps ([Note: a unit left unsharded]): copy what was written in
        place on its unsharded parameters (``p.mul_(0.5)``) into this rank's shard, so that a reshard or
        the next all-gather keeps it. Under mixed precision only the elements a write changed are
        copied (the others keep their full-precision value); no host synchronisation on one device."""
        if not (self.is_unsharded and self._needs_buffer) or self._unshard_work is not None:
            return
        assert self._unsharded is not None
        # not a slice by rank when a 0-dim parameter is its only chunk: the parameter views the front copy
        mine = self.layout.shard_of(self._unsharded)
        shard = self.flat_param.data
        with torch.no_grad():
            if mine.dtype == shard.dtype and mine.device == shard.device:
                shard.copy_(mine)
                return
            mine = mine.to(shard.device)
            changed = mine != shard.to(mine.dtype)
            shard.copy_(torch.where(changed, mine.to(shard.dtype), shard))

    def drop_post_forward_shard(self) -> None:
        """Forget the 1/k slice kept by `reshard_to_post_forward_group`: the next unshard gathers the
        shard (which an optimizer step or a load may have changed since) over the whole group."""
        self._post_forward_shard = None

    def reshard_to_post_forward_group(self) -> None:
        """Reshard, keeping this rank's 1/k of the unsharded flat parameter for the next unshard,
        which then gathers within `post_forward_group` only."""
        group, full = self.post_forward_group, self._unsharded
        assert group is not None and full is not None and self.is_unsharded
        per = self.layout.world_size // dist.get_world_size(group)  # shards each rank of the group keeps
        first = dist.get_rank(group) * per
        # the rank-major rows of those shards (a 0-dim parameter's from the front copy it views):
        # gathered within the group, they are the whole
        kept = self.layout.ranks_of(full, first, first + per)
        # the next unshard's stream waits for this copy only, not for all compute issued before it
        event = _collectives.compute_stream(self.device).record_event() if self.device.type != "cpu" else None
        self.reshard()
        self._post_forward_shard, self._post_forward_event = kept, event

    def _finish_unshard(self) -> None:
        assert self._unshard_work is not None
        work, self._unshard_work = self._unshard_work, None
        if self._alloc_at_wait:  # the copy-out the wait runs writes into it
            self._alloc_at_wait = False
            self._alloc_unsharded()
        try:
            work.wait(f"the all-gather of unit '{self.unit_fqn or '<root>'}'")
        finally:  # refused (raised, or discarded after its step was left) with a receive still posted
            self._unshard_src = None
            if _collectives.left_posted(work):
                self._abandon_buffer()

    def _abandon_buffer(self) -> None:
        """A refused all-gather left a receive posted into the unsharded buffer, which gloo cannot
        withdraw: that storage stays with the receive (held by the group's record) and later unshards
        gather into a new buffer. Only in a step that fails."""
        assert self._unsharded is not None
        self._unsharded = torch.empty(self.layout.padded_numel, dtype=self.compute_dtype, device=self.device)
        self._unsharded_views = self.views_of(self._unsharded)
        self._unsharded_regions = self.layout.regions_of(self._unsharded)
        self._unsharded.untyped_storage().resize_(0)

    def _alloc_unsharded(self) -> bool:
        """Give the unsharded flat parameter its storage; whether it had to be allocated now."""
        assert self._unsharded is not None
        storage = self._unsharded.untyped_storage()
        nbytes = self._unsharded.numel() * self._unsharded.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)
            return True
        return False

    def _free_unsharded(self) -> None:
        """Free the unsharded storage; on CUDA only once the unshard stream, which allocated it, has
        waited for the compute stream's last use of it: in forward and backward after the next
        all-gather is issued (`release_freed`), elsewhere now."""
        assert self._unsharded is not None
        if self._storage_stream is not None and self._unsharded.untyped_storage().size() > 0:
            self._freed_event = _collectives.compute_stream(self.device).record_event()
            if self.training_state in _IN_STEP:
                return
            self._wait_freed(self._storage_stream)
        self._unsharded.untyped_storage().resize_(0)

    def release_freed(self) -> None:
        """Give back the storage `reshard` left allocated (CUDA; see [Note: streams without record_stream])."""
        if self._freed_event is not None and not self.is_unsharded and self._unshard_work is None:
            self._wait_freed(self._storage_stream)
            assert self._unsharded is not None
            self._unsharded.untyped_storage().resize_(0)

    def _wait_freed(self, stream: Optional[torch.cuda.Stream]) -> None:
        """``stream`` (None: the compute stream) is about to use the unsharded storage again: it waits
        for its last use first."""
        if self._freed_event is not None:
            (stream if stream is not None else _collectives.compute_stream(self.device)).wait_event(self._freed_event)
            self._freed_event = None
