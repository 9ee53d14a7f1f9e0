"""`register_fsdp_forward_method`: other forward methods (e.g. ``generate``) run the forward hooks."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from fsdp_composable._common_utils import _FSDPState, _get_fsdp_state, _is_inside_unit
from fsdp_composable._runtime._entry_points import _in_backward
from fsdp_composable._runtime._lazy_init import _ctx, _lazy_init
from fsdp_composable._runtime._runtime_utils import (
    _fsdp_root_post_forward,
    _fsdp_root_pre_forward,
    _post_forward,
    _pre_forward,
)

__all__ = ["register_fsdp_forward_method"]


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
            ctx.abort_step()
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
                ctx.abort_step()
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
