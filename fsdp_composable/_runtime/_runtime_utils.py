"""The runtime of one step: hooks for root pre-forward, pre/post forward, pre/post backward, and the
final callback. Each hook is a function taking the state (and handle) first.

[Note: one step]
root pre-forward (lazy init once; `RootContext.begin_step`: every state enters FORWARD_BACKWARD;
cast root inputs) -> per unit: pre-forward (unshard, wait, prefetch the next unit, attach the
post-backward trigger to the inputs) -> forward -> post-forward (reshard unless root unit or
SHARD_GRAD_OP/NO_SHARD; hook the outputs for pre-backward) ... backward: pre-backward (unshard,
prefetch, point ``.grad`` at the gradient buffer) -> autograd fills the buffer -> post-backward
(start the async reduction, reshard) -> final callback (`RootContext.end_step`: finish every
reduction, reshard leftovers, every state back to IDLE). The hooks hold no state of their own:
what a step needs lives in the root context ([Note: the root context]), what a unit needs in its
handle.

[Note: when post-backward runs]
A unit's gradients are complete once autograd has run the whole module backward, i.e. once the
gradients of the module's *inputs* are computed. Pre-forward passes the inputs that require grad
through `_PostBackwardTrigger`, an identity whose backward runs then. A unit called k times gets k
triggers and reduces after the last. Units whose inputs need no grad (the first unit) or whose
trigger never runs reduce in the final callback.

[Note: gradients before backward]
A unit left unsharded after forward (the root unit, SHARD_GRAD_OP) may have a part of it run and
backward on its own before the unit's own backward: a chunked loss calls the head (held by the root
unit) on pieces of the root's output and runs backward on each, then backward through the root's
output. Autograd accumulates those gradients into the unsharded parameters' ``.grad``, full-size.
Pre-forward records each parameter's ``.grad`` object; at pre-backward a ``.grad`` that is another
object is such a gradient (a user's edit between steps is made before forward): it is taken as the
start of this backward's unsharded gradient, reduced with the rest, as in FSDP2.

[Note: fully_shard under torch.compile]
The hooks issue collectives, wait on their work and change Python state, which dynamo cannot put in a
graph, so each hook object's ``__call__`` is dynamo-disabled (``torch._disable_dynamo``, the form of
``torch._dynamo.disable`` that imports dynamo at the first call, not when this package is imported: that
import costs about a second in every process, a rank that never runs a forward included): a compiled region stops at
every unit boundary and the hooks run eagerly there (torch's FSDP2 disables its hooks alike on 2.13).
The call itself is disabled, not only the function it wraps: otherwise dynamo compiles the
``__call__`` frame on its own, finds a disabled call at its first line and counts a graph break for
every kind of hook (4 breaks in the first step of a compiled TinyGPT; 0 now), plus a recompilation
per new argument type. Where the boundary sits in torch's loop over hooks in ``Module._call_impl``,
dynamo cannot resume after it ("graph break in loop"): the frame that calls a unit, such as a root
forward looping over its blocks, runs eagerly, while every frame it calls compiles, one graph per
unit forward and per other submodule. That is the floor for hook-driven sharding on torch 2.13:
``model.compile()`` of a two-block TinyGPT compiles 4 graphs in its first step (a block's forward,
shared by the blocks; the root's embedding, final norm and head), runs 5 per step, counts no graph
break and compiles nothing after the first step (`tests/test_compile.py`). Code of the root's own
forward between submodule calls (``tok(idx) + pos``) stays eager; ``block.compile()`` per block
compiles the same blocks and nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import weakref
from typing import Any, Callable, NoReturn, Optional

import torch
from torch import nn
from torch.autograd import Variable
from torch.autograd.graph import get_gradient_edge
from torch.utils import _pytree as pytree

from fsdp_composable._base._copy_guard import refusal
from fsdp_composable._base._grad_records import GradState
from fsdp_composable._comm import _trace
from fsdp_composable._common_utils import TrainingState, _FSDPState, _get_fsdp_state
from fsdp_composable._flat_param import FlatParamHandle, HandleTrainingState
from fsdp_composable._grads import _exposed_grads
from fsdp_composable._grads import _reduce_utils as grads
from fsdp_composable._grads._extension_grads import reduce_extension_grads
from fsdp_composable._guards._ddp_guard import refuse_inside_ddp
from fsdp_composable._guards._model_edit_checks import check_model_unchanged
from fsdp_composable._runtime._cast_inputs import cast_floating, to_device
from fsdp_composable._runtime._entry_points import _in_backward
from fsdp_composable._runtime._lazy_init import _buffer_dtype_state_dict_hook, _ctx, _lazy_init
from fsdp_composable._runtime._prefetch import _prefetch_for_backward, _prefetch_for_forward, _unshard
from fsdp_composable._runtime._root_context import RootContext, UnitStep
from fsdp_composable.api import BackwardPrefetch

__all__: list[str] = []

_BACKWARD_STATES = (HandleTrainingState.BACKWARD_PRE, HandleTrainingState.BACKWARD_POST)


# ---------------------------------------------------------------------------- registration
class _EagerHook:
    """A forward hook that runs eagerly even inside ``torch.compile(module)``: it issues collectives,
    waits on work and flips state, which dynamo cannot trace; the module's own forward still compiles
    whole ([Note: fully_shard under torch.compile]). Pickled with its module (``torch.save(model)``),
    it refuses as the unit's state does ([Note: copying a sharded model]): the hooks come before the
    submodules in a module's ``__dict__``, so a top module with no parameters of its own reaches them
    first."""

    def __init__(self, state: _FSDPState, fn: Callable[..., Any]) -> None:
        self._fn = fn
        self._what = f"the state of '{type(state.module).__name__}'"

    @torch._disable_dynamo  # the call itself, not only `fn`: see [Note: fully_shard under torch.compile]
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def __reduce_ex__(self, protocol: object) -> NoReturn:
        raise refusal(self._what)


def _eager(state: _FSDPState, fn: Callable[..., Any]) -> Callable[..., Any]:
    return _EagerHook(state, fn)


def _register_hooks(state: _FSDPState) -> None:
    """Attach the root hooks to ``state.module`` and the unit hooks to each unit module."""
    module = state.module
    state.hook_handles.append(
        module.register_forward_pre_hook(
            _eager(state, functools.partial(_fsdp_root_pre_forward, state)), prepend=True, with_kwargs=True
        )
    )
    for handle in state.handles:
        pre = _eager(state, functools.partial(_pre_forward, state, handle))
        post = _eager(state, functools.partial(_post_forward, state, handle))
        for unit_module in handle.members:  # several for fully_shard([m1, m2])
            state.hook_handles.append(
                unit_module.register_forward_pre_hook(pre, prepend=unit_module is not module, with_kwargs=True)
            )
            state.hook_handles.append(unit_module.register_forward_hook(post))
    state.hook_handles.append(
        module.register_forward_hook(_eager(state, functools.partial(_fsdp_root_post_forward, state)), always_call=True)
    )
    _register_direct_call_checks(state)
    state.hook_handles.append(module._register_state_dict_hook(functools.partial(_buffer_dtype_state_dict_hook, state)))


def _register_direct_call_checks(state: _FSDPState) -> None:
    """A module inside a unit holding some of its parameters (``blocks.0.fc1``), called by itself
    while they are 1-D shard pieces (after a step, outside the root's forward), would fail in its
    own code with a shape error on some ranks, and compute on a rank whose piece happens to be whole."""
    units = {id(h.module) for h in state.handles}
    held: dict[nn.Module, list[tuple[FlatParamHandle, str]]] = {}
    for handle in state.handles:
        if handle.layout.world_size == 1 or handle.tensor_parallel:
            continue  # its parameters keep their shapes; DTensor parameters say their global shape
        for info in handle.layout.infos:
            for holder, _, fqn in info.holders:
                if id(holder) not in units and _get_fsdp_state(holder) is None:
                    name = f"{handle.unit_fqn}.{fqn}" if handle.unit_fqn else fqn
                    held.setdefault(holder, []).append((handle, name))
    for holder, params in held.items():
        state.hook_handles.append(holder.register_forward_pre_hook(functools.partial(_refuse_direct_call, params)))


def _refuse_direct_call(params: list[tuple[FlatParamHandle, str]], module: nn.Module, args: Any) -> None:
    for handle, fqn in params:
        if handle.is_unsharded:  # in the model's forward or backward
            continue
        # unshard_params (or a state-dict load) points every parameter at a full view; otherwise some
        # parameter of the unit is a piece of another shape on every rank (so all ranks raise alike)
        if any(p.shape != i.shape for p, i in zip(handle.params, handle.layout.infos)):
            raise RuntimeError(
                f"fully_shard: {type(module).__name__} holding parameter '{fqn}' was called by itself while its "
                f"parameters are sharded (each rank holds a 1-D piece of unit '{handle.unit_fqn or '<root>'}'): "
                "call the model (or the unit that contains it), or call it inside `with unshard_params(model):`"
            )


def _is_root_unit(state: _FSDPState, handle: FlatParamHandle) -> bool:
    root = state.root_state
    return root is not None and handle.module is root.module


# ---------------------------------------------------------------------------- forward
def _fsdp_root_pre_forward(state: _FSDPState, module: nn.Module, args: Any, kwargs: Any) -> Any:
    refuse_inside_ddp(module)  # see [Note: fully_shard inside an existing DDP]
    _lazy_init(state, module)
    if not state.is_root:
        return None
    if _in_backward():  # recomputed by activation checkpointing: cast as the forward did
        return _cast_inputs(args, kwargs, state.config.input_dtype(is_root=True))
    ctx = _ctx(state)
    if any(s.training_state is TrainingState.SUMMON_FULL_PARAMS for s in ctx.states):
        raise RuntimeError(
            f"forward of {type(module).__name__} was called inside unshard_params(); leave the "
            "unshard_params context before running forward"
        )
    if ctx.unfinished():  # the previous step stopped midway ([Note: a step that stops midway])
        ctx.abort_step()
    if not ctx.open_forwards:  # else nested: a registered method (e.g. generate) calling self(...)
        for handle in ctx.handles:  # left unsharded between steps: [Note: a unit left unsharded]
            if handle.is_unsharded and handle.training_state is HandleTrainingState.IDLE:
                handle.keep_unsharded_writes()
        check_model_unchanged(state)  # see [Note: edits of a sharded model]; before a reshard hides one
        ctx.close_skipped_backward()  # [Note: a skipped backward]
    if ctx.enter_forward():
        ctx.begin_step()
    moved = state.device.type != "cpu"
    if moved:  # the root's inputs on the compute device, as FSDP1/FSDP2 do
        args, kwargs = to_device(args, state.device), to_device(kwargs, state.device)
    dtype = state.config.input_dtype(is_root=True)
    if dtype is not None:
        return _cast_floating(args, dtype), _cast_floating(kwargs, dtype)
    return (args, kwargs) if moved else None


def _fsdp_root_post_forward(state: _FSDPState, module: nn.Module, args: Any, output: Any) -> Any:
    dtype = state.config.output_dtype  # every call's module, recomputation too (it must match)
    if dtype is not None:
        output = _cast_floating(output, dtype)
    if not state.is_root or _in_backward():
        return output
    ctx = _ctx(state)
    if sys.exc_info()[1] is not None:  # registered with always_call: the forward raised
        ctx.leave_forward(failed=True)
        return None
    if not ctx.leave_forward(failed=False):
        return output  # nested in a registered method: its own post-forward closes the forward
    for s, h in ctx.grouped_units():  # a unit of several modules some of which did not run
        if ctx.steps[h].group_left:
            ctx.steps[h].group_left.clear()
            _finish_forward(s, h)
    ctx.exec_order.end_forward()
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in _tensors(output)):
        ctx.end_step()  # no backward will follow: leave everything IDLE and resharded now
    return output


@_trace.hook("pre_forward")
def _pre_forward(state: _FSDPState, handle: FlatParamHandle, module: nn.Module, args: Any, kwargs: Any) -> Any:
    # Recomputation by activation checkpointing (possibly before this unit's pre-backward, when a
    # later op of an enclosing checkpointed module needs it): only make the parameters whole.
    if _in_backward() or handle.training_state in _BACKWARD_STATES:
        _unshard(state, handle)
        handle.wait_unshard()
        return _cast_inputs(args, kwargs, handle.config.input_dtype(is_root=False))  # as the forward did
    if state.ctx is None:  # a unit called by itself before the root's first forward
        _lazy_init(state, state.module)
    ctx = _ctx(state)
    step = ctx.steps[handle]
    grouped = len(handle.members) > 1
    nested = handle.training_state is HandleTrainingState.FORWARD
    if grouped and step.group_left:  # another member of a unit whose forward started: already whole
        nested = False
    elif nested and ctx.method_calls == 0:  # left in FORWARD by a forward that died (BaseException)
        ctx.abort_step()
        nested = False
    if nested:  # the unit's module calls itself inside a registered method: it is already whole
        step.forward_depth += 1
    elif not (grouped and step.group_left):
        if not handle.switches.unshard_in_backward and torch.is_grad_enabled():
            _refuse_input_grads_without_params(handle, args, kwargs)
        handle.set_training_state(HandleTrainingState.FORWARD)
        step.forward_depth = 1
        if grouped:
            step.group_left.update(id(m) for m in handle.members)
        step.grads_at_forward = [p.grad for p in handle.params]
        unit = ctx.unit_of(handle)
        ctx.exec_order.record_pre_forward(handle, list(unit))
        for sibling in unit:  # a unit's groups gather together, then each waits for its own
            _unshard(state, sibling)
        _prefetch_for_forward(state, handle)
        handle.wait_unshard()
    dtype = handle.config.input_dtype(is_root=False)
    if dtype is not None:
        args, kwargs = _cast_floating(args, dtype), _cast_floating(kwargs, dtype)
    if torch.is_grad_enabled():
        args, kwargs = _attach_post_backward_trigger(state, handle, args, kwargs)
    return args, kwargs


@_trace.hook("post_forward")
def _post_forward(state: _FSDPState, handle: FlatParamHandle, module: nn.Module, args: Any, output: Any) -> Any:
    dtype = _unit_output_dtype(state, handle)
    if dtype is not None:  # recomputation too: it must give what forward gave
        output = _cast_floating(output, dtype)
    if _in_backward() or handle.training_state in _BACKWARD_STATES:
        return output
    step = _ctx(state).steps[handle]
    if len(handle.members) > 1:  # the last member to run finishes: [Note: several modules as one unit]
        if id(module) in step.group_left:
            step.group_left.discard(id(module))
            if not step.group_left:
                _finish_forward(state, handle)
    elif step.forward_depth > 1:  # the inner call of a unit calling itself: stays whole
        step.forward_depth -= 1
    else:
        _finish_forward(state, handle)
    if torch.is_grad_enabled():
        hook = functools.partial(_pre_backward_hook, state, handle)
        outputs = [t for t in _tensors(output) if t.requires_grad]
        for t in outputs:
            t.register_hook(hook)
        if outputs:
            _ctx(state).backward_hooks.append(weakref.ref(hook))
    return output


def _finish_forward(state: _FSDPState, handle: FlatParamHandle) -> None:
    ctx = _ctx(state)
    ctx.steps[handle].forward_depth = 0
    ctx.exec_order.record_post_forward(handle)
    if _reshard_after_forward(state, handle):
        if handle.post_forward_group is not None and torch.is_grad_enabled() and handle.is_unsharded:
            handle.reshard_to_post_forward_group()  # see [Note: resharding to a smaller group]
        else:
            handle.reshard()
    handle.set_training_state(HandleTrainingState.IDLE)


def _unit_output_dtype(state: _FSDPState, handle: FlatParamHandle) -> Optional[torch.dtype]:
    """A policy unit casts its outputs only under a ``mixed_precision`` of its own (a `CustomPolicy`
    override), as a module given its own FSDP2 ``mp_policy``; the call's ``output_dtype`` is for the
    call's module (`_fsdp_root_post_forward`), so its units' activations stay as computed."""
    if handle.module is state.module or handle.config.mixed_precision is state.config.mixed_precision:
        return None
    return handle.config.output_dtype


def _reshard_after_forward(state: _FSDPState, handle: FlatParamHandle) -> bool:
    if handle.switches.reshard_after_forward is not None:  # set_reshard_after_forward: [Note: per-unit switches]
        return handle.switches.reshard_after_forward
    if _is_root_unit(state, handle):
        return False  # needed first in backward; the root post-forward reshards it if none follows
    return not torch.is_grad_enabled() or handle.config.reshard_after_forward


# ---------------------------------------------------------------------------- backward
@_trace.hook("pre_backward")
def _pre_backward_hook(state: _FSDPState, handle: FlatParamHandle, grad: torch.Tensor) -> None:
    ctx = _ctx(state)
    step = ctx.steps[handle]
    if step.ran_pre_backward:
        return
    if torch.is_grad_enabled():  # backward(create_graph=True): autograd records the gradients' graph
        raise RuntimeError(
            f"fully_shard: unit '{handle.root_fqn}' ran a backward with create_graph=True (a double backward, "
            "such as a gradient penalty): its unsharded parameters are freed after its backward, so the graph "
            "of the gradients could not be differentiated again. Leave the modules the penalty differentiates "
            "through out of the units (fully_shard(..., ignored_modules=[...])), or compute the term without "
            "create_graph"
        )
    if not ctx.final_callback_queued:
        _refuse_autograd_grad(ctx)
        ctx.final_callback_queued = True
        Variable._execution_engine.queue_callback(functools.partial(_post_backward_final_callback, ctx))
    step.ran_pre_backward = True
    handle.set_training_state(HandleTrainingState.BACKWARD_PRE)
    ctx.exec_order.record_pre_backward(handle)
    gather = handle.switches.unshard_in_backward or handle.is_unsharded  # else: not needed for gradients
    if gather:
        _unshard(state, handle)
    if state.backward_prefetch is BackwardPrefetch.BACKWARD_PRE or handle.switches.backward_prefetch is not None:
        _prefetch_for_backward(state, handle)
    if gather:
        handle.wait_unshard()
    else:  # full shapes without storage, as autograd checks gradients against the parameters' shapes
        handle.use_unsharded_views()
    # a unit frozen after sharding (every parameter's requires_grad_(False)) has nothing to reduce
    if handle.requires_grad and any(p.requires_grad for p in handle.params):
        # Let autograd allocate the gradients as they come, instead of holding a whole buffer from
        # now on, when no trigger will fire (the unit reduces in the final callback) or when the
        # reduction sends them as they are (see [Note: gradients land in the flat buffer]).
        untriggered = step.pending_triggers == 0 or step.untriggered_calls > 0
        # a DTensor parameter's .grad cannot view a plain buffer: [Note: tensor-parallel parameters]
        lazy = untriggered or handle.tensor_parallel or grads.takes_autograd_grads(handle)
        grads.begin_backward(handle, lazy=lazy, early=_grads_before_backward(step, handle))


def _grads_before_backward(step: UnitStep, handle: FlatParamHandle) -> list[Optional[torch.Tensor]]:
    """Gradients a backward of part of the model accumulated into this unit's unsharded parameters
    since its forward (a chunked loss: the head called alone and backward run on it before the root's
    backward), by parameter; empty if none. See [Note: gradients before backward]."""
    before = step.grads_at_forward
    if not before:
        return []
    early = [g if g is not None and g is not b else None for g, b in zip((p.grad for p in handle.params), before)]
    return early if any(g is not None for g in early) else []


def _refuse_input_grads_without_params(handle: FlatParamHandle, args: Any, kwargs: Any) -> None:
    """``set_unshard_in_backward(module, False)``: the unit's backward gets its parameters' shapes
    without storage. The gradient of an input that requires grad (a linear's, a norm's) needs the
    parameters themselves: refuse in forward, on every rank, instead of a storage error in backward."""
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves((args, kwargs))):
        raise RuntimeError(
            f"fully_shard: set_unshard_in_backward(False) was set on unit '{handle.root_fqn}', but its forward "
            "got an input that requires grad: that input's gradient needs the unit's parameters in backward, "
            "which it would not gather. Call set_unshard_in_backward(module, True) for this unit; False is for "
            "units whose backward needs no parameters (an embedding of the model's input)"
        )


def _refuse_autograd_grad(ctx: RootContext) -> None:
    """``torch.autograd.grad(loss, model.parameters())`` would return this rank's full-size gradients
    of its own batch, never averaged across ranks, and leave the units' reductions nothing to reduce.
    torch tells a backward run by ``autograd.grad`` by refusing to say whether it will run a leaf's
    gradient accumulator; the same call on every rank raises on every rank, and the step is closed
    as any failed step is ([Note: a step that stops midway])."""
    # a plain parameter: asking about a tensor-parallel (DTensor) one stalled 2-D training (seen with
    # SequenceParallel norms), so models whose units all are tensor-parallel go unchecked
    param = next((p for h in ctx.handles if not h.tensor_parallel for p in h.params if p.requires_grad), None)
    if param is None:
        return
    try:
        torch._C._will_engine_execute_node(get_gradient_edge(param).node)
    except RuntimeError as e:
        if "autograd.grad" not in str(e):
            raise
        raise RuntimeError(
            "fully_shard: torch.autograd.grad over a sharded model is not supported: it would return this "
            "rank's gradients of its own batch only, full-size and not averaged across ranks. Call "
            "loss.backward() instead: each parameter's .grad is then this rank's shard of the averaged "
            "gradient (unshard_params(model, with_grads=True) shows the full ones)"
        ) from None


@_trace.hook("post_backward")
def _post_backward(state: _FSDPState, handle: FlatParamHandle) -> None:
    """Start the unit's gradient reduction and reshard; runs once per backward per unit."""
    if handle.training_state is not HandleTrainingState.BACKWARD_PRE:
        return
    handle.set_training_state(HandleTrainingState.BACKWARD_POST)
    ctx = _ctx(state)
    if handle.grads.state in (GradState.FLAT, GradState.AUTOGRAD):
        if _syncs(ctx, handle):
            # Keep one reduction in flight: it overlaps the next unit's backward, and finishing the
            # older one frees its unsharded gradient buffer, so gradient memory stays at ~one unit.
            ctx.wait_reductions()
            ctx.start_reduce(handle)
        else:
            grads.stage_for_no_sync(handle)  # `no_sync`: added to the kept sum when backward ends
    if handle.extensions is not None and _syncs(ctx, handle):
        reduce_extension_grads(handle)  # [Note: extension parameters]; under `no_sync` they stay unsharded
    if handle.switches.reshard_after_backward or not handle.is_unsharded:  # not gathered: views of nothing
        handle.reshard()
    _exposed_grads.expose_sharded_grads(handle)
    if state.backward_prefetch is BackwardPrefetch.BACKWARD_POST and handle.switches.backward_prefetch is None:
        _prefetch_for_backward(state, handle)


def _post_backward_final_callback(ctx: RootContext) -> None:
    """End of backward: reduce units whose trigger did not run, finish every reduction, go IDLE."""
    for state, handle in ctx.units():
        if handle.training_state is HandleTrainingState.BACKWARD_PRE:
            _post_backward(state, handle)
    for handle in ctx.handles:
        # a unit that ran in earlier `no_sync` micro-batches but not in this synced backward
        if handle.grads.state is GradState.KEPT_FOR_NO_SYNC and _syncs(ctx, handle):
            ctx.start_reduce(handle)
    ctx.end_step()


def _syncs(ctx: RootContext, handle: FlatParamHandle) -> bool:
    """Whether this backward reduces ``handle``'s gradients: not inside ``no_sync``, nor after
    ``set_requires_gradient_sync(unit, False)`` (both keep them unsharded locally)."""
    return ctx.sync_gradients and handle.switches.reduce_grads


# ---------------------------------------------------------------------------- post-backward trigger
class _PostBackwardTrigger(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs when the unit's backward is done."""

    @staticmethod
    def forward(ctx: Any, fire: Callable[[], None], *inputs: torch.Tensor) -> Any:
        ctx.fire = fire
        return inputs if len(inputs) != 1 else inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.fire()
        return (None, *grads)


def _attach_post_backward_trigger(
    state: _FSDPState, handle: FlatParamHandle, args: Any, kwargs: Any
) -> tuple[Any, Any]:
    # also for frozen groups: post-backward is where they reshard once the unit's backward is done
    plain = not kwargs and type(args) is tuple and all(type(a) is torch.Tensor for a in args)
    if plain:  # the common call, module(tensor, ...): no pytree round trip
        flat: list[Any] = list(args)
    else:
        flat, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
    step = _ctx(state).steps[handle]
    if not positions:
        step.untriggered_calls += 1  # this call's backward cannot be observed: reduce at the end
        return args, kwargs
    step.pending_triggers += 1
    outs = _PostBackwardTrigger.apply(functools.partial(_on_trigger, state, handle), *(flat[i] for i in positions))
    outs = (outs,) if isinstance(outs, torch.Tensor) else outs
    for i, out in zip(positions, outs):
        flat[i] = out
    if plain:
        return tuple(flat), kwargs
    return pytree.tree_unflatten(flat, spec)  # type: ignore[no-any-return]


def _on_trigger(state: _FSDPState, handle: FlatParamHandle) -> None:
    step = _ctx(state).steps[handle]
    step.pending_triggers -= 1
    # A call without a trigger (inputs needing no grad) may still have backward to run after the
    # last trigger fires; then only the final callback knows the unit is done.
    if step.pending_triggers == 0 and step.untriggered_calls == 0:
        _post_backward(state, handle)


# ---------------------------------------------------------------------------- tensors in structures
def _tensors(structure: Any) -> list[torch.Tensor]:
    """Every tensor in a nested output: containers pytree knows, and dataclass fields (pytree treats
    an unregistered dataclass as a leaf, which would hide its tensors from the pre-backward hooks)."""
    if type(structure) is torch.Tensor:  # the common output: no pytree walk
        return [structure]
    out: list[torch.Tensor] = []
    for leaf in pytree.tree_leaves(structure):
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            out.extend(_tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)]))
    return out


def _cast_inputs(args: Any, kwargs: Any, dtype: Optional[torch.dtype]) -> Optional[tuple[Any, Any]]:
    """A forward pre-hook's result: the inputs cast to ``dtype`` (None: left as they are)."""
    return None if dtype is None else (_cast_floating(args, dtype), _cast_floating(kwargs, dtype))


def _cast_floating(structure: Any, dtype: torch.dtype) -> Any:
    """Cast floating-point tensors in ``structure`` (dataclass fields too) to ``dtype``; others pass through."""
    return cast_floating(structure, dtype)
