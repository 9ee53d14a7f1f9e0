"""Two `torchrun` launchers on this machine act as two nodes of two ranks each (c10d rendezvous on
127.0.0.1), train the main job with HYBRID_SHARD on the 2 x 2 layout (shard within a node, replicate
across the nodes), and match one process training the same global batch.

This is the command docs/getting-started.md gives for two machines, with 127.0.0.1 as the first
node's address. It starts 7 processes, so it is kept to 3 steps of a 2-block model (about 30 s on
2 busy cores); deselect it locally with ``-m "not multinode"``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import free_port

REPO = Path(__file__).resolve().parent.parent
STEP_LINE = re.compile(r"^step (\d+) loss (\S+) time (\d+\.\d\d)s$", re.M)
JOB = ["--steps", "3", "--d-model", "32", "--layers", "2", "--seq", "16", "--global-batch", "8", "--threads", "1"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


def _losses(stdout: str) -> list[float]:
    return [float(loss) for _, loss, _ in STEP_LINE.findall(stdout)]


@pytest.mark.multinode
def test_two_torchrun_nodes_hybrid_shard_match_one_process(tmp_path: Path) -> None:
    port = free_port()
    launchers = []
    for node_rank in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes=2", "--nproc-per-node=2", f"--node-rank={node_rank}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=test-multinode",
            "-m", "fsdp_composable", "--strategy", "HYBRID_SHARD", "--checkpoint-dir", str(tmp_path / "ckpt"), *JOB,
        ]  # fmt: skip
        launchers.append(
            subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    reference = subprocess.run(
        [sys.executable, "-m", "fsdp_composable", "--world-size", "1", *JOB],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    outputs = []
    try:
        for proc in launchers:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, f"torchrun exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{err[-4000:]}"
            outputs.append(out)
    finally:
        for proc in launchers:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert reference.returncode == 0, reference.stderr[-4000:]
    out = "".join(outputs)  # rank 0 prints; it runs on whichever node the rendezvous made first
    assert "HYBRID_SHARD (2 replicas x shard group 2) on 4 CPU ranks (gloo, under torchrun)" in out, out
    assert "ShardingPlan: 3 units, HYBRID_SHARD: shard group size 2, replicate group size 2, rank 0" in out, out
    assert re.search(r"^rank 3 peak RSS", out, re.M), out
    got, expected = _losses(out), _losses(reference.stdout)
    assert len(got) == len(expected) == 3, (out, reference.stdout)
    for a, b in zip(got, expected):
        assert abs(a - b) < 1e-4, (got, expected)
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_3\n"  # one checkpoint, written by both nodes
    assert len(list((tmp_path / "ckpt" / "step_3").glob("*.distcp"))) == 4
