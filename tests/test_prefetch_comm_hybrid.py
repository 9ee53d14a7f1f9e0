"""Communication per step, prefetch order, the all-gather limiter, and HYBRID_SHARD."""

from __future__ import annotations

import copy
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from models import Block, TinyGPT, gpt_batch, gpt_loss
from parity import local_slice, train_side_by_side
from torch import nn

from fsdp_composable import (
    BackwardPrefetch,
    FullyShardedDataParallel,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    fully_shard,
)
from fsdp_composable._comm import _collectives
from fsdp_composable._runtime._prefetch import default_forward_prefetch


class CommCounter:
    """Counts our collectives and the bytes each rank sends in a ring implementation."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self._orig: dict[str, Any] = {}

    def __enter__(self) -> CommCounter:
        world = dist.get_world_size()
        for name in ("all_gather", "reduce_scatter", "all_reduce"):
            fn = getattr(_collectives, name)
            self._orig[name] = fn

            def counted(out: torch.Tensor, *args: Any, _fn: Any = fn, _name: str = name) -> Any:
                self.calls[_name] = self.calls.get(_name, 0) + 1
                big = [out] if _name != "reduce_scatter" else args[0]  # a tensor, or the parts of one
                big = [big] if isinstance(big, torch.Tensor) else big
                factor = 2 if _name == "all_reduce" else 1  # ring all-reduce = reduce-scatter + all-gather
                sent = factor * (world - 1) * sum(t.numel() * t.element_size() for t in big) // world
                self.bytes[_name] = self.bytes.get(_name, 0) + sent
                return _fn(out, *args)

            setattr(_collectives, name, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._orig.items():
            setattr(_collectives, name, fn)


def comm_per_step(strategy: str, bf16: bool) -> dict:
    torch.manual_seed(0)
    model = TinyGPT(n_layers=3)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    fully_shard(model, ModuleWrapPolicy({Block}), strategy=ShardingStrategy[strategy], mixed_precision=mp)
    state = fully_shard.state(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    gpt_loss(model, local_slice(gpt_batch(0, 2 * world), rank, world)).backward()  # warm-up step
    with CommCounter() as counter:
        gpt_loss(model, local_slice(gpt_batch(1, 2 * world), rank, world)).backward()
    padded = {h.unit_fqn: h.layout.padded_numel for h in state.handles}
    # one flag per original parameter rides with each reduction: [Note: which parameters got a gradient]
    flags = sum(len(h.params) for h in state.handles)
    return {"calls": counter.calls, "bytes": counter.bytes, "padded": padded, "flags": flags}


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_collectives_and_bytes_per_step(dist_run, strategy: str) -> None:
    world = 2
    r = dist_run(world, comm_per_step, strategy, False)[0]
    units = r["padded"]
    total = sum(units.values())
    non_root = total - units[""]
    ring = (world - 1) / world
    if strategy == "FULL_SHARD":
        # every unit gathered in forward; all but the root (kept unsharded) gathered again in backward
        assert r["calls"] == {"all_gather": 2 * len(units) - 1, "reduce_scatter": len(units)}
        assert r["bytes"]["all_gather"] == ring * 4 * (total + non_root)
        assert r["bytes"]["reduce_scatter"] == ring * 4 * (total + world * r["flags"])
    elif strategy == "SHARD_GRAD_OP":
        assert r["calls"] == {"all_gather": len(units), "reduce_scatter": len(units)}
        assert r["bytes"]["all_gather"] == ring * 4 * total
        assert r["bytes"]["reduce_scatter"] == ring * 4 * (total + world * r["flags"])
    else:
        assert r["calls"] == {"all_reduce": len(units)}
        assert r["bytes"]["all_reduce"] == 2 * ring * 4 * (total + r["flags"])


def test_bf16_param_dtype_halves_all_gather_bytes(dist_run) -> None:
    fp32 = dist_run(2, comm_per_step, "FULL_SHARD", False)[0]
    bf16 = dist_run(2, comm_per_step, "FULL_SHARD", True)[0]
    assert bf16["bytes"]["all_gather"] * 2 == fp32["bytes"]["all_gather"]
    assert bf16["bytes"]["reduce_scatter"] == fp32["bytes"]["reduce_scatter"]  # reduce_dtype stays fp32


class SkipsMiddle(nn.Module):
    """Three blocks; the middle one's output is detached, so its backward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.blocks[0](x))
        x = x + self.blocks[1](x).detach()
        return self.head(torch.tanh(self.blocks[2](x)))


def prefetch_logs(prefetch: str, forward_prefetch: Optional[bool], skip_middle: bool) -> list:
    torch.manual_seed(0)
    model: nn.Module = SkipsMiddle() if skip_middle else TinyGPT(n_layers=3)
    policy = (lambda m: m in set(model.blocks)) if skip_middle else ModuleWrapPolicy({Block})
    fully_shard(model, policy, backward_prefetch=BackwardPrefetch[prefetch], forward_prefetch=forward_prefetch)
    state = fully_shard.state(model)
    eo = state.exec_order_data
    logs, peaks = [], []
    for step in range(3):
        if skip_middle:
            model(torch.randn(4, 8)).sum().backward()
        else:
            gpt_loss(model, gpt_batch(step, 2)).backward()
        eo = state.exec_order_data
        logs.append(eo.last_prefetch_log)
        peaks.append(state.limiter.peak)
    return [logs, peaks]


def test_backward_pre_prefetch_order(dist_run) -> None:
    logs, peaks = dist_run(2, prefetch_logs, "BACKWARD_PRE", False, False)[0]
    assert logs[1] == [("backward", "blocks.2"), ("backward", "blocks.1"), ("backward", "blocks.0")]
    assert max(peaks) <= 2


def test_backward_post_prefetch_order(dist_run) -> None:
    logs, _ = dist_run(2, prefetch_logs, "BACKWARD_POST", False, False)[0]
    assert logs[1] == [("backward", "blocks.1"), ("backward", "blocks.0")]


def test_forward_prefetch_order_and_limit(dist_run) -> None:
    logs, peaks = dist_run(2, prefetch_logs, "BACKWARD_PRE", True, False)[0]
    assert logs[0][:1] == [("backward", "blocks.2")], "no forward prefetch before the order is known"
    assert logs[1] == [
        ("forward", "blocks.0"),
        ("forward", "blocks.1"),
        ("forward", "blocks.2"),
        ("backward", "blocks.2"),
        ("backward", "blocks.1"),
        ("backward", "blocks.0"),
    ]
    assert max(peaks) <= 2


def forward_prefetch_defaults() -> dict:
    group = dist.group.WORLD
    model = TinyGPT(n_layers=2)
    fully_shard(model, ModuleWrapPolicy({Block}))
    wrapped = FullyShardedDataParallel(TinyGPT(n_layers=2), auto_wrap_policy=ModuleWrapPolicy({Block}))
    return {
        "fully_shard": fully_shard.state(model).forward_prefetch,
        "wrapper": wrapped.forward_prefetch,
        "cpu": default_forward_prefetch(None, group, torch.device("cpu")),
        "cuda": default_forward_prefetch(None, group, torch.device("cuda", 0)),
        "false_on_cpu": default_forward_prefetch(False, group, torch.device("cpu")),
        "true_on_cuda": default_forward_prefetch(True, group, torch.device("cuda", 0)),
    }


def test_forward_prefetch_by_default_on_cpu(dist_run) -> None:
    # see [Note: forward prefetch by default]: gloo on the CPU prefetches unless told not to; on CUDA
    # the unshard stream overlaps the all-gathers by itself
    assert dist_run(2, forward_prefetch_defaults)[0] == {
        "fully_shard": True,
        "wrapper": True,
        "cpu": True,
        "cuda": False,
        "false_on_cpu": False,
        "true_on_cuda": True,
    }
    default, _ = dist_run(2, prefetch_logs, "BACKWARD_PRE", None, False)[0]
    explicit, _ = dist_run(2, prefetch_logs, "BACKWARD_PRE", True, False)[0]
    assert default == explicit and ("forward", "blocks.1") in default[1]


def test_prefetch_skips_unit_without_backward(dist_run) -> None:
    logs, _ = dist_run(2, prefetch_logs, "BACKWARD_PRE", False, True)[0]
    # after one iteration the runtime knows blocks.1 gets no gradient and prefetches blocks.0 instead
    assert logs[1] == [("backward", "blocks.2"), ("backward", "blocks.0")]
    assert logs[2] == logs[1]


def prefetch_by_units(freeze: bool) -> dict:
    """Prefetch log and units in flight; ``freeze``: every block unit also holds a frozen handle."""
    torch.manual_seed(0)
    model = TinyGPT(n_layers=3)
    if freeze:
        for block in model.blocks:
            block.ln1.requires_grad_(False)
    fully_shard(model, ModuleWrapPolicy({Block}), forward_prefetch=True)
    state = fully_shard.state(model)
    handles = state.handles
    most = [0]  # non-root units unsharded or being gathered at once, seen after every all-gather issued

    def units_alive() -> int:
        return len({id(h.module) for h in handles if h.module is not model and (h.is_unsharded or h.unshard_in_flight)})

    for h in handles:

        def spy(*args: Any, _orig: Any = h.unshard, **kwargs: Any) -> None:
            _orig(*args, **kwargs)
            most[0] = max(most[0], units_alive())

        h.unshard = spy  # type: ignore[method-assign]
    logs = []
    for step in range(3):
        gpt_loss(model, gpt_batch(step, 2)).backward()
        logs.append(state.exec_order_data.last_prefetch_log)
    per_unit = [sum(1 for h in handles if h.module is b) for b in model.blocks]
    return {"logs": logs, "most": most[0], "peak": state.limiter.peak, "handles_per_block": per_unit}


def test_prefetch_counts_units_not_handles(dist_run) -> None:
    plain = dist_run(2, prefetch_by_units, False)[0]
    mixed = dist_run(2, prefetch_by_units, True)[0]
    assert plain["handles_per_block"] == [1, 1, 1] and mixed["handles_per_block"] == [2, 2, 2]
    # a unit's handle count changes neither what is prefetched nor how many units are in flight
    assert mixed["logs"] == plain["logs"]
    assert mixed["logs"][1] == [
        ("forward", "blocks.0"),
        ("forward", "blocks.1"),
        ("forward", "blocks.2"),
        ("backward", "blocks.2"),
        ("backward", "blocks.1"),
        ("backward", "blocks.0"),
    ]
    assert mixed["most"] == plain["most"] == mixed["peak"] == plain["peak"] == 2


def hybrid(use_mesh: bool) -> dict:
    rank = dist.get_rank()
    # 2 x 2: shard within {0,1} and {2,3}, replicate across {0,2} and {1,3}
    if use_mesh:
        from torch.distributed.device_mesh import init_device_mesh

        group: Any = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        group = (shards[rank // 2], replicas[rank % 2])
    torch.manual_seed(0)
    ref = TinyGPT()

    def shard(m: nn.Module) -> nn.Module:
        return fully_shard(m, ModuleWrapPolicy({Block}), strategy=ShardingStrategy.HYBRID_SHARD, process_group=group)

    out = train_side_by_side(ref, shard, gpt_loss, gpt_batch, per_rank_batch=2, steps=3, optim="adamw")
    return out


@pytest.mark.parametrize("use_mesh", [False, True])
def test_hybrid_shard_parity_2x2(dist_run, use_mesh: bool) -> None:
    for r in dist_run(4, hybrid, use_mesh):
        assert r["keys_equal"] and r["shapes_equal"]
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=1e-5, atol=1e-5)
        assert r["max_weight_diff"] < 1e-5


class _Logged:
    """A collective's work whose `wait` is logged."""

    def __init__(self, work: Any, log: list, name: str) -> None:
        self.work, self.log, self.name = work, log, name

    def wait(self) -> Any:
        self.log.append(f"wait {self.name}")
        return self.work.wait() if self.work is not None else True


def hybrid_order_of_waits() -> list:
    """HYBRID_SHARD 2 x 2: the order in which one backward issues and waits its collectives."""
    rank = dist.get_rank()
    shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    torch.manual_seed(0)
    model = TinyGPT(n_layers=3)
    group = (shards[rank // 2], replicas[rank % 2])
    fully_shard(model, ModuleWrapPolicy({Block}), strategy=ShardingStrategy.HYBRID_SHARD, process_group=group)
    batch = local_slice(gpt_batch(0, 8), rank, 4)
    gpt_loss(model, batch).backward()  # the first step runs the order check
    log: list = []
    originals = {name: getattr(_collectives, name) for name in ("reduce_scatter", "all_reduce")}

    def spy(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            index = sum(1 for e in log if e.startswith(name[:3]))
            log.append(f"{name[:3]} {index}")
            return _Logged(originals[name](*args, **kwargs), log, f"{name[:3]} {index}")

        return call

    try:
        for name in originals:
            setattr(_collectives, name, spy(name))
        loss = gpt_loss(model, batch)
        log.append("backward")
        loss.backward()
    finally:
        for name, fn in originals.items():
            setattr(_collectives, name, fn)
    return log


def test_hybrid_all_reduce_overlaps_the_next_backward(dist_run) -> None:
    log = dist_run(4, hybrid_order_of_waits)[0]
    issued = [e for e in log if e.startswith("red ")]
    assert len(issued) == 4, log  # one reduce-scatter per unit (3 blocks + root)
    last_reduce_scatter = log.index(issued[-1])
    # every all-reduce across replicas is issued as soon as its unit's reduce-scatter is done, and
    # waited for only at the end of backward: it runs while the later units compute their gradients
    waits = [i for i, e in enumerate(log) if e.startswith("wait all")]
    assert len(waits) == 4 and min(waits) > last_reduce_scatter, log
    assert log.index("all 0") < log.index("red 2") and log.index("all 1") < log.index("red 3"), log


def hybrid_errors() -> list:
    errors = []
    for kwargs in (
        {"strategy": ShardingStrategy.HYBRID_SHARD},
        {"strategy": ShardingStrategy.FULL_SHARD, "process_group": (dist.group.WORLD, dist.group.WORLD)},
        {"process_group": "world"},
    ):
        try:
            fully_shard(copy.deepcopy(nn.Linear(2, 2)), **kwargs)
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    return errors


def test_hybrid_shard_bad_groups(dist_run) -> None:
    import expecttest

    errors = dist_run(2, hybrid_errors)[0]
    tc = expecttest.TestCase()
    tc.assertExpectedInline(
        errors[0],
        """ShardingStrategy.HYBRID_SHARD needs process_group=(shard_group, replicate_group) or a 2-D DeviceMesh (replicate, shard): say which ranks shard together and which replicate""",  # noqa: E501
    )
    tc.assertExpectedInline(
        errors[1],
        """a (shard, replicate) process_group or 2-D DeviceMesh is only for HYBRID_SHARD, not FULL_SHARD; pass one ProcessGroup""",  # noqa: E501
    )
    tc.assertExpectedInline(
        errors[2],
        """fully_shard argument 'process_group' must be a ProcessGroup, a DeviceMesh, a (shard_group, replicate_group) tuple or None, got str""",  # noqa: E501
    )
