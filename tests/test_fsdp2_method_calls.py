"""FSDP2's methods called on a model sharded here (``model.unshard()``): the model keeps its class, so
Python's AttributeError is raised, on every rank, and nothing changes; docs/errors.md lists every public
method of torch's ``FSDPModule`` with the function to call instead, each of which exists, and the
migration guide's FSDP2 table says so in its first row."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import torch
from models import Block, TinyGPT, gpt_batch, gpt_loss
from parity import error_text
from torch.distributed.fsdp import FSDPModule

import fsdp_composable
from fsdp_composable import ModuleWrapPolicy, fully_shard

DOCS = Path(__file__).resolve().parent.parent / "docs"
FSDP2_METHODS = sorted(n for n in vars(FSDPModule) if not n.startswith("_"))


def method_calls() -> dict[str, Any]:
    torch.manual_seed(0)
    model = fully_shard(TinyGPT(), ModuleWrapPolicy({Block}))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = {
        "class": type(model).__name__,
        "unshard": error_text(lambda: model.unshard()),  # type: ignore[operator]
        "sync": error_text(lambda: model.set_requires_gradient_sync(False)),  # type: ignore[operator]
        "function": error_text(lambda: fsdp_composable.set_requires_gradient_sync(model, True)),
    }
    gpt_loss(model, gpt_batch(0, 2)).backward()  # the model still trains
    after = model.state_dict()
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    return out


def test_fsdp2_method_on_sharded_model_says_attribute_error(dist_run: Callable[..., Any]) -> None:
    for r in dist_run(2, method_calls):
        assert r == {
            "class": "TinyGPT",
            "unshard": "AttributeError: 'TinyGPT' object has no attribute 'unshard'",
            "sync": "AttributeError: 'TinyGPT' object has no attribute 'set_requires_gradient_sync'",
            "function": "no error",
            "unchanged": True,
        }, r


def test_errors_page_lists_every_fsdp2_method() -> None:
    text = (DOCS / "errors.md").read_text()
    section = text.split("## FSDP2's methods on a sharded model: `AttributeError`", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `model\.(\w+)\(\.\.\.\)` \| `AttributeError` \| (.*) \|$", section, re.M))
    assert sorted(rows) == FSDP2_METHODS, sorted(set(rows) ^ set(FSDP2_METHODS))
    for name, instead in rows.items():
        if instead.startswith("not offered"):
            assert not hasattr(fsdp_composable, name), name
        else:  # the function named, and exported
            assert instead.startswith(f"`{name}(module"), (name, instead)
            assert name in fsdp_composable.__all__, name


def test_migration_guide_says_it_first() -> None:
    text = (DOCS / "migration.md").read_text()
    fsdp2 = text.split("## From FSDP2: `fully_shard(module, ...)`", 1)[1]
    first_row = [line for line in fsdp2.splitlines() if line.startswith("| ")][1]
    assert first_row.startswith("| `model.unshard()`, `model.set_requires_gradient_sync(False)`"), first_row
    assert "AttributeError" in first_row and "unshard(model)" in first_row, first_row
    assert "`fsdp_composable.unshard(model)`" in text.split("## Deliberate differences", 1)[0]
