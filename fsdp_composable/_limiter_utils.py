"""`_AllGatherLimiter`: at most a fixed number of units' unsharded parameters alive at once.

[Note: why limit all-gathers]
Prefetching issues the next unit's all-gather before the current unit is done. On CUDA the CPU
thread runs ahead of the GPU, so without a bound it would issue all-gathers for many units and
memory would depend on how far ahead it got: peak memory changes from step to step. The limiter
counts units whose unsharded parameters are allocated (or being gathered), not counting the root
unit, which stays unsharded for the whole step by design. A *prefetch* that would exceed the bound
is skipped (the unit is gathered when it runs instead); an unshard a unit needs to run is never
refused. Nothing is tied to a stream with ``record_stream``: memory is freed by `reshard`, which
first waits for the unit's all-gather, so freed memory is never still being written. On CUDA the
storage a reshard gave up is freed once the next all-gather is issued (`release_freed`, see
[Note: streams without record_stream]), so a unit's buffer outlives its reshard by one all-gather:
at most two units' buffers exist at once, as with the bound of two.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdp_composable._config import MAX_UNSHARDED_UNITS

if TYPE_CHECKING:
    from fsdp_composable._flat_param import FlatParamHandle

__all__: list[str] = []


class _AllGatherLimiter:
    def __init__(self, max_units: int = MAX_UNSHARDED_UNITS) -> None:
        self.max_units = max_units
        self.peak = 0  # most non-root units unsharded at once since the last reset (for tests/benchmarks)

    def in_flight(self, handles: "list[FlatParamHandle]") -> int:
        return sum(1 for h in handles if h.is_unsharded or h.unshard_in_flight)

    def may_prefetch(self, handles: "list[FlatParamHandle]") -> bool:
        return self.in_flight(handles) < self.max_units

    def record(self, handles: "list[FlatParamHandle]") -> None:
        self.peak = max(self.peak, self.in_flight(handles))

    def release_freed(self, handles: "list[FlatParamHandle]") -> None:
        """Free the storage of units resharded since the last all-gather was issued (CUDA)."""
        for handle in handles:
            handle.release_freed()
