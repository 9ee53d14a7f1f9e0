"""Tensor-subclass parameters that define their own all-gather: torch FSDP2's extension protocol
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``), with torchao's NF4 (QLoRA) and float8 training
weights, and a subclass of our own that uses the protocol's long form and two inputs of different dtypes.

Parity: the sharded model trains like the unsharded one on the same global batch. Float8 casts the
*activations* with a scale from their own absolute maximum, so its reference runs each rank's slice of
the batch on its own (the gradients averaged), which is what data parallelism computes; with that,
the float8 model matches bit for bit."""

from __future__ import annotations

import copy
import importlib.util
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from expecttest import assert_expected_inline
from parity import global_mean
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from fsdp_composable import CPUOffload, ModuleWrapPolicy, ShardingStrategy, clip_grad_norm_, fully_shard
from fsdp_composable._comm import _collectives
from fsdp_composable._comm._tensor_parallel import full_tensor

needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="torchao is not installed (the [torchao] extra)"
)
aten = torch.ops.aten


def _whole(value: Any) -> Any:
    """``value.full_tensor()`` as the library gathers it: on gloo a subclass's gathers one at a time
    ([Note: a subclass's gathers on gloo] in `_tensor_parallel`)."""
    return full_tensor(value, value.device)


class _Sends:
    """Counts what this rank sends in all-gathers of bytes (the extension parameters' one) and of floats."""

    def __init__(self) -> None:
        self.bytes, self.floats = 0, 0
        self._orig = _collectives.all_gather

    def __enter__(self) -> _Sends:
        def spy(output: torch.Tensor, shard: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if shard.dtype == torch.uint8:
                self.bytes += shard.numel()
            elif shard.is_floating_point():
                self.floats += shard.numel()
            return self._orig(output, shard, *args, **kwargs)

        _collectives.all_gather = spy  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        _collectives.all_gather = self._orig  # type: ignore[assignment]


def _train(
    model: nn.Module, ref: nn.Module, steps: int, make_batch: Any, per_rank_ref: bool = False, clip: Any = None
) -> list[tuple[float, float]]:
    """(reference loss, sharded loss) per step; AdamW on both; each rank takes its slice of the batch.
    ``clip(model)``: clips the sharded model's gradients to norm 0.05, checked against torch's on the reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = make_batch(step, world)
        if per_rank_ref:
            pairs = zip(x.chunk(world), y.chunk(world))
            loss_ref = sum(F.mse_loss(ref(a), b) / world for a, b in pairs)
        else:
            loss_ref = F.mse_loss(ref(x), y)
        loss_ref.backward()
        if clip is not None:
            norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        opt_ref.step()
        opt_ref.zero_grad()
        loss = F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        if clip is not None:
            norm = clip(model)
            assert float(norm_ref) > 0.05, norm_ref  # it clips
            assert abs(float(norm) - float(norm_ref)) < 1e-5 * float(norm_ref), (norm, norm_ref)
        opt.step()
        opt.zero_grad()
        losses.append((float(loss_ref), global_mean(loss.detach())))
    return losses


def _batch(width: int, out: int):  # type: ignore[no-untyped-def]
    def make(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100)  # one batch: the loss must go down
        return torch.randn(2 * world, 8, width, generator=g), torch.randn(2 * world, 8, out, generator=g)

    return make


# ---------------------------------------------------------------- QLoRA: NF4 base weights, LoRA adapters (Llama-style)
class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int = 4) -> None:
        from torchao.quantization import to_nf4

        super().__init__()
        self.weight = nn.Parameter(to_nf4(torch.randn(d_out, d_in) / d_in**0.5), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(d_out, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + (x @ self.lora_a.t()) @ self.lora_b.t()


class QLoRABlock(nn.Module):
    def __init__(self, d: int = 256) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = LoRALinear(d, 2 * d)
        self.down = LoRALinear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class LlamaQLoRABlock(nn.Module):
    """A Llama-style block: RMSNorm, causal attention (q, k, v, o) and a gated MLP (gate, up, down), every
    linear an NF4 base weight with a LoRA adapter."""

    def __init__(self, d: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q, self.k, self.v, self.o = (LoRALinear(d, d) for _ in range(4))
        self.gate, self.up, self.down = LoRALinear(d, 2 * d), LoRALinear(d, 2 * d), LoRALinear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (m(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def qlora_parity() -> dict[str, Any]:
    torch.manual_seed(0)
    ref = nn.Sequential(LlamaQLoRABlock(), LlamaQLoRABlock(), nn.Linear(256, 8))
    model = copy.deepcopy(ref)
    fully_shard(model, ModuleWrapPolicy({LlamaQLoRABlock}))
    weight = model[0].up.weight
    nf4 = {n: p for n, p in ref.named_parameters() if type(p).__name__ == "NF4Tensor"}
    before = [model.get_parameter(n)._local_tensor.quantized_data.clone() for n in nf4]
    with _Sends() as sends:
        losses = _train(model, ref, 3, _batch(256, 8))
    lora = [(n, p) for n, p in model.named_parameters() if "lora" in n]
    adapters = {n: (_whole(p) - ref.get_parameter(n)).abs().max().item() for n, p in lora}
    after = [model.get_parameter(n)._local_tensor.quantized_data for n in nf4]
    # FULL state dict: the NF4 weights whole (the same codes as the unsharded model's), loaded into a
    # sharded model built from another seed
    saved = model.state_dict()
    torch.manual_seed(1)
    blocks = [LlamaQLoRABlock(), LlamaQLoRABlock()]
    other = fully_shard(nn.Sequential(*blocks, nn.Linear(256, 8)), ModuleWrapPolicy({LlamaQLoRABlock}))
    other.load_state_dict(saved)
    loaded = all(
        torch.equal(_whole(other.get_parameter(n)).quantized_data, p.quantized_data) for n, p in nf4.items()
    )
    loaded &= all(torch.equal(_whole(other.get_parameter(n)), _whole(p)) for n, p in lora)
    return {
        "losses": losses,
        "adapters": adapters,
        "face": (type(weight).__name__, type(weight._local_tensor).__name__, tuple(weight.shape)),
        "placements": str(weight.placements),
        "local_rows": weight._local_tensor.shape[0],
        "frozen_unchanged": all(torch.equal(a, b) for a, b in zip(before, after)),
        "saved": sorted({type(saved[n]).__name__ for n in nf4}),
        "saved_same": all(torch.equal(saved[n].quantized_data, p.quantized_data) for n, p in nf4.items()),
        "loaded": loaded,
        "sent_bytes": sends.bytes,
        "nf4_numel": sum(p.numel() for p in nf4.values()),
        "world": dist.get_world_size(),
    }


@needs_torchao
@pytest.mark.parametrize("world", [2, 4])
def test_qlora_nf4_trains_like_the_unsharded_model(dist_run, world: int) -> None:
    for r in dist_run(world, qlora_parity):
        for a, b in r["losses"]:
            assert abs(a - b) < 1e-5 * abs(a), r["losses"]
        assert r["losses"][-1][1] < r["losses"][0][1], r["losses"]  # it trained
        # AdamW amplifies the rounding of near-zero gradient elements: see ADAM_DIFF in test_extensions_adversary
        assert max(r["adapters"].values()) < 1e-4, r["adapters"]
        assert r["face"] == ("DTensor", "NF4Tensor", (512, 256)) and r["placements"] == "(Shard(dim=0),)", r
        assert r["local_rows"] == 512 // world and r["frozen_unchanged"]
        assert r["saved"] == ["NF4Tensor"] and r["saved_same"] and r["loaded"], r
        # the 4-bit codes (half a byte per weight), one int8 scale per 64 weights and one float32
        # factor per 64 x 256: this rank's share, gathered twice per step (forward, backward), 3 steps
        n = r["nf4_numel"]
        per_gather = (n // 2 + n // 64 + 4 * n // (64 * 256)) // world
        assert r["sent_bytes"] == 3 * 2 * per_gather, (r["sent_bytes"], per_gather)
        assert per_gather < 0.14 * (4 * n // world)  # what float32 weights would send


# ---------------------------------------------------------------- float8 training weights (torchao)
class Float8Block(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def float8_parity() -> dict[str, Any]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    ref = nn.Sequential(Float8Block(), Float8Block(), nn.Linear(64, 8))
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(ref, config=config, module_filter_fn=lambda m, fqn: fqn != "2")
    model = copy.deepcopy(ref)
    fully_shard(model, ModuleWrapPolicy({Float8Block}))
    with _Sends() as sends:
        losses = _train(model, ref, 3, _batch(64, 8), per_rank_ref=True)
    diffs = [(_whole(p) - ref.get_parameter(n)).abs().max().item() for n, p in model.named_parameters()]
    weight = model[0].up.weight
    return {
        "losses": losses,
        "diffs": diffs,
        "local": type(weight._local_tensor).__name__,
        "sent_bytes": sends.bytes,
        "float8_numel": sum(b.up.weight.numel() + b.down.weight.numel() for b in (ref[0], ref[1])),
    }


@needs_torchao
def test_float8_weights_are_gathered_in_float8_and_train_bit_for_bit(dist_run) -> None:
    for r in dist_run(2, float8_parity):
        assert all(a == b for a, b in r["losses"]), r["losses"]
        assert max(r["diffs"]) == 0, r["diffs"]
        assert r["local"] == "WeightWithDynamicFloat8CastTensor"
        assert r["sent_bytes"] == 3 * 2 * r["float8_numel"] // 2  # one byte per weight, this rank's half


# ---------------------------------------------------------------- a subclass of our own
class Int8Gathered(torch.Tensor):
    """A float32 weight that is all-gathered as int8 codes with one float32 scale per row (two inputs of
    different dtypes), through the protocol's long form; it trains its float32 data (straight through)."""

    calls: list[tuple[str, Any]] = []  # what fsdp_pre_all_gather was given

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> Int8Gathered:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, data.shape, strides=data.stride(), dtype=data.dtype, device=data.device
        )

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    def __repr__(self) -> str:
        return f"Int8Gathered({self._data!r})"

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: None, size: Any, stride: Any) -> Int8Gathered:
        return Int8Gathered(inner["_data"])

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    _KEEP = {
        aten.split.Tensor,
        aten.new_zeros.default,
        aten.detach.default,
        aten.alias.default,
        aten.view.default,
        aten.slice.Tensor,
        aten.clone.default,
        aten.empty_like.default,
    }

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        a, k = tree_map_only(Int8Gathered, lambda t: t._data, (args, kwargs or {}))
        out = func(*a, **k)
        if func._schema.is_mutable and isinstance(args[0], Int8Gathered):
            return args[0]  # an in-place update (copy_, the optimizer's) of the float32 data
        if func in cls._KEEP:
            return tree_map_only(torch.Tensor, Int8Gathered, out)
        return out

    @staticmethod
    def quantize(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = data.abs().amax(dim=1).clamp_min(1e-12) / 127
        return torch.round(data / scale[:, None]).to(torch.int8), scale

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: Any, module: nn.Module, mp: Any):  # type: ignore[no-untyped-def]
        Int8Gathered.calls.append((type(module).__name__, tuple(outer_size)))
        codes, scale = Int8Gathered.quantize(self._data)
        return (codes, scale), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out: Optional[torch.Tensor] = None):  # type: ignore[no-untyped-def]
        codes, scale = outputs
        value = codes.to(param_dtype) * scale[:, None].to(param_dtype)
        if out is not None:
            out.copy_(value)
            return None
        return value, (value,)


def _straight_through(weight: torch.Tensor) -> torch.Tensor:
    codes, scale = Int8Gathered.quantize(weight.detach())
    return weight + (codes.to(weight.dtype) * scale[:, None] - weight).detach()


class QuantLinear(nn.Linear):
    """The reference: the same row-wise int8 rounding of the weight, in forward, straight through."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        return F.linear(x, w if type(w) is Int8Gathered else _straight_through(w), self.bias)


class Int8Block(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.up, self.down = QuantLinear(d, 2 * d), QuantLinear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def own_subclass_parity(strategy: ShardingStrategy) -> dict[str, Any]:
    torch.manual_seed(0)
    ref = nn.Sequential(Int8Block(), Int8Block(), nn.Linear(32, 4))
    model = copy.deepcopy(ref)
    for block in model[:2]:
        for lin in (block.up, block.down):
            lin.weight = nn.Parameter(Int8Gathered(lin.weight.detach().clone()))
    fully_shard(model, ModuleWrapPolicy({Int8Block}), strategy=strategy)
    Int8Gathered.calls.clear()
    # the norm counts the subclass parameters' gradient shards once: ours, and torch's over parameters()
    if strategy is ShardingStrategy.FULL_SHARD:
        clip = lambda m: clip_grad_norm_(m, 0.05)  # noqa: E731
    else:
        clip = lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)  # noqa: E731
    with _Sends() as sends:
        losses = _train(model, ref, 3, _batch(32, 4), clip=clip)
    diffs = {n: (_whole(p) - ref.get_parameter(n)).abs().max().item() for n, p in model.named_parameters()}
    return {"losses": losses, "diffs": diffs, "calls": sorted(set(Int8Gathered.calls)), "sent_bytes": sends.bytes}


@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD])
def test_own_subclass_gathers_int8_and_trains_like_the_unsharded_model(dist_run, strategy: ShardingStrategy) -> None:
    for r in dist_run(2, own_subclass_parity, strategy):
        for a, b in r["losses"]:
            assert abs(a - b) < 1e-5 * abs(a), r["losses"]
        assert r["losses"][-1][1] < r["losses"][0][1], r["losses"]
        assert max(r["diffs"].values()) < 1e-5, r["diffs"]
        # the long form: fsdp_pre_all_gather is told the module and the parameter's global shape
        assert r["calls"] == [("QuantLinear", (32, 64)), ("QuantLinear", (64, 32))], r["calls"]
        if strategy is ShardingStrategy.FULL_SHARD:  # per row of this rank's half: 1 byte x width + a float32 scale
            per_gather = (32 * (32 + 4) + 16 * (64 + 4)) * 2
            assert r["sent_bytes"] == 3 * 2 * per_gather, r["sent_bytes"]
        else:
            assert r["sent_bytes"] == 0  # every rank holds the whole: nothing gathered


def refusals() -> list[str]:
    out = []
    for build in (
        lambda: nn.Sequential(nn.Linear(4, 3)),  # 3 rows over 2 ranks
        lambda: nn.Sequential(nn.Linear(4, 4)),
    ):
        model = build()
        model[0].weight = nn.Parameter(Int8Gathered(model[0].weight.detach().clone()))
        offload = CPUOffload(offload_params=True) if model[0].weight.shape[0] == 4 else None
        try:
            fully_shard(model, cpu_offload=offload)
            out.append("")
        except (ValueError, TypeError) as e:
            out.append(str(e))

    class HalfProtocol(torch.Tensor):
        def fsdp_pre_all_gather(self, mesh: Any) -> Any:
            raise AssertionError("never called")

    model = nn.Sequential(nn.Linear(4, 4))
    model[0].weight = nn.Parameter(model[0].weight.detach().as_subclass(HalfProtocol))
    try:
        fully_shard(model)
        out.append("")
    except TypeError as e:
        out.append(str(e))
    return out


_FUNCTIONAL = (
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.wait_tensor.default,
)


class _Collectives(TorchDispatchMode):
    """The functional collectives issued and waited for on plain tensors, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(t is not torch.Tensor for t in types):
            return NotImplemented
        if func in _FUNCTIONAL:
            self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def nf4_gathered_whole() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torchao.quantization import to_nf4

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    whole = torch.randn(128 * world, 128)
    local = to_nf4(whole.chunk(world)[rank])
    value = DTensor.from_local(local, init_device_mesh("cpu", (world,)), [Shard(0)], run_check=False)
    with _Collectives() as collectives:
        gathered = full_tensor(value, torch.device("cpu"))
    expected = torch.cat([to_nf4(piece).quantized_data for piece in whole.chunk(world)])
    return {"seen": collectives.seen, "same": torch.equal(gathered.quantized_data, expected)}


@needs_torchao
def test_a_subclass_is_gathered_one_collective_at_a_time_on_gloo(dist_run) -> None:
    """NF4's three inner all-gathers, each waited for before the next is issued: several functional
    all-gathers in flight on gloo corrupt the heap ([Note: a subclass's gathers on gloo])."""
    for r in dist_run(2, nf4_gathered_whole):
        assert r["same"], r
        gathers = r["seen"].count("all_gather_into_tensor")
        assert gathers == 3 and r["seen"][: 2 * gathers] == ["all_gather_into_tensor", "wait_tensor"] * gathers, r


def test_refusals_name_the_parameter_on_every_rank(dist_run) -> None:
    results = dist_run(2, refusals)
    assert results[0] == results[1]
    uneven, offload, half = results[0]
    assert_expected_inline(
        uneven,
        """fully_shard: parameter '0.weight' (Int8Gathered, shape (3, 4)) defines its own all-gather, so it is split by dim 0 into 2 equal chunks without padding: its dim 0 must divide by 2 (resize it, or leave its module out of fully_shard with ignored_modules)""",  # noqa: E501
    )
    assert_expected_inline(
        offload,
        """fully_shard: parameter '0.weight' (Int8Gathered) defines its own all-gather, which CPU offload does not support: shard it without offload_policy/cpu_offload""",  # noqa: E501
    )
    assert_expected_inline(
        half,
        """fully_shard: parameter '0.weight' is a HalfProtocol, which defines fsdp_pre_all_gather but not fsdp_post_all_gather: a tensor subclass that changes what is all-gathered must define both""",  # noqa: E501
    )
