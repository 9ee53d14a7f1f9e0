"""torch.compile on blocks under `fully_shard`: the same losses as eager for 3 steps, one graph per block.

Backend: "aot_eager". It runs dynamo *and* AOTAutograd (the joint forward/backward graph, which is
where compiled code meets fully_shard's autograd hooks and resharded parameters), but skips inductor's
C++ code generation: the first forward and backward of one block took 52 s with inductor against 2 s with
aot_eager on the 2-core test machine, and code generation tests nothing about sharding.

What compiles: each block's ``forward`` (``block.forward = torch.compile(block.forward)``). fully_shard's
hooks stay eager around the compiled forward, and the block keeps its type and FQNs.

What does not, yet: ``block.compile()`` (and ``torch.compile(block)``, which wraps the same
``_call_impl``) also traces fully_shard's hooks; see `test_module_compile_traces_fully_shard_hooks`.
"""

from __future__ import annotations

import copy
import traceback
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from models import Block, TinyGPT, gpt_batch, gpt_loss
from parity import global_mean, local_slice
from torch import nn

from fsdp_composable import ModuleWrapPolicy, checkpoint, fully_shard

BACKEND = "aot_eager"
STEPS = 3


def _counting_backend(graphs: list[int]) -> Callable[..., Any]:
    """aot_eager, recording the number of calls in each graph dynamo hands it."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(BACKEND)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(sum(node.op.startswith("call_") for node in gm.graph.nodes))
        return inner(gm, example_inputs)

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


def module_compile() -> str:
    """``block.compile()`` under FULL_SHARD: return the error, if any (caught here so the pool survives)."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        model = TinyGPT()
        fully_shard(model, ModuleWrapPolicy({Block}))
        for block in model.blocks:
            block.compile(backend=BACKEND)
        _train(model, 1)
        return ""
    except RuntimeError:
        return traceback.format_exc(limit=-1)
    finally:
        torch._dynamo.reset()


def test_module_compile_traces_fully_shard_hooks(dist_run) -> None:
    errors = dist_run(2, module_compile)
    assert errors == ["", ""], errors[0]
