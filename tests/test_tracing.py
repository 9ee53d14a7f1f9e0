"""Profiler labels and the debug log (fsdp_composable._comm._trace): every all-gather, reduce-scatter, wait
and hook of every unit shows up in a torch.profiler trace named by its unit; FSDP_COMPOSABLE_DEBUG
logs each unit's unshard, reshard and reduction with sizes; and with both off nothing is entered."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from models import Block, TinyGPT, gpt_batch, gpt_loss

from fsdp_composable import ModuleWrapPolicy, fully_shard
from fsdp_composable._comm import _trace

REPO = Path(__file__).resolve().parent.parent
UNITS = ["<root>", "blocks.0", "blocks.1"]


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return fully_shard(TinyGPT(), ModuleWrapPolicy({Block}))


def _step(model: torch.nn.Module) -> None:
    gpt_loss(model, gpt_batch(0, 2)).backward()


def profiled_step() -> list[str]:
    model = _model()
    _step(model)  # lazy init and the first iteration's order check happen outside the trace
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(model)
    return sorted({e.name for e in prof.events() if e.name.startswith("fsdp::")})


def test_profiler_labels_every_collective_wait_and_hook_by_unit(dist_run) -> None:
    names = set(dist_run(2, profiled_step)[0])
    for unit in UNITS:
        for what in ("pre_forward", "pre_backward", "post_backward", "unshard", "wait_unshard", "reduce"):
            assert f"fsdp::{what} {unit}" in names, (what, unit, sorted(names))
        for what in ("all_gather", "reduce_scatter", "wait", "finish_reduce", "reshard"):
            assert f"fsdp::{what} {unit}" in names, (what, unit, sorted(names))
    for unit in UNITS[1:]:  # the root unit's post-forward is the root's own hook
        assert f"fsdp::post_forward {unit}" in names, (unit, sorted(names))
    assert not [n for n in names if n.endswith(" ?")], "a collective outside any unit's span"


def logged_step() -> list[str]:
    model = _model()
    _step(model)
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Collect()
    _trace.logger.addHandler(handler)
    _trace.logger.setLevel(logging.DEBUG)
    try:
        _step(model)
    finally:
        _trace.logger.removeHandler(handler)
        _trace.logger.setLevel(logging.NOTSET)
    return records


def test_debug_log_names_unit_operation_and_bytes(dist_run) -> None:
    lines = dist_run(2, logged_step)[1]
    block = [line for line in lines if line.endswith(("blocks.0", ")")) and " blocks.0" in line]
    expected_start = [
        # prefetched in the root's pre-forward (forward prefetch, on by default with gloo)
        "rank 1 start fsdp::unshard blocks.0 (3,216 x float32, 12,864 B)",
        "rank 1 start fsdp::all_gather blocks.0 (3,216 x float32, 12,864 B)",
        "rank 1 done fsdp::all_gather blocks.0 (3,216 x float32, 12,864 B)",
        "rank 1 done fsdp::unshard blocks.0 (3,216 x float32, 12,864 B)",
        "rank 1 start fsdp::pre_forward blocks.0",
        "rank 1 start fsdp::unshard blocks.0 (3,216 x float32, 12,864 B)",  # under way: nothing issued
        "rank 1 done fsdp::unshard blocks.0 (3,216 x float32, 12,864 B)",
        "rank 1 start fsdp::wait_unshard blocks.0",
        "rank 1 start fsdp::wait blocks.0",
        "rank 1 done fsdp::wait blocks.0",
        "rank 1 done fsdp::wait_unshard blocks.0",
    ]
    assert block[: len(expected_start)] == expected_start, block
    assert "rank 1 start fsdp::reshard blocks.0 (3,216 x float32, 12,864 B)" in block, block
    # the shard's gradient and one flag per parameter ([Note: which parameters got a gradient])
    assert "rank 1 start fsdp::reduce_scatter blocks.0 (1,618 x float32, 6,472 B)" in block, block
    assert "rank 1 done fsdp::finish_reduce blocks.0 (1,618 x float32, 6,472 B)" in block, block


def quiet_step_enters_nothing() -> bool:
    model = _model()

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("a profiler range was entered with tracing off")

    with mock.patch.object(_trace._autograd_profiler, "record_function", fail):
        with mock.patch.object(_trace._Span, "__init__", fail):
            _step(model)
            _step(model)
    return _trace.span("all_gather", "x") is _trace.span("wait", None)  # one shared no-op context


def test_off_by_default_enters_nothing(dist_run) -> None:
    assert dist_run(2, quiet_step_enters_nothing) == [True, True]


SCRIPT = """
import os, tempfile, torch, torch.distributed as dist
from torch import nn
from fsdp_composable import ModuleWrapPolicy, fully_shard
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
model = fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), ModuleWrapPolicy({nn.Linear}))
model(torch.randn(2, 4)).sum().backward()
del model
import gc; gc.collect()
dist.destroy_process_group()
import sys; sys.stderr.flush(); os._exit(0)  # the log is out: skip torch's teardown
"""


def test_environment_switch_logs_to_stderr() -> None:
    """Read when the package is imported: a fresh interpreter with the switch on logs each collective."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env={**env, _trace.ENV_SWITCH: "1"}, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Linear(4, 4)'s 16 + 4: alone, the flags stay this rank's own ([Note: which parameters got a gradient])
    assert "fsdp_composable: rank 0 done fsdp::finish_reduce 0 (20 x float32, 80 B)" in proc.stderr, proc.stderr


@pytest.mark.parametrize("value", ["", "0", "off", "false"])
def test_environment_switch_off_leaves_the_logger_alone(value: str) -> None:
    """Off (or unset): the import configures nothing, so the application's logging setup decides."""
    logger = logging.getLogger("fsdp_composable")
    before = (logger.level, list(logger.handlers))
    with mock.patch.dict(os.environ, {_trace.ENV_SWITCH: value}):
        _trace._configure_from_env()
    assert (logger.level, list(logger.handlers)) == before
