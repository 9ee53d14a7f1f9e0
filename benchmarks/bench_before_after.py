"""Paired step times of this tree's package against an earlier commit's, in the same ranks.

Usage (see benchmarks/README.md, "before and after"):
    python benchmarks/bench_before_after.py --before main --rounds 20 --out benchmarks/results/before_after.json

Exports ``fsdp_composable/`` of the ``--before`` commit with ``git archive`` into a temporary folder,
renames the package (every ``fsdp_composable`` in its sources becomes ``fsdp_before``) so both
import side by side, and runs `bench_paired.py` with ``ours`` (this tree), ``ours-before`` and the
``floor`` (plus any ``--impls`` given): the same interleaved rounds, so the machine's drift hits both
alike. Extra arguments go to `bench_paired.py` unchanged.
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile
from typing import Optional

_ROOT = pathlib.Path(__file__).resolve().parent.parent
NAME = "fsdp_before"


def export(ref: str, into: pathlib.Path) -> pathlib.Path:
    """``fsdp_composable/`` at ``ref``, renamed to `NAME`, under ``into``; returns the package folder."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", ref, "fsdp_composable"], cwd=_ROOT, check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    package = into / NAME
    (into / "fsdp_composable").rename(package)
    for path in package.rglob("*.py"):
        path.write_text(path.read_text().replace("fsdp_composable", NAME))
    return package


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the earlier commit (any git ref)")
    parser.add_argument("--impls", default="ours,ours-before,floor", help="passed to bench_paired.py")
    args, rest = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        export(args.before, pathlib.Path(tmp))
        env = dict(os.environ, BENCH_BEFORE_PACKAGE=NAME)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tmp, str(_ROOT), env.get("PYTHONPATH", "")) if p)
        command = [sys.executable, str(_ROOT / "benchmarks" / "bench_paired.py"), "--impls", args.impls, *rest]
        print(f"+ {' '.join(command)}   (ours-before: {args.before}, exported to {tmp})", flush=True)
        return subprocess.run(command, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
