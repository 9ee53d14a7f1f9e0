"""The meta-device recipe of FSDP2's docs: build the model under ``torch.device("meta")``, call
``fully_shard``, then ``model.to_empty(device=...)`` and initialise it. See [Note: to_empty after
sharding] in ``fsdp_composable/_init/_to_empty.py`` and [Note: reset_parameters after sharding].

Upstream: test/distributed/_composable/fsdp/test_fully_shard_init.py::TestFullyShardMetaDeviceInit
(to_empty + reset_parameters after fully_shard, then training). FSDP2 initialises its DTensor shards
locally; here ``reset_parameters()`` runs on full shapes, so the values are the plain model's.
"""

from __future__ import annotations

from typing import Any

import expecttest
import pytest
import torch
import torch.distributed as dist
from models import Block, OddMLP, TinyGPT, gpt_batch, gpt_loss, mlp_batch, mlp_loss
from parity import error_text, mlp_sgd_diff, same_values, train_side_by_side
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_composable import FullyShardedDataParallel, ModuleWrapPolicy, describe, fully_shard, unshard_params


def _meta_sharded(how: str) -> nn.Module:
    with torch.device("meta"):
        model = OddMLP()
    if how == "bottom-up":
        fully_shard(model.l2)
        return fully_shard(model)
    return fully_shard(model, ModuleWrapPolicy({nn.Sequential}))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _reset_each_module(model: nn.Module) -> None:
    for module in model.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()


def _units(model: nn.Module) -> list[tuple[str, int]]:
    return [(u.fqn, u.numel) for u in describe(model).units]


def meta_recipe_with_reset(how: str) -> dict[str, Any]:
    model = _meta_sharded(how)
    units = _units(model)
    model.to_empty(device="cpu")
    torch.manual_seed(7)  # the same seed everywhere: the plain model's values, module by module
    _reset_each_module(model)
    torch.manual_seed(7)
    ref = OddMLP()  # its constructor initialises the modules in the same order
    r: dict[str, Any] = {"plain_values": same_values(_state(model), _state(ref))}
    torch.manual_seed(100 + dist.get_rank())  # different seeds: every rank takes the lowest rank's draw
    model.to_empty(device="cpu")
    _reset_each_module(model)
    mine = _state(model)
    torch.manual_seed(100)
    _reset_each_module(ref)
    r["lowest_rank_draw"] = same_values(mine, _state(ref))
    r["units_kept"] = _units(model) == units and len(units) == 2
    weight = model.l1.weight  # a face: the global shape, this rank's rows locally
    r["still_sharded"] = isinstance(weight, DTensor) and weight.to_local().shape[0] < weight.shape[0]
    r["train_diff"] = mlp_sgd_diff(model, ref)
    return r


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("how", ["bottom-up", "policy"])
def test_meta_recipe_with_reset_parameters_gives_the_plain_init(dist_run, world_size, how) -> None:
    """Padded units at 2 and 4 ranks: to_empty + each module's reset_parameters() under one seed gives
    exactly the plain model built on the CPU with that seed; per-rank seeds still agree; the units stay
    as they were; training is in parity with the plain model."""
    for r in dist_run(world_size, meta_recipe_with_reset, how):
        assert r["plain_values"] and r["lowest_rank_draw"] and r["units_kept"] and r["still_sharded"], r
        assert r["train_diff"] < 1e-5, r


def meta_recipe_with_init_loop() -> dict[str, Any]:
    model = _meta_sharded("bottom-up")
    ref = OddMLP()
    # a step first, so gradients exist when to_empty runs
    mlp_loss(model, mlp_batch(0, 2)).backward()
    model.to_empty(device="cpu")
    r: dict[str, Any] = {"forward_after_to_empty": error_text(lambda: model(torch.randn(2, 5)).sum().backward())}
    with torch.no_grad():
        for i, (p, p_ref) in enumerate(zip(model.parameters(), ref.parameters())):
            p.fill_(0.01 * (i + 1))  # this rank's slice of the parameter
            p_ref.fill_(0.01 * (i + 1))
    model.zero_grad()
    r["plain_values"] = same_values(_state(model), _state(ref))
    r["train_diff"] = mlp_sgd_diff(model, ref)
    return r


@pytest.mark.parametrize("world_size", [2, 4])
def test_to_empty_keeps_the_shards_so_an_init_loop_over_parameters_writes_them(dist_run, world_size) -> None:
    """to_empty after fully_shard leaves every parameter (and gradient) a view of its unit's shard: the
    next forward and backward run, and nn.init over model.parameters() writes the shards, so the
    model equals the plain one initialised the same way and trains in parity."""
    for r in dist_run(world_size, meta_recipe_with_init_loop):
        assert r["forward_after_to_empty"] == "no error", r
        assert r["plain_values"], r
        assert r["train_diff"] < 1e-5, r


def to_empty_elsewhere() -> dict[str, Any]:
    model = _meta_sharded("bottom-up")
    torch.manual_seed(3)
    _reset_each_module(model)
    before = _state(model)
    r = {"error": error_text(lambda: model.to_empty(device="meta"))}
    r["unchanged"] = same_values(_state(model), before)
    r["usable"] = error_text(lambda: model(torch.randn(2, 5)).sum().backward())
    return r


def test_to_empty_on_another_device_is_refused_before_any_change(dist_run) -> None:
    results = dist_run(2, to_empty_elsewhere)
    for r in results:
        assert r["unchanged"] and r["usable"] == "no error", r
        assert r["error"] == results[0]["error"]
    expecttest.TestCase().assertExpectedInline(
        results[0]["error"],
        """RuntimeError: to_empty(device='meta') was called on a fully_shard model whose unit '<root>' keeps its shards on cpu: after fully_shard to_empty only re-creates storage in place. Build or move the model on its device before fully_shard (or pass device_id=), then call to_empty with that device""",  # noqa: E501
    )


def _init_weights(model: nn.Module) -> None:
    """A model-wide init in the style of ``init_weights()``: not a module's ``reset_parameters``."""
    for _, p in model.named_parameters():
        nn.init.normal_(p, std=0.02) if p.dim() > 1 else nn.init.zeros_(p)


def meta_gpt_with_init_weights() -> dict[str, Any]:
    with torch.device("meta"):
        model = TinyGPT()  # `pos` and attention's weights have no reset_parameters()
    fully_shard(model, ModuleWrapPolicy({Block}), param_init_fn=lambda m: m.to_empty(device="cpu", recurse=False))
    model.to_empty(device="cpu")
    torch.manual_seed(5)  # the same seed on every rank
    with torch.no_grad(), unshard_params(model):  # full shapes: the init sees what the plain model sees
        _init_weights(model)
    plain = TinyGPT()
    torch.manual_seed(5)
    with torch.no_grad():
        _init_weights(plain)
    r: dict[str, Any] = {"plain_values": same_values(_state(model), _state(plain))}
    r.update(train_side_by_side(plain, lambda m: model, gpt_loss, gpt_batch, per_rank_batch=2, steps=2, optim="sgd"))
    return r


@pytest.mark.parametrize("world_size", [2, 4])
def test_meta_recipe_with_a_model_wide_init_inside_unshard_params(dist_run, world_size) -> None:
    """A model whose modules lack reset_parameters(): param_init_fn only allocates, and a model-wide init
    run inside unshard_params under one seed gives exactly the plain model's values; then parity."""
    for r in dist_run(world_size, meta_gpt_with_init_weights):
        assert r["plain_values"], r
        assert max(abs(a - b) for a, b in zip(r["ref_losses"], r["losses"])) < 1e-5, r
        assert r["max_weight_diff"] < 1e-5, r


def meta_recipe_wrapper(use_orig_params: bool) -> dict[str, Any]:
    with torch.device("meta"):
        model = OddMLP()
    wrapped = FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}), use_orig_params=use_orig_params
    )
    wrapped.to_empty(device="cpu")
    torch.manual_seed(9)
    _reset_each_module(wrapped)
    torch.manual_seed(9)
    ref = OddMLP()
    r: dict[str, Any] = {"plain_values": same_values(_state(wrapped), _state(ref))}
    r["forward"] = error_text(lambda: wrapped(torch.randn(2, 5)).sum().backward())
    return r


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_meta_recipe_on_the_wrapper_class(dist_run, use_orig_params) -> None:
    """The same recipe on FullyShardedDataParallel, flat parameters (registered on the modules) too."""
    for r in dist_run(2, meta_recipe_wrapper, use_orig_params):
        assert r["plain_values"] and r["forward"] == "no error", r


class _TiedPair(nn.Module):
    """Two linears sharing one weight, then a head: the pair is one list unit."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(x)))


def _chain() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 5), nn.Linear(5, 3), nn.Linear(3, 2))


def meta_list_unit(kind: str) -> dict[str, Any]:
    build = _chain if kind == "chain" else _TiedPair
    with torch.device("meta"):
        model = build()
    members = [model[0], model[1]] if kind == "chain" else [model.a, model.b]
    fully_shard(members)
    fully_shard(model)
    members[1].to_empty(device="cpu")  # a later member's own to_empty keeps its shards too
    model.to_empty(device="cpu")
    torch.manual_seed(4)
    _reset_each_module(model)
    ref = build()  # on the CPU: to_empty of a meta model would untie the plain model's weight
    torch.manual_seed(4)
    _reset_each_module(ref)
    r: dict[str, Any] = {"plain_values": same_values(_state(model), _state(ref))}
    batch = torch.randn(3, 4)
    r["forward_diff"] = (model(batch) - ref(batch)).abs().max().item()
    return r


@pytest.mark.parametrize("kind", ["chain", "tied"])
def test_meta_recipe_with_a_list_unit_gives_the_plain_init(dist_run, kind) -> None:
    """fully_shard([m1, m2]) on a meta model, then to_empty and each module's reset_parameters() under
    one seed: every module (the second member and those after it; members that tie a weight) gets
    exactly the plain model's values."""
    for r in dist_run(2, meta_list_unit, kind):
        assert r["plain_values"] and r["forward_diff"] < 1e-6, r


def sharded_inside_the_meta_block(api: str) -> dict[str, Any]:
    with torch.device("meta"):
        model = OddMLP()
        if api == "fully_shard":
            fully_shard(model.l2)
            model = fully_shard(model)
        else:
            model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))
        still_meta = torch.empty(1).is_meta  # the block's default device is back
    model.to_empty(device="cpu")
    torch.manual_seed(7)
    _reset_each_module(model)
    torch.manual_seed(7)
    ref = OddMLP()
    r: dict[str, Any] = {"plain_values": same_values(_state(model), _state(ref)), "still_meta": still_meta}
    r["train_diff"] = mlp_sgd_diff(model, ref)
    return r


@pytest.mark.parametrize("api", ["fully_shard", "wrapper"])
def test_fully_shard_inside_the_meta_device_block(dist_run, api) -> None:
    """fully_shard (or the wrapper) called inside ``with torch.device("meta"):``, as FSDP2 code does:
    it works as when called after the block; to_empty and reset_parameters() give the plain model's
    values, and training is in parity."""
    for r in dist_run(2, sharded_inside_the_meta_block, api):
        assert r["plain_values"] and r["still_meta"], r
        assert r["train_diff"] < 1e-5, r
