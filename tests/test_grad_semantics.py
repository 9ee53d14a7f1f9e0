"""Gradients as torch FSDP users rely on them (issue 13, "Gradients"), ported from the behaviours of
upstream test/distributed/fsdp: test_fsdp_core.py (unused parameters), test_fsdp_use_orig_params.py
(empty local shards, ``.grad`` edits), test_fsdp_grad_acc.py (no_sync mixed with synced
backwards) and test_fsdp_clip_grad_norm.py (flat mode, ignored modules, low-precision gradients,
the no-gradient warning). Models are float64 so sharded sums match the reference to 1e-12."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_composable import (
    FullyShardedDataParallel,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    clip_grad_norm_,
    fully_shard,
    no_sync,
    unshard_params,
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.mid = nn.Linear(7, 7)
        self.unused = nn.Linear(7, 3)
        self.out = nn.Linear(7, 1)  # one row: rank 1 holds none of it (an empty slice)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        self.unused(h)  # runs, but its output never reaches the loss
        return self.out(h)


def _data(step: int) -> torch.Tensor:
    return torch.randn(2 * dist.get_world_size(), 5, generator=torch.Generator().manual_seed(step)).double()


def _local(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0] // dist.get_world_size()
    return x[dist.get_rank() * n : (dist.get_rank() + 1) * n]


def _pair(strategy: str = "FULL_SHARD") -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = Net().double()
    model = copy.deepcopy(ref)
    fully_shard(model, ModuleWrapPolicy({nn.Linear}), strategy=ShardingStrategy[strategy])
    return ref, model


def _full_params(model: nn.Module) -> list[torch.Tensor]:
    with unshard_params(model, writeback=False):
        return [p.detach().clone() for p in model.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def unused_and_empty() -> dict[str, Any]:
    """Upstream test_fsdp_core (unused parameters): a unit whose output does not reach the loss
    keeps ``.grad`` None, so Adam leaves it alone; a parameter with no element on this rank has an
    empty ``.grad`` (FSDP2's behaviour; FSDP1's use_orig_params gave None), so every rank steps it."""
    ref, model = _pair()
    opt_ref, opt = torch.optim.Adam(ref.parameters(), lr=0.1), torch.optim.Adam(model.parameters(), lr=0.1)
    for step in range(2):
        ref(_data(step)).pow(2).mean().backward()
        model(_local(_data(step))).pow(2).mean().backward()
        unused_none = all(p.grad is None for p in model.unused.parameters())
        used = [p for n, p in model.named_parameters() if "unused" not in n]
        empty_ok = all(p.grad is not None and p.grad.shape == p.shape for p in used)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    return {
        "unused_none": unused_none,
        "empty_ok": empty_ok,
        "some_empty": any(p.to_local().numel() == 0 for p in model.parameters()),  # this rank's chunk
        "diff": _max_diff(_full_params(model), [p.detach() for p in ref.parameters()]),
    }


def test_unused_unit_grads_are_none_and_empty_shard_grads_empty(dist_run) -> None:
    results = dist_run(2, unused_and_empty)
    assert any(r["some_empty"] for r in results)  # the layout does give some rank an empty slice
    for r in results:
        assert r["unused_none"] and r["empty_ok"] and r["diff"] < 1e-12


def no_sync_after_synced(strategy: str) -> float:
    """Upstream test_fsdp_grad_acc.py::TestGradAcc::test_grad_acc: synced backward, then no_sync micro-batches,
    then synced: the
    gradients are the sum of all of them, for every strategy."""
    ref, model = _pair(strategy)
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        for micro, sync in enumerate((True, False, False, True)):
            x = _data(10 * step + micro)
            ref(x).pow(2).mean().backward()
            if sync:
                model(_local(x)).pow(2).mean().backward()
            else:
                with no_sync(model):
                    model(_local(x)).pow(2).mean().backward()
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    return _max_diff(_full_params(model), [p.detach() for p in ref.parameters()])


def test_no_sync_after_synced_backward_every_strategy(dist_run) -> None:
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        for diff in dist_run(2, no_sync_after_synced, strategy):
            assert diff < 1e-12, strategy


def grad_edits() -> dict[str, float]:
    """Upstream test_fsdp_use_orig_params.py::TestFSDPUseOrigParamsWriteback::test_grad_writeback: ``.grad``
    edited between backward and step (in place, replaced, set to None) is what the optimizer steps, and the next
    backward accumulates into it (or replaces None) exactly as on the plain model."""
    ref, model = _pair()

    def edit(m: nn.Module) -> None:
        m.inp.weight.grad.mul_(2.0)
        m.mid.weight.grad = torch.full_like(m.mid.weight.grad, 0.25)
        m.out.bias.grad = None

    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        ref(_data(step)).pow(2).mean().backward()
        model(_local(_data(step))).pow(2).mean().backward()
        edit(ref)
        if model.mid.weight.grad is not None:  # edits land on this rank's slices
            edit(model)
        else:
            model.inp.weight.grad.mul_(2.0) if model.inp.weight.grad is not None else None
            model.out.bias.grad = None
        # the next backward accumulates into the edited gradients (no zero_grad in between)
        ref(_data(step + 5)).pow(2).mean().backward()
        model(_local(_data(step + 5))).pow(2).mean().backward()
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    return {"diff": _max_diff(_full_params(model), [p.detach() for p in ref.parameters()])}


def test_grad_edits_between_backward_and_step(dist_run) -> None:
    for r in dist_run(2, grad_edits):
        assert r["diff"] < 1e-12


def grad_data_writes(kind: str) -> dict[str, float]:
    """Upstream torch FSDP's gradient writeback test: a gradient written between backward and step is
    what the optimizer steps and what the next backward accumulates into, as on the plain model. Upstream
    writes ``p.grad.data = t``; a DTensor gradient does not take that (refused:
    test_writes_between_steps), so the same values are written in place."""
    ref, model = _pair()
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    norms: list[float] = []
    for step in range(2):
        for m, x in ((ref, _data(step)), (model, _local(_data(step)))):
            m(x).pow(2).mean().backward()
            for p in m.parameters():
                if p.grad is not None:
                    with torch.no_grad():
                        p.grad.mul_(3.0) if kind == "scaled" else p.grad.fill_(1.0)
        if kind == "ones":  # clip_grad_norm_ and unshard_params(with_grads=True) see the writes too
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9).item()
            norms.append(clip_grad_norm_(model, 1e9).item() - ref_norm)
            with unshard_params(model, with_grads=True):
                pairs = [(p.grad, r.grad) for p, r in zip(model.parameters(), ref.parameters()) if r.grad is not None]
                norms.append(_max_diff([a for a, _ in pairs], [b for _, b in pairs]))
        ref(_data(step + 5)).pow(2).mean().backward()  # accumulates into the written gradients
        model(_local(_data(step + 5))).pow(2).mean().backward()
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    diff = _max_diff(_full_params(model), [p.detach() for p in ref.parameters()])
    return {"diff": diff, "norms": max((abs(n) for n in norms), default=0.0)}


def test_grad_data_writes_between_backward_and_step(dist_run) -> None:
    for kind in ("scaled", "ones"):
        for r in dist_run(2, grad_data_writes, kind):
            assert r["diff"] < 1e-12 and r["norms"] < 1e-6, (kind, r)  # the norm: float32


def clip_cases() -> dict[str, Any]:
    """Upstream test_fsdp_clip_grad_norm.py::TestClipGradNorm::test_ddp_parity, ::test_low_precision_grads and
    ::test_no_gradients: the returned total norm equals the unsharded model's, is
    the same on every rank, and the clipped gradients step like the reference's."""
    out: dict[str, Any] = {}
    x = _data(0)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    ref = copy.deepcopy(base)
    ref(x).pow(2).mean().backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    # flat mode: the wrapper registers flat parameters (counted once, as shards)
    wrapped = FullyShardedDataParallel(copy.deepcopy(base), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    wrapped(_local(x)).pow(2).mean().backward()
    out["flat"] = clip_grad_norm_(wrapped, 0.1).item() - ref_norm.item()
    # ignored modules: their gradients are the user's (here averaged by hand, as DDP would)
    ignoring = copy.deepcopy(base)
    fully_shard(ignoring, ModuleWrapPolicy({nn.Linear}), ignored_modules=[ignoring[2]])
    ignoring(_local(x)).pow(2).mean().backward()
    for p in ignoring[2].parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad.div_(dist.get_world_size())
    norm = clip_grad_norm_(ignoring, 0.1)
    out["ignored"] = norm.item() - ref_norm.item()
    out["ignored_norm"] = norm.item()
    # keep_low_precision_grads: float16 gradients; the norm is computed in float32 and returned in
    # the gradients' dtype, equal to the norm of the whole low-precision gradient
    torch.manual_seed(0)
    low = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    mp = MixedPrecision(param_dtype=torch.float16, keep_low_precision_grads=True)
    fully_shard(low, ModuleWrapPolicy({nn.Linear}), mixed_precision=mp)
    low(_local(x).float()).pow(2).mean().backward()
    full_grads = []  # each unit's whole flat gradient (its padding is zero), gathered by hand
    for handle in fully_shard.state(low).handles:
        shard = handle.flat_param.grad
        pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, shard)
        full_grads.append(torch.cat(pieces))
    expected = torch.linalg.vector_norm(torch.stack([g.float().norm() for g in full_grads])).to(torch.float16)
    low_norm = clip_grad_norm_(low, 1e9)
    out["low_dtype"] = low_norm.dtype
    out["low"] = (low_norm.float() - expected.float()).abs().item()
    # no gradients yet: a warning
    fresh = copy.deepcopy(base)
    fully_shard(fresh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clip_grad_norm_(fresh, 1.0)
    out["warned"] = [str(w.message) for w in caught]
    return out


def test_clip_grad_norm_flat_ignored_low_precision_and_no_grads(dist_run) -> None:
    results = dist_run(2, clip_cases)
    for r in results:
        # the norm is computed in float32, as torch FSDP does, whatever the gradients' dtype
        assert abs(r["flat"]) < 1e-6 and abs(r["ignored"]) < 1e-6
        assert r["low_dtype"] == torch.float16 and r["low"] == 0
        assert any("no gradients" in w for w in r["warned"])
    assert len({r["ignored_norm"] for r in results}) == 1  # the same on every rank
