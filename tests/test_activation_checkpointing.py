"""Composable `checkpoint` with `fully_shard`: either order, around a unit or inside one, a module called
twice per forward, torch's own checkpoint APIs, and a padded world size. Each case checks gradients and
losses against an unsharded, un-checkpointed reference, counts forwards (recomputation runs the
checkpointed module once more per call), and checks that FQNs and state-dict keys are unchanged."""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import expecttest
import pytest
import torch
import torch.distributed as dist
from models import Block, OddMLP, TinyGPT, gpt_batch, gpt_loss, mlp_batch, mlp_loss
from parity import Batch, count_forwards, global_mean, local_slice
from torch import nn

from fsdp_composable import (
    CheckpointWrapper,
    ModuleWrapPolicy,
    ShardingStrategy,
    checkpoint,
    fully_shard,
    unshard_params,
)

TORCH_WRAPPED = "_checkpoint_wrapped_module."


class Twice(nn.Module):
    """One block applied twice per forward: a checkpointed module called twice, a unit called twice."""

    def __init__(self, vocab: int = 37, d: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.block = Block(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.block(self.tok(idx))))


def _structure(model: nn.Module, strip_wrapper: bool = False) -> tuple[list[str], ...]:
    """Module FQNs, parameter FQNs and state-dict keys; ``strip_wrapper`` drops what torch's
    checkpoint_wrapper adds to module FQNs (by design), to compare the rest."""

    def clean(names: list[str]) -> list[str]:
        if not strip_wrapper:
            return names
        return [n.replace(TORCH_WRAPPED, "") for n in names if not n.endswith(TORCH_WRAPPED[:-1])]

    return (
        clean([n for n, _ in model.named_modules()]),
        clean([n for n, _ in model.named_parameters()]),
        list(model.state_dict()),  # never stripped: state-dict keys must match as they are
    )


def _targets(model: nn.Module, where: str) -> list[nn.Module]:
    """The modules to checkpoint: the Block units themselves, or a submodule inside each unit."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if where == "around":
        return blocks
    if where == "inside":
        return [b.fc1 for b in blocks]
    if where == "odd":
        return [model.get_submodule("l2")]
    raise ValueError(where)


def _apply_ac(model: nn.Module, targets: list[nn.Module], api: str) -> None:
    for m in targets:
        if api == "ours":
            assert checkpoint(m) is m
        elif api == "torch_composable":
            from torch.distributed._composable import checkpoint as torch_checkpoint

            torch_checkpoint(m)
        elif api == "torch_wrapper":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            parent_fqn, _, attr = next(n for n, x in model.named_modules() if x is m).rpartition(".")
            setattr(model.get_submodule(parent_fqn), attr, checkpoint_wrapper(m))
        else:
            raise ValueError(api)


def parity(
    model_name: str, where: str, order: str, api: str = "ours", strategy: str = "FULL_SHARD", policy: str = "classes"
) -> dict[str, Any]:
    """Train the checkpointed, sharded model and the plain reference side by side for 2 steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    builders: dict[str, tuple[Callable[[], nn.Module], Any, Any, Any]] = {
        "gpt": (TinyGPT, gpt_loss, gpt_batch, {Block}),
        "twice": (Twice, gpt_loss, gpt_batch, {Block}),
        "odd": (OddMLP, mlp_loss, mlp_batch, {nn.Sequential}),
    }
    build, loss_fn, batch_fn, unit_classes = builders[model_name]
    ref = build()
    model = copy.deepcopy(ref)
    targets = _targets(model, where)
    if order == "before":
        _apply_ac(model, targets, api)
    if policy == "manual":  # one fully_shard call per block, then the root: a state per block
        for block in model.modules():
            if isinstance(block, tuple(unit_classes)):
                fully_shard(block, strategy=ShardingStrategy[strategy])
        fully_shard(model, strategy=ShardingStrategy[strategy])
    else:
        fully_shard(model, ModuleWrapPolicy(unit_classes), strategy=ShardingStrategy[strategy])
    if order == "after":
        _apply_ac(model, targets, api)
    calls = count_forwards(targets)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_diff, grad_diff, forwards = 0.0, 0.0, []
    for step in range(2):
        batch: Batch = batch_fn(step, 2 * world)
        ref_loss = loss_fn(ref, batch)
        ref_loss.backward()
        calls[0] = 0
        loss = loss_fn(model, local_slice(batch, rank, world))
        loss.backward()
        forwards.append(calls[0])
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        with unshard_params(model, with_grads=True, writeback=False):
            for name, p in model.named_parameters():
                grad_diff = max(grad_diff, (p.grad - ref_grads[name.replace(TORCH_WRAPPED, "")]).abs().max().item())
        loss_diff = max(loss_diff, abs(global_mean(loss) - ref_loss.item()))
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    sd = model.state_dict()
    weight_diff = max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return {
        "forwards": forwards,
        "calls_per_step": len(targets) * (2 if model_name == "twice" else 1),
        "grad_diff": grad_diff,
        "loss_diff": loss_diff,
        "weight_diff": weight_diff,
        "structure_same": _structure(model, strip_wrapper=api == "torch_wrapper") == _structure(ref),
        "types_same": [type(m) for m in model.modules()] == [type(m) for m in ref.modules()] or api == "torch_wrapper",
    }


def _check(results: list[dict[str, Any]]) -> None:
    for r in results:
        # every call of a checkpointed module runs once in forward and once more in backward
        assert r["forwards"] == [2 * r["calls_per_step"]] * 2, r
        assert r["grad_diff"] < 1e-5 and r["loss_diff"] < 1e-5 and r["weight_diff"] < 1e-5, r
        assert r["structure_same"] and r["types_same"], r


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("where", ["around", "inside"])
def test_checkpoint_with_fully_shard(dist_run, where: str, order: str) -> None:
    _check(dist_run(2, parity, "gpt", where, order))


@pytest.mark.parametrize("where, order", [("around", "after"), ("inside", "before")])
def test_checkpointed_module_called_twice(dist_run, where: str, order: str) -> None:
    _check(dist_run(2, parity, "twice", where, order))


@pytest.mark.parametrize("order", ["before", "after"])
def test_checkpoint_around_manually_nested_units(dist_run, order: str) -> None:
    # before: fully_shard(block) appends its unit pre-forward after checkpoint's, inside the region
    _check(dist_run(2, parity, "gpt", "around", order, "ours", "FULL_SHARD", "manual"))


def test_checkpoint_shard_grad_op(dist_run) -> None:
    _check(dist_run(2, parity, "gpt", "around", "before", "ours", "SHARD_GRAD_OP"))


@pytest.mark.parametrize("api", ["torch_composable", "torch_wrapper"])
def test_torch_checkpoint_apis_before_fully_shard(dist_run, api: str) -> None:
    _check(dist_run(2, parity, "gpt", "around", "before", api))


def test_checkpoint_padded_world_size_4(dist_run) -> None:
    _check(dist_run(4, parity, "odd", "odd", "after"))


class _TanhOut(nn.Module):
    """Ends in tanh, which saves its output: backward unpacks it, recomputing the whole module, before
    the pre-backward hook of the unit nested inside (``inner``) has run."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(torch.relu(self.pre(x))))


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.outer = _TanhOut()
        self.b = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.outer(self.a(x)))


def units_inside_checkpointed_module() -> dict[str, Any]:
    """checkpoint(outer) where outer and every Linear inside it are units."""

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = _Nested()
    model = copy.deepcopy(ref)
    checkpoint(model.outer)
    fully_shard(model, ModuleWrapPolicy({_TanhOut, nn.Linear}))
    calls = count_forwards([model.outer])
    x = torch.randn(2 * world, 4)
    grad_diff = 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            ref.zero_grad()
            model.zero_grad()
            ref(x).mean().backward()
            model(x[2 * rank : 2 * rank + 2]).mean().backward()
            with unshard_params(model, with_grads=True, writeback=False):
                for p, q in zip(model.parameters(), ref.parameters()):
                    grad_diff = max(grad_diff, (p.grad - q.grad).abs().max().item())
    return {"grad_diff": grad_diff, "forwards": calls[0], "warnings": [str(w.message) for w in caught]}


def test_units_inside_checkpointed_module(dist_run) -> None:
    for r in dist_run(2, units_inside_checkpointed_module):
        assert r["grad_diff"] < 1e-6 and r["forwards"] == 4, r


def test_units_inside_checkpointed_module_run_in_order(dist_run) -> None:
    for r in dist_run(2, units_inside_checkpointed_module):
        assert r["warnings"] == [], r


def checkpoint_fully_shard_root(order: str) -> dict:
    """The whole sharded model checkpointed: recomputing the root's forward mid-backward only
    re-gathers parameters, so gradients match the plain unsharded model."""
    torch.manual_seed(0)
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    if order == "before":
        checkpoint(model)
    fully_shard(model, ModuleWrapPolicy({Block}))
    if order == "after":
        checkpoint(model)
    calls = count_forwards([model])
    batch = gpt_batch(0, 4)
    gpt_loss(ref, batch).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # a second step: the state must be IDLE and consistent again
            model.zero_grad()
            gpt_loss(model, local_slice(batch, dist.get_rank(), dist.get_world_size())).backward()
    with unshard_params(model, with_grads=True, writeback=False):
        diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return {"diff": diff, "forwards": calls[0], "warnings": [str(w.message) for w in caught]}


@pytest.mark.parametrize("order", ["before", "after"])
def test_checkpoint_on_fully_shard_root(dist_run, order: str) -> None:
    for r in dist_run(2, checkpoint_fully_shard_root, order):
        assert r["diff"] < 1e-6 and r["forwards"] == 4 and r["warnings"] == [], r


def test_checkpoint_without_sharding() -> None:
    torch.manual_seed(0)
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    structure = _structure(model)
    for block in model.blocks:
        assert checkpoint(block) is block and type(block) is Block
    assert _structure(model) == structure
    calls = count_forwards(list(model.blocks))
    batch = gpt_batch(0, 4)
    loss = gpt_loss(model, batch)
    assert calls[0] == 2
    loss.backward(retain_graph=True)
    assert calls[0] == 4
    loss.backward()  # a second backward through the same graph recomputes again
    assert calls[0] == 6
    (2 * gpt_loss(ref, batch)).backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # no graph, no region, no recomputation
        gpt_loss(model, batch)
    assert calls[0] == 8


def test_checkpoint_preserves_dropout_mask() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    model = copy.deepcopy(ref)
    checkpoint(model)
    x = torch.randn(16, 4)
    torch.manual_seed(1)
    ref(x).sum().backward()
    torch.manual_seed(1)
    model(x).sum().backward()  # a different mask in recomputation would change the gradient
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor, debug: bool = False) -> torch.Tensor:
        return torch.tanh(self.lin(x) * scale) if not debug else x


def test_checkpoint_keyword_arguments() -> None:
    # ``debug`` is also a parameter name of torch's checkpoint generator: it must reach the module
    torch.manual_seed(0)
    ref = _Scaled()
    model = copy.deepcopy(ref)
    checkpoint(model)
    calls = count_forwards([model])
    x, scale = torch.randn(2, 3), torch.randn(3, requires_grad=True)
    ref_scale = scale.detach().clone().requires_grad_()
    model(x, scale=scale, debug=False).sum().backward()
    ref(x, scale=ref_scale, debug=False).sum().backward()
    assert calls[0] == 2
    torch.testing.assert_close(scale.grad, ref_scale.grad)
    torch.testing.assert_close(model.lin.weight.grad, ref.lin.weight.grad)


class _Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            raise ValueError("empty batch")
        return self.lin(x)


def test_forward_that_raises_closes_the_region() -> None:
    model = _Fails()
    checkpoint(model)
    with pytest.raises(ValueError, match="empty batch"):
        model(torch.zeros(0, 3))
    assert checkpoint.state(model).regions == []
    # a leaked region would swap this plain graph's saved tensors for placeholders that recompute _Fails
    other = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    other(x).pow(2).sum().backward()
    assert other.weight.grad is not None
    calls = count_forwards([model])
    model(torch.randn(2, 3)).pow(2).sum().backward()
    assert calls[0] == 2


def test_checkpoint_errors() -> None:
    errors = {}
    block = Block(4)
    checkpoint(block)
    for name, call in {
        "twice": lambda: checkpoint(block),
        "reentrant": lambda: checkpoint(nn.Linear(2, 2), use_reentrant=True),
        "reentrant_type": lambda: checkpoint(nn.Linear(2, 2), use_reentrant="no"),
        "wrapper": lambda: checkpoint(CheckpointWrapper(nn.Linear(2, 2))),
        "not_module": lambda: checkpoint("fc1"),
        "no_state": lambda: checkpoint.state(nn.Linear(2, 2)),
    }.items():
        try:
            call()
        except (TypeError, ValueError, RuntimeError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        "\n".join(f"{k}: {v}" for k, v in errors.items()),
        """\
twice: RuntimeError: checkpoint was already applied to this Block; apply it once per module (a second application would recompute its forward twice)
reentrant: ValueError: checkpoint(use_reentrant=True) is not supported (module Linear): reentrant checkpointing must run the forward inside an autograd Function, which hooks cannot do without wrapping the module, and it recomputes in a nested backward that fully_shard's backward hooks cannot see. Use use_reentrant=False (the default).
reentrant_type: TypeError: checkpoint argument 'use_reentrant' must be True or False, got 'no'
wrapper: ValueError: checkpoint was called on a CheckpointWrapper (wrapping Linear), whose forward is already checkpointed; apply either checkpoint or the wrapper, not both
not_module: TypeError: checkpoint expects an nn.Module as its first argument, got str
no_state: ValueError: checkpoint was not applied to this Linear; call checkpoint(module) first (APIs applied: none)""",  # noqa: E501
    )
