"""Misuse of a sharded model that used to end in raw torch errors or silently wrong state: each is a
clear error naming fully_shard, on every rank, and leaves the model usable."""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import expecttest
import torch
import torch.distributed as dist
from harness import error_of
from models import Block, TinyGPT, gpt_batch, gpt_loss
from parity import local_slice
from torch import nn

from fsdp_composable import ModuleWrapPolicy, fully_shard, unshard_params


def _sharded() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = fully_shard(TinyGPT(), ModuleWrapPolicy({Block}))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> float:
    loss = gpt_loss(model, local_slice(gpt_batch(step, 4), dist.get_rank(), dist.get_world_size()))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return float(loss.detach())


# ---------------------------------------------------------------------------- refused loads write nothing
def refused_load(case: str) -> dict[str, Any]:
    model, optim = _sharded()
    _step(model, optim, 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    other = {k: v + 1.0 for k, v in before.items()}  # every value differs from the model's
    rank = dist.get_rank()
    if case == "shape_one_rank" and rank == 1:
        other["blocks.1.fc2.bias"] = torch.zeros(3)
    elif case == "shape_every_rank":
        other["head.weight"] = torch.zeros(5, 16)
    elif case == "missing":
        del other["blocks.0.fc1.weight"]
    elif case == "extra":
        other["blocks.0.not_a_parameter"] = torch.zeros(2)
    message = error_of(lambda: model.load_state_dict(other))
    after = model.state_dict()
    out = {
        "message": message,
        "untouched": all(torch.equal(after[k], v) for k, v in before.items()),
        "buffer_untouched": torch.equal(after["pos_ids"], before["pos_ids"]) if "pos_ids" in before else True,
    }
    _step(model, optim, 1)  # the ranks are in step and the model trains on
    out["params_equal"] = sum(float(v.double().sum()) for v in model.state_dict().values())
    return out


def test_refused_full_load_leaves_every_parameter_untouched(dist_run) -> None:
    for case in ("shape_one_rank", "shape_every_rank", "missing", "extra"):
        results = dist_run(2, refused_load, case)
        for rank, r in enumerate(results):
            assert r["message"].startswith("RuntimeError: Error(s) in loading state_dict"), (case, rank, r)
            assert "fully_shard: " in r["message"] and "nothing was loaded" in r["message"], (case, rank, r)
            assert r["untouched"], (case, rank, r)
        assert results[0]["params_equal"] == results[1]["params_equal"], case


def test_errors_page_says_a_refused_full_load_writes_nothing(dist_run) -> None:
    """docs/errors.md's rows for a FULL load with a value of the wrong shape say what the code does
    (checked here at 2 ranks): nothing is written, the other keys included, and the message says so."""
    for r in dist_run(2, refused_load, "shape_every_rank"):
        assert r["untouched"], r
        said = r["message"].splitlines()[-1].strip()
    text = (Path(__file__).resolve().parent.parent / "docs" / "errors.md").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| FULL: ") and "wrong shape" in line]
    assert len(rows) == 2, rows
    for row in rows:
        assert said in row and "other keys are loaded" not in row, row
    assert "Nothing is written: every parameter and buffer keeps its value on every rank" in rows[0], rows[0]


def accepted_non_strict_load() -> bool:
    model, optim = _sharded()
    _step(model, optim, 0)
    sd = {k: v + 1.0 for k, v in model.state_dict().items()}
    del sd["head.weight"]
    result = model.load_state_dict(sd, strict=False)
    after = model.state_dict()
    return result.missing_keys == ["head.weight"] and all(torch.equal(after[k], v) for k, v in sd.items())


def test_non_strict_load_with_missing_keys_still_loads(dist_run) -> None:
    assert dist_run(2, accepted_non_strict_load) == [True, True]


# ---------------------------------------------------------------------------- copies of a sharded model
def copies() -> dict[str, str]:
    model, optim = _sharded()
    _step(model, optim, 0)
    out = {
        "deepcopy": error_of(lambda: copy.deepcopy(model)),
        "deepcopy_unit": error_of(lambda: copy.deepcopy(model.blocks[1])),
        "save": error_of(lambda: torch.save(model, io.BytesIO())),
        "save_inside_unit": error_of(lambda: torch.save(model.blocks[0].fc1, io.BytesIO())),
    }
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)  # what the errors point to works
    _step(model, optim, 1)
    return out


def test_deepcopy_and_save_of_a_sharded_model_say_to_use_state_dict(dist_run) -> None:
    for r in dist_run(2, copies):
        expecttest.TestCase().assertExpectedInline(
            r["deepcopy"],
            """TypeError: fully_shard: parameter 'pos' belongs to a model sharded by fully_shard and cannot be copied with copy.deepcopy or pickled (torch.save(model)): it holds only this rank's shard, and the model's hooks hold its process group. To copy the model, build a new one (and shard it) and load model.state_dict() into it; to save it, save model.state_dict() (or use torch.distributed.checkpoint)""",  # noqa: E501
        )
        assert r["save"] == r["deepcopy"], r
        for key in ("deepcopy_unit", "save_inside_unit"):
            assert r[key].startswith("TypeError: fully_shard: ") and "model.state_dict()" in r[key], r


# ---------------------------------------------------------------------------- torch.autograd.grad
def autograd_grad() -> dict[str, Any]:
    model, optim = _sharded()
    _step(model, optim, 0)
    batch = local_slice(gpt_batch(1, 4), dist.get_rank(), dist.get_world_size())
    message = error_of(lambda: torch.autograd.grad(gpt_loss(model, batch), list(model.parameters())))
    for step in (2, 3):  # the failed step is closed; training goes on
        _step(model, optim, step)
    return {"message": message, "sum": sum(float(v.double().sum()) for v in model.state_dict().values())}


def test_autograd_grad_over_a_sharded_model_is_refused(dist_run) -> None:
    r0, r1 = dist_run(2, autograd_grad)
    assert r0["sum"] == r1["sum"]
    for r in (r0, r1):
        expecttest.TestCase().assertExpectedInline(
            r["message"],
            """RuntimeError: fully_shard: torch.autograd.grad over a sharded model is not supported: it would return this rank's gradients of its own batch only, full-size and not averaged across ranks. Call loss.backward() instead: each parameter's .grad is then this rank's shard of the averaged gradient (unshard_params(model, with_grads=True) shows the full ones)""",  # noqa: E501
        )


# ---------------------------------------------------------------------------- a submodule called by itself
def direct_call() -> dict[str, Any]:
    model, optim = _sharded()
    _step(model, optim, 0)
    x = torch.randn(3, 16)
    out = {"fc1": error_of(lambda: model.blocks[0].fc1(x)), "ln": error_of(lambda: model.ln_f(x))}
    with unshard_params(model):
        inside = model.blocks[0].fc1(x)
    out["shape"] = tuple(inside.shape)
    _step(model, optim, 1)
    return out


def test_submodule_inside_a_unit_called_by_itself(dist_run) -> None:
    for r in dist_run(2, direct_call):
        assert r["shape"] == (3, 64), r
        assert r["fc1"].startswith(
            "RuntimeError: fully_shard: Linear holding parameter 'blocks.0.fc1.weight' was called by itself while "
            "its parameters are sharded"
        ), r
        assert "unshard_params(model)" in r["fc1"], r
        assert r["ln"].startswith("RuntimeError: fully_shard: LayerNorm holding parameter 'ln_f.weight'"), r
