"""CheckpointWrapper / apply_activation_checkpointing: recomputation, gradient parity, and state-dict keys
without the wrapper prefix, with and without fully_shard applied afterwards."""

from __future__ import annotations

import copy
from typing import Any

import expecttest
import torch
import torch.distributed as dist
from models import Block, TinyGPT, gpt_batch, gpt_loss
from parity import count_forwards, global_mean, local_slice
from torch import nn

from fsdp_composable import (
    CheckpointWrapper,
    ModuleWrapPolicy,
    StateDictType,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    fully_shard,
    state_dict_type,
    unshard_params,
)

WRAPPED = "_checkpoint_wrapped_module."


def _is_block(m: nn.Module) -> bool:
    return isinstance(m, Block)


def _count_block_forwards(model: nn.Module) -> list[int]:
    return count_forwards([m for m in model.modules() if isinstance(m, Block)])


def test_wrapper_without_sharding() -> None:
    torch.manual_seed(0)
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    inner = model.blocks[0]
    assert apply_activation_checkpointing(model, check_fn=_is_block) is model
    apply_activation_checkpointing(model, check_fn=_is_block)  # idempotent: no wrapper in a wrapper
    wrapper = model.blocks[0]
    assert type(wrapper) is CheckpointWrapper and wrapper.module is inner
    assert wrapper.fc1 is inner.fc1 and wrapper.ln1.normalized_shape == (16,)  # attribute access falls through
    assert [n for n, _ in model.named_modules() if n.startswith("blocks.0")] == [
        "blocks.0",
        "blocks.0." + WRAPPED[:-1],
    ] + ["blocks.0." + WRAPPED + n for n, _ in inner.named_modules() if n]
    # module FQNs changed, state-dict keys did not: strict loads both ways
    assert list(model.state_dict()) == list(ref.state_dict())
    plain = TinyGPT()
    plain.load_state_dict(model.state_dict(), strict=True)
    model.load_state_dict(ref.state_dict(), strict=True)
    # forward runs twice per block (once more in backward), gradients are the same
    calls = _count_block_forwards(model)
    batch = gpt_batch(0, 4)
    gpt_loss(ref, batch).backward()
    gpt_loss(model, batch).backward()
    assert calls[0] == 2 * len(model.blocks)
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[name.replace(WRAPPED, "")].grad, atol=1e-6), name


def test_wrapper_argument_errors() -> None:
    errors = {}
    for name, call in {
        "reentrant": lambda: checkpoint_wrapper(nn.Linear(2, 2), use_reentrant=True),
        "module": lambda: CheckpointWrapper("linear"),  # type: ignore[arg-type]
        "check_fn": lambda: apply_activation_checkpointing(nn.Sequential(nn.Linear(2, 2)), check_fn=3),  # type: ignore[arg-type]  # noqa: E501
        "wrapper_fn": lambda: apply_activation_checkpointing(
            nn.Sequential(nn.Linear(2, 2)), check_fn=lambda m: True, checkpoint_wrapper_fn=lambda m: None
        ),
    }.items():
        try:
            call()
        except (TypeError, ValueError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        errors["reentrant"],
        """ValueError: CheckpointWrapper(use_reentrant=True) is not supported: reentrant checkpointing recomputes the forward inside a nested backward that fully_shard's backward hooks cannot see (and drops keyword arguments). Use use_reentrant=False (the default).""",  # noqa: E501
    )
    tc.assertExpectedInline(
        errors["module"], """TypeError: CheckpointWrapper argument 'module' must be an nn.Module, got str"""
    )
    tc.assertExpectedInline(
        errors["check_fn"], """TypeError: apply_activation_checkpointing argument 'check_fn' must be callable, got 3"""
    )
    tc.assertExpectedInline(
        errors["wrapper_fn"],
        """TypeError: checkpoint_wrapper_fn returned NoneType for submodule '0'; it must return an nn.Module""",
    )


def sharded_after_checkpointing() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    apply_activation_checkpointing(model, check_fn=_is_block)
    fully_shard(model, ModuleWrapPolicy({Block}))
    calls = _count_block_forwards(model)
    ref_optim, optim = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    losses, ref_losses, grad_diff = [], [], 0.0
    for step in range(2):
        batch = gpt_batch(step, 4)
        ref_loss = gpt_loss(ref, batch)
        ref_loss.backward()
        loss = gpt_loss(model, local_slice(batch, rank, world))
        loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        with unshard_params(model, with_grads=True, writeback=False):
            for name, p in model.named_parameters():
                grad_diff = max(grad_diff, (p.grad - ref_grads[name.replace(WRAPPED, "")]).abs().max().item())
        ref_optim.step()
        optim.step()
        ref_optim.zero_grad()
        optim.zero_grad()
        losses.append(global_mean(loss))
        ref_losses.append(ref_loss.item())
    sd = model.state_dict()
    plain = TinyGPT()
    plain.load_state_dict(sd, strict=True)  # FULL state dict -> plain model
    with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded_keys = list(model.state_dict())
    torch.manual_seed(3)
    other = TinyGPT().state_dict()
    model.load_state_dict(other, strict=True)  # plain model -> sharded, checkpointed model
    return {
        "forwards": calls[0],
        "grad_diff": grad_diff,
        "losses": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "keys": list(sd) == list(ref.state_dict()) == sharded_keys,
        "values": max((sd[k] - v).abs().max().item() for k, v in ref.state_dict().items()),
        "reloaded": all(torch.equal(model.state_dict()[k], v) for k, v in other.items()),
    }


def test_fully_shard_after_activation_checkpointing(dist_run) -> None:
    for r in dist_run(2, sharded_after_checkpointing):
        assert r["forwards"] == 2 * 2 * 2, r  # 2 steps x 2 blocks x (forward + recomputation)
        assert r["grad_diff"] < 1e-6 and r["losses"] < 1e-6 and r["values"] < 1e-6, r
        assert r["keys"] and r["reloaded"], r


def test_wrapper_named_parameters_match_state_dict() -> None:
    """Upstream: test/distributed/fsdp/test_checkpoint_wrapper.py (CheckpointWrapper.named_parameters() strips
    ``_checkpoint_wrapped_module``): the wrapper's parameter and buffer FQNs are its state-dict keys."""
    inner = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    wrapped = checkpoint_wrapper(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)))
    params = [n for n, _ in wrapped.named_parameters()]
    buffers = [n for n, _ in wrapped.named_buffers()]
    assert params == [n for n, _ in inner.named_parameters()]
    assert buffers == [n for n, _ in inner.named_buffers()]
    assert set(params) | set(buffers) == set(wrapped.state_dict())
    assert [p for _, p in wrapped.named_parameters()] == list(wrapped.parameters())
