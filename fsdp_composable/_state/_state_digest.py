"""A digest of a tensor's values, for ranks to agree that they were given the same value.

[Note: digests of loaded optimizer state]
``optim.load_state_dict`` on a sharded model checks, before loading, that every rank was given the
same state for each parameter (see `_check_saved_same_on_all_ranks`). Keys, dtypes and shapes say
which collectives follow; the values matter too: ranks given checkpoints of different steps (or
one edited value) would load silently and diverge. Values that must be identical on every rank are
the plain ones: full tensors and ``step`` (a DTensor's local piece differs per rank by design, but
its parameter's ``step`` says which step it came from). Each such tensor is reduced on its own
device to two integers: its bytes read as integers of the element's width, summed plain and
weighted by position, in int64 arithmetic that wraps. Integer sums do not depend on the order of
the reduction, so equal values give equal digests on any device, and the cost is one pass over the
value, in chunks (bounded extra memory), with one copy to the host per parameter.
"""

from __future__ import annotations

import torch

__all__ = ["digests"]

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22  # elements per pass: the int64 copy of a chunk is the extra memory
_PERIOD = 65521  # position weights cycle through 1.._PERIOD (a prime: shifts change the weighted sum)


def digests(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Two integers per tensor, equal for tensors of equal dtype, shape and bytes."""
    if not tensors:
        return []
    sums = [_digest(t) for t in tensors]
    return [(int(a), int(b)) for a, b in torch.stack([s.cpu() for s in sums]).tolist()]


def _digest(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1)
    width = flat.element_size()
    ints = flat.view(_INT_OF_WIDTH[width]) if width in _INT_OF_WIDTH else flat.view(torch.int64)
    total = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, ints.numel(), _CHUNK):
        chunk = ints[start : start + _CHUNK].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=flat.device) % _PERIOD + 1
        total += torch.stack([chunk.sum(), (chunk * weights).sum()])
    return total
