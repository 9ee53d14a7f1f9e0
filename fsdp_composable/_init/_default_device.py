"""`fully_shard` called inside ``with torch.device("meta"):``.

[Note: fully_shard under a meta default device]
FSDP2's recipe builds the model under ``with torch.device("meta"):``, and code ported from it often
calls ``fully_shard`` inside that block too. There every tensor created without a device is a meta
tensor: our collectives' small tensors (rank-agreement headers, flags), the units' buffers and
their materialisation would be meta tensors with no data, and the first collective would fail on
one side while its peers wait. Construction never means a meta default: it places what it creates
explicitly, and what it creates without a device it means for the CPU. So while `fully_shard` (and
the wrapper's constructor) run under a meta default device, the default is the CPU; the model's
meta parameters stay meta until construction materialises them (as outside the block), and the
user's block is back to meta when the call returns.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["default_device_not_meta"]


@contextlib.contextmanager
def default_device_not_meta() -> Iterator[None]:
    """The CPU as the default device while inside, if it is the meta device; else nothing changes."""
    if torch.get_default_device().type != "meta":
        yield
        return
    with torch.device("cpu"):
        yield
