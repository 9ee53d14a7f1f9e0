"""Refuse ``copy.deepcopy`` and pickling (``torch.save(model)``) of a sharded model's parameters.

[Note: copying a sharded model]
Between steps a sharded model's parameters are ``DTensor`` faces over this rank's shard, and its
hooks hold the unit's state, which holds the process group. ``copy.deepcopy(model)`` and
``torch.save(model)`` used to end in torch's "cannot pickle 'ProcessGroup' object", or, for a submodule
inside a unit that holds no state (``torch.save(model.blocks[0].fc1)``), in torch's "invalid python
storage" errors on the faces. A working copy would need a second sharded model over the same process
group with its own hooks (torch FSDP2 does not offer one either), so both are refused with an error that
says what to do: build a new model and load ``model.state_dict()`` (FULL: the unsharded model's keys and
shapes), or save the state dict (or with ``torch.distributed.checkpoint``). Each face, original and flat
parameter, each unit's state and handle answers ``__deepcopy__`` and ``__reduce_ex__`` with that error:
deepcopy and pickle look both up on the object (its own ``__dict__`` first, for tensors; the faces'
class is torch's ``DTensor``, so their own ``__dict__`` is the only place), so whichever of them a copy
reaches first raises, for the whole model or any part of it.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch

__all__: list[str] = []


def refusal(what: str) -> TypeError:
    return TypeError(
        f"fully_shard: {what} belongs to a model sharded by fully_shard and cannot be copied with "
        "copy.deepcopy or pickled (torch.save(model)): it holds only this rank's shard, and the model's hooks "
        "hold its process group. To copy the model, build a new one (and shard it) and load "
        "model.state_dict() into it; to save it, save model.state_dict() (or use torch.distributed.checkpoint)"
    )


class _Refuse:
    """Bound as a tensor's own ``__deepcopy__`` / ``__reduce_ex__``: raises `refusal`."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __call__(self, *args: Any) -> NoReturn:
        raise refusal(self.what)


def refuse_copies(param: torch.Tensor, fqn: str) -> None:
    """Called once for each original and flat parameter when its unit is built, and for each face
    (again after a swap by ``_apply`` took its attributes)."""
    refuse = _Refuse(f"parameter '{fqn}'")
    param.__dict__["__deepcopy__"] = refuse
    param.__dict__["__reduce_ex__"] = refuse
