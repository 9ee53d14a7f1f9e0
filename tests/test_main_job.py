"""The main job, `python -m fsdp_composable`, end to end as a user runs it, plus its argument checks."""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from expecttest import TestCase

from fsdp_composable.__main__ import parse_args
from fsdp_composable.demo import GPT, rank_slice, synthetic_batch

REPO = Path(__file__).resolve().parent.parent
STEP_LINE = re.compile(r"^step (\d+) loss (\S+) time (\d+\.\d\d)s$")
SMALL = ["--d-model", "32", "--layers", "2", "--seq", "16", "--batch", "4"]


def _run_job(args: list[str], env_extra: dict[str, str] | None = None, timeout: float = 120.0) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(env_extra or {})
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_composable", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc.stdout, proc.stderr


def _losses(stdout: str) -> list[float]:
    matches = [STEP_LINE.match(line) for line in stdout.splitlines()]
    steps = [(int(m.group(1)), float(m.group(2))) for m in matches if m]
    assert [s for s, _ in steps] == list(range(1, len(steps) + 1)), stdout
    return [loss for _, loss in steps]


def test_default_job_two_ranks() -> None:
    out, err = _run_job(["--steps", "4"])
    losses = _losses(out)
    assert len(losses) == 4, out
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], f"the synthetic task is learnable, loss should drop: {losses}"
    assert re.search(r"^rank 0 peak RSS \d+\.\d MiB$", out, re.M), out
    assert re.search(r"^rank 1 peak RSS \d+\.\d MiB$", out, re.M), out
    assert "train:" in err, "rank 0 draws a tqdm progress bar on stderr"


def test_torchrun_environment_runs_in_place_with_bf16_and_shard_grad_op(tmp_path: Path) -> None:
    # RANK/WORLD_SIZE set: this process is the only rank and joins via env:// (as under torchrun).
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    plot = tmp_path / "loss.png"
    args = ["--steps", "3", "--strategy", "SHARD_GRAD_OP", "--mixed-precision", "bf16", "--plot", str(plot), *SMALL]
    out, _ = _run_job(args, env)
    losses = _losses(out)
    assert len(losses) == 3 and math.isfinite(losses[-1]), out
    assert "rank 1" not in out
    assert plot.stat().st_size > 0


def test_synthetic_data_is_deterministic_and_split_by_rank() -> None:
    inputs, targets = synthetic_batch(step=3, global_batch=4, seq=6, vocab=11, seed=5)
    again, _ = synthetic_batch(step=3, global_batch=4, seq=6, vocab=11, seed=5)
    other, _ = synthetic_batch(step=4, global_batch=4, seq=6, vocab=11, seed=5)
    assert torch.equal(inputs, again) and not torch.equal(inputs, other)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    # every token has exactly one successor: the task is learnable
    pairs = {(a, b) for a, b in zip(inputs.flatten().tolist(), targets.flatten().tolist())}
    assert len({a for a, _ in pairs}) == len(pairs)
    assert torch.equal(torch.cat([rank_slice(inputs, r, 2) for r in range(2)]), inputs)


def test_model_shapes() -> None:
    model = GPT(vocab=11, d_model=8, n_layers=2, seq=6, n_heads=2)
    assert model(torch.zeros(3, 6, dtype=torch.long)).shape == (3, 6, 11)


class TestArguments(TestCase):
    def test_bad_values_exit_2_naming_the_option(self) -> None:
        messages = []
        bad = (
            ["--world-size", "0"],
            ["--d-model", "30", "--heads", "4"],
            ["--steps", "0"],
            ["--resume"],
            ["--checkpoint-dir", "ckpt", "--checkpoint-every", "-1"],
            ["--checkpoint-dir", "/nonexistent/ckpt", "--resume"],
        )
        for argv in bad:
            err = io.StringIO()
            with self.assertRaises(SystemExit) as cm, contextlib.redirect_stderr(err):
                parse_args(argv)
            self.assertEqual(cm.exception.code, 2)
            messages.append(err.getvalue().strip().splitlines()[-1])
        self.assertExpectedInline(
            "\n".join(messages),
            """\
python -m fsdp_composable: error: --world-size must be at least 1, got 0
python -m fsdp_composable: error: --heads 4 must divide --d-model 30
python -m fsdp_composable: error: --steps must be at least 1, got 0
python -m fsdp_composable: error: --resume and --checkpoint-every need --checkpoint-dir DIR
python -m fsdp_composable: error: --checkpoint-every must be at least 0, got -1
python -m fsdp_composable: error: --resume: no checkpoint directory '/nonexistent/ckpt'; save one first with --checkpoint-dir""",  # noqa: E501
        )

    def test_defaults(self) -> None:
        args = parse_args([])
        self.assertEqual(
            (args.world_size, args.steps, args.strategy, args.mixed_precision, args.device),
            (2, 20, "FULL_SHARD", "none", "cpu"),
        )


def _step_losses(stdout: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in map(STEP_LINE.match, stdout.splitlines()) if m}


def test_sharded_checkpoint_resume_matches_training_on(tmp_path: Path) -> None:
    """Save at step 3 with 2 ranks, resume to step 5 with 2 ranks (and with 4): steps 4 and 5 match a run
    that never stopped. The job also prints describe()'s table and can checkpoint activations."""
    straight, _ = _run_job(["--steps", "5", *SMALL])
    assert "ShardingPlan: 3 units, world size 2" in straight, straight
    ckpt = str(tmp_path / "ckpt")
    first, _ = _run_job(["--steps", "3", "--checkpoint-dir", ckpt, "--activation-checkpointing", *SMALL])
    assert f"saved checkpoint at step 3 to {ckpt}" in first
    shutil.copytree(ckpt, str(tmp_path / "ckpt4"))  # the resumed run below saves step 5 over `ckpt`
    resumed, _ = _run_job(["--steps", "5", "--checkpoint-dir", ckpt, "--resume", *SMALL])
    assert f"resumed from {ckpt} at step 3" in resumed
    expected, got = _step_losses(straight), _step_losses(resumed)
    assert sorted(got) == [4, 5], resumed
    for step in (4, 5):
        assert abs(got[step] - expected[step]) < 1e-4, (step, got[step], expected[step])
    ckpt4 = str(tmp_path / "ckpt4")
    # 4 ranks with half the batch each: the same global batch, so the same loss
    args = ["--steps", "4", "--checkpoint-dir", ckpt4, "--resume", "--world-size", "4", *SMALL, "--batch", "2"]
    four, _ = _run_job(args)
    assert abs(_step_losses(four)[4] - expected[4]) < 1e-4, four
