"""Recovery that loses nothing (issue 12 §2): after a forward or backward that raises (an exception
or a ``BaseException`` such as ``KeyboardInterrupt``) on every rank, training goes on *bit for bit*
like a run that never saw the failed step: nothing of it (gradients reduced, in flight, or kept
under ``no_sync``) reappears, and ``no_sync`` micro-batches completed before it keep their sums.
Every check compares the local shards with ``torch.equal`` against a run without the failure."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_composable import (
    ModuleWrapPolicy,
    ShardingStrategy,
    clip_grad_norm_,
    fully_shard,
    no_sync,
    register_fsdp_forward_method,
    unshard_params,
)


class Injected(Exception):
    pass


class Net(nn.Module):
    """Three Linear units and a root parameter, so the root unit takes part in every backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.mid = nn.Linear(7, 7)
        self.out = nn.Linear(7, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x))))) * self.scale

    def generate(self, x: torch.Tensor) -> torch.Tensor:  # as HF generate(): calls self(...) inside
        with torch.no_grad():
            return self(self(x)[:, :1].expand(-1, 5).contiguous())


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, exc: Any) -> torch.Tensor:
        ctx.exc = exc
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise ctx.exc("injected backward failure")


def _batch(step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + dist.get_rank())
    return torch.randn(4, 5, generator=g)


def _install(model: Net, kind: str, on: dict[str, bool]) -> None:
    """Failure points: a forward hook, the loss, an autograd function (after the later units have
    reduced), each as an Exception or a KeyboardInterrupt."""
    exc = KeyboardInterrupt if kind.endswith("interrupt") else Injected

    def forward_hook(module: nn.Module, args: Any) -> None:
        if on["on"] and kind.startswith("forward"):
            raise exc("injected forward failure")

    def output_hook(module: nn.Module, args: Any, out: torch.Tensor) -> Optional[torch.Tensor]:
        if on["on"] and kind.startswith("backward"):
            return _RaiseInBackward.apply(out, exc)  # type: ignore[no-any-return]
        return None

    model.mid.register_forward_pre_hook(forward_hook)
    model.inp.register_forward_hook(output_hook)


def _loss(model: Net, x: torch.Tensor, kind: str, on: dict[str, bool]) -> torch.Tensor:
    out = model(x)
    if on["on"] and kind == "loss":
        raise Injected("injected loss failure")
    return out.pow(2).mean()


def _train(strategy: str, kind: Optional[str], mode: str, world_check: bool = False) -> list[torch.Tensor]:
    """Three steps of two micro-batches; at step 1 a failing attempt is inserted (``mode``):
    ``plain``: before the step's backward; ``no_sync``: between the no_sync micro-batch and the
    synced one; ``synced``: as the synced micro-batch, which is then run again."""
    torch.manual_seed(0)
    model = Net()
    fully_shard(model, ModuleWrapPolicy({nn.Linear}), strategy=ShardingStrategy[strategy])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    on = {"on": False}
    if kind is not None:
        _install(model, kind, on)

    def attempt(x: torch.Tensor, sync: bool) -> None:
        on["on"] = True
        try:
            if sync:
                _loss(model, x, kind or "", on).backward()
            else:
                with no_sync(model):
                    _loss(model, x, kind or "", on).backward()
        except (Injected, KeyboardInterrupt):
            pass
        else:
            raise AssertionError("the failure was not injected")
        finally:
            on["on"] = False

    for step in range(3):
        failing = kind is not None and step == 1
        if mode == "plain":
            if failing:
                attempt(_batch(step, 9), sync=True)
                opt.zero_grad()
            _loss(model, _batch(step, 0), "", on).backward()
        else:
            with no_sync(model):
                _loss(model, _batch(step, 0), "", on).backward()
            if failing:
                attempt(_batch(step, 9), sync=mode == "synced")
            _loss(model, _batch(step, 1), "", on).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


KINDS = ["forward", "forward_interrupt", "loss", "backward", "backward_interrupt"]


def recovery_matrix(strategy: str, kinds: list[str], modes: list[str]) -> list[str]:
    """Every (kind, mode) whose parameters differ from the run without a failure."""
    bad = []
    for mode in modes:
        ref = _train(strategy, None, mode)
        for kind in kinds:
            got = _train(strategy, kind, mode)
            if not all(torch.equal(a, b) for a, b in zip(got, ref)):
                bad.append(f"{kind}/{mode}")
    return bad


def test_failed_step_leaves_no_trace_full_shard(dist_run) -> None:
    for bad in dist_run(2, recovery_matrix, "FULL_SHARD", KINDS, ["plain", "no_sync", "synced"]):
        assert bad == []


def test_failed_step_leaves_no_trace_other_strategies(dist_run) -> None:
    for strategy in ("SHARD_GRAD_OP", "NO_SHARD"):
        for bad in dist_run(2, recovery_matrix, strategy, ["forward_interrupt", "backward"], ["plain", "no_sync"]):
            assert bad == [], strategy


def test_failed_step_leaves_no_trace_four_ranks(dist_run) -> None:
    for bad in dist_run(4, recovery_matrix, "FULL_SHARD", ["backward", "backward_interrupt"], ["no_sync"]):
        assert bad == []


def generate_and_unit_first() -> dict[str, Any]:
    """A registered method that calls self(...) inside (HF generate()), and a unit called by itself
    before the root's first forward: no StateTransitionError, outputs as the plain model's, and
    training afterwards equal to a model that did neither."""
    torch.manual_seed(0)
    plain = Net()
    torch.manual_seed(0)
    model = Net()
    fully_shard(model, ModuleWrapPolicy({nn.Linear}))
    x = _batch(0, 0)
    unit_out = model.mid(torch.ones(2, 7))
    same_unit = torch.allclose(unit_out, plain.mid(torch.ones(2, 7)))
    unit_out.sum().backward()  # a backward through the unit alone
    for p in model.parameters():
        p.grad = None
    register_fsdp_forward_method(model, "generate")
    gen = model.generate(x)
    same_gen = torch.allclose(gen, plain.generate(x), atol=1e-6)
    gen_interrupted = False
    try:
        with torch.no_grad():
            orig = model.forward

            def interrupted(*a: Any) -> Any:
                raise KeyboardInterrupt

            model.forward = interrupted  # type: ignore[method-assign]
            model.generate(x)
    except KeyboardInterrupt:
        gen_interrupted = True
    finally:
        model.forward = orig  # type: ignore[method-assign]
    torch.manual_seed(0)
    ref = Net()
    fully_shard(ref, ModuleWrapPolicy({nn.Linear}))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    for step in range(2):
        for m, opt in zip((model, ref), opts):
            m(_batch(step, 0)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    equal = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    return {"unit": same_unit, "gen": same_gen, "interrupted": gen_interrupted, "equal": equal}


def test_registered_method_calling_self_and_unit_called_first(dist_run) -> None:
    for r in dist_run(2, generate_and_unit_first):
        assert r == {"unit": True, "gen": True, "interrupted": True, "equal": True}


# ---------------------------------------------------------------------------- entry points after an interrupted forward
def _use_entry_point(model: Net, entry: str, step: int) -> None:
    """Call ``entry`` first after the step's start, then train the step."""
    off = {"on": False}
    if entry == "no_sync":
        with no_sync(model):
            _loss(model, _batch(step, 0), "", off).backward()
    elif entry == "unshard_params":
        with unshard_params(model):
            pass
    elif entry == "reset_parameters":
        torch.manual_seed(7)
        model.mid.reset_parameters()
    elif entry == "clip_grad_norm_":
        clip_grad_norm_(model, 1.0)
    _loss(model, _batch(step, 1), "", off).backward()


def entry_point_after_interrupted_forward(entry: str) -> str:
    """A ``KeyboardInterrupt`` escapes a root forward (torch runs none of the forward hooks after it, so
    the forward stays open); the next call is ``entry``, between steps: it closes the interrupted
    forward's step and does its work, and training goes on bit for bit like a run without the interrupt.
    The error text otherwise."""
    params = []
    for interrupt in (True, False):
        torch.manual_seed(0)
        model = Net()
        fully_shard(model, ModuleWrapPolicy({nn.Linear}))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        on = {"on": False}
        _install(model, "forward_interrupt", on)
        for step in range(3):
            if step == 1 and interrupt:
                on["on"] = True
                try:
                    model(_batch(step, 9))
                except KeyboardInterrupt:
                    pass
                finally:
                    on["on"] = False
            try:
                _use_entry_point(model, entry, step)
            except Exception as e:
                return f"{type(e).__name__}: {e}"
            opt.step()
            opt.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
    return "equal" if all(torch.equal(a, b) for a, b in zip(*params)) else "differs"


def test_entry_points_close_a_forward_left_open_by_keyboard_interrupt(dist_run) -> None:
    """``no_sync``, ``unshard_params``, ``reset_parameters()`` and ``clip_grad_norm_`` called from inside
    a running forward refuse (tests/test_bad_runtime_inputs.py); called after a forward that a
    ``BaseException`` left open, they close it and work."""
    entries = ["no_sync", "unshard_params", "reset_parameters", "clip_grad_norm_"]
    for entry in entries:
        for r in dist_run(2, entry_point_after_interrupted_forward, entry):
            assert r == "equal", (entry, r)


def optimizer_built_while_a_failed_backward_is_open() -> tuple[list[str], str, list[str]]:
    """A backward raises on every rank; an optimizer is built from ``model.parameters()`` before
    anything closed that step, and another once the next forward did."""
    torch.manual_seed(0)
    model = Net()
    fully_shard(model, ModuleWrapPolicy({nn.Linear}))
    x = _batch(0, 0)
    try:
        _RaiseInBackward.apply(model(x), Injected).pow(2).mean().backward()
    except Injected:
        pass
    shown = [type(p).__name__ for p in model.parameters()]  # the root unit's parameter is its original
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).pow(2).mean().backward()  # the next forward closes the failed step
    try:
        early.step()
        message = ""
    except RuntimeError as e:
        message = str(e)
    late = torch.optim.SGD(model.parameters(), lr=0.1)
    late.step()  # built after the step was closed: it steps the faces
    return shown, message, [type(p).__name__ for p in model.parameters()]


def test_an_optimizer_built_before_a_failed_backward_is_closed_is_refused_with_the_reason(dist_run) -> None:
    for shown, message, after in dist_run(2, optimizer_built_while_a_failed_backward_is_open):
        assert "Parameter" in shown and "DTensor" in shown, shown
        assert message.startswith("the optimizer holds parameter 'scale' as it was before fully_shard"), message
        assert "a step that raised in backward stays open" in message, message
        assert set(after) == {"DTensor"}, after
