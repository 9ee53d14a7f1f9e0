"""The benchmark-only safety switches ([Note: safety switches]): each turns exactly its check off,
training gives the same values with it off, and every check is back on when the block ends."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from models import Block, TinyGPT
from parity import error_text, gpt_step

from fsdp_composable import ModuleWrapPolicy, fully_shard
from fsdp_composable._base import _safety
from fsdp_composable._comm import _rank_agreement


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = fully_shard(TinyGPT(n_layers=2), ModuleWrapPolicy({Block}))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def switches() -> dict[str, Any]:
    model, optim = _model()
    ref, ref_optim = _model()
    headers = [0]
    isend = dist.isend

    def counting(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any:
        headers[0] += tag == _rank_agreement._HEADER_TAG
        return isend(tensor, dst, group, tag)

    dist.isend = counting  # type: ignore[assignment]
    sent: dict[str, int] = {}
    try:
        for step, off in enumerate([(), ("headers",), ("grad_bookkeeping",), ("edit_checks",), NAMES, ()]):
            headers[0] = 0
            with _safety.switched_off(*off):
                loss = gpt_step(model, optim, step)
            sent[",".join(off) or f"all on ({step})"] = headers[0]
            assert loss == gpt_step(ref, ref_optim, step), off  # the same values with a check off
    finally:
        dist.isend = isend  # type: ignore[assignment]
    weight = model.blocks[0].fc1.weight
    with _safety.switched_off("edit_checks"):  # a write of another shape: refused when noticed
        weight.data = torch.zeros(weight.numel() + 1)
        unnoticed = error_text(lambda: model(torch.zeros(2, 8, dtype=torch.long)))  # (the unshard undid it)
    weight.data = torch.zeros(weight.numel() + 1)
    noticed = error_text(lambda: model(torch.zeros(2, 8, dtype=torch.long)))
    return {
        "headers_sent": sent,
        "edit_off": unnoticed,
        "edit_on": noticed.split(":")[0],
        "unknown": error_text(lambda: _safety.switched_off("header").__enter__()),
        "back_on": _safety.current() == _safety.SafetyChecks(),
    }


NAMES = _safety.NAMES


def test_safety_switches_turn_off_one_check_each(dist_run) -> None:
    for r in dist_run(2, switches):
        sent = r["headers_sent"]
        assert sent["headers"] == 0 and sent[",".join(NAMES)] == 0, sent
        assert min(sent["all on (0)"], sent["all on (5)"], sent["grad_bookkeeping"], sent["edit_checks"]) > 0, sent
        assert r["edit_off"] == "no error" and r["edit_on"] == "ModelEditedAfterShardingError", r
        assert r["unknown"] == (
            "ValueError: unknown safety check(s) ['header']; the checks are "
            "['headers', 'edit_checks', 'grad_bookkeeping']"
        )
        assert r["back_on"]
