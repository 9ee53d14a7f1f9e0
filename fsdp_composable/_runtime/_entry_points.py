"""What an entry point between steps (``no_sync``, ``clip_grad_norm_``, ``unshard_params``,
``reset_parameters``) checks first: whether a forward or backward is running now, and whether the
previous step stopped midway ([Note: a step that stops midway]).

The stack-frame walk in `_live_forward` recognises torch's ``nn.Module._call_impl``: it changes
nothing in torch but depends on its internals (listed as 7. in `_torch_interop`, which cannot hold
it: it imports the runtime that uses it). The library's own counter (``open_forwards``, kept by the
root pre/post-forward hooks) cannot replace it: torch runs no hook when a ``BaseException`` leaves a
forward (``_call_impl`` runs its ``always_call`` hooks for an ``Exception`` only), so the counter
alone cannot tell an entry point called inside a running forward (refused) from one called after
an interrupted forward (which closes that step and goes on): tests/test_bad_runtime_inputs.py pins
the first, tests/test_recovery.py the second."""

from __future__ import annotations

import sys
from typing import Any, Iterator

import torch
from torch import nn

from fsdp_composable._common_utils import TrainingState, _FSDPState
from fsdp_composable._runtime._root_context import RootContext

__all__: list[str] = []


def _in_backward() -> bool:
    """A forward running while autograd runs a backward is activation-checkpoint recomputation."""
    return bool(torch._C._current_graph_task_id() != -1)


def _live_forward(ctx: RootContext) -> bool:
    """Whether a root forward is running on this thread's stack now (an entry point called from
    inside it), as opposed to one left open by a ``BaseException``."""
    root = ctx.root.module
    for frame in _frames():
        if frame.f_code is _CALL_IMPL_CODE and frame.f_locals.get("self") is root:
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
    return state.ctx is not None and _live_forward(state.ctx)


def _settle_unfinished_step(state: _FSDPState) -> None:
    """At an entry point between steps (``no_sync``, ``clip_grad_norm_``, ``unshard_params``): close
    a step that stopped midway (abort), or one whose backward will not come because its forward
    finished and no backward started (end it normally: nothing of it reached the gradients)."""
    ctx = state.ctx
    if ctx is None or _in_backward() or _live_forward(ctx):
        return
    if ctx.final_callback_queued or ctx.open_forwards > 0:
        ctx.abort_step()
    elif any(s.training_state is TrainingState.FORWARD_BACKWARD for s in ctx.states):
        ctx.end_step()
