"""The main job, `python -m fsdp_composable`, end to end as a user runs it (its argument checks:
test_main_job_arguments.py)."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from job_helpers import LAUNCHER_VARS
from job_helpers import assert_fits as _assert_fits

from fsdp_composable.__main__ import parse_args
from fsdp_composable._job import _job_processes
from fsdp_composable._job.demo import GPT, rank_slice, synthetic_batch, use_progress_bar

REPO = Path(__file__).resolve().parent.parent
STARTING_2 = "starting 2 ranks: each imports torch, then they join one process group"
STEP_LINE = re.compile(r"^step (\d+) loss (\S+) time (\d+\.\d\d)s$")
SMALL = ["--d-model", "32", "--layers", "2", "--seq", "16", "--global-batch", "8"]


def _job_env(env_extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(env_extra or {})
    return env


def _run_job(
    args: list[str], env_extra: dict[str, str] | None = None, timeout: float = 120.0, cwd: Path = REPO
) -> tuple[str, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_composable", *args],
        cwd=cwd,
        env=_job_env(env_extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    _assert_fits(proc.stdout + proc.stderr)
    return proc.stdout, proc.stderr


def _losses(stdout: str) -> list[float]:
    matches = [STEP_LINE.match(line) for line in stdout.splitlines()]
    steps = [(int(m.group(1)), float(m.group(2))) for m in matches if m]
    assert [s for s, _ in steps] == list(range(1, len(steps) + 1)), stdout
    return [loss for _, loss in steps]


def _readline(proc: subprocess.Popen[bytes]) -> str:
    """One line of an unbuffered (``bufsize=0``) stdout: a byte at a time, so that nothing is read
    ahead into a buffer that a later ``communicate()``, which reads the pipe itself, would not see."""
    assert proc.stdout is not None
    return proc.stdout.readline().decode()


def _fake_package(root: Path, name: str) -> None:
    """A package ``name`` whose import fails, as if it were not installed."""
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(f"raise ModuleNotFoundError('{name} is not installed (test stub)')\n")


def test_default_job_two_ranks_without_numpy_prints_first_line_fast(tmp_path: Path) -> None:
    """The README's first command in an environment without numpy (torch does not depend on it; the
    test extras bring it in): trains, reports each rank's peak memory and a summary. The first line
    comes before torch is imported; with stdout not a terminal, no progress bar is drawn."""
    _fake_package(tmp_path, "numpy")
    env = _job_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO)])
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsdp_composable", "--steps", "4"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,  # see _readline
    )
    first = _readline(proc)
    first_line_s = time.monotonic() - start
    rest, err = (b.decode() for b in proc.communicate(timeout=120))
    out = first + rest
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{err[-4000:]}"
    assert first.startswith("fsdp_composable demo: GPT with 4 blocks"), first
    assert first_line_s < 2.0, f"first line after {first_line_s:.2f}s"
    _assert_fits(out + err)
    losses = _losses(out)
    assert len(losses) == 4, out
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], f"the synthetic task is learnable, loss should drop: {losses}"
    # the silent start says what it is doing: a line per rank, then the group
    head = out.split("ShardingPlan:")[0].splitlines()
    assert head[1:3] == ["FULL_SHARD on 2 CPU ranks (gloo, starting them)", STARTING_2], head
    for rank in (0, 1):
        assert any(re.match(rf"rank {rank} \(pid \d+\) imported torch after \d+\.\ds; joining$", x) for x in head), head
    assert re.match(r"process group up: 2 ranks after \d+\.\ds; building and sharding the model$", head[-1]), head
    assert re.search(r"^rank 0 peak RSS \d+\.\d MiB$", out, re.M), out
    assert re.search(r"^rank 1 peak RSS \d+\.\d MiB$", out, re.M), out
    summary, times = out.strip().splitlines()[-2:]
    pattern = r"summary: 4 steps, \d+\.\d\d steps/s, [\d,]+ tokens/s, final loss \d\.\d{4}$"
    assert re.match(pattern, summary), summary
    assert re.match(r"time: \d+\.\ds in all: \d+\.\ds starting up, \d+\.\d\ds training$", times), times
    assert "train [" not in err and "\r" not in out + err, "no progress bar frames off a terminal"


def test_help_and_bad_options_do_not_import_torch(tmp_path: Path) -> None:
    """--help and a bad option answer without importing torch (a stub torch that fails to import is
    first on the path), and the first line of a run is printed before torch is imported."""
    _fake_package(tmp_path, "torch")
    env = _job_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO)])

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "fsdp_composable", *argv]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)

    start = time.monotonic()
    helped = run("--help")
    assert time.monotonic() - start < 2.0
    assert helped.returncode == 0 and "--global-batch" in helped.stdout, helped.stderr
    bad = run("--lr", "nan")
    assert bad.returncode == 2 and bad.stdout == ""
    expected = "python -m fsdp_composable: error: --lr must be a finite number above 0 and at most 10, got nan"
    expected += " (see --help)\n"
    assert bad.stderr == expected
    started = run("--steps", "1")
    assert started.stdout.startswith("fsdp_composable demo: GPT with 4 blocks"), started.stdout
    assert STARTING_2 in started.stdout  # the main process starts the ranks without torch ...
    assert "torch is not installed (test stub)" in started.stderr  # ... which the ranks then import
    assert started.returncode == 1, started.stderr
    # a forked rank imports torch in its own code, so its traceback comes back (spawn: its output)
    ended = r"^rank \d (failed:$|exited with status 1 \(its output above says why\)$)"
    assert re.search(ended, started.stderr, re.M), started.stderr


def test_progress_bar_only_on_a_terminal() -> None:
    class Stream:
        def __init__(self, tty: bool) -> None:
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    assert use_progress_bar(Stream(True), Stream(True))
    assert not use_progress_bar(Stream(False), Stream(True))  # python -m fsdp_composable > log
    assert not use_progress_bar(Stream(True), Stream(False))  # 2> log


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
    # world size 1 shards nothing: the first lines and describe()'s table agree on what ran
    assert "SHARD_GRAD_OP on 1 CPU rank (gloo, under torchrun)\nwith 1 rank there is nothing to shard" in out, out
    units = [line for line in out.splitlines() if line.startswith(("<root>", "blocks."))]
    assert len(units) == 3 and all(" NO_SHARD " in line and "bfloat16" in line for line in units), out


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


def _step_losses(stdout: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in map(STEP_LINE.match, stdout.splitlines()) if m}


def test_sharded_checkpoint_resume_matches_training_on(tmp_path: Path) -> None:
    """Train 5 steps with 2 ranks, saving at steps 3 and 5; resume from step 3 to step 5 with 2 ranks
    (and to step 4 with 4 ranks, the same global batch): steps 4 and 5 match the run that never
    stopped. Each save has its own directory and `latest` names the newest complete one. The job also
    prints describe()'s table and can checkpoint activations; its time line counts the saves apart
    from training."""
    ckpt = tmp_path / "ckpt"
    args = ["--steps", "5", "--checkpoint-dir", "ckpt", "--checkpoint-every", "3", "--activation-checkpointing"]
    straight, _ = _run_job([*args, *SMALL], cwd=tmp_path)
    assert "ShardingPlan: 3 units, world size 2, rank 0" in straight, straight
    assert re.search(r"^saved checkpoint at step 3 to ckpt/step_3 in \d+\.\d\ds$", straight, re.M), straight
    assert re.search(r"^saved checkpoint at step 5 to ckpt/step_5 in \d+\.\d\ds$", straight, re.M), straight
    pattern = r"^time: (\d+\.\d)s in all: (\d+\.\d)s starting up, (\d+\.\d\d)s training, (\d+\.\d\d)s for 2 checkpoint"
    times = re.search(pattern + " saves$", straight, re.M)
    assert times, straight
    total, *parts = map(float, times.groups())
    assert sum(parts) <= total + 0.2, times.group(0)  # disjoint spans of one run (printed rounded)
    assert (ckpt / "latest").read_text() == "step_5\n"
    # job.json holds the sha256 of every file the 2 ranks saved; a swapped .metadata is refused
    saved = json.loads((ckpt / "step_3" / "job.json").read_text())["files"]
    assert sorted(saved) == sorted(p.name for p in (ckpt / "step_3").iterdir() if p.name != "job.json"), saved
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(saved), saved
    shutil.copytree(ckpt, tmp_path / "planted")
    (tmp_path / "planted" / "step_5" / ".metadata").write_bytes(b"cos\nsystem\n(S'true'\ntR.")
    with pytest.raises(SystemExit):
        parse_args(["--steps", "6", "--checkpoint-dir", str(tmp_path / "planted"), "--resume", *SMALL])
    # two copies stopped after step 3: `latest` names step_3, as when the run had stopped there
    for name in ("stopped", "stopped4"):
        shutil.copytree(ckpt, tmp_path / name, ignore=shutil.ignore_patterns("step_5"))
        (tmp_path / name / "latest").write_text("step_3\n")
    # the two resumes side by side: each spends most of its start importing torch on one core
    jobs = ThreadPoolExecutor(max_workers=2)
    args = ["--steps", "4", "--checkpoint-dir", "stopped4", "--resume", "--world-size", "4", *SMALL]
    four_job = jobs.submit(_run_job, args, cwd=tmp_path)
    resumed, _ = _run_job(["--steps", "5", "--checkpoint-dir", "stopped", "--resume", *SMALL], cwd=tmp_path)
    stopped = tmp_path / "stopped"
    assert "resumed from stopped/step_3 at step 3 (saved by 2 ranks, now 2)" in resumed, resumed
    assert (stopped / "latest").read_text() == "step_5\n"
    assert sorted(p.name for p in stopped.iterdir()) == ["latest", "step_3", "step_5"]
    assert json.loads((stopped / "step_5" / "job.json").read_text())["step"] == 5
    expected, got = _step_losses(straight), _step_losses(resumed)
    assert sorted(got) == [4, 5], resumed
    for step in (4, 5):
        assert abs(got[step] - expected[step]) < 1e-4, (step, got[step], expected[step])
    four, _ = four_job.result()
    jobs.shutdown()
    assert "(saved by 2 ranks, now 4)" in four
    assert abs(_step_losses(four)[4] - expected[4]) < 1e-4, four


def _session_alive(session: int) -> list[int]:
    """The processes of ``session`` (Linux: /proc) that are still running (zombies do not count)."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path("/proc", entry, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] != "Z":
            alive.append(int(entry))
    return alive


STOP_CASES = {  # signal, sent to the main process or its whole process group, the job's options
    "SIGTERM-main-hybrid": ("SIGTERM", "main", ["--strategy", "HYBRID_SHARD"]),
    "SIGINT-group-starting": ("SIGINT", "group", []),
    "SIGINT-group-world-size-1": ("SIGINT", "group", ["--world-size", "1"]),
    "SIGKILL-main": ("SIGKILL", "main", []),
}


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks through /proc")
@pytest.mark.parametrize("case", list(STOP_CASES))
def test_a_signal_to_the_main_process_stops_every_rank(case: str) -> None:
    """SIGTERM to the main process while the ranks train, Ctrl-C (SIGINT to the whole process group)
    while the ranks are being started or import torch, and Ctrl-C while one rank trains in this
    process: one line on stderr, no traceback, exit status 128 + the signal. After any of these,
    and after SIGKILL to the main process (which nothing can catch), every process the job started
    is gone within seconds: no rank trains on as an orphan. The SIGTERM run is HYBRID_SHARD at 2
    ranks, whose first lines say it runs as NO_SHARD."""
    signame, target, options = STOP_CASES[case]
    sig = signal.Signals[signame]
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsdp_composable", "--steps", "100000", *SMALL, *options],
        cwd=REPO, env=_job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0, start_new_session=True,
    )
    watchdog = threading.Timer(300.0, os.killpg, (proc.pid, signal.SIGKILL))  # a hung job fails, not hangs
    watchdog.start()
    try:
        seen = []
        wait_for = "fsdp_composable demo:" if case == "SIGINT-group-starting" else "step 1 "
        while not (seen and seen[-1].startswith(wait_for)):
            line = _readline(proc)
            assert line, f"the job ended early:\n{''.join(seen)}"
            seen.append(line)
        if case == "SIGTERM-main-hybrid":
            assert "a shard group of 1 rank shards nothing: this runs as NO_SHARD over 2 ranks" in "".join(seen)
            assert " NO_SHARD " in next(line for line in seen if line.startswith("blocks.0"))
        if case == "SIGINT-group-starting":
            time.sleep(1.5)  # the ranks are being started or are importing torch
        if target == "main":
            os.kill(proc.pid, sig)
        else:
            os.killpg(proc.pid, sig)  # what Ctrl-C at a terminal does
        out, err = (b.decode() for b in proc.communicate(timeout=60))
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while _session_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    orphans = _session_alive(proc.pid)
    for pid in orphans:
        os.kill(pid, signal.SIGKILL)
    assert not orphans, f"still running after the main process ended: {orphans}"
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        return
    assert proc.returncode == 128 + sig, (proc.returncode, err)
    what = "rank 0 stopped" if "--world-size" in options else "(stopped all 2 ranks|no rank had started)"
    assert re.fullmatch(rf"python -m fsdp_composable: interrupted by {signame}; {what}\n", err), err
    assert "Traceback" not in out + err


def _rank_entry_for_test(rank: int, seconds: float) -> None:
    """Rank 0 fails at once; the others would sleep for ``seconds``."""
    if rank == 0:
        raise ValueError("rank 0 fails on purpose")
    time.sleep(seconds)


def test_a_failing_rank_stops_the_others() -> None:
    """The first rank that fails ends the run: the others are stopped (not waited for) and its
    traceback comes back to the main process."""
    before = set(multiprocessing.active_children())  # e.g. the suite's pools of gloo ranks
    with pytest.raises(_job_processes.RankFailed) as info:
        _job_processes.run_ranks(f"{__name__}:_rank_entry_for_test", 2, (600.0,))
    assert info.value.rank == 0
    assert info.value.details.startswith("failed:\nTraceback"), info.value.details
    assert "ValueError: rank 0 fails on purpose" in info.value.details
    assert set(multiprocessing.active_children()) <= before  # the ranks it started are all gone


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_on_a_terminal_a_progress_bar_and_no_leaked_semaphore() -> None:
    """Run with stdout and stderr on a terminal (a pseudo-terminal): rank 0 draws its bar, every line
    fits 100 columns, and nothing is printed after the job ends (multiprocessing's resource tracker
    used to warn about a leaked semaphore, tqdm's lock, once the prompt was back)."""
    import pty

    main, child = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsdp_composable", "--steps", "3", *SMALL],
        cwd=REPO, env=_job_env({"COLUMNS": "100"}), stdin=subprocess.DEVNULL, stdout=child, stderr=child,
    )
    os.close(child)
    chunks = []
    while True:  # until every holder of the terminal (the resource tracker too) has closed it
        try:
            chunk = os.read(main, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    assert proc.wait(timeout=120) == 0
    text = b"".join(chunks).decode()
    assert "leaked" not in text and "Warning" not in text, text
    assert "train [" in text and "2/3 steps" in text, text
    assert text.rstrip().splitlines()[-1].startswith("time: "), text
    _assert_fits(re.sub(r"\r(\x1b\[K)?", "\n", text))


def test_ci_runs_the_readme_first_command_in_a_bare_virtualenv() -> None:
    """.ci/run reads the README's first quickstart command (so the two cannot drift) and runs it in a
    fresh virtualenv holding only torch; the run itself is CI's (minutes: it installs torch)."""
    printed = subprocess.run(
        [sys.executable, str(REPO / ".ci" / "readme_first_command.py")], capture_output=True, text=True, check=True
    ).stdout.strip()
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert printed == "pip install -e . && python -m fsdp_composable"
    assert f"```bash\n{printed}\n" in readme.split("## Quickstart", 1)[1]
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    steps = ["python .ci/readme_first_command.py", 'python -m venv "$venv"', '"$venv/bin/pip" install torch==2.13.0']
    for needed in steps:
        assert needed in ci, needed
    assert 'bash -euo pipefail -c "$first_command"' in ci


def test_docs_give_a_quick_test_subset_and_say_checkpoints_must_be_trusted() -> None:
    """getting-started.md's quick test commands name test files that exist and markers that are
    registered (a renamed file would otherwise leave new users a command that collects nothing);
    training.md warns that loading a checkpoint unpickles its metadata."""
    text = (REPO / "docs" / "getting-started.md").read_text(encoding="utf-8")
    section = text.split("## Running the tests", 1)[1].split("\n## ", 1)[0]
    # the whole suite's time, as the README gives it
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    suite_time = "8 to 9 minutes on 2 CPU cores of a fast VM, 15 to 17 on a slower one"
    assert suite_time in " ".join(section.split()) and suite_time in " ".join(readme.split()), section
    commands = [shlex.split(line.split("#")[0]) for line in section.splitlines() if line.startswith("python -m pytest")]
    assert len(commands) >= 1, section
    markers = (REPO / "pyproject.toml").read_text(encoding="utf-8").split("markers = [", 1)[1].split("]")[0]
    for words in commands:
        files = [w for w in words if w.startswith("tests/")]
        assert files and all((REPO / f).is_file() for f in files), words
        for expression in (w for i, w in enumerate(words) if i > 3 and words[i - 1] == "-m"):  # after python -m pytest
            marker = expression.removeprefix("not ")
            assert f'"{marker}:' in markers, (marker, markers)
    training = (REPO / "docs" / "training.md").read_text(encoding="utf-8")
    assert "## Checkpoints come from trusted directories only" in training
    assert "pickle" in training.split("## Checkpoints come from trusted", 1)[1].split("\n## ", 1)[0]
