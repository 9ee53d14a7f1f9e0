"""Writes between steps on the parameters a sharded model exposes (DTensor faces viewing this rank's
shard) are kept, or refused loudly and undone, never lost. ``p.data = t`` does not write a DTensor's
shard, nor ``p.grad.data = t`` its gradient's: they are refused (at the next forward, and at the
optimizer's step; write in place or through ``unshard_params``/``load_state_dict``); on the wrapper's
flat parameters (``use_orig_params=False``) they are kept. A table of every write kind x mode, each
trained next to the unsharded model that gets the same write (an elementwise write, so it means the
same on a slice as on the whole), float64, odd sizes."""

from __future__ import annotations

import copy
from typing import Any, Callable

import expecttest
import pytest
import torch
import torch.distributed as dist
from parity import error_text
from torch import nn

from fsdp_composable import FullyShardedDataParallel, ModuleWrapPolicy, fully_shard, unshard_params


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.norm = nn.LayerNorm(7)
        self.mid = nn.Linear(7, 7)
        self.out = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(self.norm(self.inp(x)))))


Write = Callable[[nn.Parameter], None]


def _set_grad(p: nn.Parameter) -> None:
    p.grad = p.grad * 3 + 0.5  # type: ignore[operator]


def _set_grad_data(p: nn.Parameter) -> None:
    p.grad.data = p.grad.data * 3 + 0.5  # type: ignore[union-attr]


def _set_data(p: nn.Parameter) -> None:
    p.data = p.data * 2 + 1


# kind -> (when: "grad" after backward / "param" after step, the write)
WRITES: dict[str, tuple[str, Write]] = {
    "p.data = t": ("param", _set_data),
    "p.data = full": ("param", _set_data),  # the whole parameter's shape: see `_write_full`
    "p.data.copy_(t)": ("param", lambda p: p.data.copy_(p.data * 2 + 1)),
    "p.add_(t)": ("param", lambda p: p.detach().add_(0.25)),
    "p.grad = t": ("grad", _set_grad),
    "p.grad.data = t": ("grad", _set_grad_data),
    "p.grad.zero_()": ("grad", lambda p: p.grad.zero_()),  # type: ignore[union-attr]
    "p.grad.mul_(t)": ("grad", lambda p: p.grad.mul_(3)),  # type: ignore[union-attr]
}
MODES = ("fully_shard", "use_orig_params=True", "use_orig_params=False")


def _shard(model: nn.Module, mode: str) -> nn.Module:
    policy = ModuleWrapPolicy({nn.Linear})
    if mode == "fully_shard":
        return fully_shard(model, policy)
    return FullyShardedDataParallel(model, auto_wrap_policy=policy, use_orig_params=mode.endswith("True"))


def _x(step: int) -> torch.Tensor:
    return torch.randn(2 * dist.get_world_size(), 5, generator=torch.Generator().manual_seed(step)).double()


def _write(model: nn.Module, fn: Write, grads: bool) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() and (not grads or p.grad is not None):
                fn(p)


def _write_full(model: nn.Module, ref: nn.Module, step: int) -> None:
    """``p.data = t`` with ``t`` of the parameter's full shape, the same on every rank."""
    for p, q in zip(model.parameters(), ref.parameters()):
        t = torch.linspace(-1, 1 + step, q.numel(), dtype=q.dtype).reshape(q.shape)
        q.data = t.clone()
        p.data = t


def write_case(mode: str, kind: str) -> float:
    """The largest difference from the reference after three steps with the write between them."""
    when, fn = WRITES[kind]
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = Net().double()
    model = _shard(copy.deepcopy(ref), mode)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = _x(step)
        n = x.shape[0] // world
        ref(x).pow(2).mean().backward()
        model(x[rank * n : (rank + 1) * n]).pow(2).mean().backward()
        if when == "grad":
            _write(ref, fn, grads=True)
            _write(model, fn, grads=True)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        if when == "param" and kind == "p.data = full":
            _write_full(model, ref, step)
        elif when == "param":
            _write(ref, fn, grads=False)
            _write(model, fn, grads=False)
    with unshard_params(model, writeback=False):
        return max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))


def write_table(modes: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for mode in modes:
        for kind in WRITES:
            if kind == "p.data = full" and mode.endswith("False"):
                continue  # the registered parameters are the flat shards themselves
            try:
                diff = write_case(mode, kind)
            except Exception as e:  # noqa: BLE001 - the table says which write raised
                out[f"{mode:<22} {kind:<16}"] = f"raised {type(e).__name__}"
                continue
            out[f"{mode:<22} {kind:<16}"] = "kept" if diff < 1e-12 else f"LOST ({diff:.2g})"
    return out


def _expected(key: str) -> str:
    """``p.data = t`` on a face is refused at the next forward, ``p.grad.data = t`` on its DTensor
    gradient at the optimizer's step (before it would step without it); every other write is kept."""
    kind = key.split(maxsplit=1)[1]
    refused = not key.startswith("use_orig_params=False") and kind.startswith(("p.data = ", "p.grad.data = "))
    return "raised ModelEditedAfterShardingError" if refused else "kept"


# at 4 ranks (`out` leaves rank 3 a chunk of padding alone): the faces of fully_shard, and the wrapper's
# flat parameters (use_orig_params=True has fully_shard's faces: at 2 ranks only)
@pytest.mark.parametrize("world, modes", [(2, MODES), (4, (MODES[0], MODES[2]))], ids=["2", "4"])
def test_every_write_kind_in_every_mode_is_kept_or_refused(dist_run, world: int, modes: tuple[str, ...]) -> None:
    for table in dist_run(world, write_table, modes):
        wrong = {k: v for k, v in table.items() if v != _expected(k)}
        assert wrong == {}, "\n".join(f"{k} {v}" for k, v in wrong.items())


def refused_writes(mode: str) -> list[str]:
    """A write that cannot be kept (neither the shape of this rank's slice nor the parameter's) raises
    at the next forward naming the parameter, on every rank, and the model trains on afterwards."""
    torch.manual_seed(0)
    model = _shard(Net().double(), mode)
    x = _x(0)[: 2]
    model(x).sum().backward()
    p = dict(model.named_parameters())
    name = next(n for n in p if n.endswith("mid.weight"))
    p[name].data = torch.zeros(3, dtype=torch.float64)
    errors = [error_text(lambda: model(x))]
    model(x).sum().backward()  # usable again
    return errors


@pytest.mark.parametrize("mode", MODES[:2])
def test_a_write_that_cannot_be_kept_is_refused_naming_the_parameter(dist_run, mode: str) -> None:
    for errors in dist_run(2, refused_writes, mode):
        assert "mid.weight" in errors[0] and "p.data = t" in errors[0], errors


def summon_between_forwards(mode: str) -> dict[str, Any]:
    """``unshard_params`` entered between two forwards of one step, then backward of both: it works
    (the step goes on), or it refuses at entry and the step goes on without it."""
    torch.manual_seed(0)
    ref = Net().double()
    model = _shard(copy.deepcopy(ref), mode)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _x(0), _x(1)
    n = x.shape[0] // world
    mine = slice(rank * n, (rank + 1) * n)
    first = model(x[mine]).pow(2).mean()

    def summon() -> None:
        with unshard_params(model, writeback=False):
            pass

    text = error_text(summon)
    loss = first + model(y[mine]).pow(2).mean()
    loss.backward()
    (ref(x).pow(2).mean() + ref(y).pow(2).mean()).backward()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref.step()
    opt.step()
    with unshard_params(model, writeback=False):
        diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return {"error": text, "diff": diff}


@pytest.mark.parametrize("mode", MODES)
def test_unshard_params_between_two_forwards_of_a_step(dist_run, mode: str) -> None:
    for r in dist_run(2, summon_between_forwards, mode):
        assert r["error"].startswith("RuntimeError: unshard_params cannot be entered between a forward of"), r
        assert r["diff"] < 1e-12, r


def state_dicts_after_a_write(mode: str) -> dict[str, bool]:
    """An in-place write then ``state_dict()`` at once saves the write; an in-place write then
    ``load_state_dict(saved)`` loads ``saved``: the write is not copied over it at the next forward."""
    torch.manual_seed(0)
    ref = Net().double()
    model = _shard(copy.deepcopy(ref), mode)
    model(_x(0)).sum().backward()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2).add_(1)
    after_write = model.state_dict()
    written = all(torch.equal(after_write[k], saved[k] * 2 + 1) for k in saved)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)
    model.load_state_dict(saved)
    out = model(_x(1))
    return {"saved_the_write": written, "load_wins": torch.equal(out, ref(_x(1)))}


@pytest.mark.parametrize("mode", MODES)
def test_state_dicts_right_after_a_write(dist_run, mode: str) -> None:
    for result in dist_run(2, state_dicts_after_a_write, mode):
        assert result == {"saved_the_write": True, "load_wins": True}


def grad_data_write() -> list[str]:
    """``p.grad.data = t`` after backward: the optimizer's step refuses it, naming the parameter, before
    it steps; the gradient is shown again as it was, and the model trains on."""
    torch.manual_seed(0)
    model = _shard(Net().double(), "fully_shard")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = _x(0)[:2]
    model(x).sum().backward()
    p = dict(model.named_parameters())
    name = next(n for n in p if n.endswith("mid.weight"))
    before = p[name].grad.to_local().clone()  # type: ignore[union-attr]
    p[name].grad.data = p[name].grad.data * 3  # type: ignore[union-attr]
    errors = [error_text(opt.step)]
    assert torch.equal(p[name].grad.to_local(), before)  # type: ignore[union-attr]
    opt.step()
    model(x).sum().backward()  # usable again
    return errors


def test_a_grad_data_write_is_refused_at_the_step(dist_run) -> None:
    errors = dist_run(2, grad_data_write)
    assert errors[0] == errors[1]
    expecttest.TestCase().assertExpectedInline(errors[0][0], """ModelEditedAfterShardingError: the gradient of parameter 'mid.weight' had its .data replaced after backward (p.grad.data = t): a DTensor gradient keeps its local tensor, so the write would be lost. Write in place (p.grad.mul_(2), p.grad.to_local().copy_(t)), or assign a DTensor of the same layout (p.grad = g). The gradients were shown again as they were""")  # noqa: E501
