"""The ``output_and_loss`` term of `estimate_memory`: the module's output, the loss computed from it
and the loss's backward down to the output's gradient, measured on fake tensors (see [Note: measuring
the loss])."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Optional

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__: list[str] = []

LossFn = Callable[[Any], torch.Tensor]


# [Note: measuring the loss]
# Where backward starts, before any unit's gradient buffer exists, the step holds the forward's saved
# activations plus what the loss needs: the loss's own saved tensors (cross-entropy saves its
# log-softmax, vocabulary-sized and in fp32 when the logits are cast up) and the gradients its
# backward passes down to the module's output (for cross-entropy the log-softmax's and then the
# logits'). Over a large vocabulary these are as large as a block's activations, and they do not
# shrink with the model's width (the benchmark's 10M model: 3 x 15.9 MiB, a quarter of its peak).
# With ``loss_fn`` we run it on the fake forward's output and then autograd down to the output (a
# `GradientEdge` of each output tensor, so the output itself is not held) under `_LiveBytes`, a
# dispatch mode that counts each storage made by an op once and drops it when its storage dies
# (`weakref.finalize` on the storage, which torch keeps alive exactly as long as the storage); the
# term is the peak. The output counts while the loss's forward runs and afterwards only if the loss
# saved it (the usual `loss = loss_fn(model(x))` drops it); a storage the forward saved for backward
# (counted in ``activations``) is not counted again. Without ``loss_fn`` the term is the output's
# gradient alone: the bytes of every floating output tensor that requires grad, which any loss's
# backward produces (a lower bound: a loss's own tensors are not known).
class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages ops make while it is active (plus those `hold` adds)."""

    def __init__(self, known: Iterable[int]) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = dict.fromkeys(known, 0)  # storage key -> bytes counted (0: not ours)

    def hold(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage as alive from now until it dies."""
        if is_traceable_wrapper_subclass(t):  # a DTensor: its local tensor's ops are seen on their own
            return
        storage = t.untyped_storage()
        key = _storage_key(t)
        if key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_sparse:
                self.hold(t)
        return out


def _storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def _output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a forward's output; a mapping pytree does not flatten (a dict subclass such as
    Hugging Face's ``ModelOutput`` where it is not registered) is looked into by its values."""
    out: list[torch.Tensor] = []
    for leaf in pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and not leaf.is_sparse:
            out.append(leaf)
        elif isinstance(leaf, Mapping):
            out += _output_tensors(list(leaf.values()))
    return out


def _output_grad_bytes(output: Any) -> int:
    """The gradient of every floating output tensor that requires grad (what any loss's backward makes)."""
    return sum(t.numel() * t.element_size() for t in _output_tensors(output) if t.requires_grad)


def _hold_outputs(tracker: _LiveBytes, output: Any) -> list[Any]:
    """Count the output's storages as alive; the gradient edges of its tensors that require grad
    (a function of its own: no local name outlives it to keep an output tensor alive)."""
    outputs = _output_tensors(output)
    for t in outputs:
        tracker.hold(t)
    return [get_gradient_edge(t) for t in outputs if t.requires_grad and t.grad_fn is not None]


def _loss_bytes(holder: list[Any], loss_fn: Optional[LossFn], fake_mode: Any, known: set[int]) -> int:
    """The ``output_and_loss`` term. ``holder`` is a one-element list of the fake forward's output,
    which we take out of it, so that it dies when the loss no longer needs it; ``known``: storages
    already counted (saved activations, the model's own)."""
    output = holder.pop()
    if loss_fn is None:
        return _output_grad_bytes(output)
    tracker = _LiveBytes(known)
    edges = _hold_outputs(tracker, output)
    with fake_mode, torch.enable_grad(), tracker:
        try:
            loss = loss_fn(output)
        except Exception as e:
            raise RuntimeError(
                f"estimate_memory could not run loss_fn on the fake forward's output ({type(e).__name__}: {e}); "
                "make it value-independent (no .item(), no data-dependent shapes), or leave loss_fn=None"
            ) from e
        del output
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                "estimate_memory argument 'loss_fn' must return a one-element tensor (the loss), got "
                f"{type(loss).__name__ if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}"
            )
        if edges and loss.requires_grad:
            grads = torch.autograd.grad(loss, edges, allow_unused=True)  # type: ignore[arg-type]
            del grads
    return tracker.peak
