"""Count the bytes each collective moves, in the benchmark process only.

[Note: two counters]
`CommCounter` wraps the Python collectives of ``torch.distributed`` (``COLLECTIVES``) wherever a
module bound them: ``torch.distributed``, ``distributed_c10d``, and any module under
``fsdp_composable``, ``torch.distributed`` or ``torch.nn.parallel`` that took a reference at import
time (``fsdp_composable._comm._collectives`` does). A wrapped call made from inside another wrapped call
(torch 2.13's ``all_gather_into_tensor`` calls ``all_gather_single``) is counted once, by the
outermost. It cannot see collectives issued from C++: DDP's reducer calls
``ProcessGroup::allreduce`` directly, and functional collectives call ``torch.ops._c10d_functional``.

`DispatchCommCounter` classifies the c10d dispatcher ops (``c10d.allreduce_``,
``c10d._allgather_base_``, ``_c10d_functional.all_gather_into_tensor``, ...) that a
``TorchDispatchMode`` sees. Every ``ProcessGroup`` method goes through these ops, so it also sees
DDP's bucketed all-reduce. It runs inside the tracked step only (a Python mode slows every op).

[Note: payload and wire bytes]
payload: the larger side of one call, i.e. the gathered output of an all-gather, the full input of
a reduce-scatter, the tensor of an all-reduce or broadcast. wire: an estimate of what one rank sends
with ring algorithms, (N-1)/N x payload for all-gather, reduce-scatter and broadcast and
2(N-1)/N x payload for all-reduce, N being the group size (the world size for dispatcher ops).
Point-to-point sends (kind "send": how fsdp_composable runs all-gather and reduce-scatter on gloo)
are exact: payload and wire are the bytes sent. Receives are not counted; they are the peers' sends.
"""

from __future__ import annotations

import functools
import sys
import threading
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

__all__ = ["COLLECTIVES", "CommCounter", "DispatchCommCounter", "OpStats", "payload_bytes", "wire_factor"]

# Python-level collective -> kind.
COLLECTIVES: dict[str, str] = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "_all_gather_base": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
    "isend": "send",
    "send": "send",
}

_PATCH_PREFIXES = ("torch.distributed", "torch.nn.parallel", "fsdp_composable")


@dataclass
class OpStats:
    kind: str
    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0


def wire_factor(kind: str, group_size: int) -> float:
    """Bytes one rank sends per payload byte with ring algorithms."""
    if kind in ("send", "header"):
        return 1.0
    if group_size <= 1:
        return 0.0
    share = (group_size - 1) / group_size
    return 2 * share if kind == "all_reduce" else share


def _tensor_bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    return 0


def payload_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The larger of the call's tensor arguments (a list argument counts as the sum of its tensors)."""
    sizes = [_tensor_bytes(a) for a in args] + [_tensor_bytes(v) for v in kwargs.values()]
    return max(sizes, default=0)


def _group_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    for x in (*args, *kwargs.values()):
        if isinstance(x, dist.ProcessGroup):
            return dist.get_world_size(x)
    return dist.get_world_size() if dist.is_initialized() else 1


def _is_agreement_header(args: tuple[Any, ...]) -> bool:
    """A send of fsdp_composable's rank-agreement header (a few int64s opening with its magic number,
    see [Note: collective headers] in fsdp_composable/_comm/_rank_agreement.py): counted as kind "header", apart
    from the payload, so the payload stays comparable with theory and with other implementations."""
    from fsdp_composable._comm._rank_agreement import _MAGIC

    first = args[0] if args else None
    if isinstance(first, (list, tuple)) and first:
        first = first[0]
    return (
        isinstance(first, torch.Tensor)
        and first.dtype == torch.int64
        and first.dim() == 1
        and 0 < first.numel() <= 16
        and int(first[0]) == _MAGIC
    )


class _Tally:
    def __init__(self) -> None:
        self.ops: dict[str, OpStats] = {}
        self._lock = threading.Lock()

    def record(self, name: str, kind: str, payload: int, group_size: int) -> None:
        with self._lock:
            stats = self.ops.setdefault(name, OpStats(kind))
            stats.calls += 1
            stats.payload_bytes += payload
            stats.wire_bytes += payload * wire_factor(kind, group_size)

    def reset(self) -> None:
        with self._lock:
            self.ops = {}

    def snapshot(self) -> dict[str, Any]:
        """Per-op stats, per-kind payload totals, and the totals."""
        with self._lock:
            ops = {k: asdict(v) for k, v in sorted(self.ops.items())}
        by_kind: dict[str, int] = {}
        for v in ops.values():
            by_kind[v["kind"]] = by_kind.get(v["kind"], 0) + v["payload_bytes"]
        return {
            "ops": ops,
            "payload_bytes_by_kind": by_kind,
            "payload_bytes": sum(v["payload_bytes"] for v in ops.values()),
            "wire_bytes": sum(v["wire_bytes"] for v in ops.values()),
        }


class CommCounter(_Tally):
    """Wraps ``torch.distributed``'s Python collectives; use as a context manager or install()/uninstall()."""

    def __init__(self, names: Optional[dict[str, str]] = None) -> None:
        super().__init__()
        self.names = dict(COLLECTIVES if names is None else names)
        self.enabled = True
        self.patched: list[tuple[Any, str, Any]] = []  # (module, attribute, original)
        self.missing: list[str] = []
        self._tls = threading.local()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        kind = self.names[name]

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._tls, "depth", 0)
            if depth == 0 and self.enabled:
                what = "header" if kind == "send" and _is_agreement_header(args) else kind
                size = payload_bytes(args, kwargs)
                self.record(name if what == kind else "header", what, size, _group_size(args, kwargs))
            self._tls.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._tls.depth = depth

        return counted

    def install(self) -> CommCounter:
        if self.patched:
            raise RuntimeError("CommCounter.install() called twice; call uninstall() first")
        wrappers: dict[int, tuple[Any, Callable[..., Any]]] = {}
        for name in self.names:
            original = getattr(dist, name, None)
            if original is None:
                self.missing.append(name)
                continue
            wrappers[id(original)] = (original, self._wrap(name, original))
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not mod_name.startswith(_PATCH_PREFIXES):
                continue
            for attr, value in list(vars(mod).items()):
                hit = wrappers.get(id(value))
                if hit is not None and hit[0] is value:
                    setattr(mod, attr, hit[1])
                    self.patched.append((mod, attr, value))
        return self

    def uninstall(self) -> None:
        for mod, attr, original in reversed(self.patched):
            setattr(mod, attr, original)
        self.patched = []

    def __enter__(self) -> CommCounter:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def _dispatch_kind(op_name: str) -> Optional[str]:
    """'c10d::_allgather_base_' -> 'all_gather', 'c10d::send' -> 'send'; None for barriers, waits and receives."""
    base = op_name.split("::", 1)[-1].replace("_", "")
    if base == "send":
        return "send"
    for key, kind in (("allgather", "all_gather"), ("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce")):
        if key in base:
            return kind
    return "broadcast" if base.startswith("broadcast") else None


class DispatchCommCounter(_Tally):
    """Counts c10d / functional-collective dispatcher ops handed to `observe` by a dispatch mode."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.world_size = world_size

    def observe(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        namespace = getattr(func, "namespace", "")
        if namespace not in ("c10d", "_c10d_functional", "c10d_functional"):
            return
        name = func._schema.name
        kind = _dispatch_kind(name)
        if kind is None:
            return
        payload = payload_bytes(args, kwargs)
        if kind == "send" and _is_agreement_header(args):
            kind, name = "header", "header"
        if namespace != "c10d" and kind == "all_gather":
            # functional all-gather takes (input, group_size, group_name) and returns the output
            group_size = next((a for a in args if isinstance(a, int)), self.world_size)
            payload *= group_size
        self.record(name, kind, payload, self.world_size)
