"""`NoGrad`: ``torch.no_grad()`` for the per-unit path, without the object torch's context builds."""

from __future__ import annotations

import torch

__all__ = ["NoGrad"]


class NoGrad:
    """``torch.no_grad()`` for the per-unit path (the gradient reductions): the same switch, without the
    ``set_grad_enabled`` object torch's context builds at every entry (microseconds, twice per unit and step)."""

    __slots__ = ("prev",)

    def __enter__(self) -> None:
        self.prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        torch._C._set_grad_enabled(self.prev)
