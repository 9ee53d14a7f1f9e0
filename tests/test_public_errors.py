"""The public errors: importable from ``fsdp_composable``, subclasses of ``FSDPError`` (and of
RuntimeError, as before), and what a real failure raises. Every exception class the package
defines must be one of them, so users never need a private import to catch one."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import DistPool, shared_pool
from models import Block, TinyGPT, gpt_batch, gpt_loss
from parity import local_slice
from torch import nn

import fsdp_composable
from fsdp_composable import (
    CollectiveError,
    ExecutionOrderError,
    FSDPError,
    ModelEditedAfterShardingError,
    ModuleWrapPolicy,
    RankMismatchError,
    ShardedModelWrappedError,
    StateTransitionError,
    fully_shard,
)
from fsdp_composable._comm import _collectives, _exchanges
from fsdp_composable._flat_param import HandleTrainingState

PUBLIC_ERRORS = {
    "CollectiveError": RuntimeError,
    "ExecutionOrderError": RuntimeError,
    "ModelEditedAfterShardingError": RuntimeError,
    "RankMismatchError": RuntimeError,
    "ShardedModelWrappedError": RuntimeError,
    "StateTransitionError": RuntimeError,
}
NOT_IMPORTED = {"fsdp_composable.__main__"}  # importing it runs the main job
# the main job's own control flow (a signal, a failed rank): raised and caught inside `python -m
# fsdp_composable`, never by the library to its users
JOB_ONLY = {"fsdp_composable._job._job_processes"}


def _package_exception_classes() -> set[type]:
    """Every exception class defined in a module of the package."""
    found: set[type] = set()
    for info in pkgutil.walk_packages(fsdp_composable.__path__, "fsdp_composable."):
        if info.name in NOT_IMPORTED or info.name in JOB_ONLY:
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError as e:  # an optional integration whose framework is not installed
            assert e.name is not None and not e.name.startswith("fsdp_composable"), e
            continue
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__.startswith("fsdp_composable"):
                found.add(obj)
    return found


def test_every_error_is_public_and_an_fsdp_error() -> None:
    assert FSDPError.__module__ == "fsdp_composable.api" and "FSDPError" in fsdp_composable.__all__
    for name, builtin in PUBLIC_ERRORS.items():
        cls = getattr(fsdp_composable, name)
        assert name in fsdp_composable.__all__, name
        assert cls.__module__ == "fsdp_composable.api", cls
        assert issubclass(cls, FSDPError) and issubclass(cls, builtin), cls.__mro__
    defined = {cls.__name__ for cls in _package_exception_classes()}
    assert defined == {"FSDPError", *PUBLIC_ERRORS}, defined


@pytest.fixture(scope="module")
def pool() -> DistPool:
    return shared_pool(2, pg_timeout_s=4.0)


def _raised(fn: Any) -> tuple[str, bool, str]:
    """(class name, whether ``fsdp_composable.<name>`` is that very class, message start)."""
    try:
        fn()
    except FSDPError as e:
        return type(e).__name__, getattr(fsdp_composable, type(e).__name__, None) is type(e), str(e)[:60]
    return "nothing", False, ""


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return fully_shard(TinyGPT(), ModuleWrapPolicy({Block}))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return local_slice(gpt_batch(0, 4), dist.get_rank(), dist.get_world_size())


def _execution_order() -> tuple[str, bool, str]:
    """Rank 1 built a block of another width (as in test_rank_mismatch)."""
    torch.manual_seed(0)
    model = TinyGPT()
    if dist.get_rank() == 1:
        model.blocks[1].fc1, model.blocks[1].fc2 = nn.Linear(16, 65), nn.Linear(65, 16)
    fully_shard(model, ModuleWrapPolicy({Block}))
    return _raised(lambda: gpt_loss(model, _batch()).backward())


def _rank_mismatch() -> tuple[str, bool, str]:
    """Rank 0 asks for a state dict while rank 1 trains (as in test_rank_mismatch)."""
    model = _gpt()
    if dist.get_rank() == 0:
        return _raised(model.state_dict)
    return _raised(lambda: gpt_loss(model, _batch()).backward())


def _model_edited() -> tuple[str, bool, str]:
    """A parameter replaced after sharding (as in test_torch_semantics)."""
    model = _gpt()
    model.head.weight = nn.Parameter(torch.zeros(3))
    return _raised(lambda: model(_batch()[0]))


def _state_transition() -> tuple[str, bool, str]:
    """A handle sent from IDLE straight to BACKWARD_POST (as in test_core)."""
    model = _gpt()
    handle = fully_shard.state(model).handles[0]
    return _raised(lambda: handle.set_training_state(HandleTrainingState.BACKWARD_POST))


def _ddp_wrapped() -> tuple[str, bool, str]:
    """DistributedDataParallel around a sharded model (as in test_accelerate)."""
    model = _gpt()
    return _raised(lambda: torch.nn.parallel.DistributedDataParallel(model))


def _collective_failed() -> tuple[str, bool, str]:
    """A send that fails as gloo's does when the peer is gone (as in test_collectives)."""

    def post(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Connection closed by peer")

    exchange = _exchanges._start(dist.group.WORLD, 1, [(post, torch.ones(1), 1 - dist.get_rank())])
    return _raised(lambda: _collectives.wait(exchange, "the all-gather of unit 'blocks.1'"))


@pytest.mark.parametrize(
    "scenario, expected",
    [  # the raw exchange first: it runs outside a step, so it must not follow a step the ranks left
        (_collective_failed, CollectiveError),
        (_execution_order, ExecutionOrderError),
        (_rank_mismatch, RankMismatchError),
        (_model_edited, ModelEditedAfterShardingError),
        (_state_transition, StateTransitionError),
        (_ddp_wrapped, ShardedModelWrappedError),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_a_real_failure_raises_the_public_error(pool: DistPool, scenario: Any, expected: type) -> None:
    for name, is_public, message in pool.run(scenario, timeout=60):
        assert (name, is_public) == (expected.__name__, True), message
