"""Edge cases of unit shape and call pattern, each checked against the unsharded model.

Empty shards (more ranks than elements), units without parameters, buffer-only modules, inputs that
need no grad, nested and non-tensor outputs, zero-sized parameters, and forwards under ``no_grad``,
``inference_mode`` and ``eval()`` before training. Dataclass outputs, a unit called twice whose first
call's inputs need no grad, and false execution-order warnings for repeated calls were library bugs
these tests found; they stay as regression tests.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from parity import global_mean
from torch import nn

from fsdp_composable import ModuleWrapPolicy, ShardingStrategy, fully_shard
from fsdp_composable._common_utils import TrainingState

GLOBAL_BATCH = 8
TOL = 1e-5
Batch = tuple[torch.Tensor, ...]


# ---------------------------------------------------------------------------- shared helpers
def _batch(step: int, width: int = 3) -> Batch:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, width, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)


def _local(batch: Batch) -> Batch:
    rank, world = dist.get_rank(), dist.get_world_size()
    per = GLOBAL_BATCH // world
    return tuple(t[rank * per : (rank + 1) * per] for t in batch)


def _mse(model: nn.Module, batch: Batch) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def _compare_state_dicts(model: nn.Module, ref: nn.Module) -> dict[str, Any]:
    sd, ref_sd = model.state_dict(), ref.state_dict()
    return {
        "keys_equal": list(sd) == list(ref_sd),
        "meta_diff": [
            k for k in ref_sd if k in sd and (sd[k].shape, sd[k].dtype) != (ref_sd[k].shape, ref_sd[k].dtype)
        ],
        "max_diff": max(
            ((sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd if k in sd and sd[k].numel()), default=0.0
        ),
    }


def _train(
    ref: nn.Module,
    model: nn.Module,
    steps: int = 3,
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor] = _mse,
    batch_fn: Callable[[int], Batch] = _batch,
) -> dict[str, Any]:
    """Train ``ref`` on the global batch and the sharded ``model`` on this rank's slice."""
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_losses, losses = [], []
    for step in range(steps):
        batch = batch_fn(step)
        loss_ref = loss_fn(ref, batch)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        loss = loss_fn(model, _local(batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss_ref.item())
        losses.append(global_mean(loss))
    return {"ref_losses": ref_losses, "losses": losses, **_compare_state_dicts(model, ref)}


def _check(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["keys_equal"] and not r["meta_diff"], r
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=TOL, atol=TOL)
        assert r["max_diff"] <= TOL, r["max_diff"]
    assert all(r["losses"] == results[0]["losses"] for r in results), "ranks disagree on the global loss"


def _handles(model: nn.Module) -> list[Any]:
    return list(fully_shard.state(model).handles)  # root unit first, then pre-order


def _idle_and_resharded(model: nn.Module) -> bool:
    state = fully_shard.state(model)
    return state.training_state is TrainingState.IDLE and not any(h.is_unsharded for h in _handles(model))


# ---------------------------------------------------------------------------- more ranks than elements
class ThreeElements(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rest = nn.Linear(3, 2)
        self.tiny = nn.Linear(2, 1)  # one row each: at world size 4 three ranks' shards are all padding
        self.scalar = nn.Parameter(torch.tensor(0.5))  # a 0-dim parameter in the root unit: every rank holds it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tiny(torch.tanh(self.rest(x))) * self.scalar


def more_ranks_than_elements(strategy: str) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = ThreeElements()
    model = fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({nn.Linear}), strategy=ShardingStrategy[strategy])
    out = _train(ref, model)
    (tiny,) = [h for h in _handles(model) if h.unit_fqn == "tiny"]
    out["tiny_layout"] = (tiny.layout.padded_numel, tiny.layout.shard_numel)
    out["local_numels"] = {h.unit_fqn: [p.numel() for p in h.params] for h in _handles(model)}
    return out


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_more_ranks_than_elements(dist_run: Callable[..., list[Any]], strategy: str) -> None:
    results = dist_run(4, more_ranks_than_elements, strategy)
    _check(results)
    assert [r["tiny_layout"] for r in results] == [(12, 3)] * 4
    # tiny: the weight's one row (2 elements) and the bias on rank 0, ranks 1-3 only padding; root: the
    # 0-dim scalar whole on every rank
    assert [r["local_numels"]["tiny"] for r in results] == [[2, 1], [0, 0], [0, 0], [0, 0]]
    assert [r["local_numels"][""] for r in results] == [[1], [1], [1], [1]]


# ---------------------------------------------------------------------------- units without parameters
class BufferOnly(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


class ParamFreeUnits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(3, 5)
        self.act = nn.Tanh()
        self.norm = BufferOnly(5)
        self.l2 = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.norm(self.act(self.l1(x))))


def param_free_units() -> dict[str, Any]:
    torch.manual_seed(1)
    ref = ParamFreeUnits()
    model = fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({nn.Tanh, BufferOnly, nn.Linear}))
    out = _train(ref, model)
    out["units"] = [h.unit_fqn for h in _handles(model)]
    out["idle"] = _idle_and_resharded(model)
    return out


def test_policy_picks_parameter_free_modules(dist_run: Callable[..., list[Any]]) -> None:
    results = dist_run(4, param_free_units)
    _check(results)
    for r in results:
        # the root owns nothing either (every parameter is in a Linear unit), so it has no handle
        assert r["units"] == ["l1", "l2"] and r["idle"], r


def buffers_only_root() -> dict[str, Any]:
    ref = BufferOnly(3)
    model = fully_shard(copy.deepcopy(ref))
    out: dict[str, Any] = {"handles": len(_handles(model)), "diffs": []}
    for step in range(2):
        x = _local(_batch(step))[0].requires_grad_(True)
        x_ref = x.detach().clone().requires_grad_(True)
        y, y_ref = model(x), ref(x_ref)
        y.pow(2).sum().backward()
        y_ref.pow(2).sum().backward()
        assert x.grad is not None and x_ref.grad is not None
        out["diffs"] += [(y - y_ref).abs().max().item(), (x.grad - x_ref.grad).abs().max().item()]
    with torch.no_grad():
        out["diffs"].append((model(x) - ref(x)).abs().max().item())
    out["idle"] = fully_shard.state(model).training_state is TrainingState.IDLE
    out.update(_compare_state_dicts(model, ref))
    return out


def test_module_with_only_buffers(dist_run: Callable[..., list[Any]]) -> None:
    for r in dist_run(4, buffers_only_root):
        assert r["handles"] == 0 and r["keys_equal"] and not r["meta_diff"] and r["max_diff"] == 0, r
        assert max(r["diffs"]) == 0 and r["idle"], r


# ---------------------------------------------------------------------------- inputs
class MultiInput(nn.Module):
    """Positional float and integer inputs plus a boolean keyword input."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.l1 = nn.Linear(3, 4)
        self.l2 = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        h = torch.where(mask, torch.tanh(self.l1(x + self.emb(idx))), 0.0)
        return self.l2(h)


def _multi_batch(step: int) -> Batch:
    x, y = _batch(step)
    g = torch.Generator().manual_seed(200 + step)
    return x, torch.randint(0, 5, (GLOBAL_BATCH,), generator=g), torch.rand(GLOBAL_BATCH, 1, generator=g) > 0.3, y


def inputs(x_requires_grad: bool, strategy: str) -> dict[str, Any]:
    torch.manual_seed(2)
    ref = MultiInput()
    policy = ModuleWrapPolicy({nn.Embedding, nn.Linear})  # emb's only input is integer: no grad at all
    model = fully_shard(copy.deepcopy(ref), policy, strategy=ShardingStrategy[strategy])
    seen: list[tuple[bool, torch.Tensor]] = []  # (sharded?, x) per loss, reference first each step

    def loss_fn(m: nn.Module, batch: Batch) -> torch.Tensor:
        x, idx, mask, y = batch
        x = x.detach().requires_grad_(x_requires_grad)
        seen.append((m is model, x))
        return F.mse_loss(m(x, idx, mask=mask), y)

    out = _train(ref, model, loss_fn=loss_fn, batch_fn=_multi_batch)
    rank, world = dist.get_rank(), dist.get_world_size()
    per = GLOBAL_BATCH // world
    diffs = []
    for (_, x_ref), (_, x) in zip(seen[0::2], seen[1::2]):
        if x.grad is not None and x_ref.grad is not None:
            # the local loss averages over 1/world of the batch: its input gradient is world times larger
            diffs.append((x_ref.grad[rank * per : (rank + 1) * per] - x.grad / world).abs().max().item())
    out["input_grad_diffs"] = diffs
    out["idle"] = _idle_and_resharded(model)
    return out


@pytest.mark.parametrize("x_requires_grad", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_inputs_with_and_without_grad(dist_run: Callable[..., list[Any]], x_requires_grad: bool, strategy: str) -> None:
    results = dist_run(4, inputs, x_requires_grad, strategy)
    _check(results)
    for r in results:
        assert len(r["input_grad_diffs"]) == (3 if x_requires_grad else 0) and r["idle"], r
        assert max(r["input_grad_diffs"], default=0.0) <= TOL, r


# ---------------------------------------------------------------------------- outputs
class NestedOut(nn.Module):
    """A unit whose output is a dict holding lists and tuples of tensors, None, ints and strings."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = self.l(x)
        return {"h": h, "parts": [h * 2, (h.sum(-1, keepdim=True), None)], "n": 3, "tag": "text"}


class TupleOut(nn.Module):
    """A unit whose output is a tuple of a tensor and a non-tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 2)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, int]:
        return torch.tanh(self.l(h)), h.shape[0]


class NoTensorOut(nn.Module):
    """A unit whose output is not a tensor at all (its parameter is not used in the loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(2, 2)

    def forward(self, h: torch.Tensor) -> str:
        return f"batch of {h.shape[0]}"


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


class NamedTupleOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(2, 2)

    def forward(self, h: torch.Tensor) -> Pair:
        y = self.l(h)
        return Pair(y, y * y)


class NestedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.nested = NestedOut()
        self.tuple_out = TupleOut()
        self.note = NoTensorOut()
        self.pair = NamedTupleOut()
        self.head = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        out = self.nested(x)
        assert out["n"] == 3 and out["tag"] == "text" and out["parts"][1][1] is None
        h = out["h"] + out["parts"][0] + out["parts"][1][0]
        t, n = self.tuple_out(h)
        assert isinstance(n, int) and isinstance(self.note(t), str)
        pair = self.pair(t)
        return {"y": self.head(pair.a + pair.b), "count": n}


def nested_outputs(strategy: str) -> dict[str, Any]:
    torch.manual_seed(3)
    ref = NestedModel()
    policy = ModuleWrapPolicy({NestedOut, TupleOut, NoTensorOut, NamedTupleOut})
    model = fully_shard(copy.deepcopy(ref), policy, strategy=ShardingStrategy[strategy])

    def loss_fn(m: nn.Module, batch: Batch) -> torch.Tensor:
        return F.mse_loss(m(batch[0])["y"], batch[1])

    out = _train(ref, model, loss_fn=loss_fn)
    out["idle"] = _idle_and_resharded(model)
    return out


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_nested_and_non_tensor_outputs(dist_run: Callable[..., list[Any]], strategy: str) -> None:
    results = dist_run(4, nested_outputs, strategy)
    _check(results)
    assert all(r["idle"] for r in results)


@dataclass
class Output:
    hidden: torch.Tensor
    note: Optional[str] = None


class DataclassOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> Output:
        return Output(torch.tanh(self.l(x)), "ok")


class DataclassModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = DataclassOut()
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x).hidden)


def dataclass_output(strategy: str) -> dict[str, Any]:
    torch.manual_seed(4)
    ref = DataclassModel()
    # pytree treats an unregistered dataclass as a leaf; the runtime must still find its tensors
    model = fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({DataclassOut}), strategy=ShardingStrategy[strategy])
    return _train(ref, model)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_dataclass_output(dist_run: Callable[..., list[Any]], strategy: str) -> None:
    _check(dist_run(4, dataclass_output, strategy))


# ---------------------------------------------------------------------------- a unit called twice
class CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 3)
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(torch.tanh(self.inner(x))))


def called_twice(strategy: str, x_requires_grad: bool) -> dict[str, Any]:
    torch.manual_seed(7)
    ref = CalledTwice()
    policy = ModuleWrapPolicy({nn.Linear})
    model = fully_shard(copy.deepcopy(ref), policy, strategy=ShardingStrategy[strategy])

    def loss_fn(m: nn.Module, batch: Batch) -> torch.Tensor:
        return F.mse_loss(m(batch[0].detach().requires_grad_(x_requires_grad)), batch[1])

    return _train(ref, model, loss_fn=loss_fn)


@pytest.mark.parametrize(
    "strategy, x_requires_grad",
    [
        ("FULL_SHARD", True),
        # the first call's inputs need no grad, so it has no post-backward trigger: the unit must wait
        # for the final callback instead of reducing after the second call's backward
        ("FULL_SHARD", False),
        ("SHARD_GRAD_OP", False),
        ("NO_SHARD", False),
    ],
)
def test_unit_called_twice(dist_run: Callable[..., list[Any]], strategy: str, x_requires_grad: bool) -> None:
    _check(dist_run(4, called_twice, strategy, x_requires_grad))


def order_warnings(pattern: str) -> list[str]:
    """fully_shard's warnings over 3 steps whose units run in the same order every iteration."""
    torch.manual_seed(7)
    # CalledTwice runs `inner` twice per forward; ParamFreeUnits runs each unit once per forward
    model = fully_shard(
        CalledTwice() if pattern == "twice_in_forward" else ParamFreeUnits(), ModuleWrapPolicy({nn.Linear})
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x = _local(_batch(step))[0].requires_grad_(True)
            if pattern == "twice_in_forward":
                loss = model(x).sum()
            else:  # two forwards, one backward through both
                loss = model(x).sum() + model(x * 2).sum()
            loss.backward()
    return [str(w.message) for w in caught if "fully_shard" in str(w.message)]


@pytest.mark.parametrize("pattern", ["twice_in_forward", "two_forwards_one_backward"])
def test_repeated_calls_do_not_warn_about_order(dist_run: Callable[..., list[Any]], pattern: str) -> None:
    for caught in dist_run(2, order_warnings, pattern):
        assert caught == [], caught


# ---------------------------------------------------------------------------- zero-sized parameters
class OnlyEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.empty(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.p.sum()


class ZeroSized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(3, 3)
        self.empty = nn.Parameter(torch.empty(0))
        self.empty2d = nn.Parameter(torch.empty(0, 3))
        self.only_empty = OnlyEmpty()  # a unit whose only parameter has no elements
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l(x) + self.empty.sum() + (x @ self.empty2d.t()).sum(-1, keepdim=True)
        return self.head(self.only_empty(torch.tanh(h)))


def zero_sized(strategy: str) -> dict[str, Any]:
    torch.manual_seed(5)
    ref = ZeroSized()
    model = fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({OnlyEmpty}), strategy=ShardingStrategy[strategy])
    out = _train(ref, model)
    sd = model.state_dict()
    out["shapes"] = {k: tuple(sd[k].shape) for k in ("empty", "empty2d", "only_empty.p")}
    out["units"] = [h.unit_fqn for h in _handles(model)]
    return out


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_zero_sized_parameters(dist_run: Callable[..., list[Any]], strategy: str) -> None:
    results = dist_run(4, zero_sized, strategy)
    _check(results)
    for r in results:
        assert r["shapes"] == {"empty": (0,), "empty2d": (0, 3), "only_empty.p": (0,)}, r
        assert r["units"] == ["", "only_empty"], r


# ---------------------------------------------------------------------------- forwards without backward
class ModeDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l(x)
        return h * 2 if self.training else h


class EvalModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(3, 3)
        self.mode = ModeDependent()
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mode(self.l0(x))))


def _forward_only(model: nn.Module, ref: nn.Module, how: str, x: torch.Tensor) -> float:
    """One forward with no backward after it; returns the max abs difference to the reference."""
    if how.startswith("eval"):
        model.eval()
        ref.eval()
    ctx: Any = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(how, torch.no_grad)
    if how == "eval_grad":  # a validation forward that forgot no_grad: the graph is built, then dropped
        y, y_ref = model(x), ref(x)
    else:
        with ctx():
            y, y_ref = model(x), ref(x)
    model.train()
    ref.train()
    return (y - y_ref).abs().max().item()


def forward_then_train(how: str, strategy: str) -> dict[str, Any]:
    torch.manual_seed(6)
    ref = EvalModel()
    policy = ModuleWrapPolicy({ModeDependent, nn.Linear})
    model = fully_shard(copy.deepcopy(ref), policy, strategy=ShardingStrategy[strategy])
    x = _local(_batch(99))[0]
    diffs = [_forward_only(model, ref, how, x)]
    idle = [_idle_and_resharded(model)]
    first = _train(ref, model, steps=2)
    diffs.append(_forward_only(model, ref, how, x))  # between steps too
    idle.append(_idle_and_resharded(model))
    second = _train(ref, model, steps=2, batch_fn=lambda step: _batch(step + 2))
    second["ref_losses"] = first["ref_losses"] + second["ref_losses"]
    second["losses"] = first["losses"] + second["losses"]
    return {**second, "forward_diffs": diffs, "idle_after_forward": idle}


@pytest.mark.parametrize("how", ["no_grad", "inference_mode", "eval_no_grad"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_forward_without_backward_then_train(dist_run: Callable[..., list[Any]], how: str, strategy: str) -> None:
    results = dist_run(4, forward_then_train, how, strategy)
    _check(results)
    for r in results:
        assert max(r["forward_diffs"]) <= TOL and all(r["idle_after_forward"]), r


def test_eval_forward_with_grad_enabled_then_train(dist_run: Callable[..., list[Any]]) -> None:
    results = dist_run(4, forward_then_train, "eval_grad", "FULL_SHARD")
    _check(results)
    assert all(max(r["forward_diffs"]) <= TOL for r in results)
