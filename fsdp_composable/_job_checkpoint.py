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
METADATA_FILE = ".metadata"  # torch.distributed.checkpoint writes it last, once every shard is written
MAX_POINTER_CHARS = 4096
MAX_JOB_CHARS = 1 << 20
MAX_INT = 10**9  # larger than any step or size the job accepts
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
    ``latest`` names something that is not a complete checkpoint directly inside ``root``."""
    pointer = os.path.join(root, LATEST)
    if not os.path.lexists(pointer):
        return None
    if os.path.islink(pointer) or not os.path.isfile(pointer):
        raise ValueError(f"{pointer} is not a regular file (the job writes it as one)")
    try:
        with open(pointer, encoding="utf-8") as f:
            name = f.read(MAX_POINTER_CHARS).strip()
    except (OSError, ValueError) as e:
        raise ValueError(f"{pointer} cannot be read ({e})") from None
    path = _inside(root, name, pointer)
    job_file = os.path.join(path, JOB_FILE)
    try:
        with open(job_file, encoding="utf-8") as f:
            job = json.loads(f.read(MAX_JOB_CHARS), parse_constant=_refuse_constant)
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"{pointer} names {name!r}, but {job_file} cannot be read ({e})") from None
    problem = _job_problem(job)
    if problem:
        raise ValueError(f"{job_file} is not the job's record: {problem}")
    if not os.path.isfile(os.path.join(path, METADATA_FILE)):
        raise ValueError(f"{path} has no {METADATA_FILE}: its save did not complete")
    return SavedCheckpoint(path, job["step"], job)


def _inside(root: str, name: str, pointer: str) -> str:
    """``root/name`` when ``name`` is one directory name that resolves (symbolic links followed)
    directly inside ``root``; a pointer must never lead a resume, or a save beside it, elsewhere."""
    separators = {os.sep, os.altsep or os.sep, "\0"}
    if not name or name in (os.curdir, os.pardir) or any(c in name for c in separators):
        raise ValueError(f"{pointer} names {name!r}, which is not the name of a directory in {root}")
    path = os.path.join(root, name)
    resolved = os.path.realpath(path)
    if os.path.dirname(resolved) != os.path.realpath(root):
        raise ValueError(f"{pointer} names {name!r}, which resolves to {resolved}, outside {root}")
    return path


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a step or a size can be")


def _job_problem(job: Any) -> str:
    """'' when ``job`` has what `job_record` writes and `python -m fsdp_composable` reads, else why not."""
    if not isinstance(job, dict):
        return f"a JSON object was expected, got {type(job).__name__}"
    required = ("step", *MODEL_SHAPE_OPTIONS)
    for key in (*required, "global_batch", "world_size"):
        value = job.get(key)
        if value is None and key not in required:
            continue  # written by every save, read only for messages
        if key not in job:
            return f"{key!r} is missing"
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_INT:
            return f"{key!r} must be an integer from 1 to {MAX_INT}, got {_short(repr(value))}"
    return ""


def shape_mismatch(saved: SavedCheckpoint, args: argparse.Namespace) -> str:
    """'' when ``args`` build the model ``saved`` holds, else which options differ."""
    diffs = [
        f"--{name.replace('_', '-')} {saved.job.get(name)} there, {getattr(args, name)} here"
        for name in MODEL_SHAPE_OPTIONS
        if saved.job.get(name) != getattr(args, name)
    ]
    return "; ".join(diffs)
