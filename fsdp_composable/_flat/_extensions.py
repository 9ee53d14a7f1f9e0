"""Parameters whose tensor subclass decides what is all-gathered: FSDP2's extension protocol.

[Note: extension parameters]
A parameter whose tensor type defines ``fsdp_pre_all_gather`` and ``fsdp_post_all_gather`` (torchao's
``NF4Tensor`` for QLoRA, its float8 training weights, or a user's own) is not flattened into the unit's
flat parameter: the unit keeps it beside, as torch FSDP2 does.

- Sharded: its face is a ``DTensor`` with ``Shard(0)`` over the unit's process group whose local tensor
  is this rank's dim-0 chunk *of the subclass* (``torch.chunk`` on the subclass, copied), so the
  subclass keeps its own representation (4-bit codes and scales for NF4) and the optimizer steps the
  subclass as FSDP2's would. Dim 0 must divide by the shard group's size (a subclass has no general
  padding; NF4 refuses uneven splits itself).
- Unshard: each parameter's ``fsdp_pre_all_gather`` says which plain tensors to send (any dtypes:
  4-bit codes packed in ``uint8``, ``int8`` scales, float8 data); the unit sends all of them, as bytes,
  in one all-gather beside the flat parameter's, and copies each rank's bytes out into per-input
  outputs of shape ``(world * d0, *rest)``. ``fsdp_post_all_gather`` builds the unsharded tensor from
  them the first time (``out=None``), and refreshes that same tensor in place every later time
  (``out=``): the module's forward and autograd's saved tensors always see one object.
- Reshard frees the outputs' and the inner tensors' storage (``resize_(0)``); the next unshard
  regrows it before the bytes land, so a tensor autograd saved in forward is valid again in backward.
- Gradients: a trainable extension parameter's unsharded tensor is a leaf; its gradient (a plain
  tensor of the full shape) is reduce-scattered by dim-0 chunk at the unit's post-backward, averaged
  like the flat parameter's, and accumulated into the face's gradient (`_extension_grads`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fsdp_composable._comm import _collectives, _custom_comms
from fsdp_composable._comm._tensor_parallel import full_tensor
from fsdp_composable._config import UnitConfig

__all__ = ["ExtensionParam", "ExtensionParams", "is_extension"]

# the methods of the protocol, as torch FSDP2 names them
PRE, POST = "fsdp_pre_all_gather", "fsdp_post_all_gather"


def is_extension(param: torch.Tensor) -> bool:
    """Whether ``param``'s tensor type takes part in the all-gather (both methods; one alone is refused)."""
    return hasattr(type(param), PRE) or hasattr(type(param), POST)


def check_protocol(param: torch.Tensor, fqn: str) -> None:
    kind = type(param)
    if not (hasattr(kind, PRE) and hasattr(kind, POST)):
        have, missing = (PRE, POST) if hasattr(kind, PRE) else (POST, PRE)
        raise TypeError(
            f"fully_shard: parameter '{fqn}' is a {kind.__name__}, which defines {have} but not {missing}: "
            "a tensor subclass that changes what is all-gathered must define both"
        )


@dataclass
class ExtensionParam:
    """One extension parameter of a unit: where it is registered, its face and its unsharded tensor."""

    fqn: str
    holders: list[tuple[nn.Module, str]]  # (module, attribute): where it is registered
    names: list[str]  # its names relative to the unit's module, one per holder
    owner: nn.Module  # the module that registers it (the first, if tied): ``fsdp_pre_all_gather``'s ``module``
    slots: list[tuple[dict[str, Any], str]]  # (a holder's ``_parameters``, attribute) pairs
    face: nn.Parameter
    unsharded: Optional[nn.Parameter] = None
    metadata: Any = None
    # per all-gather input: (dtype, shape) as the first gather saw them; each later gather must match
    inputs: list[tuple[torch.dtype, torch.Size]] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)  # kept: refilled by every unshard
    inner: tuple[torch.Tensor, ...] = ()  # what ``fsdp_post_all_gather`` said to free at reshard
    summoned: Optional[nn.Parameter] = None  # its whole value inside `unshard_params`


@dataclass
class _Gather:
    work: Optional[_collectives.Waitable]
    gathered: torch.Tensor  # (world * bytes) uint8: every rank's inputs, back to back
    sizes: list[list[int]]  # per parameter, per input: bytes


class ExtensionParams:
    """A unit's extension parameters: their faces, one all-gather of their inputs, their unsharded tensors."""

    def __init__(
        self,
        params: list[nn.Parameter],
        holders: list[list[tuple[nn.Module, str, str]]],
        fqns: list[str],
        group: Optional[dist.ProcessGroup],
        mesh: DeviceMesh,
        device: torch.device,
        config: UnitConfig,
    ) -> None:
        """``group``: the shard group (None: every rank holds each parameter whole, NO_SHARD); ``mesh``
        names the unit's process group, which ``fsdp_pre_all_gather`` is given."""
        self.group, self.mesh, self.device, self.config = group, mesh, device, config
        self.world, self.rank = (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)
        rank = self.rank
        placement: Placement = Shard(0) if self.world > 1 else Replicate()
        self.params: list[ExtensionParam] = []
        self._gather: Optional[_Gather] = None
        self.is_unsharded = False
        for param, where, fqn in zip(params, holders, fqns):
            check_protocol(param, fqn)
            if config.offload_params:
                raise ValueError(
                    f"fully_shard: parameter '{fqn}' ({type(param).__name__}) defines its own all-gather, "
                    "which CPU offload does not support: shard it without offload_policy/cpu_offload"
                )
            param._fsdp_fqn = fqn  # type: ignore[attr-defined]
            if param.dim() == 0 or param.shape[0] % self.world:
                raise ValueError(
                    f"fully_shard: parameter '{fqn}' ({type(param).__name__}, shape {tuple(param.shape)}) "
                    f"defines its own all-gather, so it is split by dim 0 into {self.world} equal chunks "
                    f"without padding: its dim 0 must divide by {self.world} (resize it, or leave its module "
                    "out of fully_shard with ignored_modules)"
                )
            with torch.no_grad():
                # a copy of this rank's chunk (not a view, which would keep the whole alive) made with
                # ``new_zeros`` and ``copy_``, as FSDP2 does: a subclass's ``clone`` or ``to`` may rebuild it
                # (NF4's quantizes again, with other scales)
                try:
                    chunk = torch.chunk(param.detach(), self.world, dim=0)[rank]
                    local = chunk.new_zeros(chunk.shape)
                    local.copy_(chunk)
                except (AssertionError, NotImplementedError, RuntimeError) as e:  # the subclass's own refusal
                    raise ValueError(
                        f"fully_shard: parameter '{fqn}' ({type(param).__name__}, shape {tuple(param.shape)}) "
                        f"cannot be split by dim 0 into {self.world} chunks: {type(param).__name__} refused it "
                        f"({type(e).__name__}: {e}). Give it a shape its type can split, or leave its module out "
                        "of fully_shard with ignored_modules"
                    ) from e
                if local.device != device:
                    local = local.to(device)
                value = DTensor.from_local(
                    local, mesh, [placement], run_check=False, shape=param.shape, stride=param.stride()
                )
                face = nn.Parameter(value, requires_grad=param.requires_grad)
            face._fsdp_face = True  # type: ignore[attr-defined]
            face._fsdp_fqn = fqn  # type: ignore[attr-defined]
            slots = [(m._parameters, attr) for m, attr, _ in where]
            held = [(m, attr) for m, attr, _ in where]
            self.params.append(ExtensionParam(fqn, held, [name for _, _, name in where], where[0][0], slots, face))

    def __bool__(self) -> bool:
        return bool(self.params)

    @property
    def faces(self) -> list[nn.Parameter]:
        return [p.face for p in self.params]

    # ---------------------------------------------------------------- unshard
    def param_dtype(self, p: ExtensionParam) -> torch.dtype:
        """The dtype ``fsdp_post_all_gather`` is asked for: the mixed-precision ``param_dtype``, if any."""
        return self.config.compute_dtype(p.face.dtype)

    @torch.no_grad()
    def unshard(self, comm: Optional[Any] = None) -> None:
        """Ask each parameter what to send and start the one all-gather of all of it (as bytes)."""
        if self.is_unsharded or self._gather is not None:
            return
        pieces: list[torch.Tensor] = []
        sizes: list[list[int]] = []
        for p in self.params:
            inputs, p.metadata = self._pre_all_gather(p)
            self._check_inputs(p, inputs)
            mine = [t.contiguous().view(-1).view(torch.uint8) for t in inputs]
            sizes.append([t.numel() for t in mine])
            pieces.extend(mine)
        send = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8, device=self.device)
        if self.group is None:  # nothing to gather: each rank's inputs are the whole
            self._gather = _Gather(None, send, sizes)
            return
        gathered = torch.empty(self.world * send.numel(), dtype=torch.uint8, device=self.device)
        if comm is not None:  # the user's all-gather: [Note: custom collectives]
            work = _custom_comms.all_gather(comm, gathered, send, self.group, async_op=True)
        else:
            work = _collectives.all_gather(gathered, send, self.group, async_op=True)
        self._gather = _Gather(work, gathered, sizes)

    def _pre_all_gather(self, p: ExtensionParam) -> tuple[tuple[torch.Tensor, ...], Any]:
        local = p.face._local_tensor  # type: ignore[attr-defined]
        if not is_extension(local):  # a cast (model.to(dtype)) rebuilt it as a plain tensor
            raise TypeError(
                f"fully_shard: parameter '{p.fqn}' was a tensor subclass with its own all-gather, but is now a "
                f"{type(local).__name__} (a cast of the model after fully_shard, such as model.to(torch.bfloat16), "
                "converts it): cast the model before fully_shard, or use mixed_precision=MixedPrecision(...)"
            )
        pre: Callable[..., Any] = getattr(local, PRE)
        try:  # torch FSDP2's two forms: (mesh) and (mesh, outer_size, outer_stride, module, mp_policy)
            inspect.signature(pre).bind(self.mesh)
            short = True
        except TypeError:
            short = False
        except ValueError:  # no signature to read
            short = True
        if short:
            inputs, metadata = pre(self.mesh)
        else:
            inputs, metadata = pre(self.mesh, p.face.shape, p.face.stride(), p.owner, self.config.mixed_precision)
        return tuple(inputs), metadata

    def _check_inputs(self, p: ExtensionParam, inputs: tuple[torch.Tensor, ...]) -> None:
        seen = [(t.dtype, t.shape) for t in inputs]
        if not p.inputs:
            p.inputs = seen
        elif seen != p.inputs:
            raise RuntimeError(
                f"fully_shard: {type(p.face._local_tensor).__name__}.{PRE} of parameter '{p.fqn}' returned "  # type: ignore[attr-defined]
                f"inputs {seen}, but {p.inputs} before: the all-gather's buffers are kept from the first step, "
                "so what a parameter sends must keep its dtypes and shapes"
            )

    @torch.no_grad()
    def wait(self, what: str) -> None:
        """Finish the all-gather and give each parameter its unsharded tensor (built, or refreshed in place)."""
        gather, self._gather = self._gather, None
        if gather is None:
            if not self.is_unsharded:
                self.unshard()
                self.wait(what)
            return
        _collectives.wait(gather.work, f"the all-gather of {what}'s tensor-subclass parameters")
        total = sum(sum(s) for s in gather.sizes)
        by_rank = gather.gathered.view(self.world, total)
        start = 0
        for p, sizes in zip(self.params, gather.sizes):
            first = not p.outputs
            if first:
                shapes = [(d, _gathered_shape(s, self.world)) for d, s in p.inputs]
                p.outputs = [torch.empty(shape, dtype=d, device=self.device) for d, shape in shapes]
            else:
                _regrow(p.outputs + list(p.inner))
            for out, n in zip(p.outputs, sizes):
                out.view(-1).view(torch.uint8).view(self.world, n).copy_(by_rank[:, start : start + n])
                start += n
            post = getattr(p.face._local_tensor, POST)  # type: ignore[attr-defined]
            param_dtype = self.param_dtype(p)
            if first:
                tensor, inner = post(tuple(p.outputs), p.metadata, param_dtype)
                p.unsharded = nn.Parameter(tensor, requires_grad=p.face.requires_grad)
                p.inner = tuple(inner)
            else:
                post(tuple(p.outputs), p.metadata, param_dtype, out=p.unsharded)
                assert p.unsharded is not None
                if p.unsharded.requires_grad != p.face.requires_grad:  # a freeze between steps carries over
                    p.unsharded.requires_grad_(p.face.requires_grad)
        self.is_unsharded = True

    def reshard(self, what: str) -> None:
        """Free the unsharded tensors' storage (a gather in flight is finished first: its bytes are dropped)."""
        if self._gather is not None:
            gather, self._gather = self._gather, None
            _collectives.wait(gather.work, f"the all-gather of {what}'s tensor-subclass parameters")
        for p in self.params:
            for t in p.outputs + list(p.inner):
                t.untyped_storage().resize_(0)
        self.is_unsharded = False

    # ---------------------------------------------------------------- unshard_params
    def summon(self, device: torch.device, register: bool, offload: bool, with_grads: bool) -> None:
        """Register each parameter whole, as `unshard_params` shows parameters: the sharded subclass
        gathered (``full_tensor``, a collective on every rank), not the compute form that
        ``fsdp_post_all_gather`` builds. ``register``: this rank shows them (False: rank0_only elsewhere)."""
        for p in self.params:
            whole = full_tensor(p.face, device)  # type: ignore[arg-type]
            grad = p.face.grad
            whole_grad = full_tensor(grad, device) if with_grads and grad is not None else None  # type: ignore[arg-type]
            if not register:
                continue
            if offload:
                whole = whole.cpu()
                whole_grad = whole_grad.cpu() if whole_grad is not None else None
            p.summoned = nn.Parameter(whole, requires_grad=p.face.requires_grad)
            p.summoned.grad = whole_grad
            for registered, attr in p.slots:
                registered[attr] = p.summoned

    @torch.no_grad()
    def end_summon(self, writeback: bool) -> None:
        """Leave `unshard_params`: with ``writeback``, this rank's chunk of each (possibly edited) whole
        value goes back into the face; gradients are not written back. The faces are registered again."""
        for p in self.params:
            if p.summoned is not None and writeback:
                whole = p.summoned.detach()
                mine = torch.chunk(whole, self.world, dim=0)[self.rank] if self.world > 1 else whole
                local = p.face._local_tensor  # type: ignore[attr-defined]
                local.copy_(mine if mine.device == local.device else mine.to(local.device))
            p.summoned = None
        self.show_faces()

    # ---------------------------------------------------------------- what the modules register
    def show_faces(self) -> None:
        for p in self.params:
            for registered, attr in p.slots:
                registered[attr] = p.face

    def show_unsharded(self) -> None:
        for p in self.params:
            assert p.unsharded is not None
            for registered, attr in p.slots:
                registered[attr] = p.unsharded


def _gathered_shape(shape: torch.Size, world: int) -> tuple[int, ...]:
    """One input's all-gather output: every rank's input back to back along dim 0 (FSDP2's shapes)."""
    return (world * shape[0], *shape[1:]) if len(shape) else (world,)


def _regrow(tensors: list[torch.Tensor]) -> None:
    """Give back the storage `ExtensionParams.reshard` freed (each storage once, to what its views need)."""
    need: dict[int, tuple[torch.UntypedStorage, int]] = {}
    for t in tensors:
        storage = t.untyped_storage()
        nbytes = int((t.storage_offset() + t.numel()) * t.element_size())
        key = storage._cdata  # the storage's identity (each call makes a new Python object)
        if key not in need or need[key][1] < nbytes:
            need[key] = (storage, nbytes)
    for storage, nbytes in need.values():
        if storage.size() < nbytes:
            storage.resize_(nbytes)
