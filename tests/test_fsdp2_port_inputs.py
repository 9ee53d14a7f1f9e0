"""Inputs that code ported from torch FSDP2 passes as written: ``set_post_optim_event(None)`` (what a
CPU stream's ``record_event()`` returns), ``ignored_params`` holding more than the module's own
parameters; the errors for what stays refused (an integer parameter, one tied weight given to two
``fully_shard`` calls); units sharded bottom-up by hand named by their FQN in traces and messages."""

from __future__ import annotations

import copy
from typing import Any, Callable

import expecttest
import torch
import torch.distributed as dist
from models import OddMLP, TinyGPT, gpt_batch, gpt_loss
from parity import error_text, mlp_sgd_diff
from torch import nn

from fsdp_composable import ModuleWrapPolicy, fully_shard, set_post_optim_event

POLICY = ModuleWrapPolicy({nn.Sequential})


def post_optim_none() -> dict[str, Any]:
    """SGD steps with ``set_post_optim_event(model, stream.record_event())`` after each, as FSDP2 code
    writes it; on the CPU that event is None: accepted (before and after the first forward), exact."""
    torch.manual_seed(0)
    ref = OddMLP()
    model = fully_shard(copy.deepcopy(ref), POLICY)
    event = torch.cpu.current_stream().record_event()
    before = error_text(lambda: set_post_optim_event(model, event))
    diff = mlp_sgd_diff(model, ref, steps=1)
    after = error_text(lambda: set_post_optim_event(model, event))
    ctx = fully_shard.state(model).ctx
    assert ctx is not None
    return {"event": event, "before": before, "after": after, "held": ctx.post_optim_event, "diff": diff}


def test_post_optim_event_none_is_accepted(dist_run: Callable[..., Any]) -> None:
    for r in dist_run(2, post_optim_none):
        assert r == {"event": None, "before": "no error", "after": "no error", "held": None, "diff": r["diff"]}, r
        assert r["diff"] < 1e-6, r


def ignored_superset() -> dict[str, Any]:
    """One set of every ignored parameter of the model, given to every ``fully_shard`` call (FSDP2
    takes a superset): each call ignores its own, the blocks' sharding and the training are exact."""
    torch.manual_seed(0)
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    ignored = {model.pos, model.blocks[1].fc2.bias}
    for block in model.blocks:
        fully_shard(block, ignored_params=ignored)
    fully_shard(model, ignored_params=ignored)
    full = {n: tuple(p.shape) for n, p in model.named_parameters() if p in ignored}
    out: dict[str, Any] = {"full_shapes": full}
    out["foreign"] = error_text(lambda: fully_shard(OddMLP(), ignored_params={nn.Parameter(torch.ones(2))}))
    out["not_param"] = error_text(lambda: fully_shard(OddMLP(), ignored_params=[nn.Linear(1, 1)]))
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(2):
        batch = gpt_batch(step, 2 * world)
        for m, o, b in ((model, opt, tuple(t[rank * 2 : rank * 2 + 2] for t in batch)), (ref, opt_ref, batch)):
            gpt_loss(m, b).backward()  # type: ignore[arg-type]
            if m is model:  # ignored gradients stay local (as FSDP2): average them as DDP would
                for p in ignored:
                    assert p.grad is not None
                    dist.all_reduce(p.grad)
                    p.grad /= world
            o.step()
            o.zero_grad()
    sd, ref_sd = model.state_dict(), ref.state_dict()
    out["diff"] = max(float((sd[k] - ref_sd[k]).abs().max()) for k in ref_sd)
    return out


def test_ignored_params_superset(dist_run: Callable[..., Any]) -> None:
    results = dist_run(2, ignored_superset)
    assert results[0] == results[1] | {"diff": results[0]["diff"]}, results
    r = results[0]
    assert r["full_shapes"] == {"pos": (8, 16), "blocks.1.fc2.bias": (16,)}, r
    assert r["diff"] < 1e-5, r
    tc = expecttest.TestCase()
    tc.assertExpectedInline(r["foreign"], """no error""")
    tc.assertExpectedInline(
        r["not_param"],
        """TypeError: fully_shard argument 'ignored_params' must hold parameters (or pass modules as ignored_modules=[...]), got Linear""",  # noqa: E501
    )


class IntCounter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)


def refusals() -> dict[str, str]:
    tied = TinyGPT(tied=True)
    fully_shard(tied.tok)
    return {
        "int64": error_text(lambda: fully_shard(IntCounter())),
        "tied": error_text(lambda: fully_shard(tied.head)),
    }


def test_refusals_say_what_happened(dist_run: Callable[..., Any]) -> None:
    results = dist_run(2, refusals)
    assert results[0] == results[1], results
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        results[0]["int64"],
        """ValueError: parameter 'seen' has dtype torch.int64; fully_shard shards floating-point parameters only. Register it as a buffer, or keep it whole on every rank: pass it in ignored_params (or its module in ignored_modules)""",  # noqa: E501
    )
    tc.assertExpectedInline(
        results[0]["tied"],
        """RuntimeError: parameter 'weight' of this Linear is shared (tied) with Embedding's parameter 'weight', which an earlier fully_shard call already sharded: a parameter belongs to one unit. Shard the modules that share it in one call (fully_shard([m1, m2])), or leave them to their common parent's fully_shard""",  # noqa: E501
    )


def hand_sharded_labels() -> list[str]:
    """Blocks sharded one by one, then the root: the trace names each block by its FQN."""
    torch.manual_seed(0)
    model = TinyGPT()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    gpt_loss(model, gpt_batch(0, 2)).backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        gpt_loss(model, gpt_batch(1, 2)).backward()
    return sorted({e.name for e in prof.events() if e.name.startswith("fsdp::pre_forward")})


def test_hand_sharded_units_named_by_fqn(dist_run: Callable[..., Any]) -> None:
    for names in dist_run(2, hand_sharded_labels):
        assert names == ["fsdp::pre_forward <root>", "fsdp::pre_forward blocks.0", "fsdp::pre_forward blocks.1"], names
