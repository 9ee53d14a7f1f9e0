"""Misuse that used to end in a raw error from torch or an assertion (a bare AssertionError, a pickling
AttributeError, "setStorage ... out of bounds", "No backend type associated with device type") gets a
clear error on every rank naming the unit and what to do, or works; the model stays usable."""

from __future__ import annotations

import io
from typing import Any

import expecttest
import torch
import torch.distributed as dist
from harness import error_of
from models import Block, TinyGPT, gpt_batch, gpt_loss
from parity import local_slice
from torch import nn

from fsdp_composable import ModuleWrapPolicy, fully_shard, set_unshard_in_backward, unshard


class Two(nn.Module):
    """Two linear units under a top module with no parameters of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _two() -> nn.Module:
    torch.manual_seed(0)
    return fully_shard(Two(), lambda m: isinstance(m, nn.Linear))


def _x() -> torch.Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(dist.get_rank()), requires_grad=True)


def _trains(model: nn.Module) -> str:
    """The model still trains: "" or the error of a plain step."""
    return error_of(lambda: model(_x()).sum().backward())


# ---------------------------------------------------------------------------- a cast with an unshard in flight
def cast_with_unshard_in_flight() -> dict[str, Any]:
    torch.manual_seed(0)
    ref = TinyGPT()
    torch.manual_seed(0)
    model = fully_shard(TinyGPT(), ModuleWrapPolicy({Block}))
    batch = gpt_batch(0, 4)
    handle = unshard(model.blocks[0], async_op=True)
    model.to(torch.bfloat16)
    ref.to(torch.bfloat16)
    out: dict[str, Any] = {"wait": error_of(handle.wait)}  # the cast dropped the gather: nothing to wait for
    sd = model.state_dict()
    out["same"] = all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())
    loss = gpt_loss(model, local_slice(batch, dist.get_rank(), 2))
    loss.backward()
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    out["loss"] = abs(total.item() / 2 - gpt_loss(ref, batch).item())
    out["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    return out


def test_cast_while_an_unshard_is_in_flight(dist_run) -> None:
    """Before: a bare AssertionError at the next forward or state_dict()."""
    for r in dist_run(2, cast_with_unshard_in_flight):
        assert r["wait"] == "" and r["same"] and r["dtypes"] == ["torch.bfloat16"], r
        assert r["loss"] < 2e-2, r  # bf16: the ranks' halves of the batch are summed in another order


# ---------------------------------------------------------------------------- torch.save of a top without parameters
def save_top_module_without_parameters() -> dict[str, str]:
    model = _two()
    return {"save": error_of(lambda: torch.save(model, io.BytesIO())), "after": _trains(model)}


def test_save_of_a_model_whose_top_module_has_no_parameters(dist_run) -> None:
    r0, r1 = dist_run(2, save_top_module_without_parameters)
    assert r0 == r1 and r0["after"] == "", (r0, r1)
    expecttest.TestCase().assertExpectedInline(
        r0["save"],
        """TypeError: fully_shard: the state of 'Two' belongs to a model sharded by fully_shard and cannot be copied with copy.deepcopy or pickled (torch.save(model)): it holds only this rank's shard, and the model's hooks hold its process group. To copy the model, build a new one (and shard it) and load model.state_dict() into it; to save it, save model.state_dict() (or use torch.distributed.checkpoint)""",  # noqa: E501
    )


# ---------------------------------------------------------------------------- the step refusal names hand-sharded units
def step_with_hand_sharded_unit_unsharded() -> str:
    torch.manual_seed(0)
    model = TinyGPT()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gpt_loss(model, gpt_batch(0, 2)).backward()
    opt.step()
    unshard(model.blocks[1])
    return error_of(opt.step)


def test_step_refusal_names_a_unit_sharded_by_hand(dist_run) -> None:
    r0, r1 = dist_run(2, step_with_hand_sharded_unit_unsharded)
    assert r0 == r1, (r0, r1)
    expecttest.TestCase().assertExpectedInline(
        r0,
        """RuntimeError: optimizer.step() was called while the parameters of unit 'blocks.1' are unsharded (between a forward and its backward, inside unshard_params, after unshard(module), or kept by set_reshard_after_backward(False)), so it would step their full-shape copies instead of the shard. Call reshard(module) on that unit (or step after backward); to get a state-dict template from a fresh optimizer (init_optim_state, torch's get_state_dict), call it before the forward""",  # noqa: E501
    )


# ---------------------------------------------------------------------------- backwards that need freed parameters
def double_backward() -> dict[str, str]:
    model = _two()
    x = _x()

    def penalty() -> None:
        y = model(x).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        (y + g.pow(2).sum()).backward()

    return {"penalty": error_of(penalty), "after": _trains(model)}


def test_double_backward_is_refused(dist_run) -> None:
    r0, r1 = dist_run(2, double_backward)
    assert r0 == r1 and r0["after"] == "", (r0, r1)
    expecttest.TestCase().assertExpectedInline(
        r0["penalty"],
        """RuntimeError: fully_shard: unit 'b' ran a backward with create_graph=True (a double backward, such as a gradient penalty): its unsharded parameters are freed after its backward, so the graph of the gradients could not be differentiated again. Leave the modules the penalty differentiates through out of the units (fully_shard(..., ignored_modules=[...])), or compute the term without create_graph""",  # noqa: E501
    )


def no_unshard_in_backward_with_input_grads() -> dict[str, str]:
    model = _two()
    set_unshard_in_backward(model.b, False)
    out = {"step": error_of(lambda: model(_x()).sum().backward())}
    set_unshard_in_backward(model.b, True)
    out["after"] = _trains(model)
    return out


def test_unshard_in_backward_off_for_a_unit_whose_input_needs_grad(dist_run) -> None:
    r0, r1 = dist_run(2, no_unshard_in_backward_with_input_grads)
    assert r0 == r1 and r0["after"] == "", (r0, r1)
    expecttest.TestCase().assertExpectedInline(
        r0["step"],
        """RuntimeError: fully_shard: set_unshard_in_backward(False) was set on unit 'b', but its forward got an input that requires grad: that input's gradient needs the unit's parameters in backward, which it would not gather. Call set_unshard_in_backward(module, True) for this unit; False is for units whose backward needs no parameters (an embedding of the model's input)""",  # noqa: E501
    )


# ---------------------------------------------------------------------------- placement before the first collective
def cuda_group_with_cpu_model() -> str:
    group = dist.new_group(backend="cuda:gloo")  # gloo serving CUDA tensors only
    model = Two()
    return error_of(lambda: fully_shard(model, process_group=group, ignored_modules=[model.a]))


def test_group_for_another_device_is_named_before_the_ignored_modules_check(dist_run) -> None:
    r0, r1 = dist_run(2, cuda_group_with_cpu_model)
    assert r0 == r1, (r0, r1)
    expecttest.TestCase().assertExpectedInline(
        r0,
        """ValueError: fully_shard: the module's parameters are on cpu, but its process group (backend 'cuda:gloo') communicates cuda tensors only; pass device_id=torch.cuda.current_device() (it moves the model one unit at a time) or move the model there first""",  # noqa: E501
    )
