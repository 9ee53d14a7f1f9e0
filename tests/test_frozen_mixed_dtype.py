"""A unit may mix frozen and trainable parameters, and parameters of different dtypes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from parity import global_mean, local_slice
from test_prefetch_comm_hybrid import CommCounter
from torch import nn

from fsdp_composable import ShardingStrategy, fully_shard, unshard_params


class Mixed(nn.Module):
    """One unit: trainable fp32, frozen fp32 (odd sizes) and trainable bf16 parameters, interleaved."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.frozen = nn.Linear(7, 7)
        self.low = nn.Linear(7, 3).to(torch.bfloat16)
        self.out = nn.Linear(3, 1)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen(torch.tanh(self.inp(x))))
        return self.out(self.low(h.bfloat16()).float())


def frozen_and_mixed(strategy: str) -> dict:
    torch.manual_seed(0)
    ref = Mixed()
    model = fully_shard(copy.deepcopy(ref), strategy=ShardingStrategy[strategy])
    handles = fully_shard.state(model).handles
    rank, world = dist.get_rank(), dist.get_world_size()
    trainable = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    opt_ref, opt = torch.optim.SGD(trainable(ref), lr=0.1), torch.optim.SGD(trainable(model), lr=0.1)
    losses, ref_losses, calls = [], [], []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * world, 5, generator=g), torch.randn(4 * world, 1, generator=g)
        loss_ref = (ref(x) - y).pow(2).mean()
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        xl, yl = local_slice((x, y), rank, world)
        with CommCounter() as counter:
            loss = (model(xl) - yl).pow(2).mean()
            loss.backward()
        calls.append(counter.calls)
        frozen_grads = [p.grad for p in model.frozen.parameters()]
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
        ref_losses.append(loss_ref.item())
    with unshard_params(model, writeback=False):
        diffs = {
            n: (p.float() - q.float()).abs().max().item()
            for (n, p), q in zip(model.named_parameters(), ref.parameters())
        }
        dtypes = {n: p.dtype for n, p in model.named_parameters()}
    return {
        "groups": [(h.dtype, h.requires_grad, [i.fqn for i in h.layout.infos]) for h in handles],
        "calls": calls[-1],
        "frozen_grads": frozen_grads,
        "frozen_flat_grad": [h.flat_param.grad is None for h in handles if not h.requires_grad],
        "losses": losses,
        "ref_losses": ref_losses,
        "diffs": diffs,
        "dtypes": dtypes,
    }


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_frozen_and_mixed_dtype_parameters_in_one_unit(dist_run, strategy: str) -> None:
    for r in dist_run(4, frozen_and_mixed, strategy):
        assert r["groups"] == [
            (torch.float32, True, ["inp.weight", "inp.bias", "out.weight", "out.bias"]),
            (torch.float32, False, ["frozen.weight", "frozen.bias"]),
            (torch.bfloat16, True, ["low.weight", "low.bias"]),
        ]
        # frozen parameters: no gradient, no gradient buffer, no reduction, values untouched
        assert r["frozen_grads"] == [None, None] and r["frozen_flat_grad"] == [True]
        kind = "reduce_scatter" if strategy == "FULL_SHARD" else "all_reduce"
        assert r["calls"][kind] == 2
        assert r["diffs"]["frozen.weight"] == 0 and r["diffs"]["frozen.bias"] == 0
        assert r["dtypes"]["low.weight"] is torch.bfloat16 and r["dtypes"]["inp.weight"] is torch.float32
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=2e-2, atol=2e-2)
        assert max(v for k, v in r["diffs"].items() if not k.startswith("low")) < 1e-2
        assert r["diffs"]["low.weight"] < 2e-2
