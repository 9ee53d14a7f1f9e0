"""Edits to a model after ``fully_shard`` (``p.data = t``, a new parameter) found broken by an
adversarial pass: the error leaves no cleared gradient behind, and it is raised on every rank even
where the edited parameter has no element. Every comparison is exact against a run without the edit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from models import Block, TinyGPT, gpt_batch
from parity import gpt_step as _step
from parity import local_slice
from torch import nn

from fsdp_composable import ModuleWrapPolicy, fully_shard


# ---------------------------------------------------------------------------- edit checks
class _Generating(TinyGPT):
    def generate(self, idx: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self(self(idx).argmax(-1))


class _OneRow(_Generating):
    """With a one-row parameter: at world size 2 all of it lives on rank 0, rank 1's slice is empty."""

    def __init__(self) -> None:
        super().__init__(vocab=37, d=12)
        self.scale = nn.Parameter(torch.ones(1, 37))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) * self.scale


def _gen_model(one_row: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    from fsdp_composable import register_fsdp_forward_method

    torch.manual_seed(0)
    model = fully_shard(_OneRow() if one_row else _Generating(vocab=37, d=12), ModuleWrapPolicy({Block}))
    register_fsdp_forward_method(model, "generate")
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def edit_error_after_zero_grad(edit: str, via: str) -> bool:
    from fsdp_composable._guards._model_edit_checks import ModelEditedAfterShardingError

    model, optim = _gen_model()
    ref, ref_optim = _gen_model()
    _step(model, optim, 0)  # ends with zero_grad(): the flat gradient is released at the next forward
    _step(ref, ref_optim, 0)
    if edit == "data":
        model.blocks[0].fc1.weight.data = torch.zeros(3)  # refused: a DTensor face does not take it
    else:
        model.blocks[0].extra = nn.Parameter(torch.zeros(3))
    idx = local_slice(gpt_batch(9, 4), dist.get_rank(), dist.get_world_size())[0]
    try:
        model.generate(idx) if via == "generate" else model(idx)
    except ModelEditedAfterShardingError:
        pass
    else:
        raise AssertionError("the edit was not detected")
    if edit == "param":
        del model.blocks[0].extra
    for step in (1, 2):
        _step(model, optim, step)
        _step(ref, ref_optim, step)
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("edit", ["data", "param"])
@pytest.mark.parametrize("via", ["forward", "generate"])
def test_edit_error_does_not_bring_back_cleared_gradients(dist_run, edit: str, via: str) -> None:
    """The edit check raises in the root's pre-forward, before it releases the gradient that
    ``zero_grad()`` cleared; aborting that forward re-exposed the previous step's gradient as
    ``.grad``, and the next step silently trained on old + new gradients."""
    assert dist_run(2, edit_error_after_zero_grad, edit, via) == [True, True]


def data_edit_of_empty_local_slice() -> dict[str, Any]:
    from fsdp_composable._guards._model_edit_checks import ModelEditedAfterShardingError

    model, optim = _gen_model(one_row=True)
    ref, ref_optim = _gen_model(one_row=True)
    _step(model, optim, 0)
    _step(ref, ref_optim, 0)
    param = model.scale  # 37 elements that all live on rank 0 at world size 2
    local_numel = param.to_local().numel()
    param.data = param.data.clone()  # a DTensor face ignores it: refused alike on every rank, then undone
    try:
        model(local_slice(gpt_batch(9, 4), dist.get_rank(), dist.get_world_size())[0])
        raised = ""
    except ModelEditedAfterShardingError as e:
        raised = str(e).split(" after fully_shard")[0]
    _step(model, optim, 1)
    _step(ref, ref_optim, 1)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    return {"local_numel": local_numel, "raised": raised, "same": same}


def test_data_edit_of_a_parameter_with_an_empty_local_slice_is_handled_alike_on_every_rank(dist_run) -> None:
    """Every empty tensor has data pointer 0, so ``p.data = t`` of a parameter with no element on a
    rank went unnoticed there: that rank ran the forward's all-gathers while the others raised
    (a hang until the process-group timeout, or a gloo abort). The write is refused on every rank
    alike (a DTensor face does not take it): the rank with the empty slice notices it too (the face's
    own storage changed), every rank points the face back at its view, and training goes on."""
    results = dist_run(2, data_edit_of_empty_local_slice, timeout=90)
    assert sorted(r["local_numel"] for r in results) == [0, 37]
    for r in results:
        assert r["raised"] == "parameter 'scale' had its .data replaced", r
        assert r["same"]
