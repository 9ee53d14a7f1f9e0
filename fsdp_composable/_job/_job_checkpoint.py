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

[Note: the digests of a saved checkpoint]
Loading a DCP checkpoint unpickles its ``.metadata``, so a file planted in (or swapped into) a
checkpoint directory would run code at the next ``--resume``. ``job.json`` therefore records the
sha256 of every file the save wrote (rank 0 hashes them once `dcp.save` returned: every rank's files
and the metadata are written by then), and `latest` refuses a directory whose files are not exactly
those, unchanged: a file missing, added or altered is named, before anything is unpickled (by the
launcher before any rank starts, and by every rank again before it loads). This guards the files the
job wrote against later changes; it is no defence against someone who can rewrite ``job.json`` too:
resume only from directories you trust (docs/training.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
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
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class SavedCheckpoint:
    path: str  # DIR/step_<N>
    step: int
    job: dict[str, Any]


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step}")


def job_record(args: argparse.Namespace, step: int, world_size: int, files: dict[str, str]) -> dict[str, Any]:
    """What ``job.json`` holds; ``files``: `file_digests` of the saved directory."""
    record = {name: getattr(args, name) for name in MODEL_SHAPE_OPTIONS}
    record.update(step=step, global_batch=args.global_batch, world_size=world_size, strategy=args.strategy)
    record["files"] = files
    return record


def file_digests(path: str) -> dict[str, str]:
    """The sha256 of every file in the checkpoint directory ``path`` but ``job.json``; see [Note: the
    digests of a saved checkpoint]. Raises ValueError naming anything that is not a regular file."""
    out = {}
    for name in sorted(os.listdir(path)):
        if name == JOB_FILE or name.startswith(JOB_FILE + ".tmp"):
            continue
        full = os.path.join(path, name)
        if os.path.islink(full) or not os.path.isfile(full):
            raise ValueError(f"{path} holds {name!r}, which is not a regular file (a save writes only files)")
        digest = hashlib.sha256()
        with open(full, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        out[name] = digest.hexdigest()
    return out


def _files_problem(path: str, recorded: dict[str, str]) -> str:
    """'' when ``path`` holds exactly the files ``recorded``, unchanged; else the first difference."""
    found = file_digests(path)
    for name in sorted(set(found) | set(recorded)):
        if name not in recorded:
            return f"{name!r} is not a file the job saved there"
        if name not in found:
            return f"{name!r}, which the job saved, is missing"
        if found[name] != recorded[name]:
            return f"{name!r} was changed after the save (its sha256 is not the one {JOB_FILE} recorded)"
    return ""


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
    try:
        problem = _files_problem(path, job["files"])
    except OSError as e:
        problem = f"its files cannot be read ({e})"
    if problem:
        raise ValueError(
            f"{path}: {problem}; refusing it, since loading a checkpoint unpickles its files: restore the "
            "directory as the job saved it, or start a fresh run"
        )
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
    files = job.get("files")
    if files is None:
        return "'files' is missing (the digests of the saved files, which every save of the job records)"
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and _SHA256.fullmatch(v) for k, v in files.items()
    ):
        return f"'files' must map each file's name to its sha256, got {_short(repr(files))}"
    return ""


def shape_mismatch(saved: SavedCheckpoint, args: argparse.Namespace) -> str:
    """'' when ``args`` build the model ``saved`` holds, else which options differ."""
    diffs = [
        f"--{name.replace('_', '-')} {saved.job.get(name)} there, {getattr(args, name)} here"
        for name in MODEL_SHAPE_OPTIONS
        if saved.job.get(name) != getattr(args, name)
    ]
    return "; ".join(diffs)
