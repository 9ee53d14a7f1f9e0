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
storage a reshard gave up is freed once the next all-gather is issued (`release_resharded`, see
[Note: streams without record_stream]), so a unit's buffer outlives its reshard by one all-gather:
at most two units' buffers exist at once, as with the bound of two.

[Note: the limiter counts units]
A unit with frozen and trainable parameters, or parameters of several dtypes, has one handle per
group; all of them are gathered together and freed together, so they are one unit for the bound
(counting handles would make such a unit fill the bound alone and lose its prefetch). The limiter
keeps the units the runtime unsharded (`record`, called by every runtime unshard) and drops one once
none of its handles is unsharded or being gathered, so a query looks at the few units alive, not
at every handle of the model: the cost per unshard does not grow with the number of units.
Unshards outside a step (`unshard_params`, state dicts) do not pass here; no forward runs then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from fsdp_composable._config import MAX_UNSHARDED_UNITS

if TYPE_CHECKING:
    from fsdp_composable._flat_param import FlatParamHandle

__all__: list[str] = []

Unit = Sequence["FlatParamHandle"]  # every handle of one unit (the root context's shared tuple)


def _alive(unit: Unit) -> bool:
    for h in unit:  # a loop, not any(...): this runs at every unshard
        if h.is_unsharded or h.unshard_in_flight:
            return True
    return False


class _AllGatherLimiter:
    def __init__(self, max_units: int = MAX_UNSHARDED_UNITS) -> None:
        self.max_units = max_units
        self.peak = 0  # most non-root units unsharded at once since the last reset (for tests/benchmarks)
        self._live: list[tuple[Unit, bool]] = []  # (unit, counted: not the root unit), recorded and alive
        self._resharded: list[Unit] = []  # dropped from _live since the last `release_resharded`

    def _prune(self) -> None:
        for entry in self._live:  # usually every unit is still alive: no new list then
            if not _alive(entry[0]):
                break
        else:
            return
        keep: list[tuple[Unit, bool]] = []
        for entry in self._live:
            if _alive(entry[0]):
                keep.append(entry)
            else:
                self._resharded.append(entry[0])
        self._live = keep

    def in_flight(self) -> int:
        """Non-root units unsharded or being gathered now (among those the runtime unsharded)."""
        self._prune()
        count = 0
        for _, counted in self._live:
            count += counted
        return count

    def may_prefetch(self) -> bool:
        return self.in_flight() < self.max_units

    def record(self, unit: Unit, counted: bool) -> None:
        """``unit`` was just unsharded by the runtime; ``counted``: False for the root unit."""
        for entry in self._live:
            if entry[0] is unit:
                break
        else:
            self._live.append((unit, counted))
        self.peak = max(self.peak, self.in_flight())

    def release_resharded(self) -> None:
        """Free the storage of units resharded since the last all-gather was issued (CUDA)."""
        self._prune()
        resharded, self._resharded = self._resharded, []
        for unit in resharded:
            for handle in unit:
                handle.release_freed()

    def release_freed(self, handles: "list[FlatParamHandle]") -> None:
        """Free what `reshard` left allocated for every one of ``handles`` (the end of a step)."""
        self._prune()
        self._resharded = []
        for handle in handles:
            handle.release_freed()
