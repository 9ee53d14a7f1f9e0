"""Functions on one sharded module, FSDP2's per-module methods for us: `is_sharded`,
`sharded_modules`, `unshard` / `reshard` (explicit prefetch from user code).

[Note: sharded modules]
A *sharded module* owns a unit: a module ``fully_shard`` was applied to, or one its policy made a
unit (both are in the registry under ``fully_shard``), or a `FullyShardedDataParallel` instance
(which stands for the module it wraps). It keeps its class, so where FSDP2 code calls a method of
``FSDPModule`` we offer a function taking the module; `is_sharded` is the analogue of
``isinstance(m, FSDPModule)``. A module inside a unit that owns none itself is not sharded, and
every function here refuses it, naming its FQN.

[Note: explicit unshard]
``unshard(module)`` all-gathers the module's unit now, as its pre-forward would (the same
`_prefetch._unshard`, so the limiter sees it but never refuses it). The unit's pre-forward then
finds it unsharded, or its all-gather in flight, and only waits: no second all-gather. The unit is
resharded where it would have been anyway (its post-forward, the end of the step), or by
``reshard(module)``. Inside ``unshard_params`` both are refused, as forward is.

[Note: a unit left unsharded]
Outside forward and backward a unit can stay unsharded: ``unshard(module)`` before its forward, or
``set_reshard_after_backward(False)`` after its backward. Its unsharded buffer is a copy of the
shard, and its next forward uses that copy without gathering again. So whatever writes the shard
first reshards such a unit (`reshard_left_unsharded`): ``load_state_dict`` (else the next forward
would run on the values from before the load, silently) and ``unshard_params`` (its writes).
``optimizer.step()`` refuses it instead, on every step, naming the unit: its parameters are the
full-shape views then, not the shard the optimizer's state belongs to. Resharding between steps
folds what the user left in ``.grad`` first, so a ``zero_grad()`` since the gradient was last shown
drops it; a gradient never shown (kept unsharded after backward) cannot be cleared that way.
In-place writes on the unsharded parameters (``p.mul_(0.5)`` under ``torch.no_grad()``) are copied
into the shard (`FlatParamHandle.keep_unsharded_writes`) before such a reshard and at the root's next
forward, so they are kept as writes on the sharded faces are.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from fsdp_composable._common_utils import TrainingState, _FSDPState, _get_fsdp_state
from fsdp_composable._flat_param import FSDP_FLATTENED, FlatParamHandle, HandleTrainingState
from fsdp_composable._grads import _exposed_grads
from fsdp_composable._guards._dtype_casts import adopt_cast
from fsdp_composable._runtime._prefetch import _unshard
from fsdp_composable.api import _check_bool

__all__ = ["UnshardHandle", "is_sharded", "reshard", "sharded_modules", "unshard"]

_WRAPPER_STATE = "_fsdp_state"  # where a FullyShardedDataParallel instance keeps its state


def _wrapper_state(module: nn.Module) -> Optional[_FSDPState]:
    state = vars(module).get(_WRAPPER_STATE)
    return state if isinstance(state, _FSDPState) else None


def is_sharded(module: object) -> bool:
    """Whether ``module`` owns a unit ([Note: sharded modules]): the analogue of FSDP2's
    ``isinstance(module, FSDPModule)``."""
    if not isinstance(module, nn.Module):
        return False
    return _get_fsdp_state(module) is not None or _wrapper_state(module) is not None


def sharded_modules(module: nn.Module) -> list[nn.Module]:
    """Every sharded module in ``module``'s subtree (``module`` included), in pre-order. A wrapper
    instance is listed for the module it wraps."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"sharded_modules expects an nn.Module, got {type(module).__name__}")
    found: list[nn.Module] = []
    wrapped: set[int] = set()
    for m in module.modules():
        state = _wrapper_state(m)
        if state is not None:
            wrapped.add(id(state.module))
        if id(m) not in wrapped and is_sharded(m):
            found.append(m)
    return found


def module_fqn(module: nn.Module) -> Optional[str]:
    """``module``'s FQN relative to the sharded module it lies in, read from its parameters (None:
    it holds no parameter a unit manages)."""
    for name, param in module.named_parameters():
        full = getattr(param, "_fsdp_fqn", None)
        if getattr(param, FSDP_FLATTENED, False) and isinstance(full, str) and full.endswith(name):
            return full[: len(full) - len(name)].rstrip(".")
    return None


def resolve(module: object, api: str) -> tuple[nn.Module, _FSDPState]:
    """The unit-owning module behind ``module`` (a wrapper's wrapped module) and its state; raise,
    naming the module, when it owns no unit."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"{api} expects a sharded nn.Module (one fully_shard was applied to or made a unit), "
            f"got {type(module).__name__}"
        )
    state = _wrapper_state(module)
    if state is not None:
        return state.module, state
    state = _get_fsdp_state(module)
    if state is not None:
        return module, state
    fqn = module_fqn(module)
    where = f"module {fqn!r} ({type(module).__name__})" if fqn is not None else f"this {type(module).__name__}"
    inside = " (its parameters belong to an enclosing unit)" if fqn is not None else ""
    raise ValueError(
        f"{api}: {where} is not a sharded module{inside}; call it on a module fully_shard was applied "
        "to or its policy made a unit (sharded_modules(model) lists them)"
    )


def unit_handles(state: _FSDPState, module: nn.Module) -> list[FlatParamHandle]:
    """The handles of the unit ``module`` owns (none when it holds no parameter of its own)."""
    return [h for h in state.handles if any(m is module for m in h.members)]  # any member of a list unit


def unit_name(state: _FSDPState, module: nn.Module) -> str:
    """``module``'s FQN as the error messages show it."""
    fqn = next((h.unit_fqn for h in unit_handles(state, module)), None)
    if fqn is None:
        fqn = module_fqn(module) or ""
    return f"{type(module).__name__} {fqn or '<root>'!r}"


def _refuse_inside_unshard_params(state: _FSDPState, module: nn.Module, api: str) -> None:
    states = state.all_states or [state]
    if any(s.training_state is TrainingState.SUMMON_FULL_PARAMS for s in states):
        raise RuntimeError(
            f"{api} of {unit_name(state, module)} was called inside unshard_params(); leave the "
            "unshard_params context first"
        )


class UnshardHandle:
    """What ``unshard(module, async_op=True)`` returns: `wait` finishes the all-gather and points
    the parameters at the gathered values. The module's pre-forward waits for it anyway, so calling
    `wait` is needed only to use the parameters before that."""

    def __init__(self, handles: list[FlatParamHandle]) -> None:
        self._handles = handles

    def wait(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            adopt_cast(handle)  # a cast since: the gather (of the old dtype) is dropped ([Note: casts after sharding])
            # a pre-forward may have waited (and a post-forward resharded) since: nothing to do then
            if handle.unshard_in_flight or handle.is_unsharded:
                handle.wait_unshard()


def unshard(module: nn.Module, async_op: bool = False) -> Optional[UnshardHandle]:
    """All-gather ``module``'s unit now (not its sub-units); see [Note: explicit unshard].

    ``async_op=True`` returns an `UnshardHandle` whose ``wait()`` finishes it (the module's
    pre-forward waits too); otherwise it waits and returns None. A collective: every rank calls it."""
    _check_bool("unshard argument 'async_op'", async_op)
    module, state = resolve(module, "unshard")
    _refuse_inside_unshard_params(state, module, "unshard")
    handles = unit_handles(state, module)
    for handle in handles:
        handle.drop_post_forward_shard()  # may predate a step or a load: gather the shard itself
        adopt_cast(handle)  # a cast since the last step: gather the new dtype
        _unshard(state, handle)
    waiter = UnshardHandle(handles)
    if async_op:
        return waiter
    waiter.wait()
    return None


def reshard_left_unsharded(state: _FSDPState, handle: FlatParamHandle) -> None:
    """Reshard ``handle`` if it was left unsharded outside forward and backward ([Note: a unit left
    unsharded]); a no-op otherwise."""
    if handle.training_state is not HandleTrainingState.IDLE:
        return
    if not (handle.is_unsharded or handle.unshard_in_flight):
        return
    _reshard_idle(state, handle)


def _reshard_idle(state: _FSDPState, handle: FlatParamHandle) -> None:
    """Reshard ``handle`` between steps (keeping in-place writes on its unsharded parameters) and
    show its sharded gradient as ``.grad`` again."""
    handle.keep_unsharded_writes()
    handle.reshard()
    # a zero_grad() since the gradient was last shown cleared it: drop it rather than show it again
    _exposed_grads.stash_sharded_grads(handle)
    _exposed_grads.expose_sharded_grads(handle)  # kept unsharded after backward: show its gradient now
    if state.ctx is not None:
        state.ctx.limiter.release_freed(state.ctx.handles)


def reshard(module: nn.Module) -> None:
    """Free ``module``'s unsharded parameters (not its sub-units') and point them at the shard again."""
    module, state = resolve(module, "reshard")
    _refuse_inside_unshard_params(state, module, "reshard")
    running = (HandleTrainingState.FORWARD, HandleTrainingState.BACKWARD_PRE)
    handles = unit_handles(state, module)
    if any(h.training_state in running for h in handles):
        raise RuntimeError(
            f"reshard of {unit_name(state, module)} was called while its forward or backward runs; "
            "call it before its forward or after its backward"
        )
    for handle in handles:
        _reshard_idle(state, handle)
