"""Our gloo all-gather / reduce-scatter (point-to-point exchanges) against gloo's own collectives,
and training parity on the path other backends take (native collectives, a zeroed flat gradient
buffer): forced here on gloo, because CI has no GPU."""

from __future__ import annotations

import copy
from typing import Any, Optional

import expecttest
import pytest
import torch
import torch.distributed as dist
from test_parity import _check, _gpt_policy, _mlp_manual_nesting
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_composable import MixedPrecision, fully_shard
from fsdp_composable._comm import _collectives, _exchanges, _rank_agreement


def _compare_with_gloo(dtype: torch.dtype) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    shard_numel = 7
    shard = torch.randn(shard_numel, generator=gen).to(dtype)
    ours, theirs = torch.empty(world * shard_numel, dtype=dtype), torch.empty(world * shard_numel, dtype=dtype)
    _collectives.wait(_collectives.all_gather(ours, shard, dist.group.WORLD), "test")
    dist.all_gather_into_tensor(theirs, shard)
    gathered = torch.equal(ours, theirs)

    full = torch.randn(world * shard_numel, generator=gen).to(dtype)
    expected = torch.empty(shard_numel, dtype=dtype)
    dist.reduce_scatter_tensor(expected, full.clone())
    whole = torch.empty(shard_numel, dtype=dtype)
    _collectives.wait(_collectives.reduce_scatter(whole, full, dist.group.WORLD), "test")
    # parts whose boundaries fall inside chunks and on them, and an empty part
    total = world * shard_numel
    cuts = sorted({c for c in (0, 3, shard_numel, shard_numel + 2, total - 1, total) if c <= total})
    parts = [full[a:b] for a, b in zip(cuts, cuts[1:])] + [full[:0]]
    in_parts = torch.empty(shard_numel, dtype=dtype)
    _collectives.wait(_collectives.reduce_scatter(in_parts, parts, dist.group.WORLD), "test")
    return {
        "gathered": gathered,
        "whole": (whole - expected).abs().max().item(),
        "parts": (in_parts - expected).abs().max().item(),
        "point_to_point": _collectives.point_to_point(dist.group.WORLD, torch.device("cpu")),
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_point_to_point_collectives_match_gloo(dist_run, world_size: int, dtype: torch.dtype) -> None:
    # bit-equal up to 2 ranks (a + b is commutative); at 4 the summation order differs from gloo's
    tol = 0.0 if world_size < 4 and dtype == torch.float32 else (1e-5 if dtype == torch.float32 else 0.05)
    for r in dist_run(world_size, _compare_with_gloo, dtype):
        assert r["gathered"] and r["point_to_point"], r
        assert r["whole"] <= tol and r["parts"] <= tol, r


def _with_native_collectives(fn: Any, *args: Any) -> Any:
    original = _collectives.point_to_point
    _collectives.point_to_point = lambda group, device: False  # type: ignore[assignment]
    try:
        return fn(*args)
    finally:
        _collectives.point_to_point = original


@pytest.mark.parametrize("world_size", [2, 4])
def test_native_collectives_flat_gradient_buffer_parity(dist_run, world_size: int) -> None:
    _check(dist_run(world_size, _with_native_collectives, _gpt_policy, "FULL_SHARD", True, "adamw"), tol=1e-5)
    _check(dist_run(world_size, _with_native_collectives, _mlp_manual_nesting, "FULL_SHARD", "sgd"), tol=1e-5)


class _BackwardOps(TorchDispatchMode):
    """Every op of the backward, with the number of elements it wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops.append((str(func.overloadpacket.__name__), out.numel() if isinstance(out, torch.Tensor) else 0))
        return out


_FILLS = ("zeros", "zero_", "fill_", "new_zeros")


def _autograd_grads_into_the_input(reduce_dtype: Optional[torch.dtype]) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 7))  # rows not divisible by 2 or 4: padded chunks
    model = copy.deepcopy(ref)
    mp = MixedPrecision(reduce_dtype=reduce_dtype) if reduce_dtype is not None else None
    fully_shard(model, mixed_precision=mp)  # one unit of four parameters
    x = torch.randn(4 * world, 5)
    model(x.view(world, 4, 5)[rank]).sum().backward()  # the first step: the order check
    model.zero_grad()
    with _BackwardOps() as seen:
        model(x.view(world, 4, 5)[rank]).sum().backward()
    ref(x).sum().backward()
    padded = fully_shard.state(model).handles[0].layout.padded_numel
    return {
        "chunk_cats": sum(1 for name, _ in seen.ops if name == "_chunk_cat"),
        "fills": [(name, n) for name, n in seen.ops if name in _FILLS and n >= padded],
        "error": max(
            (p.grad.full_tensor() - r.grad / world).abs().max().item()
            for p, r in zip(model.parameters(), ref.parameters())
        ),
    }


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("reduce_dtype", [None, torch.float64])
def test_native_collectives_take_autograd_grads_into_one_rank_major_input(
    dist_run, world_size: int, reduce_dtype: Optional[torch.dtype]
) -> None:
    """A unit of several parameters, on the path other backends take: no zeroed unit-sized gradient
    buffer; autograd's gradients go into the reduce-scatter input by one ``_chunk_cat`` (padding and
    the reduce dtype's cast included), and the gradients are DDP's."""
    for r in dist_run(world_size, _with_native_collectives, _autograd_grads_into_the_input, reduce_dtype):
        assert r["chunk_cats"] == 1 and r["fills"] == [], r
        assert r["error"] < 1e-6, r


def _failing_post_is_reported_at_wait() -> str:
    def post(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Connection closed by peer")  # what gloo raises when the peer is gone

    exchange = _exchanges._start(dist.group.WORLD, 1, [(post, torch.ones(1), 1 - dist.get_rank())])
    try:
        _collectives.wait(exchange, "the all-gather of unit 'blocks.1'")
    except _collectives.CollectiveError as e:
        return str(e)
    return "no error"


def test_a_send_that_fails_while_posting_names_the_unit_at_wait(dist_run) -> None:
    for message in dist_run(2, _failing_post_is_reported_at_wait):
        expected = "fully_shard: the all-gather of unit 'blocks.1' did not complete: Connection closed by peer"
        assert message.startswith(expected), message


def _issue_then_meet(numel_by_rank: list[int]) -> dict[str, Any]:
    """Rank 0 issues an all-gather and only then waits at a barrier that the other ranks reach before
    they issue theirs: an exchange that waited for the peers' headers before returning would hang here.
    Then the ranks gather again, each with its own size, and once more with one size."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    out = torch.empty(world * 5)
    if rank == 0:
        work = _collectives.all_gather(out, torch.full((5,), 1.0), group)
        dist.barrier()
    else:
        dist.barrier()
        work = _collectives.all_gather(out, torch.full((5,), float(rank + 1)), group)
    _collectives.wait(work, "test")
    gathered = out.tolist()
    numel = numel_by_rank[rank]
    mismatch = ""
    try:
        _collectives.wait(_collectives.all_gather(torch.empty(world * numel), torch.ones(numel), group), "test")
    except Exception as e:  # noqa: BLE001
        mismatch = f"{type(e).__name__}"
    _rank_agreement.start_step(group)  # what the next root forward does: the refused step is over
    again = torch.empty(world * 3)
    _collectives.wait(_collectives.all_gather(again, torch.full((3,), float(rank)), group), "test")
    return {"gathered": gathered, "mismatch": mismatch, "again": again.tolist()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_exchange_is_posted_before_the_peers_headers_arrive(dist_run, world_size: int) -> None:
    """[Note: agreement without a round trip]: the payload goes out with the header; a disagreement on
    the size is still an error on every rank (no receive met a send of another size: no abort) and the
    next exchange gets its own data, not a message left over from the refused one."""
    sizes = [4] * world_size
    sizes[-1] = 6
    results = dist_run(world_size, _issue_then_meet, sizes)
    for r in results:
        assert r["gathered"] == [float(x) for x in range(1, world_size + 1) for _ in range(5)], r
        assert r["mismatch"] == "RankMismatchError", r
        assert r["again"] == [float(x) for x in range(world_size) for _ in range(3)], r


def _rank_zero_leaves_before_waiting(work: _collectives.InFlight) -> str:
    """Rank 0 leaves the step (as its recovery does after an exception), then every rank waits for
    ``work``; the others meet the departure at their next collective of the step; then a new step
    starts. What each rank saw: "completed", or the errors' names."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    if rank == 0:
        _rank_agreement.leave_step([group])
    outcome = "completed"
    try:
        work.wait("the test collective")
    except Exception as e:  # noqa: BLE001
        outcome = type(e).__name__
    if rank != 0:  # the departure reaches the peer at its next collective of the step
        try:
            _collectives.wait(_collectives.all_gather(torch.empty(world), torch.ones(1), group), "test")
        except Exception as e:  # noqa: BLE001
            outcome += f", then {type(e).__name__}"
    _rank_agreement.start_step(group)
    return outcome


def _refused_after_posting() -> dict[str, Any]:
    """Rank 0 issues an all-gather, then leaves the step (as its recovery does after an exception)
    before waiting for it: its exchange is refused (discarded: its step is over), but the peer, which
    read the matching header rank 0 sent with it, completes it, so rank 0's receive still gets
    written. It must stay posted into memory nobody frees (`left_posted`), and the group must keep
    working for the next step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    out = torch.zeros(world * 4)
    work = _collectives.InFlight(work=_collectives.all_gather(out, torch.full((4,), float(rank + 1)), group))
    outcome = _rank_zero_leaves_before_waiting(work)
    again = torch.empty(world * 2)
    _collectives.wait(_collectives.all_gather(again, torch.full((2,), float(rank)), group), "test")
    return {"outcome": outcome, "left_posted": _collectives.left_posted(work), "again": again.tolist()}


def test_refused_exchange_keeps_its_posted_receive(dist_run) -> None:
    r0, r1 = dist_run(2, _refused_after_posting)
    # waited for after its step was left, the refused exchange is discarded (as the recovery does)
    assert (r0["outcome"], r0["left_posted"]) == ("completed", True), r0
    assert (r1["outcome"], r1["left_posted"]) == ("completed, then RankMismatchError", False), r1
    assert r0["again"] == r1["again"] == [0.0, 0.0, 1.0, 1.0]


# ---------------------------------------------------------------- reduce-scatter: no temporary when it may reuse
def _reduce_scatter_memory() -> dict[str, Any]:
    """The bytes a reduce-scatter allocates beyond its output, over 4 ranks: one chunk when it may
    not write into its input (the lowest peer's lands in the output, the others' pass one at a time
    through one temporary), none when it may (the others' pass through this rank's own chunk of the
    input, once that is summed)."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks._mem_tracker import LiveBytesTracker

    rank, world = dist.get_rank(), dist.get_world_size()
    chunk = 1 << 18  # 1 MiB of float32 per chunk: the headers' few bytes do not count
    full = torch.arange(world * chunk, dtype=torch.float32).add_(rank)
    parts = list(full.split([chunk // 3, world * chunk - chunk // 3]))  # a boundary inside a chunk
    output = torch.empty(chunk)
    with LiveBytesTracker() as tracker:
        tracker.add_existing([*parts, output])
        _collectives.wait(_collectives.reduce_scatter(output, parts, dist.group.WORLD), "test")
    expected = torch.arange(rank * chunk, (rank + 1) * chunk, dtype=torch.float32) * world + sum(range(world))
    extra = tracker.peak_bytes - 4 * chunk * (world + 1)  # beyond the parts and the output
    reused = torch.empty(chunk)
    with LiveBytesTracker() as tracker:
        tracker.add_existing([*parts, reused])
        _collectives.wait(_collectives.reduce_scatter(reused, parts, dist.group.WORLD, writable=parts), "test")
    extra_reused = tracker.peak_bytes - 4 * chunk * (world + 1)
    mine = full[rank * chunk : (rank + 1) * chunk]  # written into: each element of it is summed here alone
    overwritten = not torch.equal(mine, torch.arange(rank * chunk, (rank + 1) * chunk, dtype=torch.float32) + rank)
    # every rank's chunks alike (a 0-dim parameter's gradient repeated into each): every rank adds the
    # same terms, and in the same order, so the sums are bit for bit the same on every rank
    gen = torch.Generator().manual_seed(rank)
    values = torch.randn(1000, generator=gen) * torch.logspace(-8, 8, 1000)
    same = torch.empty(1000)
    _collectives.wait(_collectives.reduce_scatter(same, values.repeat(world), dist.group.WORLD), "test")
    everyone = [torch.empty(1000) for _ in range(world)]
    dist.all_gather(everyone, same)
    identical = all(torch.equal(everyone[0], other) for other in everyone)
    # the same tensor in every chunk (how a 0-dim gradient is sent), writable: never reused, same order
    _collectives.wait(_collectives.reduce_scatter(same, [values] * world, dist.group.WORLD, writable=[values]), "t")
    dist.all_gather(everyone, same)
    aliased = all(torch.equal(everyone[0], other) for other in everyone)
    return {
        "extra": extra,
        "extra_reused": extra_reused,
        "overwritten": overwritten,
        "chunk": 4 * chunk,
        "equal": torch.equal(output, expected),
        "equal_reused": torch.equal(reused, expected),
        "identical": identical,
        "aliased_identical": aliased,
    }


def test_reduce_scatter_reuses_its_own_chunk_or_holds_one_and_sums_in_rank_order(dist_run) -> None:
    for r in dist_run(4, _reduce_scatter_memory):
        assert r["equal"] and r["equal_reused"] and r["identical"] and r["aliased_identical"], r
        # not writable: one chunk (before, N-2 chunks: two at 4 ranks)
        assert r["chunk"] <= r["extra"] < 1.1 * r["chunk"], r
        # writable: the headers' few bytes, no chunk; this rank's own chunk of the input took the others'
        assert r["extra_reused"] < 0.01 * r["chunk"] and r["overwritten"], r


def _refused_reduce_scatter_after_posting() -> dict[str, Any]:
    """As `_refused_after_posting`, for a reduce-scatter over 4 ranks: rank 0 leaves the step before
    waiting for it, so it never receives its late chunks (from ranks 2 and 3) as a completed exchange
    would; the late receives are still posted, so ranks 2 and 3, whose exchanges agreed and complete,
    do not wait forever for those sends."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    out = torch.zeros(3)
    full = torch.full((world * 3,), float(rank + 1))
    work = _collectives.InFlight(work=_collectives.reduce_scatter(out, full, group))
    outcome = _rank_zero_leaves_before_waiting(work)
    again = torch.empty(2)
    _collectives.wait(_collectives.reduce_scatter(again, torch.full((world * 2,), float(rank)), group), "test")
    left_posted = _collectives.left_posted(work)
    return {"outcome": outcome, "out": out.tolist(), "left_posted": left_posted, "again": again.tolist()}


def test_refused_reduce_scatter_posts_its_late_receives(dist_run) -> None:
    results = dist_run(4, _refused_reduce_scatter_after_posting)
    # discarded (a receive posted before it was refused may still have written its output)
    assert results[0]["outcome"] == "completed" and results[0]["left_posted"], results[0]
    for r in results[1:]:
        assert r["outcome"] == "completed, then RankMismatchError" and r["out"] == [10.0] * 3, r
    assert all(r["again"] == [6.0, 6.0] for r in results), results


# ---------------------------------------------------------------- the gradient reduction reuses autograd's gradients
def _reuse_in_training(keep: bool, only_rank: Optional[int] = None) -> dict[str, Any]:
    """A unit whose chunks move directly (two 512 x 512 layers), with a 0-dim parameter (sent whole in
    every chunk) and an unused one (shared zeros), against the unsharded model; ``keep``: a hook keeps
    autograd's gradient of one weight (``p.grad``) beyond the reduction (on ``only_rank`` alone if given)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    keep = keep and only_rank in (None, rank)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(512, 512), nn.Linear(512, 512)
            self.scale = nn.Parameter(torch.tensor(0.5))
            self.unused = nn.Parameter(torch.ones(512, 40))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x))) * self.scale

    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    fully_shard(model)
    reused: list[tuple[int, int]] = []
    original = _exchanges.reusable_pieces

    def counting(pieces: Any, me: int, writable: Any) -> list[bool]:
        out = original(pieces, me, writable)
        reused.append((sum(out), len(out)))
        return out

    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    if keep:

        def keep_grad(module: nn.Module, args: Any) -> None:  # on the unsharded weight, in forward
            module.a.weight.register_post_accumulate_grad_hook(lambda p: kept.append((p.grad, p.grad.clone())))

        model.register_forward_pre_hook(keep_grad)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    scale_grads = []
    _exchanges.reusable_pieces = counting  # type: ignore[assignment]
    try:
        for _ in range(3):
            x = torch.randn(world * 4, 512, generator=gen)
            model(x[rank * 4 : (rank + 1) * 4]).pow(2).mean().backward()
            scale_grads.append(model.scale.grad.to_local().clone())
            opt.step()
            opt.zero_grad()
            ref(x).pow(2).mean().backward()
            ref_opt.step()
            ref_opt.zero_grad()
    finally:
        _exchanges.reusable_pieces = original  # type: ignore[assignment]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, torch.stack(scale_grads))
    full = model.state_dict()  # FULL: the unsharded values
    return {
        "reused": sorted(set(reused)),
        "diff": max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items()),
        "scale_identical": all(torch.equal(everyone[0], other) for other in everyone),
        "kept": len(kept),
        "kept_intact": all(torch.equal(g, c) for g, c in kept),
    }


@pytest.mark.parametrize("world_size", [3, 4])
def test_gradient_reduction_reuses_autograd_gradients_nothing_else_holds(dist_run, world_size: int) -> None:
    for r in dist_run(world_size, _reuse_in_training, False):
        # the two weights and biases: reused; the 0-dim gradient, the unused one's zeros, the flags and
        # the padding (at 3 ranks): not
        assert [n for n, _ in r["reused"]] == [4], r
        assert r["diff"] < 1e-6 and r["scale_identical"], r
    for r in dist_run(world_size, _reuse_in_training, True):
        # a gradient a hook kept is left alone (and keeps autograd's values)
        assert [n for n, _ in r["reused"]] == [3] and r["kept"] >= 3 and r["kept_intact"], r
        assert r["diff"] < 1e-6 and r["scale_identical"], r
    # one rank's hook only: the ranks decide apart (what travels under which tag does not depend on it)
    for rank, r in enumerate(dist_run(world_size, _reuse_in_training, True, 1)):
        assert [n for n, _ in r["reused"]] == [3 if rank == 1 else 4] and r["kept_intact"], r
        assert r["diff"] < 1e-6 and r["scale_identical"], r


def test_held_here_alone_table() -> None:
    """When autograd's gradient may take a later chunk: only when nothing but the caller holds it."""
    from fsdp_composable._grads._reduce_inputs import held_here_alone

    def alone() -> bool:
        grad = torch.randn(8)
        return held_here_alone(grad, 1)

    def another_name() -> bool:
        grad = torch.randn(8)
        kept = [grad]  # a hook that kept p.grad
        return held_here_alone(grad, 1) and bool(kept)

    def a_view_kept() -> bool:
        grad = torch.randn(8)
        view = grad[:4]
        return held_here_alone(grad, 1) and bool(view.numel())

    def itself_a_view() -> bool:
        grad = torch.randn(8)[2:]
        return held_here_alone(grad, 1)

    def two_names_expected() -> bool:
        grad = torch.randn(8)
        also = grad
        return held_here_alone(grad, 2) and also is grad

    cases = [alone, another_name, a_view_kept, itself_a_view, two_names_expected]
    expecttest.TestCase().assertExpectedInline(
        "\n".join(f"{case.__name__}: {case()}" for case in cases),
        """\
alone: True
another_name: False
a_view_kept: False
itself_a_view: False
two_names_expected: True""",
    )
