"""``MixedPrecision(output_dtype=...)`` (FSDP2's ``MixedPrecisionPolicy.output_dtype``): the outputs of
the module fully_shard was applied to are cast; a policy unit with a mixed precision of its own
(CustomPolicy) casts its inputs (``cast_forward_inputs``) and its outputs."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import OddMLP, mlp_batch
from parity import global_mean, local_slice
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_composable import CustomPolicy, MixedPrecision, ModuleWrapPolicy, fully_shard

POLICY = ModuleWrapPolicy({nn.Sequential})


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    out = model(batch[0])
    return F.mse_loss(out, batch[1].to(out.dtype))


def cast_outputs() -> dict[str, Any]:
    """Two SGD steps with float64 outputs next to the unsharded model whose output is cast by hand."""
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = OddMLP()
    model = fully_shard(copy.deepcopy(ref), POLICY, mixed_precision=MixedPrecision(output_dtype=torch.float64))
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {"loss_diff": 0.0}
    for step in range(2):
        batch = mlp_batch(step, 2 * world)
        loss_ref = F.mse_loss(ref(batch[0]).double(), batch[1].double())
        mine = local_slice(batch, rank, world)
        out["dtype"] = model(mine[0]).dtype
        loss = _loss(model, mine)
        for o, lo in ((opt_ref, loss_ref), (opt, loss)):
            lo.backward()
            o.step()
            o.zero_grad()
        out["loss_diff"] = max(out["loss_diff"], abs(global_mean(loss) - loss_ref.item()))
    sd = model.state_dict()
    out["weight_diff"] = max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_output_dtype_casts_the_outputs(dist_run: Callable[..., Any], world_size: int) -> None:
    for r in dist_run(world_size, cast_outputs):
        assert r["dtype"] == torch.float64
        assert r["loss_diff"] < 1e-6 and r["weight_diff"] < 1e-6, r


def fsdp2_policy_and_unit_override() -> dict[str, Any]:
    x = torch.randn(4, 5)
    out: dict[str, Any] = {}
    for name, output_dtype in (("bf16", None), ("fp32", torch.float32)):
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=output_dtype)
        out[name] = fully_shard(OddMLP(), POLICY, mp_policy=mp)(x).dtype
    # a bfloat16 unit inside a float32 model: its inputs cast down, its outputs back up
    own = MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=True, output_dtype=torch.float32)
    torch.manual_seed(0)
    ref = OddMLP()
    model = copy.deepcopy(ref)
    unit = model.l2
    fully_shard(model, CustomPolicy(lambda m: {"mixed_precision": own} if m is unit else False))
    seen: list[torch.dtype] = []
    unit[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    unit.register_forward_hook(lambda m, args, y: seen.append(y.dtype))
    y = model(x)
    out["unit"], out["model_output"] = seen, y.dtype
    out["close"] = torch.allclose(y, ref(x), atol=5e-2)
    return out


def test_fsdp2_output_dtype_and_a_unit_of_its_own(dist_run: Callable[..., Any]) -> None:
    for r in dist_run(2, fsdp2_policy_and_unit_override):
        assert r == {
            "bf16": torch.bfloat16,
            "fp32": torch.float32,
            "unit": [torch.bfloat16, torch.float32],
            "model_output": torch.float32,
            "close": True,
        }, r
