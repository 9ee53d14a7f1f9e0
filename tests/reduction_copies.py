"""What a gradient reduction copies: every copy of a unit's whole (padded) gradient made while
`_reduce_utils.start_reduce` issues that unit's reduction: a copy of at least that size reading a
tensor whose memory holds at least that much (the gradient buffer or slices of it; autograd's separate
gradients assembled into one tensor are not counted). Used by test_partial_grads.py and
device_audit_world.py."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_composable._comm import _collectives
from fsdp_composable._grads import _reduce_utils

_COPIES = {
    torch.ops.aten.cat.default,
    torch.ops.aten.copy_.default,
    torch.ops.aten.clone.default,
    torch.ops.aten._to_copy.default,
}


def _read(func: Any, args: Any) -> list[torch.Tensor]:
    """The tensors a copy reads."""
    if func is torch.ops.aten.cat.default:
        return list(args[0])
    return [args[1] if func is torch.ops.aten.copy_.default else args[0]]


class _Copies(TorchDispatchMode):
    def __init__(self, least: int, unit: str, seen: list[str]) -> None:
        super().__init__()
        self.least, self.unit, self.seen = least, unit, seen

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _COPIES and isinstance(out, torch.Tensor) and out.numel() >= self.least:
            # read from memory of a whole unit's gradient (the buffer, or a slice of it): not autograd's
            # separate gradients assembled into one tensor
            if any(t.untyped_storage().nbytes() >= self.least * t.element_size() for t in _read(func, args)):
                self.seen.append(f"{func.__name__} of {out.numel()} elements (unit '{self.unit}')")
        return out


@dataclass
class Seen:
    copies: list[str] = field(default_factory=list)
    collectives: list[str] = field(default_factory=list)  # "<name> <numel>", in the order issued


@contextlib.contextmanager
def reduction_copies() -> Iterator[Seen]:
    """Collect, per reduction issued meanwhile, each copy (``cat``, ``copy_``, ``clone``, ``to``) of
    its unit's whole gradient made while issuing it (see the module docstring), and the collectives
    issued meanwhile."""
    seen = Seen()
    real = _reduce_utils.start_reduce
    real_collectives = {name: getattr(_collectives, name) for name in ("reduce_scatter", "all_reduce")}

    def counted(handle: Any, *args: Any) -> Any:
        with _Copies(max(handle.layout.padded_numel, 1), handle.unit_fqn or "<root>", seen.copies):
            return real(handle, *args)

    def collective(name: str) -> Any:
        def run(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            seen.collectives.append(f"{name} {output.numel()}")
            return real_collectives[name](output, *args, **kwargs)

        return run

    _reduce_utils.start_reduce = counted  # type: ignore[assignment]
    for name in real_collectives:
        setattr(_collectives, name, collective(name))
    try:
        yield seen
    finally:
        _reduce_utils.start_reduce = real  # type: ignore[assignment]
        for name, fn in real_collectives.items():
            setattr(_collectives, name, fn)
