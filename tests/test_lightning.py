"""fsdp_composable.lightning on 2 CPU ranks: Fabric and Trainer shard with fully_shard, checkpoint
with DCP and resume exactly where an uninterrupted run would be, and skip the gradient reduction
inside no_backward_sync / gradient accumulation."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from models import OddMLP, mlp_batch
from torch import nn

from fsdp_composable import ModuleWrapPolicy, StateDictType, state_dict_type
from fsdp_composable._comm import _collectives as collectives

L = pytest.importorskip("lightning", reason="lightning is not installed: pip install -e '.[lightning]'")

from fsdp_composable.lightning import FabricStrategy, TrainerStrategy  # noqa: E402

POLICY = ModuleWrapPolicy({nn.Linear})


@contextlib.contextmanager
def _lightning_rank() -> Iterator[None]:
    """This pool rank as a process Lightning did not start (LOCAL_RANK set); the env restored after."""
    saved = dict(os.environ)
    os.environ["LOCAL_RANK"] = os.environ["RANK"]
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _counting_reductions() -> Iterator[list[int]]:
    """Count the gradient reductions fully_shard issues (a reduce-scatter per sharded unit)."""
    count = [0]
    original = collectives.reduce_scatter

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    collectives.reduce_scatter = counted  # type: ignore[assignment]
    try:
        yield count
    finally:
        collectives.reduce_scatter = original  # type: ignore[assignment]


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    with state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return {k: v.clone() for k, v in model.state_dict().items()}


# --- Fabric -------------------------------------------------------------------------------------


def _fabric(**kwargs: Any) -> Any:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=FabricStrategy(POLICY, **kwargs))
    fabric.launch()
    return fabric


def _fabric_setup(fabric: Any, seed: int) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = fabric.setup_module(OddMLP())
    return model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))


def _fabric_train(fabric: Any, model: Any, optim: Any, steps: range) -> list[float]:
    rank = dist.get_rank()
    losses = []
    for step in steps:
        x, y = mlp_batch(step, 8)
        loss = nn.functional.mse_loss(model(x[4 * rank : 4 * rank + 4]), y[4 * rank : 4 * rank + 4])
        fabric.backward(loss)
        optim.step()
        optim.zero_grad()
        losses.append(float(loss.item()))
    return losses


def _fabric_resume(ckpt: str, distributed: bool) -> dict[str, Any]:
    with _lightning_rank():
        fabric = _fabric(save_distributed_checkpoint=distributed)
        model, optim = _fabric_setup(fabric, seed=0)
        _fabric_train(fabric, model, optim, range(2))
        fabric.save(ckpt, {"model": model, "optimizer": optim, "step": 2})
        saved = _full(model)
        uninterrupted = _fabric_train(fabric, model, optim, range(2, 5))
        expected = _full(model)

        model, optim = _fabric_setup(fabric, seed=1)  # other weights, no optimizer state
        state = {"model": model, "optimizer": optim, "step": 0}
        remainder = fabric.load(ckpt, state)
        resumed = _fabric_train(fabric, model, optim, range(state["step"], 5))
        got = _full(model)
        files = sorted(os.listdir(ckpt)) if distributed else _single_file(ckpt, saved, optim)
    return {
        "step": state["step"],
        "remainder": remainder,
        "losses_equal": resumed == uninterrupted,
        "weights_equal": all(torch.equal(got[k], v) for k, v in expected.items()),
        "files": files,
    }


def _single_file(ckpt: str, saved: dict[str, torch.Tensor], optim: Any) -> list[str]:
    """The one file, read with plain torch.load: its keys, and the model's full tensors as saved."""
    data = torch.load(ckpt, weights_only=True)
    assert sorted(data["model"]) == sorted(saved) and all(torch.equal(data["model"][k], v) for k, v in saved.items())
    assert sorted(data["optimizer"]["state"]) == sorted(n for n in saved), data["optimizer"]["state"].keys()
    return sorted(data)


@pytest.mark.parametrize("distributed", [True, False])
def test_fabric_save_load_resumes_exactly(dist_run: Any, distributed: bool) -> None:
    ckpt = os.path.join(tempfile.mkdtemp(), "ckpt")
    results = dist_run(2, _fabric_resume, ckpt, distributed, timeout=300)
    for r in results:
        assert r["step"] == 2 and r["remainder"] == {}, r
        assert r["losses_equal"] and r["weights_equal"], r
        if distributed:
            assert ".metadata" in r["files"] and "meta.pt" in r["files"], r
        else:  # one file, as Lightning writes with save_distributed_checkpoint=False
            assert r["files"] == ["model", "optimizer", "step"], r


def _fabric_no_backward_sync() -> dict[str, int]:
    with _lightning_rank():
        fabric = _fabric()
        model, optim = _fabric_setup(fabric, seed=0)
        x, y = mlp_batch(0, 4)
        counts = {}
        for enabled in (True, False):
            with _counting_reductions() as count, fabric.no_backward_sync(model, enabled=enabled):
                fabric.backward(nn.functional.mse_loss(model(x), y))
            counts[f"enabled={enabled}"] = count[0]
        with _counting_reductions() as count:  # the next backward outside reduces the accumulated sum
            fabric.backward(nn.functional.mse_loss(model(x), y))
        counts["after"] = count[0]
    return counts


def test_fabric_no_backward_sync_skips_the_reduction(dist_run: Any) -> None:
    results = dist_run(2, _fabric_no_backward_sync, timeout=300)
    for r in results:
        assert r["enabled=True"] == 0, r
        assert r["enabled=False"] > 0 and r["after"] == r["enabled=False"], r


def _by_hand(model: nn.Module, mesh: Any) -> nn.Module:
    from fsdp_composable import fully_shard

    fully_shard(model.l2, process_group=mesh["data_parallel"])  # bottom-up: a unit, then the root
    return fully_shard(model, process_group=mesh["data_parallel"])


def _fabric_parallelize_fn() -> dict[str, Any]:
    import copy

    from harness import error_of

    with _lightning_rank():
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=FabricStrategy(parallelize_fn=_by_hand))
        fabric.launch()
        torch.manual_seed(0)
        plain = OddMLP()
        model = fabric.setup_module(copy.deepcopy(plain))
        optim = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
        ref_optim = torch.optim.SGD(plain.parameters(), lr=0.1)
        _fabric_train(fabric, model, optim, range(2))
        for step in range(2):  # the unsharded model on the global batch
            x, y = mlp_batch(step, 8)
            nn.functional.mse_loss(plain(x), y).backward()
            ref_optim.step()
            ref_optim.zero_grad()
        got = _full(model)
        max_diff = max(float((got[k] - v).abs().max()) for k, v in plain.state_dict().items())
        lazy = FabricStrategy(parallelize_fn=lambda m, mesh: m)  # forgets fully_shard
        error = error_of(lambda: lazy._shard(OddMLP(), fabric.strategy.device_mesh))
    return {"max_diff": max_diff, "error": error}


def test_fabric_parallelize_fn_trains_like_the_unsharded_model(dist_run: Any) -> None:
    results = dist_run(2, _fabric_parallelize_fn, timeout=300)
    for r in results:
        assert r["max_diff"] < 1e-6, r
        assert r["error"] == (
            "TypeError: FabricStrategy: parallelize_fn must call fully_shard on the module (or its submodules) "
            "and return the module, got OddMLP with no fully_shard state"
        ), r


def _fabric_bad_args() -> list[str]:
    out = []
    for make in (
        lambda: FabricStrategy(POLICY, parallelize_fn=lambda m, mesh: m),
        lambda: FabricStrategy(POLICY, process_group=None),
    ):
        try:
            make()
        except ValueError as e:
            out.append(str(e))
    return out


def test_strategy_arguments_are_checked() -> None:
    errors = _fabric_bad_args()
    assert len(errors) == 2, errors
    assert "either parallelize_fn" in errors[0] and "process_group=device_mesh" in errors[1], errors
    TrainerStrategy(POLICY, save_distributed_checkpoint=False)  # a single file: accepted, tested below


# --- Trainer ------------------------------------------------------------------------------------


class _Pairs(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x, self.y = mlp_batch(9, 16)

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class _LitMLP(L.LightningModule):  # type: ignore[misc,name-defined]
    def __init__(self, seed: int, reductions: Callable[[], int]) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = OddMLP()
        self._reductions = reductions
        self.per_backward: list[int] = []
        self._seen = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_after_backward(self) -> None:
        now = self._reductions()
        self.per_backward.append(now - self._seen)
        self._seen = now

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _trainer(root: str, epochs: int, distributed: bool = True) -> Any:
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=TrainerStrategy(POLICY, save_distributed_checkpoint=distributed),
        max_epochs=epochs,
        accumulate_grad_batches=2,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def _trainer_resume(root: str, distributed: bool = True) -> dict[str, Any]:
    loader = torch.utils.data.DataLoader(_Pairs(), batch_size=2)
    ckpt = os.path.join(root, "epoch1.ckpt")
    with _lightning_rank(), _counting_reductions() as count:
        whole = _LitMLP(0, lambda: count[0])
        _trainer(root, epochs=2).fit(whole, loader)
        expected = _full(whole)

        first = _LitMLP(0, lambda: count[0])
        trainer = _trainer(root, epochs=1, distributed=distributed)
        trainer.fit(first, loader)
        trainer.save_checkpoint(ckpt)

        resumed = _LitMLP(1, lambda: count[0])
        trainer = _trainer(root, epochs=2, distributed=distributed)
        trainer.fit(resumed, loader, ckpt_path=ckpt)
        got = _full(resumed)
    return {
        "single_file": os.path.isfile(ckpt),
        "weights_equal": all(torch.equal(got[k], v) for k, v in expected.items()),
        "global_step": trainer.global_step,
        "per_backward": whole.per_backward,
        "resumed_backwards": len(resumed.per_backward),
    }


@pytest.mark.parametrize("distributed", [True, False])
def test_trainer_checkpoint_resume_and_accumulation(dist_run: Any, distributed: bool) -> None:
    results = dist_run(2, _trainer_resume, tempfile.mkdtemp(), distributed, timeout=400)
    for r in results:
        assert r["single_file"] is not distributed, r
        assert r["weights_equal"], r
        assert r["global_step"] == 4 and r["resumed_backwards"] == 4, r  # 2 optimizer steps per epoch
        # accumulate_grad_batches=2: the first micro-batch of each step reduces nothing
        skipped, reduced = r["per_backward"][0::2], r["per_backward"][1::2]
        assert len(skipped) == 4 and set(skipped) == {0}, r
        assert min(reduced) > 0, r
