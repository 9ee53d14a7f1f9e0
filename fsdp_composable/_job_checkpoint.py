"""Where the main job (`python -m fsdp_composable`) keeps its checkpoints, read without torch.

[Note: the main job's checkpoint directory]
``--checkpoint-dir DIR`` holds one directory per save, ``DIR/step_<N>`` (a
`torch.distributed.checkpoint` checkpoint plus ``job.json``: the step, the model's shape options
and the global batch), and a text file ``DIR/latest`` naming the newest one. A save writes its own
new directory and only then, on rank 0 once every rank's files and the metadata are written,
replaces ``latest`` (write a temporary file, then an atomic rename). So a save that dies midway
leaves ``latest`` on the previous, complete checkpoint: no save ever writes over the only good one.
``job.json`` lets `python -m fsdp_composable --resume` refuse a checkpoint of another model, or a
``--steps`` it has already reached, before it starts any rank.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

__all__: list[str] = []

LATEST = "latest"
JOB_FILE = "job.json"
# the options that fix the model's parameter shapes: a checkpoint only loads into the same ones
MODEL_SHAPE_OPTIONS = ("vocab", "d_model", "layers", "heads", "seq")


@dataclass(frozen=True)
class SavedCheckpoint:
    path: str  # DIR/step_<N>
    step: int
    job: dict[str, Any]


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step}")


def job_record(args: argparse.Namespace, step: int, world_size: int) -> dict[str, Any]:
    record = {name: getattr(args, name) for name in MODEL_SHAPE_OPTIONS}
    record.update(step=step, global_batch=args.global_batch, world_size=world_size, strategy=args.strategy)
    return record


def write_job(path: str, record: dict[str, Any]) -> None:
    _write_atomically(os.path.join(path, JOB_FILE), json.dumps(record, indent=1, sort_keys=True) + "\n")


def point_latest(root: str, path: str) -> None:
    """Make ``root/latest`` name ``path`` (a directory directly under ``root``); atomic."""
    _write_atomically(os.path.join(root, LATEST), os.path.basename(path) + "\n")


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def latest(root: str) -> Optional[SavedCheckpoint]:
    """The checkpoint ``root/latest`` names, or None when there is none; raises ValueError when
    ``latest`` names something that is not a complete checkpoint."""
    pointer = os.path.join(root, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer, encoding="utf-8") as f:
        name = f.read().strip()
    path = os.path.join(root, name)
    job_file = os.path.join(path, JOB_FILE)
    try:
        with open(job_file, encoding="utf-8") as f:
            job = json.load(f)
        step = int(job["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{pointer} names {name!r}, but {job_file} cannot be read ({e})") from None
    return SavedCheckpoint(path, step, job)


def shape_mismatch(saved: SavedCheckpoint, args: argparse.Namespace) -> str:
    """'' when ``args`` build the model ``saved`` holds, else which options differ."""
    diffs = [
        f"--{name.replace('_', '-')} {saved.job.get(name)} there, {getattr(args, name)} here"
        for name in MODEL_SHAPE_OPTIONS
        if saved.job.get(name) != getattr(args, name)
    ]
    return "; ".join(diffs)
