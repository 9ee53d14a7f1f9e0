"""FSDP2's argument names for fully_shard (issue 14, section 3) and torch's own clip_grad_norm_ on a
sharded model (section 4)."""

from __future__ import annotations

import copy
from typing import Any

import expecttest
import torch
import torch.distributed as dist
from models import Block, TinyGPT, gpt_batch, gpt_loss
from parity import local_slice
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import Shard

from fsdp_composable import (
    CPUOffload,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    clip_grad_norm_,
    describe,
    fully_shard,
)


# ---------------------------------------------------------------------------- names map to ours
def _plan(m: nn.Module) -> tuple[str, int, Any, Any, bool]:
    unit = describe(m).units[0]
    world = unit.padded_numel // unit.shard_numel
    return unit.strategy.name, world, unit.param_dtype, unit.reduce_dtype, unit.offload_params


def mapped() -> dict[str, Any]:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    out["mesh"] = _plan(fully_shard(TinyGPT(), ModuleWrapPolicy({Block}), mesh=mesh))
    out["no_reshard"] = _plan(fully_shard(TinyGPT(), mesh=mesh, reshard_after_forward=False))
    out["reshard"] = _plan(fully_shard(TinyGPT(), reshard_after_forward=True))
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    out["2d"] = _plan(fully_shard(TinyGPT(), mesh=mesh2))
    out["policies"] = _plan(
        fully_shard(
            TinyGPT(),
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            offload_policy=CPUOffloadPolicy(),
        )
    )
    out["no_policies"] = _plan(fully_shard(TinyGPT(), offload_policy=OffloadPolicy(), mp_policy=MixedPrecisionPolicy()))
    model = TinyGPT()
    fully_shard(model, ignored_params=set(model.blocks[1].parameters()) | set(model.ln_f.parameters()))
    sharded = {f for unit in describe(model).units for f in unit.param_fqns}
    out["ignored"] = sorted(n for n, _ in model.named_parameters() if n not in sharded)
    return out


def test_fsdp2_names_map_to_ours(dist_run) -> None:
    r = dist_run(4, mapped)[0]
    assert r["mesh"] == ("FULL_SHARD", 4, None, None, False)
    assert r["no_reshard"] == ("SHARD_GRAD_OP", 4, None, None, False)
    assert r["reshard"] == ("FULL_SHARD", 4, None, None, False)
    assert r["2d"] == ("HYBRID_SHARD", 2, None, None, False)
    assert r["policies"] == ("FULL_SHARD", 4, torch.bfloat16, torch.float32, True)
    assert r["no_policies"] == ("FULL_SHARD", 4, None, None, False)
    assert r["ignored"] == [
        "blocks.1.attn.in_proj_weight",
        "blocks.1.attn.out_proj.weight",
        "blocks.1.fc1.bias",
        "blocks.1.fc1.weight",
        "blocks.1.fc2.bias",
        "blocks.1.fc2.weight",
        "blocks.1.ln1.bias",
        "blocks.1.ln1.weight",
        "blocks.1.ln2.bias",
        "blocks.1.ln2.weight",
        "ln_f.bias",
        "ln_f.weight",
    ]


def test_mp_policy_maps_field_by_field() -> None:
    from fsdp_composable._names._fsdp2_names import OurArgs, map_fsdp2_names

    ours = map_fsdp2_names(
        nn.Linear(2, 2),
        OurArgs(None, ShardingStrategy.FULL_SHARD, None, None, None),
        mesh=None,
        reshard_after_forward=None,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16),
        offload_policy=None,
        ignored_params=None,
        shard_placement_fn=None,
    )
    assert ours.mixed_precision == MixedPrecision(param_dtype=torch.float16, cast_forward_inputs=True)


def trains_like_our_names() -> list[float]:
    """reshard_after_forward=False on a mesh trains bit for bit like strategy=SHARD_GRAD_OP."""
    torch.manual_seed(0)
    ref = TinyGPT()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    a = fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({Block}), mesh=mesh, reshard_after_forward=False)
    b = fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({Block}), strategy=ShardingStrategy.SHARD_GRAD_OP)
    diffs = []
    for model in (a, b):
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for step in range(2):
            gpt_loss(model, local_slice(gpt_batch(step, 4), dist.get_rank(), dist.get_world_size())).backward()
            opt.step()
            opt.zero_grad()
    sa, sb = a.state_dict(), b.state_dict()
    diffs = [float((sa[k] - sb[k]).abs().max()) for k in sa]
    return diffs


def test_fsdp2_names_train_like_ours(dist_run) -> None:
    assert max(dist_run(2, trains_like_our_names)[0]) == 0.0


def bad_names() -> dict[str, str]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mesh2 = init_device_mesh("cpu", (2, 1))
    cases = {
        "both_groups": lambda: fully_shard(TinyGPT(), mesh=mesh, process_group=dist.group.WORLD),
        "conflict": lambda: fully_shard(TinyGPT(), strategy=ShardingStrategy.NO_SHARD, reshard_after_forward=False),
        "int": lambda: fully_shard(TinyGPT(), reshard_after_forward=3),
        "int_hybrid": lambda: fully_shard(TinyGPT(), mesh=mesh2, reshard_after_forward=2),
        "hybrid_zero2": lambda: fully_shard(TinyGPT(), mesh=mesh2, reshard_after_forward=False),
        "hybrid_conflict": lambda: fully_shard(TinyGPT(), mesh=mesh2, strategy=ShardingStrategy.SHARD_GRAD_OP),
        "not_mesh": lambda: fully_shard(TinyGPT(), mesh=dist.group.WORLD),
        "both_mp": lambda: fully_shard(
            TinyGPT(), mixed_precision=MixedPrecision(param_dtype=torch.float16), mp_policy=MixedPrecisionPolicy()
        ),
        "bad_mp": lambda: fully_shard(TinyGPT(), mp_policy="bf16"),
        "both_offload": lambda: fully_shard(TinyGPT(), cpu_offload=CPUOffload(), offload_policy=CPUOffloadPolicy()),
        "placement": lambda: fully_shard(TinyGPT(), shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None),
        "placement_default": lambda: fully_shard(TinyGPT(), shard_placement_fn=lambda p: Shard(0)),
        "foreign_ignore": lambda: fully_shard(TinyGPT(), ignored_params={nn.Parameter(torch.ones(2))}),
        "both_ignore": lambda: fully_shard((m := TinyGPT()), ignored_modules=[m.ln_f], ignored_params={m.pos}),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = "no error"
        except (TypeError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def test_fsdp2_names_bad_inputs(dist_run) -> None:
    e = dist_run(2, bad_names)[0]
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        e["both_groups"], """ValueError: fully_shard got both process_group= and mesh= (FSDP2's name for it); pass only one of them"""  # noqa: E501
    )
    tc.assertExpectedInline(
        e["conflict"],
        """ValueError: fully_shard: strategy=ShardingStrategy.NO_SHARD conflicts with reshard_after_forward=False (which means ShardingStrategy.SHARD_GRAD_OP); pass only one of them""",  # noqa: E501
    )
    tc.assertExpectedInline(
        e["int"],
        """ValueError: fully_shard(TinyGPT): reshard_after_forward=3 must be a divisor of the shard group's size 2 (the number of consecutive ranks to stay sharded over after forward)""",  # noqa: E501
    )
    tc.assertExpectedInline(e["int_hybrid"], """ValueError: fully_shard: reshard_after_forward=2 (an int) is not supported with a 2-D mesh (HYBRID_SHARD); pass a 1-D mesh, or True/False""")  # noqa: E501
    tc.assertExpectedInline(
        e["hybrid_zero2"],
        """ValueError: fully_shard: a 2-D mesh (HYBRID_SHARD) with reshard_after_forward=False is not supported; keep reshard_after_forward=True or pass a 1-D mesh with strategy=ShardingStrategy.SHARD_GRAD_OP""",  # noqa: E501
    )
    tc.assertExpectedInline(
        e["hybrid_conflict"],
        """ValueError: fully_shard: strategy=ShardingStrategy.SHARD_GRAD_OP conflicts with a 2-D mesh (which means ShardingStrategy.HYBRID_SHARD); pass only one of them""",  # noqa: E501
    )
    tc.assertExpectedInline(e["not_mesh"], """TypeError: fully_shard argument 'mesh' must be a DeviceMesh, got ProcessGroup""")  # noqa: E501
    tc.assertExpectedInline(
        e["both_mp"], """ValueError: fully_shard got both mixed_precision= and mp_policy= (FSDP2's name for it); pass only one of them"""  # noqa: E501
    )
    tc.assertExpectedInline(
        e["bad_mp"],
        """TypeError: fully_shard argument 'mp_policy' must be FSDP2's MixedPrecisionPolicy (or our MixedPrecision; better: mixed_precision=MixedPrecision(...)), got str""",  # noqa: E501
    )
    tc.assertExpectedInline(
        e["both_offload"], """ValueError: fully_shard got both cpu_offload= and offload_policy= (FSDP2's name for it); pass only one of them"""  # noqa: E501
    )
    tc.assertExpectedInline(
        e["placement"],
        """ValueError: fully_shard: shard_placement_fn returns Shard(dim=1) for parameter 'pos', but flat parameters are sharded by element, not on a dimension (the SHARDED state dict gives Shard(0) DTensors). Leave shard_placement_fn out; to keep the parameter whole on every rank pass it in ignored_params; to shard it on a dimension use tensor parallelism (parallelize_module on a 2-D mesh) before fully_shard""",  # noqa: E501
    )
    tc.assertExpectedInline(e["placement_default"], """no error""")
    tc.assertExpectedInline(
        e["foreign_ignore"],
        """no error""",  # a superset is accepted, as FSDP2 does (tests/test_fsdp2_port_inputs.py)
    )
    tc.assertExpectedInline(
        e["both_ignore"], """ValueError: fully_shard got both ignored_modules= and ignored_params= (FSDP2's name for it); pass only one of them"""  # noqa: E501
    )


# ---------------------------------------------------------------------------- torch's clip_grad_norm_
def torch_clip(norm_type: float) -> dict[str, Any]:
    from torch.nn.utils import clip_grad_norm_ as bound_early  # as a user imports it, before fully_shard

    torch.manual_seed(0)
    ref = TinyGPT()
    models = {
        "torch": fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({Block})),
        "ours": fully_shard(copy.deepcopy(ref), ModuleWrapPolicy({Block})),
    }
    batch = gpt_batch(0, 4)
    (gpt_loss(ref, batch) * 3).backward()  # large enough to clip
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, norm_type)
    norms = {}
    for name, model in models.items():
        (gpt_loss(model, local_slice(batch, dist.get_rank(), dist.get_world_size())) * 3).backward()
        if name == "torch":
            norms[name] = bound_early(model.parameters(), 0.5, norm_type)
        else:
            norms[name] = clip_grad_norm_(model, 0.5, norm_type)
        torch.optim.SGD(model.parameters(), lr=1.0).step()
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    ref_sd = ref.state_dict()
    plain = nn.Linear(3, 2)
    plain(torch.ones(1, 3)).sum().backward()
    return {
        "ref": float(ref_norm),
        "torch": float(norms["torch"]),
        "ours": float(norms["ours"]),
        "weights": max(
            float((sd[k] - ref_sd[k]).abs().max()) for sd in (m.state_dict() for m in models.values()) for k in ref_sd
        ),
        "plain_unchanged": float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9)),
        "plain_expected": float(torch.cat([p.grad.reshape(-1) for p in plain.parameters()]).norm()),
    }


def test_torch_clip_grad_norm_is_global(dist_run) -> None:
    """torch.nn.utils.clip_grad_norm_(model.parameters()) on a sharded model returns the unsharded
    model's norm on every rank and clips with it, like our clip_grad_norm_(model)."""
    for world in (2, 4):
        for norm_type in (2.0, float("inf")):
            for r in dist_run(world, torch_clip, norm_type):
                assert abs(r["torch"] - r["ref"]) <= 1e-5 * r["ref"], (world, norm_type, r)
                assert abs(r["ours"] - r["ref"]) <= 1e-5 * r["ref"], (world, norm_type, r)
                assert r["weights"] < 1e-5, r
                assert r["plain_unchanged"] == r["plain_expected"]
