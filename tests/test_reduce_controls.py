"""FSDP2's reduction controls as functions: the gradient divide factor (and its older name), force-sum
reductions, the all-reduce hook (HYBRID_SHARD and not), the post-optimizer event; their errors."""

from __future__ import annotations

import copy
from typing import Any, Callable

import expecttest
import pytest
import torch
import torch.distributed as dist
from models import OddMLP, mlp_batch, mlp_loss
from parity import error_text, local_slice
from torch import nn
from torch.distributed.algorithms._comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh

from fsdp_composable import (
    FullyShardedDataParallel,
    ModuleWrapPolicy,
    fully_shard,
    register_comm_hook,
    set_all_reduce_hook,
    set_force_sum_reduction_for_comms,
    set_gradient_divide_factor,
    set_post_optim_event,
    set_reduce_scatter_divide_factor,
    unshard_params,
)

POLICY = ModuleWrapPolicy({nn.Sequential})  # OddMLP: unit 'l2' and the root unit (l1, l3), all padded


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    with unshard_params(model, with_grads=True, writeback=False):
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def divided(how: str) -> float:
    """Gradients after one backward, against the unsharded model's on the global batch scaled by the
    factor each unit expects: the largest difference."""
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = OddMLP()
    model = copy.deepcopy(ref)
    if how == "wrapper":
        model = FullyShardedDataParallel(model, auto_wrap_policy=POLICY, use_orig_params=True)
        set_gradient_divide_factor(model, 1.0, recurse=True)  # a plain sum: world x the mean
        scale = {n: float(world) for n, _ in ref.named_parameters()}
    else:
        fully_shard(model, POLICY)
        if how == "recurse":
            set_gradient_divide_factor(model, 1.0, recurse=True)
            scale = {n: float(world) for n, _ in ref.named_parameters()}
        elif how == "one_unit":  # the root's own unit is left as it is
            set_reduce_scatter_divide_factor(model.l2, 0.5)
            scale = {n: 2.0 * world if n.startswith("l2.") else 1.0 for n, _ in ref.named_parameters()}
        else:  # force-sum: recorded, numerics unchanged
            set_force_sum_reduction_for_comms(model, True, recurse=True)
            scale = {n: 1.0 for n, _ in ref.named_parameters()}
    batch = mlp_batch(0, 2 * world)
    mlp_loss(ref, batch).backward()
    mlp_loss(model, local_slice(batch, rank, world)).backward()
    grads = _grads(model)
    key = (lambda n: n.removeprefix("_fsdp_wrapped_module.")) if how == "wrapper" else (lambda n: n)
    got = {key(n): g for n, g in grads.items()}
    return max((got[n] - scale[n] * p.grad).abs().max().item() for n, p in ref.named_parameters())


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("how", ["recurse", "one_unit", "force_sum", "wrapper"])
def test_gradient_divide_factor(dist_run: Callable[..., Any], how: str, world_size: int) -> None:
    assert max(dist_run(world_size, divided, how)) < 1e-5


def hooked(hybrid: bool) -> dict[str, Any]:
    """Two SGD steps with a hook doubling each unit's reduced gradient, next to the unsharded model
    stepping with twice the learning rate."""
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = OddMLP()
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (2, world // 2)) if hybrid else None
    fully_shard(model, POLICY, mesh=mesh)
    calls: list[tuple[str, torch.Tensor]] = []

    def hook_for(unit: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            calls.append((unit, grad.clone()))
            grad.mul_(2.0)

        return hook

    set_all_reduce_hook(model, hook_for("<root>"))
    set_all_reduce_hook(model.l2, hook_for("l2"))
    handles = {h.unit_fqn or "<root>": h for h in fully_shard.state(model).handles}
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.2), torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {"calls": [], "right_tensor": True}
    for step in range(2):
        calls.clear()
        batch = mlp_batch(step, 2 * world)
        mlp_loss(ref, batch).backward()
        mlp_loss(model, local_slice(batch, rank, world)).backward()
        out["calls"].append(sorted((u, g.numel() == handles[u].layout.shard_numel) for u, g in calls))
        for unit, seen in calls:  # the gradient the hook saw, doubled, is the unit's sharded gradient
            out["right_tensor"] &= torch.allclose(2 * seen, handles[unit].flat_param.grad)
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    sd = model.state_dict()
    out["weight_diff"] = max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return out


@pytest.mark.parametrize("hybrid", [True, False])
@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_hook_runs_once_per_unit(dist_run: Callable[..., Any], hybrid: bool, world_size: int) -> None:
    for r in dist_run(world_size, hooked, hybrid):
        assert r["calls"] == [[("<root>", True), ("l2", True)]] * 2, r["calls"]
        assert r["right_tensor"]
        assert r["weight_diff"] < 1e-5, r


def post_optim_event() -> dict[str, Any]:
    """On the CPU the event is accepted after a step and dropped by the next forward."""
    model = fully_shard(OddMLP(), POLICY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mlp_loss(model, mlp_batch(0, 2)).backward()
    opt.step()
    set_post_optim_event(model, torch.Event("cpu"))
    ctx = fully_shard.state(model).ctx
    assert ctx is not None
    held = ctx.post_optim_event is not None
    mlp_loss(model, mlp_batch(1, 2)).backward()
    return {"held": held, "dropped": ctx.post_optim_event is None}


def test_post_optim_event_on_cpu(dist_run: Callable[..., Any]) -> None:
    for r in dist_run(2, post_optim_event):
        assert r == {"held": True, "dropped": True}


def errors() -> dict[str, str]:
    model = fully_shard(OddMLP(), POLICY)
    mesh = init_device_mesh("cpu", (2, 1))
    hybrid = fully_shard(OddMLP(), mesh=mesh)
    hooked = fully_shard(OddMLP())
    register_comm_hook(hooked, default_hooks.DefaultState(dist.group.WORLD), default_hooks.reduce_scatter_hook)
    return {
        "inside_unit": error_text(lambda: set_gradient_divide_factor(model.l2[0], 2.0)),
        "not_sharded": error_text(lambda: set_gradient_divide_factor(OddMLP(), 2.0)),
        "bad_factor": error_text(lambda: set_gradient_divide_factor(model.l2, 0)),
        "bad_flag": error_text(lambda: set_force_sum_reduction_for_comms(model, 1)),  # type: ignore[arg-type]
        "bad_hook": error_text(lambda: set_all_reduce_hook(model, "sum")),  # type: ignore[arg-type]
        "hybrid_stream": error_text(lambda: set_all_reduce_hook(hybrid, lambda g: None, stream=object())),
        "stream": error_text(lambda: set_all_reduce_hook(model, lambda g: None, stream=object())),
        "event_type": error_text(lambda: set_post_optim_event(model, "done")),
        "event_early": error_text(lambda: set_post_optim_event(model, torch.Event("cpu"))),
        "comm_hook": error_text(lambda: set_gradient_divide_factor(hooked, 2.0)),
    }


def test_errors_name_the_unit(dist_run: Callable[..., Any]) -> None:
    e = dist_run(2, errors)[0]
    tc = expecttest.TestCase()
    tc.assertExpectedInline("\n".join(f"{k}: {v}" for k, v in e.items()), """\
inside_unit: ValueError: set_gradient_divide_factor: module 'l2.0' (Linear) is not a unit: its parameters belong to an enclosing unit; call it on that unit's module, or on the root with recurse=True
not_sharded: ValueError: set_gradient_divide_factor: no fully_shard state on this OddMLP; call fully_shard(module) first
bad_factor: ValueError: set_gradient_divide_factor(unit 'l2'): factor must be a positive finite number, got 0
bad_flag: TypeError: set_force_sum_reduction_for_comms(unit '<root>'): enable must be True or False, got 1
bad_hook: TypeError: set_all_reduce_hook(unit '<root>'): hook must be callable or None, got str
hybrid_stream: ValueError: set_all_reduce_hook(unit '<root>'): stream cannot be set with HYBRID_SHARD; the hook runs on the stream of the unit's last gradient collective. Leave stream out
stream: ValueError: set_all_reduce_hook(unit '<root>'): a custom stream is not supported; the hook runs on the stream of the unit's last gradient collective. Leave stream out
event_type: TypeError: set_post_optim_event(unit '<root>', 'l2'): event must be a torch.Event recorded after the optimizer step (or None), got str
event_early: RuntimeError: set_post_optim_event(unit '<root>', 'l2'): the model has not run a forward yet; call it after the optimizer step, before the next forward
comm_hook: ValueError: set_gradient_divide_factor(unit '<root>'): the unit's gradients go through a communication hook (register_comm_hook), which replaces the reduction; do the division or the extra step inside that hook""")  # noqa: E501
