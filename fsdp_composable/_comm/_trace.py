"""Labels for the profiler and a debug log of every unit's unshard, reshard and reduction.

[Note: seeing what a step does]
Every all-gather, reduce-scatter, all-reduce, wait and hook of a unit runs inside `span`, which

- under ``torch.profiler`` (or ``torch.autograd.profiler``) opens a ``record_function`` range
  named ``fsdp::<what> <unit>``, e.g. ``fsdp::all_gather blocks.0``, so a trace shows where the
  step's time goes, unit by unit (docs/tracing.md);
- with the ``fsdp_composable`` logger at DEBUG level (``FSDP_COMPOSABLE_DEBUG=1`` in the
  environment sets that up, see `_configure_from_env`) logs one line when the operation starts and,
  for collectives and waits, one when it is done, with the rank, the unit and the bytes. When a job
  hangs, the last "start" line of each rank without its "done" names the collective it is stuck in,
  and comparing the ranks' logs shows which rank ran something else.

Off (no profiler, logger not at DEBUG) a span costs one check of a module-level flag and one
``isEnabledFor`` call and returns a shared no-op context: no string is formatted and no
``record_function`` is entered (that alone costs microseconds per call). ``benchmarks/bench_overhead.py``
measures the step with it; the numbers are in docs/tracing.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
from typing import Any, Callable, ContextManager, Optional, TypeVar

import torch
import torch.autograd.profiler as _autograd_profiler
import torch.distributed as dist

__all__: list[str] = []

logger = logging.getLogger("fsdp_composable")
ENV_SWITCH = "FSDP_COMPOSABLE_DEBUG"
_NULL: ContextManager[None] = contextlib.nullcontext()
_F = TypeVar("_F", bound=Callable[..., Any])


def _configure_from_env() -> None:
    """``FSDP_COMPOSABLE_DEBUG=1``: the ``fsdp_composable`` logger logs DEBUG lines to stderr, each
    prefixed with the time and process id (the rank is in the message). Without it the logger is
    left as the application configures it."""
    if os.environ.get(ENV_SWITCH, "").strip().lower() in ("", "0", "false", "no", "off"):
        return
    logger.setLevel(logging.DEBUG)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s pid %(process)d %(name)s: %(message)s"))
        logger.addHandler(handler)


_configure_from_env()


def span(
    what: str, unit: Optional[str], tensor: Optional[torch.Tensor] = None, done: bool = True
) -> ContextManager[Any]:
    """A profiler range ``fsdp::<what> <unit>`` and DEBUG log lines; a no-op context when neither is on.

    ``unit``: the unit's FQN, or None for the unit of the innermost enclosing span (a collective
    issued by a unit's method or hook). ``tensor``: the buffer the operation moves, for the byte
    count in the log. ``done``: also log when the operation finishes (hooks log only their start)."""
    # the flag torch's profilers set on entry and clear on exit (kineto's torch.profiler included)
    profiling = bool(_autograd_profiler._is_profiler_enabled)
    if not profiling and not logger.isEnabledFor(logging.DEBUG):
        return _NULL
    return _Span(what, unit, tensor, done, profiling)


# The unit of the innermost span entered and not yet left (only while tracing is on): a context
# variable, not a module-level stack, so each thread (and each span's exit) restores its own.
_CURRENT_UNIT: contextvars.ContextVar[str] = contextvars.ContextVar("fsdp_composable_trace_unit", default="?")


class _Span:
    def __init__(
        self, what: str, unit: Optional[str], tensor: Optional[torch.Tensor], done: bool, profiling: bool
    ) -> None:
        self.unit = (unit or "<root>") if unit is not None else _CURRENT_UNIT.get()
        self.label = f"fsdp::{what} {self.unit}"
        self.tensor = tensor
        self.done = done
        self.range = _autograd_profiler.record_function(self.label) if profiling else None
        self.token: Optional[contextvars.Token[str]] = None

    def _log(self, event: str) -> None:
        if not logger.isEnabledFor(logging.DEBUG):
            return
        rank = dist.get_rank() if dist.is_initialized() else 0
        size = ""
        if self.tensor is not None:
            t = self.tensor
            size = f" ({t.numel():,} x {str(t.dtype).removeprefix('torch.')}, {t.numel() * t.element_size():,} B)"
        logger.debug("rank %d %s %s%s", rank, event, self.label, size)

    def __enter__(self) -> None:
        self._log("start")
        self.token = _CURRENT_UNIT.set(self.unit)
        if self.range is not None:
            self.range.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.range is not None:
            self.range.__exit__(*exc)
        if self.token is not None:
            _CURRENT_UNIT.reset(self.token)
        if self.done:
            self._log("failed" if exc[0] is not None else "done")


def hook(what: str) -> Callable[[_F], _F]:
    """Decorate a runtime hook ``fn(state, handle, ...)``: it runs inside ``span(what, handle's unit)``."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapped(state: Any, handle: Any, *args: Any, **kwargs: Any) -> Any:
            if not (_autograd_profiler._is_profiler_enabled or logger.isEnabledFor(logging.DEBUG)):
                return fn(state, handle, *args, **kwargs)
            with span(what, handle.unit_fqn, done=False):
                return fn(state, handle, *args, **kwargs)

        return wrapped  # type: ignore[return-value]

    return decorate


def method(what: str, tensor: str = "", unit: Callable[[Any], str] = lambda self: self.unit_fqn) -> Callable[[_F], _F]:
    """Decorate a method of a unit's handle (or of an object ``unit`` maps to the unit's FQN): it runs
    inside ``span(what, unit(self), getattr(self, tensor))``."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not (_autograd_profiler._is_profiler_enabled or logger.isEnabledFor(logging.DEBUG)):
                return fn(self, *args, **kwargs)
            with span(what, unit(self), getattr(self, tensor, None) if tensor else None):
                return fn(self, *args, **kwargs)

        return wrapped  # type: ignore[return-value]

    return decorate
