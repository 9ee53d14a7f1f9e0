"""estimate_memory(): the estimate against an actually sharded copy at world sizes 2 and 4, and each
memory term against a hand computation (moved from test_inspect.py, which keeps describe())."""

from __future__ import annotations

import copy
import warnings
import weakref
from typing import Any, Optional
from unittest import mock

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import Block, OddMLP, TinyGPT, Toy, gpt_batch, gpt_loss
from torch import nn

from fsdp_composable import (
    BackwardPrefetch,
    MemoryEstimate,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingPlan,
    ShardingStrategy,
    SizeBasedPolicy,
    checkpoint,
    describe,
    estimate_memory,
    fully_shard,
)
from fsdp_composable._comm import _collectives
from fsdp_composable._common_utils import _get_fsdp_states
from fsdp_composable._flat_param import FlatParamHandle

BF16 = torch.bfloat16
POLICY = ModuleWrapPolicy({Block})


def _gpt(tied: bool = False) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(tied=tied)


def _step(model: nn.Module) -> None:
    gpt_loss(model, gpt_batch(0, 2)).backward()


# ---------------------------------------------------------------------------- estimate vs. actual
def estimate_vs_sharded() -> list[tuple[int, int, bool]]:
    """(estimated, actual sharded parameter bytes, predicted plan == describe) for three setups."""
    world_size = dist.get_world_size()
    mp = MixedPrecision(param_dtype=BF16)
    setups = [
        (lambda: _gpt(tied=True), POLICY, None),
        (OddMLP, SizeBasedPolicy(20), None),
        (lambda: nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Linear(5, 2)), None, mp),
    ]
    out = []
    for build, policy, mixed_precision in setups:
        torch.manual_seed(0)
        model = build()  # (a meta-device model gives the same estimate: see the test below; building on
        # meta here would make every worker pay a one-time import of torch's meta kernels, seconds each)
        est = estimate_memory(model, policy=policy, world_size=world_size, mixed_precision=mixed_precision)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the BatchNorm-under-mixed-precision notice is expected
            fully_shard(model, policy, mixed_precision=mixed_precision)
        handles = [h for s in _get_fsdp_states(model) for h in s.handles]
        actual = sum(h.flat_param.numel() * h.flat_param.element_size() for h in handles)
        out.append((est.sharded_param_bytes, actual, est.plan.units == describe(model).units))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_estimate_matches_sharded_copy(dist_run, world_size: int) -> None:
    for rank, results in enumerate(dist_run(world_size, estimate_vs_sharded)):
        for estimated, actual, same_plan in results:
            assert estimated == actual, (rank, estimated, actual)
            assert same_plan, rank  # units do not depend on the rank


def _unsharded_param_peak(strategy: ShardingStrategy) -> tuple[int, int]:
    """(estimated, measured peak) bytes of unsharded parameter buffers over two steps of TinyGPT.

    The measurement wraps the handle's allocation and freeing of its unsharded buffer, and counts the
    buffer a small unit's shards are gathered into from the all-gather to its copy-out ([Note: moving
    chunks]; on the CPU the unsharded buffer itself is allocated at the copy-out)."""
    live = {"now": 0, "peak": 0}
    alloc, free = FlatParamHandle._alloc_unsharded, FlatParamHandle._free_unsharded
    made, wait = _collectives.CopiedOut.__init__, _collectives.CopiedOut.wait

    def counted_made(copy: _collectives.CopiedOut, *args: Any) -> None:
        made(copy, *args)
        live["now"] += copy.buffer.numel() * copy.buffer.element_size()
        live["peak"] = max(live["peak"], live["now"])

    def counted_wait(copy: _collectives.CopiedOut) -> bool:
        done = wait(copy)
        live["now"] -= copy.buffer.numel() * copy.buffer.element_size()
        return done

    def storage_bytes(handle: FlatParamHandle) -> int:
        assert handle._unsharded is not None
        return int(handle._unsharded.untyped_storage().size())

    def counted_alloc(handle: FlatParamHandle) -> bool:
        before = storage_bytes(handle)
        allocated = alloc(handle)
        live["now"] += storage_bytes(handle) - before
        live["peak"] = max(live["peak"], live["now"])
        return allocated

    def counted_free(handle: FlatParamHandle) -> None:
        live["now"] -= storage_bytes(handle)
        free(handle)

    torch.manual_seed(0)
    model = TinyGPT(n_layers=3)
    est = estimate_memory(model, policy=POLICY, world_size=dist.get_world_size(), strategy=strategy)
    fully_shard(model, POLICY, strategy=strategy)
    with mock.patch.object(FlatParamHandle, "_alloc_unsharded", counted_alloc):
        with mock.patch.object(FlatParamHandle, "_free_unsharded", counted_free):
            with mock.patch.object(_collectives.CopiedOut, "__init__", counted_made):
                with mock.patch.object(_collectives.CopiedOut, "wait", counted_wait):
                    _step(model)
                    _step(model)
    return est.breakdown["unsharded_params"], live["peak"]


def measure_unsharded_param_peak() -> list[tuple[int, int]]:
    return [_unsharded_param_peak(s) for s in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP)]


def test_unsharded_params_term_matches_runtime(dist_run) -> None:
    (full_est, full_peak), (sgo_est, sgo_peak) = dist_run(2, measure_unsharded_param_peak)[0]
    # TinyGPT(n_layers=3): root 1,344 elements (1,376 padded to whole rows per rank), blocks 3,216 each, fp32
    # root + two blocks in flight (BACKWARD_PRE) + a block gathered before its copy-out (the next
    # block's gather is issued before the current one's wait; the unsharded buffer is made at the wait)
    assert full_est == full_peak == (1376 + 3 * 3216) * 4
    # SHARD_GRAD_OP keeps every block unsharded, and the last one's gather lands beside them
    assert sgo_est == sgo_peak == (1376 + 4 * 3216) * 4


def _backward_grad_peak(n_layers: int) -> int:
    """Peak bytes of the gradient storages autograd makes for the original parameters over two steps
    of TinyGPT (gloo: each unit's gradients are sent as they are, see [Note: gradients land in the
    flat buffer], or in one rank-major copy, see [Note: moving chunks]). A storage counts from its
    parameter's first accumulation (a copy: from its reduce-scatter) until it is freed."""
    live = {"now": 0, "peak": 0}
    seen: set[int] = set()

    def freed(key: int, nbytes: int) -> None:
        seen.discard(key)
        live["now"] -= nbytes

    def on_grad(param: torch.Tensor) -> None:
        assert param.grad is not None
        track(param.grad)

    def track(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage._cdata in seen:
            return
        seen.add(storage._cdata)
        live["now"] += storage.nbytes()
        live["peak"] = max(live["peak"], live["now"])
        # the storage's Python object lives exactly as long as the storage
        weakref.finalize(storage, freed, storage._cdata, storage.nbytes())

    reduce_scatter = _collectives.reduce_scatter

    def tracked_reduce_scatter(output: torch.Tensor, full: Any, *args: Any, **kwargs: Any) -> Any:
        for part in [full] if isinstance(full, torch.Tensor) else full:  # a small unit sends one copy
            track(part)
        return reduce_scatter(output, full, *args, **kwargs)

    torch.manual_seed(0)
    model = TinyGPT(n_layers=n_layers)
    fully_shard(model, POLICY)
    # autograd accumulates into the originals (the compute parameters), not the faces between steps
    originals = [p for s in _get_fsdp_states(model) for h in s.handles for p in h.params]
    hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in originals]
    with mock.patch.object(_collectives, "reduce_scatter", tracked_reduce_scatter):
        for step in range(2):
            model.zero_grad(set_to_none=True)
            gpt_loss(model, gpt_batch(step, 2 * dist.get_world_size())).backward()
    for hook in hooks:
        hook.remove()
    return live["peak"]


def measure_backward_grad_peaks() -> tuple[int, int]:
    return _backward_grad_peak(2), _backward_grad_peak(6)


@pytest.mark.parametrize("world_size", [2, 4])
def test_unsharded_grads_do_not_grow_with_depth(dist_run, world_size: int) -> None:
    """A unit's gradients are freed once its reduction is waited for (in the next unit's
    post-backward), not when the backward ends: the peak is the same at 2 and 6 blocks. It grew with
    depth (66,368 bytes at 6 blocks on 2 ranks) while a finished point-to-point reduce-scatter kept its
    send requests, which hold the sent slices of the unit's gradients, to the end of backward."""
    for rank, (shallow, deep) in enumerate(dist_run(world_size, measure_backward_grad_peaks)):
        # the root's head (37 x 16) and ln_f (2 x 16) gradients, made first and reduced in the final
        # callback, plus two blocks of 3,216 elements: the one in backward and the one being reduced
        # (sent as one copy, with its 10 parameters' presence flags)
        assert shallow == deep == (592 + 32 + 2 * 3216 + 10) * 4, (rank, shallow, deep)


# ---------------------------------------------------------------------------- estimate, by hand
LINEARS = ModuleWrapPolicy({nn.Linear})
BATCH = torch.zeros(4, 3)


def _estimate(model: Optional[nn.Module] = None, **kwargs: Any) -> MemoryEstimate:
    kwargs.setdefault("policy", LINEARS)
    kwargs.setdefault("world_size", 2)
    return estimate_memory(model if model is not None else Toy(), **kwargs)


def test_estimate_terms_full_shard_by_hand() -> None:
    # world size 2: each parameter padded to whole rows per rank (ceil(rows/2) rows a rank): root scale
    # 3 -> 4 (shard 2); a 5x3 -> 6x3 + 5 -> 6 = 24 (12); b 7x5 -> 8x5 + 7 -> 8 = 48 (24); c 1x7 -> 2x7 + 1 -> 2
    # = 16 (8)
    est = _estimate(batch_example=BATCH)
    assert [(u.fqn, u.numel, u.padded_numel, u.shard_numel) for u in est.plan.units] == [
        ("", 3, 4, 2),
        ("a", 20, 24, 12),
        ("b", 42, 48, 24),
        ("c", 8, 16, 8),
    ]
    shards = 2 + 12 + 24 + 8
    assert est.breakdown["sharded_params"] == shards * 4 == est.sharded_param_bytes == est.plan.sharded_param_bytes
    assert est.breakdown["sharded_grads"] == shards * 4
    assert est.breakdown["optimizer_state"] == 2 * shards * 4  # adam: exp_avg + exp_avg_sq; rank 0 has no padding
    # root unit (4) + the two largest non-root units in flight with BACKWARD_PRE: b (48) and a (24), and
    # the largest gathered before its copy-out (b: these units are small, so gloo copies them out)
    assert est.breakdown["unsharded_params"] == (4 + 48 + 24 + 48) * 4
    assert est.breakdown["unsharded_grads"] == 48 * 4  # b's padded gradient buffer
    # saved for backward: x (mul, for scale's grad), x*scale (a's input), relu(a) (a's output / b's
    # input, one storage), relu(b); parameters are not activations
    assert est.breakdown["activations"] == (4 * 3 + 4 * 3 + 4 * 5 + 4 * 7) * 4
    assert est.upper_bound_bytes == sum(est.breakdown.values())
    b = est.breakdown
    assert b["optimizer_step"] == shards * 4  # adam's foreach sqrt(exp_avg_sq)
    assert b["output_and_loss"] == 4 * 1 * 4  # no loss_fn: the output's gradient, (4, 1) fp32
    assert est.unsharded_at_backward_start == 4 * 4  # the root unit, kept unsharded after forward
    held = b["sharded_params"] + b["optimizer_state"]
    assert est.moments == {
        "loss": held + 4 * 4 + b["activations"] + b["output_and_loss"],
        "backward": held + b["unsharded_params"] + b["unsharded_grads"] + b["activations"],
        "backward_end": held + b["unsharded_params"] + b["unsharded_grads"] + b["sharded_grads"],
        "optimizer_step": held + b["sharded_grads"] + b["optimizer_step"],
    }
    assert est.peak_bytes == est.moments["backward"] and est.peak_moment == "backward"
    expecttest.TestCase().assertExpectedInline(
        str(est),
        """\
MemoryEstimate per rank: world size 2, 4 units, FULL_SHARD, optimizer adam
term              bytes      size  what
----------------  -----  --------  -----------------------------------------------------------------------------------
sharded_params      184     184 B  this rank's shard of every flat parameter
sharded_grads       184     184 B  sharded gradient of every unit with a trainable parameter
optimizer_state     368     368 B  adam: 2 x the trainable sharded parameters
optimizer_step      184     184 B  adam step's foreach temporaries: 1 x the trainable sharded parameters
unsharded_params    496     496 B  root unit + 2 largest FULL_SHARD unit(s) in flight + 1 gathered before its copy-out
unsharded_grads     192     192 B  largest unit's unsharded gradient buffer (compute + reduce dtype)
activations         288     288 B  saved for backward by forward(batch_example), once per storage
output_and_loss      16      16 B  the output's gradient (pass loss_fn= to measure the loss's tensors too)
----------------  -----  --------  -----------------------------------------------------------------------------------
peak              1,528  1.49 KiB  in backward: params + optimizer + unsharded + activations""",
    )

    # world size 4: root 3 -> 4 (1); a 8x3 + 8 = 32 (8); b 8x5 + 8 = 48 (12); c 4x7 + 4 = 32 (8)
    est4 = _estimate(world_size=4)
    assert [(u.padded_numel, u.shard_numel) for u in est4.plan.units] == [(4, 1), (32, 8), (48, 12), (32, 8)]
    assert est4.breakdown == {
        "sharded_params": (1 + 8 + 12 + 8) * 4,
        "sharded_grads": (1 + 8 + 12 + 8) * 4,
        "optimizer_state": 2 * (1 + 8 + 12 + 8) * 4,  # rank 0's chunks are all parameter rows
        "optimizer_step": (1 + 8 + 12 + 8) * 4,
        "unsharded_params": (4 + 48 + 32 + 48) * 4,
        "unsharded_grads": 48 * 4,
    }


def test_estimate_strategies_and_prefetch_by_hand() -> None:
    everything = 3 + 20 + 42 + 8
    sgo = _estimate(strategy=ShardingStrategy.SHARD_GRAD_OP)
    # every unit stays unsharded, and the largest one's gather lands beside them before its copy-out
    assert sgo.breakdown["unsharded_params"] == (4 + 24 + 48 + 16 + 48) * 4
    assert sgo.breakdown["sharded_params"] == (2 + 12 + 24 + 8) * 4
    assert sgo.explanations["unsharded_params"] == (
        "root unit + 3 SHARD_GRAD_OP/NO_SHARD unit(s) kept unsharded + 1 gathered before its copy-out"
    )
    no_shard = _estimate(strategy=ShardingStrategy.NO_SHARD)
    assert {u.strategy for u in no_shard.plan.units} == {ShardingStrategy.NO_SHARD}
    assert no_shard.breakdown["sharded_params"] == everything * 4
    assert no_shard.breakdown["unsharded_params"] == 0  # full precision NO_SHARD computes on the shard itself
    assert no_shard.explanations["unsharded_params"].startswith("none: full-precision NO_SHARD")
    assert no_shard.breakdown["unsharded_grads"] == 42 * 4
    single = _estimate(world_size=1)
    assert single.plan.units == no_shard.plan.units and single.strategy is ShardingStrategy.NO_SHARD
    assert single.breakdown == no_shard.breakdown
    post = _estimate(backward_prefetch=BackwardPrefetch.BACKWARD_POST, forward_prefetch=False)
    assert post.breakdown["unsharded_params"] == (4 + 48 + 48) * 4  # root + one unit at a time + its copy-out
    # forward prefetch on by default: two units at once even with BACKWARD_POST
    default_forward = _estimate(backward_prefetch=BackwardPrefetch.BACKWARD_POST)
    assert default_forward.breakdown["unsharded_params"] == (4 + 48 + 24 + 48) * 4
    forward_only = _estimate(backward_prefetch=None, forward_prefetch=True)
    assert forward_only.breakdown["unsharded_params"] == (4 + 48 + 24 + 48) * 4


def test_estimate_mixed_precision_by_hand() -> None:
    mp = MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32)
    est = _estimate(mixed_precision=mp, batch_example=BATCH)
    assert {(u.param_dtype, u.reduce_dtype, u.dtype) for u in est.plan.units} == {(BF16, torch.float32, torch.float32)}
    assert est.breakdown["sharded_params"] == (2 + 12 + 24 + 8) * 4  # sharded parameters stay in fp32
    assert est.breakdown["unsharded_params"] == (4 + 48 + 24 + 48) * 2  # gathered in bf16
    assert est.breakdown["unsharded_grads"] == 48 * 2 + 48 * 4  # bf16 buffer + its fp32 reduce copy
    assert est.breakdown["activations"] == (4 * 3 + 4 * 3 + 4 * 5 + 4 * 7) * 2  # inputs cast to bf16
    low = _estimate(mixed_precision=MixedPrecision(param_dtype=BF16, keep_low_precision_grads=True))
    assert low.breakdown["sharded_grads"] == (2 + 12 + 24 + 8) * 2
    assert low.breakdown["unsharded_grads"] == 48 * 2  # reduce dtype defaults to param_dtype: no copy
    no_shard = _estimate(strategy=ShardingStrategy.NO_SHARD, mixed_precision=mp)
    assert no_shard.breakdown["unsharded_params"] == (3 + 20 + 42 + 8) * 2  # cast copies kept through the step


def test_estimate_optimizers_and_frozen_params_by_hand() -> None:
    shards = 2 + 12 + 24 + 8
    assert _estimate(optimizer="adamw").breakdown["optimizer_state"] == 2 * shards * 4
    assert _estimate(optimizer="sgd-momentum").breakdown["optimizer_state"] == shards * 4
    assert _estimate(optimizer="sgd").breakdown["optimizer_state"] == 0
    frozen = Toy()
    frozen.scale.requires_grad_(False)  # the whole root unit is frozen
    # b splits into two flat parameters: frozen weight (7x5 -> padded 8x5 = 40) and trainable bias (7 -> 8)
    frozen.b.weight.requires_grad_(False)
    est = _estimate(frozen)
    assert [(u.fqn, u.padded_numel) for u in est.plan.units] == [("", 4), ("a", 24), ("b", 40), ("b", 8), ("c", 16)]
    assert est.breakdown["sharded_grads"] == (12 + 4 + 8) * 4  # frozen groups keep no gradient
    assert est.breakdown["optimizer_state"] == 2 * (12 + 4 + 8) * 4
    assert est.breakdown["unsharded_grads"] == 24 * 4  # the largest trainable group: a


def test_estimate_meta_model_and_no_side_effects() -> None:
    torch.manual_seed(0)
    model = TinyGPT(tied=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = gpt_batch(0, 2)[0]
    est = estimate_memory(model, policy=POLICY, world_size=4, batch_example=batch)
    with torch.device("meta"):
        meta_model = TinyGPT(tied=True)
    assert estimate_memory(meta_model, policy=POLICY, world_size=4, batch_example=batch) == est
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None and not p.is_meta for p in model.parameters())
    with pytest.raises(ValueError, match="call fully_shard"):
        describe(model)  # estimate_memory attached nothing


def test_estimate_batchnorm_unit_under_mixed_precision() -> None:
    model = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))
    est = _estimate(model, policy=None, mixed_precision=MixedPrecision(param_dtype=BF16))
    assert [(u.fqn, u.param_dtype) for u in est.plan.units] == [("", BF16), ("1", None)]


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * float(x.sum().item())


def test_estimate_bad_arguments() -> None:
    tc = expecttest.TestCase()
    cases = {
        "module": lambda: estimate_memory("model", policy=None, world_size=2),  # type: ignore[arg-type]
        "policy": lambda: _estimate(policy=3),
        "world_size type": lambda: _estimate(world_size=2.0),
        "world_size value": lambda: _estimate(world_size=0),
        "strategy": lambda: _estimate(strategy="FULL_SHARD"),
        "mixed_precision": lambda: _estimate(mixed_precision=torch.bfloat16),
        "optimizer": lambda: _estimate(optimizer="lamb"),
        "backward_prefetch": lambda: _estimate(backward_prefetch="pre"),
        "forward_prefetch": lambda: _estimate(forward_prefetch=1),
        "batch_example": lambda: _estimate(batch_example=3),
    }
    messages = {}
    for name, call in cases.items():
        with pytest.raises((TypeError, ValueError)) as e:
            call()
        messages[name] = f"{type(e.value).__name__}: {e.value}"
    tc.assertExpectedInline(
        "\n".join(f"{k}: {v}" for k, v in messages.items()),
        """\
module: TypeError: estimate_memory argument 'module' must be an nn.Module, got str
policy: TypeError: estimate_memory argument 'policy': policy must be None, ModuleWrapPolicy, SizeBasedPolicy, CustomPolicy or a callable(module) -> bool, got int
world_size type: TypeError: estimate_memory argument 'world_size' must be an int, got float
world_size value: ValueError: estimate_memory argument 'world_size' must be at least 1, got 0
strategy: TypeError: estimate_memory argument 'strategy' must be a ShardingStrategy, got 'FULL_SHARD'
mixed_precision: TypeError: estimate_memory argument 'mixed_precision' must be a MixedPrecision or None, got torch.bfloat16
optimizer: ValueError: estimate_memory argument 'optimizer' must be one of ['adam', 'adamw', 'sgd', 'sgd-momentum'], got 'lamb'
backward_prefetch: TypeError: estimate_memory argument 'backward_prefetch' must be a BackwardPrefetch or None, got 'pre'
forward_prefetch: TypeError: estimate_memory argument 'forward_prefetch' must be True, False or None, got 1
batch_example: TypeError: estimate_memory argument 'batch_example' must be a tensor, a tuple of positional arguments or a dict of keyword arguments for module.forward, got int""",  # noqa: E501
    )
    with pytest.raises(RuntimeError, match=r"could not run DataDependent.forward\(batch_example\) on fake tensors"):
        _estimate(DataDependent(), policy=None, batch_example=torch.zeros(1, 2))


def test_estimate_hybrid_shard_is_full_shard_within_the_shard_group() -> None:
    hybrid = _estimate(strategy=ShardingStrategy.HYBRID_SHARD, batch_example=BATCH)
    full = _estimate(strategy=ShardingStrategy.FULL_SHARD, batch_example=BATCH)
    assert hybrid.breakdown == full.breakdown and hybrid.peak_bytes == full.peak_bytes
    assert {u.strategy for u in hybrid.plan.units} == {ShardingStrategy.HYBRID_SHARD}


def test_activations_counted_with_the_device_kernels() -> None:
    """On the meta device scaled_dot_product_attention would take its math path and save the (B, H, L, L)
    attention matrix; the CPU kernel saves only q, k, v, the output and a logsumexp."""

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(32, 96, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = (t.unflatten(-1, (4, 8)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    batch = torch.zeros(2, 64, 32)
    real = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        real.setdefault(t.untyped_storage()._cdata, t.untyped_storage().nbytes())
        return t

    model = Attention()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(batch)
    real.pop(model.qkv.weight.untyped_storage()._cdata, None)
    with torch.device("meta"):
        meta_model = Attention()
    for m in (model, meta_model):
        est = estimate_memory(m, policy=None, world_size=1, batch_example=batch)
        assert est.breakdown["activations"] == sum(real.values())


def test_activation_checkpointing_applied_first_is_counted() -> None:
    """checkpoint() on the blocks before estimate_memory: only what is saved outside them counts, as
    in a real forward of the checkpointed model."""

    def saved_bytes(model: nn.Module, batch: torch.Tensor) -> int:
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage()._cdata not in params:
                seen.setdefault(t.untyped_storage()._cdata, t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(batch)
        return sum(seen.values())

    batch = gpt_batch(0, 2)[0].contiguous()  # a view would count its whole base storage in the real run
    torch.manual_seed(0)
    plain = TinyGPT()
    checkpointed = copy.deepcopy(plain)
    for block in checkpointed.modules():
        if isinstance(block, Block):
            checkpoint(block)
    estimates = [estimate_memory(m, policy=None, world_size=2, batch_example=batch) for m in (plain, checkpointed)]
    assert estimates[0].breakdown["activations"] == saved_bytes(plain, batch)
    assert estimates[1].breakdown["activations"] == saved_bytes(checkpointed, batch)
    assert estimates[1].breakdown["activations"] < estimates[0].breakdown["activations"]


def test_activations_with_a_plain_tensor_attribute() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = torch.full((4,), 2.0)  # not a buffer: deep-copied as a real tensor

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.lin(x) * self.scale)

    est = estimate_memory(Scaled(), policy=None, world_size=2, batch_example=torch.zeros(3, 4))
    # saved: the input (linear), the scale (mul, w.r.t. the linear output) and relu's output
    assert est.breakdown["activations"] == (3 * 4 + 4 + 3 * 4) * 4


def test_plan_is_frozen_and_copyable() -> None:
    plan = _estimate().plan
    assert isinstance(plan, ShardingPlan)
    with pytest.raises(AttributeError):
        plan.rank = 1  # type: ignore[misc]
    assert copy.deepcopy(plan) == plan
