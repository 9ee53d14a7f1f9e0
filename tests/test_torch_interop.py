"""Each change `_torch_interop` makes to torch's behaviour, on the torch we run: installed once per
process (or object), found where torch keeps it, and undone where it is temporary; and the
checkpoint collectives take their tensors on the group's communication device."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import expecttest
import torch
import torch.distributed as dist
import torch.nn.utils.clip_grad as clip_grad
from harness import error_of
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.optim import optimizer as torch_optimizer

import fsdp_composable._comm._collectives as collectives
import fsdp_composable._flat._checkpoint_comm as comm
import fsdp_composable._state._torch_clip as clip
import fsdp_composable._state._torch_interop as interop
from fsdp_composable import CPUOffload, StateDictType, fully_shard, optim_state_dict, state_dict_type
from fsdp_composable._composable_state import optimizer_check


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


def _count(hooks: Any, fn: Any) -> int:
    return sum(1 for h in hooks.values() if h is fn)


def installed_once() -> dict[str, Any]:
    a = fully_shard(_model())
    fully_shard(_model())  # a second call installs nothing more
    cell = dict(zip(clip_grad.clip_grad_norm_.__code__.co_freevars, clip_grad.clip_grad_norm_.__closure__ or ()))
    routed = cell["func"].cell_contents
    optim = torch.optim.Adam(a.parameters())
    optim_state_dict(a, optim)
    optim_state_dict(a, optim)
    return {
        "step_hooks": _count(torch_optimizer._global_optimizer_pre_hooks, interop._check_optimizer_on_first_step),
        "routed": type(routed).__name__,
        "original_is_torch": not isinstance(routed.original, clip._RoutedClip),
        "optim_post_hooks": _count(optim._optimizer_state_dict_post_hooks, interop._present_state_hook),
        "optim_load_hooks": _count(optim._optimizer_load_state_dict_pre_hooks, interop._take_back_state_hook),
        "module_hooks": _count(a._state_dict_pre_hooks, interop._state_dict_pre_hook),
    }


def test_changes_are_installed_once(dist_run) -> None:
    r = dist_run(1, installed_once)[0]
    assert r == {
        "step_hooks": 1,
        "routed": "_RoutedClip",
        "original_is_torch": True,
        "optim_post_hooks": 1,
        "optim_load_hooks": 1,
        "module_hooks": 1,
    }


def clip_of_plain_params() -> dict[str, Any]:
    fully_shard(_model())  # routes torch's function
    plain = _model()
    twin = copy.deepcopy(plain)
    for m in (plain, twin):
        m(torch.ones(3, 4)).sum().backward()
    total = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
    routed = clip_grad.clip_grad_norm_.__closure__[0].cell_contents  # type: ignore[index]
    expected = routed.original(list(twin.parameters()), 0.1)
    return {
        "norm": bool(torch.equal(total, expected)),
        "grads": all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), twin.parameters())),
    }


def test_routed_clip_is_torch_for_other_parameters(dist_run) -> None:
    assert dist_run(1, clip_of_plain_params)[0] == {"norm": True, "grads": True}


def stale_check_memo() -> dict[str, Any]:
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optim.step()  # no fully_shard over its parameters yet
    checked = optimizer_check(optim)
    before = None if checked is None else checked[0]
    fully_shard(model)
    model(torch.ones(2, 4)).sum().backward()
    return {"before": before, "error": error_of(optim.step)}


def test_step_hook_rechecks_after_fully_shard(dist_run) -> None:
    # The optimizer held none of our parameters (None: no fully_shard in this process yet, so unchecked);
    # after fully_shard it holds 4 originals, which faces replaced: checked again, and refused.
    r = dist_run(1, stale_check_memo)[0]
    assert r["before"] in (None, 0), r
    expecttest.TestCase().assertExpectedInline(
        r["error"],
        """RuntimeError: the optimizer holds parameter '0.weight' as it was before fully_shard: fully_shard registers a new DTensor parameter in its place, which the optimizer would never step. Build the optimizer after fully_shard, from model.parameters(), while no step is open (a step that raised in backward stays open, its units registering these parameters, until the next forward or an entry point such as unshard_params)""",  # noqa: E501
    )


def torch_api_switch() -> dict[str, Any]:
    model = fully_shard(_model())
    state = fully_shard.state(model)
    sd = get_model_state_dict(model)
    one_shots = [h for h in model._state_dict_hooks.values() if isinstance(h, interop._OneShot)]
    with state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        inside = get_model_state_dict(model)
        kept = state.state_dict_type
    return {
        "types": sorted({type(v).__name__ for v in sd.values()}),
        "left": len(one_shots),
        "after": state.state_dict_type.name,
        "inside": sorted({type(v).__name__ for v in inside.values()}),
        "kept": kept.name,
    }


def test_torch_api_switch_is_undone(dist_run) -> None:
    r = dist_run(1, torch_api_switch)[0]
    assert r == {
        "types": ["DTensor"],
        "left": 0,
        "after": "FULL_STATE_DICT",
        "inside": ["DTensor"],
        "kept": "LOCAL_STATE_DICT",
    }


# ---------------------------------------------------------------------------- communication device
class _Audited(Exception):
    pass


def comm_devices() -> dict[str, list[str]]:
    """Every checkpoint collective, given CPU values while the group's communication device is another
    (``meta`` stands in for CUDA): record the devices of the tensors it hands to torch.distributed."""
    seen: dict[str, list[str]] = {}
    where = [""]

    def record(*args: Any, **kwargs: Any) -> None:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
        seen[where[0]] = sorted({t.device.type for t in tensors})
        raise _Audited

    shard = torch.arange(4.0)
    layout = SimpleNamespace(world_size=2, padded_numel=8, same_order=True)
    handle = SimpleNamespace(
        layout=layout,
        flat_param=shard,
        process_group=dist.group.WORLD,
        device=torch.device("cpu"),
        unit_fqn="u",
        root_fqn="u",
    )
    saved = (comm.comm_device_of, collectives._all_gather, dist.all_gather, dist.all_reduce)
    comm.comm_device_of = lambda h: torch.device("meta")  # type: ignore[assignment]
    collectives._all_gather = record
    dist.all_gather, dist.all_reduce = record, record
    try:
        for name, call in (
            ("gather_full_flat", lambda: comm.gather_full_flat(handle, shard)),  # type: ignore[arg-type]
            ("any_rank", lambda: comm.any_rank(handle, True)),  # type: ignore[arg-type]
        ):
            where[0] = name
            try:
                call()
            except (_Audited, collectives.CollectiveError):
                pass
    finally:
        comm.comm_device_of, collectives._all_gather = saved[0], saved[1]
        dist.all_gather, dist.all_reduce = saved[2], saved[3]
    return seen


def test_checkpoint_collectives_use_the_comm_device(dist_run) -> None:
    seen = dist_run(1, comm_devices)[0]
    assert seen == {name: ["meta"] for name in ("gather_full_flat", "any_rank")}


def offload_round_trip() -> dict[str, Any]:
    """CPU offload: the FULL and SHARDED state dicts and unshard_params give the values back on the
    shard's device (the CPU) after communicating on the comm device."""
    ref = _model()
    model = fully_shard(copy.deepcopy(ref), cpu_offload=CPUOffload(offload_params=True))
    full = model.state_dict()
    with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = model.state_dict()
    return {
        "full": all(torch.equal(full[k], v) for k, v in ref.state_dict().items()),
        "devices": sorted({str(v.device) for v in (*full.values(), *sharded.values())}),
    }


def test_offload_state_dicts_on_the_shard_device(dist_run) -> None:
    for r in dist_run(2, offload_round_trip):
        assert r == {"full": True, "devices": ["cpu"]}
