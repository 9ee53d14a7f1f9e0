"""The runtime of one step: hooks for root pre-forward, pre/post forward, pre/post backward, and the
final callback. Each hook is a function taking the state (and handle) first.

[Note: one step]
root pre-forward (lazy init once; every state enters FORWARD_BACKWARD; cast root inputs) -> per
unit: pre-forward (unshard, wait, prefetch the next unit, attach the post-backward trigger to the
inputs) -> forward -> post-forward (reshard unless root unit or SHARD_GRAD_OP/NO_SHARD; hook the
outputs for pre-backward) ... backward: pre-backward (unshard, prefetch, point ``.grad`` at the
gradient buffer) -> autograd fills the buffer -> post-backward (start the async reduction, reshard)
-> final callback (finish every reduction, reshard leftovers, every state back to IDLE).

[Note: when post-backward runs]
A unit's gradients are complete once autograd has run the whole module backward, i.e. once the
gradients of the module's *inputs* are computed. Pre-forward passes the inputs that require grad
through `_PostBackwardTrigger`, an identity whose backward runs then. A unit called k times gets k
triggers and reduces after the last. Units whose inputs need no grad (the first unit) or whose
trigger never runs reduce in the final callback.

[Note: a step that stops midway]
A step is opened by the root pre-forward and closed by `_end_step` (the final callback, or the root
post-forward when no backward follows). When forward or backward raises, `_abort_step` closes it
instead: it waits for every collective already posted (each rank that failed at the same point
posted the same ones, so nothing stays half-matched), drops everything the step produced for the
gradients ([Note: the gradient lifecycle]), reshards and returns every state and handle to IDLE,
while the sharded gradients of earlier backwards and ``no_sync``'s kept sums stay. It runs from the
root post-forward (``always_call``: an ``Exception`` in forward), from a registered forward method
(any ``BaseException``), and, for what neither sees (a ``BaseException`` in forward, anything in
backward, where autograd skips the final callback), from the next entry point that finds the step
unfinished ([Note: the root context]).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils import _pytree as pytree

from fsdp_composable import _rank_agreement, _trace
from fsdp_composable import _reduce_utils as grads
from fsdp_composable._cast_inputs import cast_floating
from fsdp_composable._common_utils import (
    TrainingState,
    _FSDPState,
    _get_fsdp_state,
    _get_fsdp_states,
    _is_inside_unit,
    _set_training_state,
)
from fsdp_composable._config import UnitConfig
from fsdp_composable._exec_order_utils import _ExecOrderData
from fsdp_composable._flat_param import FlatParamHandle, HandleTrainingState
from fsdp_composable._limiter_utils import _AllGatherLimiter
from fsdp_composable._model_edit_checks import check_model_unchanged
from fsdp_composable._reduce_utils import GradState
from fsdp_composable._root_context import RootContext, UnitStep
from fsdp_composable.api import BackwardPrefetch, ShardingStrategy

__all__: list[str] = []

_RESHARD_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
_BACKWARD_STATES = (HandleTrainingState.BACKWARD_PRE, HandleTrainingState.BACKWARD_POST)


# ---------------------------------------------------------------------------- registration
def _eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Hooks run eagerly even inside ``torch.compile(module)``: they issue collectives, wait on work
    and flip state, which dynamo cannot trace; the module's own forward still compiles whole."""
    return torch._dynamo.disable(fn)  # type: ignore[no-any-return]


def _register_hooks(state: _FSDPState) -> None:
    """Attach the root hooks to ``state.module`` and the unit hooks to each unit module."""
    module = state.module
    state.hook_handles.append(
        module.register_forward_pre_hook(
            _eager(functools.partial(_fsdp_root_pre_forward, state)), prepend=True, with_kwargs=True
        )
    )
    for handle in state.handles:
        unit_module = handle.module
        pre = _eager(functools.partial(_pre_forward, state, handle))
        post = _eager(functools.partial(_post_forward, state, handle))
        state.hook_handles.append(
            unit_module.register_forward_pre_hook(pre, prepend=unit_module is not module, with_kwargs=True)
        )
        state.hook_handles.append(unit_module.register_forward_hook(post))
    state.hook_handles.append(
        module.register_forward_hook(_eager(functools.partial(_fsdp_root_post_forward, state)), always_call=True)
    )
    state.hook_handles.append(module._register_state_dict_hook(functools.partial(_buffer_dtype_state_dict_hook, state)))


# ---------------------------------------------------------------------------- lazy init
def _lazy_init(state: _FSDPState, root_module: nn.Module) -> None:
    """On the first forward: the state whose module runs first is the root; build the root context
    every state below it shares ([Note: the root context])."""
    if state.ctx is not None:
        return
    states = _get_fsdp_states(root_module)
    streams: tuple[Optional[torch.cuda.Stream], Optional[torch.cuda.Stream]] = (None, None)
    if state.device.type == "cuda":  # one pair of side streams for the whole root, see _collectives.issue
        streams = torch.cuda.Stream(state.device), torch.cuda.Stream(state.device)
    ctx = RootContext(
        root=state,
        states=states,
        exec_order=_ExecOrderData(state.process_group),
        limiter=_AllGatherLimiter(),
        unshard_stream=streams[0],
        reduce_stream=streams[1],
        # a unit that ran by itself before the root's first forward keeps its counters
        steps={h: s.ctx.steps[h] if s.ctx is not None else UnitStep() for s in states for h in s.handles},
    )
    for s in states:
        s.ctx = ctx
    handles = ctx.handles
    fqn_of = {m: name for name, m in root_module.named_modules()}
    ctx.exec_order.set_units(handles, [fqn_of.get(h.module, h.unit_fqn) or "<root>" for h in handles])
    buffers, dtypes = _get_buffers_and_dtypes_for_computation(state)
    _cast_buffers_to_dtype_and_device(buffers, dtypes, state.device)


def _ctx(state: _FSDPState) -> RootContext:
    assert state.ctx is not None, "used before lazy init"
    return state.ctx


# ---------------------------------------------------------------------------- buffers
# [Note: buffer casting]
# Every floating-point buffer is cast once, at lazy init, to the ``buffer_dtype`` of the unit whose
# module tree holds it (per submodule, whatever the buffer's name), and stays so for computation.
# Checkpoints must not see that: each state records its buffers' original dtypes under clean FQNs at
# construction, and a state-dict hook casts the saved values back (`_buffer_dtype_state_dict_hook`).
def _module_to_unit_config(root: _FSDPState) -> dict[nn.Module, UnitConfig]:
    """The settings governing each module: its deepest enclosing unit's (states are outermost first,
    handles root first then pre-order, so deeper assignments come later and win)."""
    config: dict[nn.Module, UnitConfig] = {}
    for s in root.all_states:
        for m in s.module.modules():
            config[m] = s.config
        for handle in s.handles:
            for m in handle.module.modules():
                config[m] = handle.config
        for m in s.ignored_modules:
            config.pop(m, None)
    return config


def _get_buffers_and_dtypes_for_computation(
    root: _FSDPState,
) -> tuple[list[tuple[nn.Module, str]], list[Optional[torch.dtype]]]:
    buffers: list[tuple[nn.Module, str]] = []
    dtypes: list[Optional[torch.dtype]] = []
    for module, config in _module_to_unit_config(root).items():
        mp = config.mixed_precision
        for name, buf in module._buffers.items():
            if buf is None:
                continue
            buffers.append((module, name))
            cast = mp is not None and mp.buffer_dtype is not None and buf.is_floating_point()
            dtypes.append(mp.buffer_dtype if cast and mp is not None else None)
    return buffers, dtypes


def _get_buffers_and_dtypes_for_checkpoint(state: _FSDPState) -> dict[str, torch.dtype]:
    """Clean buffer FQN (relative to ``state.module``) -> the dtype it had before any casting."""
    return state.buffer_name_to_orig_dtype


def _cast_buffers_to_dtype_and_device(
    buffers: list[tuple[nn.Module, str]], dtypes: list[Optional[torch.dtype]], device: torch.device
) -> None:
    """Replace each ``module._buffers[name]`` by its cast (``None`` dtype: keep the dtype)."""
    for (module, name), dtype in zip(buffers, dtypes):
        buf = module._buffers[name]
        assert buf is not None
        module._buffers[name] = buf.to(device=device, dtype=dtype or buf.dtype)


def _buffer_dtype_state_dict_hook(
    state: _FSDPState, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    for fqn, dtype in _get_buffers_and_dtypes_for_checkpoint(state).items():
        value = state_dict.get(prefix + fqn)
        if isinstance(value, torch.Tensor) and value.dtype != dtype:
            state_dict[prefix + fqn] = value.to(dtype)


def _unit_handles(state: _FSDPState, handle: FlatParamHandle) -> list[FlatParamHandle]:
    """The handles of ``handle``'s unit (one per dtype/requires_grad group), ``handle`` included."""
    return [h for h in state.handles if h.module is handle.module]


def _is_root_unit(state: _FSDPState, handle: FlatParamHandle) -> bool:
    root = state.root_state
    return root is not None and handle.module is root.module


# ---------------------------------------------------------------------------- forward
def _in_backward() -> bool:
    """A forward running while autograd runs a backward is activation-checkpoint recomputation."""
    return bool(torch._C._current_graph_task_id() != -1)


def _fsdp_root_pre_forward(state: _FSDPState, module: nn.Module, args: Any, kwargs: Any) -> Any:
    _lazy_init(state, module)
    if not state.is_root or _in_backward():
        return None
    ctx = _ctx(state)
    if any(s.training_state is TrainingState.SUMMON_FULL_PARAMS for s in ctx.states):
        raise RuntimeError(
            f"forward of {type(module).__name__} was called inside unshard_params(); leave the "
            "unshard_params context before running forward"
        )
    if ctx.unfinished():  # the previous step stopped midway ([Note: a step that stops midway])
        _abort_step(ctx)
    nested = ctx.open_forwards > 0  # a registered method (e.g. generate) calling self(...)
    ctx.open_forwards += 1
    if not nested:
        check_model_unchanged(state)  # see [Note: edits of a sharded model]
        for s in ctx.states:
            _set_training_state(s, TrainingState.FORWARD_BACKWARD)
        ctx.exec_order.start_forward()
        for handle in ctx.handles:
            grads.release_cleared_grads(handle)
    mp = state.config.mixed_precision
    if mp is not None and mp.param_dtype is not None and mp.cast_root_forward_inputs:
        return _cast_floating(args, mp.param_dtype), _cast_floating(kwargs, mp.param_dtype)
    return None


def _fsdp_root_post_forward(state: _FSDPState, module: nn.Module, args: Any, output: Any) -> Any:
    if not state.is_root or _in_backward():
        return output
    ctx = _ctx(state)
    if sys.exc_info()[1] is not None:  # registered with always_call: the forward raised
        # Only a forward that was opened needs closing: if pre-forward refused to start one (e.g.
        # forward inside unshard_params), resetting would break the context that owns the states.
        if ctx.open_forwards > 1:
            ctx.open_forwards -= 1  # nested: the registered method around it aborts the step
        elif ctx.open_forwards == 1:
            _abort_step(ctx)
        return None
    ctx.open_forwards = max(ctx.open_forwards - 1, 0)
    if ctx.open_forwards > 0:
        return output  # nested in a registered method: its own post-forward closes the forward
    ctx.exec_order.end_forward()
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in _tensors(output)):
        _end_step(ctx)  # no backward will follow: leave everything IDLE and resharded now
    return output


@_trace.hook("pre_forward")
def _pre_forward(state: _FSDPState, handle: FlatParamHandle, module: nn.Module, args: Any, kwargs: Any) -> Any:
    # Recomputation by activation checkpointing (possibly before this unit's pre-backward, when a
    # later op of an enclosing checkpointed module needs it): only make the parameters whole.
    if _in_backward() or handle.training_state in _BACKWARD_STATES:
        _unshard(state, handle)
        handle.wait_unshard()
        return None
    if state.ctx is None:  # a unit called by itself before the root's first forward
        _lazy_init(state, state.module)
    ctx = _ctx(state)
    nested = handle.training_state is HandleTrainingState.FORWARD
    if nested and ctx.method_calls == 0:  # left in FORWARD by a forward that died (BaseException)
        _abort_step(ctx)
        nested = False
    if nested:  # the unit's module calls itself inside a registered method: it is already whole
        ctx.steps[handle].forward_depth += 1
    else:
        handle.set_training_state(HandleTrainingState.FORWARD)
        ctx.steps[handle].forward_depth = 1
        ctx.exec_order.record_pre_forward(handle)
        for sibling in _unit_handles(state, handle):  # a unit's groups gather together, each waits for its own
            _unshard(state, sibling)
        if state.forward_prefetch:
            _prefetch(state, ctx.exec_order.forward_prefetch_target(handle), "forward")
        handle.wait_unshard()
    mp = handle.config.mixed_precision
    if mp is not None and mp.param_dtype is not None and mp.cast_forward_inputs:
        args, kwargs = _cast_floating(args, mp.param_dtype), _cast_floating(kwargs, mp.param_dtype)
    if torch.is_grad_enabled():
        args, kwargs = _attach_post_backward_trigger(state, handle, args, kwargs)
    return args, kwargs


@_trace.hook("post_forward")
def _post_forward(state: _FSDPState, handle: FlatParamHandle, module: nn.Module, args: Any, output: Any) -> Any:
    if _in_backward() or handle.training_state in _BACKWARD_STATES:
        return output
    step = _ctx(state).steps[handle]
    if step.forward_depth > 1:  # the inner call of a unit calling itself: stays whole
        step.forward_depth -= 1
    else:
        step.forward_depth = 0
        _ctx(state).exec_order.record_post_forward(handle)
        if _reshard_after_forward(state, handle):
            handle.reshard()
        handle.set_training_state(HandleTrainingState.IDLE)
    if torch.is_grad_enabled():
        hook = functools.partial(_pre_backward_hook, state, handle)
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(hook)
    return output


def _reshard_after_forward(state: _FSDPState, handle: FlatParamHandle) -> bool:
    if _is_root_unit(state, handle):
        return False  # needed first in backward; the root post-forward reshards it if none follows
    return not torch.is_grad_enabled() or handle.config.strategy in _RESHARD_AFTER_FORWARD


# ---------------------------------------------------------------------------- backward
@_trace.hook("pre_backward")
def _pre_backward_hook(state: _FSDPState, handle: FlatParamHandle, grad: torch.Tensor) -> None:
    ctx = _ctx(state)
    step = ctx.steps[handle]
    if step.ran_pre_backward:
        return
    if not ctx.final_callback_queued:
        ctx.final_callback_queued = True
        Variable._execution_engine.queue_callback(functools.partial(_post_backward_final_callback, ctx))
    step.ran_pre_backward = True
    handle.set_training_state(HandleTrainingState.BACKWARD_PRE)
    ctx.exec_order.record_pre_backward(handle)
    _unshard(state, handle)
    if state.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
        _prefetch_for_backward(state, handle)
    handle.wait_unshard()
    if handle.requires_grad:
        # Let autograd allocate the gradients as they come, instead of holding a whole buffer from
        # now on, when no trigger will fire (the unit reduces in the final callback) or when the
        # reduction sends them as they are (see [Note: gradients land in the flat buffer]).
        untriggered = step.pending_triggers == 0 or step.untriggered_calls > 0
        # a DTensor parameter's .grad cannot view a plain buffer: [Note: tensor-parallel parameters]
        lazy = untriggered or handle.tensor_parallel or grads.takes_autograd_grads(handle)
        grads.begin_backward(handle, lazy=lazy)


@_trace.hook("post_backward")
def _post_backward(state: _FSDPState, handle: FlatParamHandle) -> None:
    """Start the unit's gradient reduction and reshard; runs once per backward per unit."""
    if handle.training_state is not HandleTrainingState.BACKWARD_PRE:
        return
    handle.set_training_state(HandleTrainingState.BACKWARD_POST)
    ctx = _ctx(state)
    if handle.grads.state in (GradState.FLAT, GradState.AUTOGRAD):
        if state.sync_gradients:
            # Keep one reduction in flight: it overlaps the next unit's backward, and finishing the
            # older one frees its unsharded gradient buffer, so gradient memory stays at ~one unit.
            _wait_reductions(ctx)
            ctx.pending_reductions.append(grads.start_reduce(handle, ctx.reduce_stream))
        else:
            grads.stage_for_no_sync(handle)  # `no_sync`: added to the kept sum when backward ends
    handle.reshard()
    grads.expose_sharded_grads(handle)
    if state.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
        _prefetch_for_backward(state, handle)


def _post_backward_final_callback(ctx: RootContext) -> None:
    """End of backward: reduce units whose trigger did not run, finish every reduction, go IDLE."""
    for state, handle in ctx.units():
        if handle.training_state is HandleTrainingState.BACKWARD_PRE:
            _post_backward(state, handle)
    for state, handle in ctx.units():
        # a unit that ran in earlier `no_sync` micro-batches but not in this synced backward
        if handle.grads.state is GradState.KEPT_FOR_NO_SYNC and state.sync_gradients:
            ctx.pending_reductions.append(grads.start_reduce(handle, ctx.reduce_stream))
    _end_step(ctx)


def _end_step(ctx: RootContext) -> None:
    """Close a step that succeeded: its gradients reach ``.grad`` (or no_sync's kept sums) now."""
    _wait_reductions(ctx)
    for handle in ctx.handles:
        if handle.is_unsharded or handle.unshard_in_flight:
            handle.reshard()
        if handle.training_state is not HandleTrainingState.IDLE:
            handle.set_training_state(HandleTrainingState.IDLE)
    finished, ctx.finished_reductions = ctx.finished_reductions, []
    for reduction in finished:
        reduction.commit()
    for handle in ctx.handles:
        if handle.grads.state is GradState.STAGED:
            grads.commit_staged(handle)
    for s in ctx.states:
        if s.training_state is TrainingState.FORWARD_BACKWARD:
            _set_training_state(s, TrainingState.IDLE)
    ctx.reset_counters()
    ctx.exec_order.next_iter()


def _abort_step(ctx: RootContext) -> None:
    """Close a step that stopped midway; see [Note: a step that stops midway]."""
    # tell the peers first: one still inside a collective of this step raises instead of waiting
    _rank_agreement.leave_step(g for h in ctx.handles for g in (h.process_group, h.replicate_group))
    error: Optional[BaseException] = None
    reductions = ctx.pending_reductions + ctx.finished_reductions
    ctx.pending_reductions, ctx.finished_reductions = [], []
    for reduction in reductions:
        try:
            reduction.wait()  # its buffers must outlive the collective; its result is dropped
        except Exception as e:  # a peer died: still reset everything, then report it
            error = error or e
    for handle in ctx.handles:
        # A forward refused before its pre-forward released what zero_grad() cleared (e.g. the edit
        # check) must not bring the cleared gradients back as .grad below.
        grads.release_cleared_grads(handle)
        grads.abort(handle)
        try:
            handle.reshard()  # waits for an all-gather in flight
        except Exception as e:
            error = error or e
        handle.training_state = HandleTrainingState.IDLE  # a reset, not a transition
        grads.expose_sharded_grads(handle)
    for s in ctx.states:
        if s.training_state is TrainingState.FORWARD_BACKWARD:
            s.training_state = TrainingState.IDLE  # a reset, not a transition
    ctx.reset_counters()
    if error is not None:
        raise error


def _wait_reductions(ctx: RootContext) -> None:
    """Finish the reductions in flight; their results wait for the end of backward."""
    pending, ctx.pending_reductions = ctx.pending_reductions, []
    for reduction in pending:
        reduction.wait()
        ctx.finished_reductions.append(reduction)


def _live_forward(ctx: RootContext) -> bool:
    """Whether a root forward is running on this thread's stack now (an entry point called from
    inside it), as opposed to one left open by a ``BaseException``."""
    roots = {id(ctx.root.module)}
    for frame in _frames():
        if frame.f_code is _CALL_IMPL_CODE and id(frame.f_locals.get("self")) in roots:
            return True
    return ctx.method_calls > 0


_CALL_IMPL_CODE = nn.Module._call_impl.__code__


def _frames() -> Iterator[Any]:
    frame = sys._getframe(1)
    while frame is not None:
        yield frame
        frame = frame.f_back  # type: ignore[assignment]


def _forward_running(state: _FSDPState) -> bool:
    """Whether the root forward of ``state``'s root is running on the stack now."""
    root = state.root_state if state.root_state is not None else state
    return root.ctx is not None and _live_forward(root.ctx)


def _settle_unfinished_step(state: _FSDPState) -> None:
    """At an entry point between steps (``no_sync``, ``clip_grad_norm_``, ``unshard_params``): close
    a step that stopped midway (abort), or one whose backward will not come because its forward
    finished and no backward started (end it normally: nothing of it reached the gradients)."""
    root = state.root_state if state.root_state is not None else state
    ctx = root.ctx
    if ctx is None or _in_backward() or _live_forward(ctx):
        return
    if ctx.final_callback_queued or ctx.open_forwards > 0:
        _abort_step(ctx)
    elif any(s.training_state is TrainingState.FORWARD_BACKWARD for s in ctx.states):
        _end_step(ctx)


# ---------------------------------------------------------------------------- unshard / prefetch
def _unshard(state: _FSDPState, handle: FlatParamHandle) -> None:
    handle.unshard(state.ctx.unshard_stream if state.ctx is not None else None)
    if state.ctx is not None:
        state.ctx.limiter.record(state.ctx.non_root_handles)


def _prefetch(state: _FSDPState, handle: Optional[FlatParamHandle], phase: str) -> None:
    """Start ``handle``'s all-gather early, unless it is already under way or the limiter says no."""
    if handle is None or handle.is_unsharded or handle.unshard_in_flight:
        return
    ctx = _ctx(state)
    if state.limit_all_gathers and not ctx.limiter.may_prefetch(ctx.non_root_handles):
        return
    ctx.exec_order.prefetch_log.append((phase, handle.unit_fqn))
    _unshard(state, handle)


def _prefetch_for_backward(state: _FSDPState, handle: FlatParamHandle) -> None:
    if state.ctx is not None:
        steps = state.ctx.steps
        target = state.ctx.exec_order.backward_prefetch_target(handle, lambda h: steps[h].ran_pre_backward)
        _prefetch(state, target, "backward")


# ---------------------------------------------------------------------------- other forward methods
def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` (e.g. ``generate``) unshard and reshard like ``forward`` does.

    Hooks only see ``forward``; this wraps the method on the instance so it runs the same pre/post
    forward steps (as the root when ``module`` is the root)."""
    state = _check_forward_method_args(module, method_name)
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")
    handles = [h for h in state.handles if h.module is module]

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if state.ctx is None:  # before the first forward (of the root, or of this unit by itself)
            _lazy_init(state, state.module)
        ctx = _ctx(state)
        if ctx.method_calls == 0 and not _in_backward() and ctx.unfinished():
            _abort_step(ctx)
        ctx.method_calls += 1  # lets the method call self(...): see [Note: the root context]
        try:
            if module is state.module:
                new = _fsdp_root_pre_forward(state, module, args, kwargs)
                args, kwargs = new if new is not None else (args, kwargs)
            for handle in handles:
                new = _pre_forward(state, handle, module, args, kwargs)
                args, kwargs = new if new is not None else (args, kwargs)
            output = method(*args, **kwargs)
            for handle in handles:
                output = _post_forward(state, handle, module, args, output)
            if module is state.module:
                _fsdp_root_post_forward(state, module, args, output)
            return output
        except BaseException:
            if ctx.method_calls == 1 and not _in_backward():  # also KeyboardInterrupt, which hooks miss
                _abort_step(ctx)
            raise
        finally:
            ctx.method_calls -= 1

    object.__setattr__(module, method_name, wrapped)


def _check_forward_method_args(module: Any, method_name: Any) -> _FSDPState:
    """The state ``register_fsdp_forward_method`` attaches to, after checking its arguments."""
    api = "register_fsdp_forward_method"
    if not isinstance(module, nn.Module):
        raise TypeError(f"{api} argument 'module' must be an nn.Module, got {type(module).__name__}")
    if not isinstance(method_name, str):
        raise TypeError(
            f"{api} argument 'method_name' must be a str, got {type(method_name).__name__}: {method_name!r}"
        )
    if method_name == "forward":  # its hooks would run twice and the states would not know why
        raise ValueError(
            f"{api}: 'forward' already runs fully_shard's hooks; register only other methods (e.g. 'generate')"
        )
    state = _get_fsdp_state(module)
    if state is None and _is_inside_unit(module):
        raise ValueError(
            f"{api}: this {type(module).__name__} is not a fully_shard root or unit; register the method on the "
            "module fully_shard was applied to (or make this module a unit with the policy)"
        )
    if state is None:
        raise ValueError(f"{api}: call fully_shard on this {type(module).__name__} before registering {method_name!r}")
    return state


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
    out: list[torch.Tensor] = []
    for leaf in pytree.tree_leaves(structure):
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            out.extend(_tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)]))
    return out


def _cast_floating(structure: Any, dtype: torch.dtype) -> Any:
    """Cast floating-point tensors in ``structure`` (dataclass fields too) to ``dtype``; others pass through."""
    return cast_floating(structure, dtype)
