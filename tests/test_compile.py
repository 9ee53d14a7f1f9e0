"""torch.compile of blocks and of the whole model under `fully_shard`: the same losses for 3 steps, counted graphs.

Backend: "aot_eager". It runs dynamo *and* AOTAutograd (the joint forward/backward graph, which is
where compiled code meets fully_shard's autograd hooks and resharded parameters), but skips inductor's
C++ code generation: the first forward and backward of one block took 52 s with inductor against 2 s with
aot_eager on the 2-core test machine, and code generation tests nothing about sharding.

What compiles, each with the unsharded model's losses and final weights:
- each block's ``forward`` (``block.forward = torch.compile(block.forward)``): one graph, no break;
- a block compiled before ``fully_shard`` (``block.compile()``, or ``torch.compile(block)`` put back into
  the model, sharded by the policy or by ``fully_shard`` of the compiled module itself) and after it,
  also under ``checkpoint(block)``;
- the whole model (``model.compile()``, ``torch.compile(model)``) after ``fully_shard``: no graph break is
  counted, nothing compiles after the first step, and every call of a unit runs one graph (the floor:
  [Note: fully_shard under torch.compile] in fsdp_composable/_runtime/_runtime_utils.py).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
from models import Block, TinyGPT, gpt_batch, gpt_loss
from parity import global_mean, local_slice
from torch import nn

from fsdp_composable import ModuleWrapPolicy, checkpoint, fully_shard

BACKEND = "aot_eager"
STEPS = 3


def _counting_backend(graphs: list[int], runs: Optional[list[int]] = None) -> Callable[..., Any]:
    """aot_eager, recording the number of calls in each graph dynamo hands it (and, in ``runs[0]``,
    how many times compiled graphs ran)."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(BACKEND)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(sum(node.op.startswith("call_") for node in gm.graph.nodes))
        compiled = inner(gm, example_inputs)
        if runs is None:
            return compiled

        def run(*args: Any) -> Any:
            runs[0] += 1
            return compiled(*args)

        return run

    return backend


def _train(model: nn.Module, steps: int) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    batch = local_slice(gpt_batch(0, 2 * world), rank, world)  # one batch: the loss must go down
    for _ in range(steps):
        loss = gpt_loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
    return losses


def compiled_forward_parity(with_checkpoint: bool) -> dict[str, Any]:
    import torch._dynamo

    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        ref = TinyGPT()
        eager, compiled = copy.deepcopy(ref), copy.deepcopy(ref)
        fully_shard(eager, ModuleWrapPolicy({Block}))
        fully_shard(compiled, ModuleWrapPolicy({Block}))
        graphs: list[int] = []
        backend = _counting_backend(graphs)
        names = [n for n, _ in compiled.named_modules()]
        forwards = [0]
        for block in compiled.blocks:
            if with_checkpoint:
                checkpoint(block)
            block.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
            # fullgraph: a graph break anywhere inside the block's forward raises instead of splitting it
            block.forward = torch.compile(block.forward, backend=backend, fullgraph=True)
        torch._dynamo.utils.counters.clear()
        eager_losses, compiled_losses = _train(eager, STEPS), _train(compiled, STEPS)
        return {
            "eager": eager_losses,
            "compiled": compiled_losses,
            "graphs": graphs,
            "forwards": forwards[0],
            "graph_breaks": dict(torch._dynamo.utils.counters["graph_break"]),
            "same_structure": [n for n, _ in compiled.named_modules()] == names
            and list(compiled.state_dict()) == list(ref.state_dict()),
        }
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("with_checkpoint", [False, True])
def test_compiled_block_forward_matches_eager(dist_run, with_checkpoint: bool) -> None:
    for r in dist_run(2, compiled_forward_parity, with_checkpoint):
        assert len(r["compiled"]) == STEPS and r["same_structure"], r
        for a, b in zip(r["eager"], r["compiled"]):
            assert abs(a - b) < 1e-5, r
        assert r["eager"][-1] < r["eager"][0], r  # it trained
        # 2 blocks x 3 steps, and once more in backward for each under checkpoint (recomputation)
        assert r["forwards"] == 2 * STEPS * (2 if with_checkpoint else 1), r
        # one graph holds a whole block's forward (the blocks share it); no graph breaks anywhere
        assert len(r["graphs"]) == 1 and r["graphs"][0] >= 10 and not r["graph_breaks"], r


# Where the user compiles: before fully_shard (the blocks), after it (a block, the whole model).
BLOCK_WAYS = [
    "block.compile() before",
    "torch.compile(block) before",  # the OptimizedModule put back into the model, the policy shards the block
    "fully_shard(torch.compile(block))",  # FSDP2's way: fully_shard each compiled block, then the root
    "block.compile() after",
    "checkpoint(block), block.compile()",  # recomputed in backward by the same compiled call
]
MODEL_WAYS = ["model.compile()", "torch.compile(model)"]


def compiled_parity(where: str) -> dict[str, Any]:
    """Train a sharded TinyGPT compiled ``where`` and the unsharded eager one side by side."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        ref = TinyGPT()
        model = copy.deepcopy(ref)
        graphs: list[int] = []
        runs = [0]
        backend = _counting_backend(graphs, runs)
        if where == "block.compile() before":
            for block in model.blocks:
                block.compile(backend=backend)
        elif "torch.compile(block)" in where:
            for i, block in enumerate(model.blocks):
                model.blocks[i] = torch.compile(block, backend=backend)
        if where == "fully_shard(torch.compile(block))":
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        else:
            fully_shard(model, ModuleWrapPolicy({Block}))
        run: nn.Module = model
        if where == "block.compile() after":
            for block in model.blocks:
                block.compile(backend=backend)
        elif where == "checkpoint(block), block.compile()":
            for block in model.blocks:
                checkpoint(block)
                block.compile(backend=backend)
        elif where == "model.compile()":
            model.compile(backend=backend)
        elif where == "torch.compile(model)":
            run = torch.compile(model, backend=backend)
        rank, world = dist.get_rank(), dist.get_world_size()
        opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        batch = gpt_batch(0, 2 * world)  # one batch: the loss must go down
        steps = []
        for _ in range(STEPS):
            counters.clear()
            runs[0], compiled_before = 0, len(graphs)
            loss = gpt_loss(run, local_slice(batch, rank, world))
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_loss = gpt_loss(ref, batch)
            ref_loss.backward()
            opt_ref.step()
            opt_ref.zero_grad()
            steps.append(
                {
                    "loss": global_mean(loss),
                    "ref": float(ref_loss.item()),
                    "new_graphs": len(graphs) - compiled_before,
                    "runs": runs[0],
                    "graph_breaks": sum(counters["graph_break"].values()),
                }
            )
        full, expected = model.state_dict(), ref.state_dict()
        # torch.compile(block) puts the block under `_orig_mod`, in the unsharded model as here
        keys = {k: k.replace("._orig_mod", "") for k in full}
        # torch.compile(model)'s OptimizedModule: torch's prefix before every key, the same full values
        outer = run.state_dict() if run is not model else {f"_orig_mod.{k}": v for k, v in full.items()}
        return {
            "steps": steps,
            "graphs": graphs,
            "outer_keys": list(outer) == [f"_orig_mod.{k}" for k in full]
            and all(torch.equal(outer[f"_orig_mod.{k}"], v) for k, v in full.items()),
            "same_keys": sorted(keys.values()) == sorted(expected),
            "weight_diff": max(float((full[k] - expected[keys[k]]).abs().max()) for k in full),
        }
    finally:
        torch._dynamo.reset()


def _check_parity(r: dict[str, Any]) -> None:
    steps = r["steps"]
    assert r["same_keys"] and r["outer_keys"] and r["weight_diff"] < 1e-5, r
    for s in steps:
        assert abs(s["loss"] - s["ref"]) < 1e-5, r
    assert steps[-1]["loss"] < steps[0]["loss"], r  # it trained
    # no graph break counted in any step; nothing compiles after the first step (no recompilation)
    assert all(s["graph_breaks"] == 0 for s in steps), r
    assert all(s["new_graphs"] == 0 for s in steps[1:]) and steps[0]["new_graphs"] == len(r["graphs"]), r


@pytest.mark.parametrize("where", BLOCK_WAYS)
def test_block_compiled_before_or_after_fully_shard(dist_run, where: str) -> None:
    for r in dist_run(2, compiled_parity, where):
        _check_parity(r)
        # one graph, a whole block's forward, shared by both blocks; it runs once per block per step (and
        # again in backward under checkpoint: the recomputation)
        assert len(r["graphs"]) == 1 and r["graphs"][0] >= 10, r
        assert all(s["runs"] == 2 * (2 if "checkpoint" in where else 1) for s in r["steps"]), r


@pytest.mark.parametrize("where", MODEL_WAYS)
def test_whole_model_compiled_after_fully_shard(dist_run, where: str) -> None:
    for r in dist_run(2, compiled_parity, where):
        _check_parity(r)
        # [Note: fully_shard under torch.compile]: the root's forward runs eagerly (its loop calls units,
        # whose hooks break the graph); each frame it calls is one graph: the block's forward (shared by
        # both blocks, >= 10 calls) and the root's own submodules tok, ln_f and head (one call each)
        assert sorted(r["graphs"]) == [1, 1, 1, max(r["graphs"])] and max(r["graphs"]) >= 10, r
        assert all(s["runs"] == 2 + 3 for s in r["steps"]), r
