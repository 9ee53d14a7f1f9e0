"""Smoke test of benchmarks/bench_step.py and unit tests of its counters (comm bytes, live bytes, theory, table)."""

from __future__ import annotations

import functools
import json
import os
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Iterator

import expecttest
import pytest
import torch
import torch.distributed as dist
from concurrent_runs import AT_ONCE, selected_tests, started_together
from forked_scripts import Finished, PreloadedPool

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks import _report  # noqa: E402
from benchmarks._comm_counter import CommCounter, DispatchCommCounter  # noqa: E402
from benchmarks._mem_tracker import LiveBytesTracker  # noqa: E402
from benchmarks._model import SMALL, BenchGPT, Block, count_params  # noqa: E402
from benchmarks._report import command_line, format_table, theory_bytes  # noqa: E402
from benchmarks.bench_step import parse_args  # noqa: E402

# ---------------------------------------------------------------------------- end to end
# Each end-to-end test's benchmark command (after the script, before ``--out``) and timeout; the
# selected ones run two at a time from the first one's test on (`concurrent_runs`).
RUNS: dict[str, tuple[list[str], float]] = {
    "test_bench_step_small_runs_and_writes_fields": (
        ["bench_step.py", "--small", "--impls", "ours,local,local-ranks,floor", "--steps", "2", "--world-size", "2"],
        180,
    ),
    "test_bench_step_strategy_against_fsdp2_equivalent": (
        ["bench_step.py", "--small", "--impls", "torch-fsdp2,ours", "--strategy", "SHARD_GRAD_OP"]
        + ["--steps", "1", "--warmup", "1", "--world-size", "2"],
        180,
    ),
    "test_bench_memory_phases_small_runs": (["bench_memory_phases.py", "--small"], 180),
    "test_bench_collectives_small_runs": (
        ["bench_collectives.py", "--numel", "1001", "--reps", "2", "--warmup", "1"],
        120,
    ),
    "test_bench_overhead_small_runs": (
        ["bench_overhead.py", "--units", "3", "--d", "8", "--steps", "2", "--warmup", "1"],
        120,
    ),
    "test_bench_scaling_quick_runs": (["bench_scaling.py", "--quick"], 180),
    "test_bench_safety_small_runs": (
        ["bench_safety.py", "--small", "--rounds", "1", "--steps", "1", "--warmup", "1"],
        120,
    ),
    "test_bench_paired_small_runs": (
        ["bench_paired.py", "--small", "--impls", "ours,ours-no-forward-prefetch,local-ranks", "--rounds", "3"],
        120,
    ),
    "test_bench_optimizer_step_small_runs": (
        ["bench_optimizer_step.py", "--small", "--rounds", "2", "--warmup", "0"],
        120,
    ),
    "test_bench_first_step_small_runs": (
        ["bench_first_step.py", "--d", "16", "--layers", "1", "--steps", "2", "--group-size", "4"],
        120,
    ),
    "test_bench_before_after_small_runs": (
        ["bench_before_after.py", "--before", "HEAD", "--small", "--rounds", "2"],
        150,
    ),
}


def _run_benchmark(servers: PreloadedPool, args: list[str], timeout: float, out: Path) -> tuple[Finished, str]:
    script = Path(REPO_ROOT, "benchmarks", args[0])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH", "")]))}
    # its ranks are forked from it: see [Note: docs examples in forked interpreters]
    done = servers.run(script, env, timeout, [*args[1:], "--out", str(out)], cwd=Path(REPO_ROOT), out=out.parent)
    return done, str(out)


@pytest.fixture(scope="module")
def bench_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future]]:
    selected = selected_tests(request)
    runs = {name: run for name, run in RUNS.items() if name in selected}
    with PreloadedPool({**os.environ, "PYTHONPATH": REPO_ROOT}, min(AT_ONCE, len(runs))) as servers:
        jobs = {
            name: functools.partial(_run_benchmark, servers, args, limit, tmp_path_factory.mktemp("bench") / "out.json")
            for name, (args, limit) in runs.items()
        }
        with started_together(jobs) as started:
            yield started


def test_bench_step_small_runs_and_writes_fields(bench_runs: dict[str, Future]) -> None:
    proc, out = bench_runs["test_bench_step_small_runs_and_writes_fields"].result()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| ours (FULL_SHARD) |" in proc.stdout and "| local |" in proc.stdout and "| local-ranks |" in proc.stdout
    assert os.path.getsize(out[: -len(".json")] + ".png") > 0
    with open(out) as f:
        report = json.load(f)
    assert {"command", "machine", "source", "config", "results"} <= set(report)
    assert report["machine"]["cpu_model"]  # the host's CPU, which step times depend on
    model = BenchGPT(SMALL)
    psi = count_params(model)
    assert report["config"]["param_count"] == psi
    ours, local, local_ranks, floor = report["results"]
    # local-ranks: the unsharded model in both ranks' processes, each on its own batch, no collective
    assert local_ranks["procs"] == 2 and local_ranks["comm_py_api_per_step"]["payload_bytes"] == 0
    assert local_ranks["losses_rank0"] == local["losses_rank0"]
    for r in (ours, local, local_ranks, floor):
        assert r["status"] == "ok", r.get("error")
        assert len(r["step_times_s"]) == 2 and r["median_step_time_s"] > 0
        assert r["peak_rss_bytes"] > 0
        for key in ("peak_live_bytes", "comm_py_api_per_step", "comm_dispatcher_tracked_step", "theory", "per_rank"):
            assert key in r
    # local holds params, grads and two AdamW states: at least 4 * Psi * 4 bytes live at its peak
    assert local["peak_live_bytes"] >= 16 * psi
    assert local["comm_py_api_per_step"]["payload_bytes"] == 0 and local["theory"]["bytes"] == 0
    # ours at world size 2 keeps half of that between steps
    assert all(r["live_bytes_at_step_start"] < 12 * psi for r in ours["per_rank"])
    for rank in ours["per_rank"] + local["per_rank"]:
        phases = rank["peak_live_bytes_by_phase"]
        assert list(phases) == ["forward", "backward", "optimizer"] and max(phases.values()) == rank["peak_live_bytes"]
    # every unit of SMALL has an even numel, so nothing is padded. On gloo, ours sends point to point
    # (see [Note: gloo collectives as point-to-point exchanges]): each rank sends half of one
    # reduce-scatter of Psi, and half of an all-gather of every block twice (forward, backward) but of
    # the root unit once (kept for backward). Exactly what a ring would send.
    # Each reduce-scatter chunk also carries one flag per original parameter of its unit
    # ([Note: which parameters got a gradient]): 2 x that many elements per unit at world size 2.
    block_numel = sum(p.numel() for m in model.modules() if isinstance(m, Block) for p in m.parameters())
    flags = 2 * len(list(model.parameters()))
    for counter in ("comm_py_api_per_step", "comm_dispatcher_tracked_step"):
        kinds = dict(ours[counter]["payload_bytes_by_kind"])
        headers = kinds.pop("header", 0)  # rank-agreement headers, 64 B per message, counted apart
        assert kinds == {"send": 0.5 * 4 * (psi + flags + psi + block_numel)}, counter
        assert 0 < headers < 0.01 * kinds["send"], counter
        assert ours[counter]["wire_bytes"] == kinds["send"] + headers, counter
    assert ours["theory"]["bytes"] == 0.5 * psi * 12
    # floor moves a FULL_SHARD step's bytes by hand: ours' less the gradient flags
    for counter in ("comm_py_api_per_step", "comm_dispatcher_tracked_step"):
        assert floor[counter]["payload_bytes_by_kind"] == {"send": 0.5 * 4 * (psi + psi + block_numel)}, counter


def test_bench_step_strategy_against_fsdp2_equivalent(bench_runs: dict[str, Future]) -> None:
    """--strategy SHARD_GRAD_OP runs FSDP2 with reshard_after_forward=False: no backward all-gather, so
    FSDP2 sends exactly (N-1)/N * Psi * (4 + 4) bytes, and both train alike."""
    proc, out = bench_runs["test_bench_step_strategy_against_fsdp2_equivalent"].result()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        fsdp2, ours = json.load(f)["results"]
    assert fsdp2["variant"] == "SHARD_GRAD_OP: reshard_after_forward=False, 1-D mesh"
    assert ours["variant"] == "SHARD_GRAD_OP"
    psi = count_params(BenchGPT(SMALL))
    assert fsdp2["theory"]["bytes"] == 0.5 * psi * 8
    # one all-gather and one reduce-scatter of every unit (payload: the whole tensor), half of each sent
    counted = fsdp2["comm_dispatcher_tracked_step"]
    assert counted["payload_bytes_by_kind"] == {"all_gather": psi * 4, "reduce_scatter": psi * 4}
    assert counted["wire_bytes"] == fsdp2["theory"]["bytes"]
    assert fsdp2["losses_rank0"] == pytest.approx(ours["losses_rank0"], rel=1e-5)
    for r in (fsdp2, ours):  # every rank names what is alive at each phase's peak, adding up to it
        for rank in r["per_rank"]:
            for phase, peak in rank["peak_live_bytes_by_phase"].items():
                assert sum(rank["peak_live_sources_by_phase"][phase].values()) == peak, (r["impl"], phase)


def test_bench_memory_phases_small_runs(bench_runs: dict[str, Future]) -> None:
    proc, rows = _finished(bench_runs, "test_bench_memory_phases_small_runs")
    fsdp2, ours, estimate = rows
    assert [fsdp2["impl"], ours["impl"]] == ["torch-fsdp2", "ours"] and estimate["peak_bytes"] > 0
    for r in (fsdp2, ours):
        for terms, peaks in zip(r["terms_by_phase_by_rank"], r["peak_by_phase_by_rank"]):
            assert {phase: sum(t.values()) for phase, t in terms.items()} == peaks
        forward, backward = r["terms_by_phase_rank0"]["forward"], r["terms_by_phase_rank0"]["backward"]
        # a FULL_SHARD step's peaks hold unsharded units and forward's activations; only backward has gradients
        assert forward["unsharded parameters"] > 0 and forward["made in forward"] > 0
        assert forward["made in backward"] == 0 < backward["made in backward"]
    assert "| **peak of the phase** |" in proc.stdout


def test_strategy_cli_says_what_fsdp2_lacks(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--impls", "torch-fsdp2,ours", "--strategy", "NO_SHARD"], ["--strategy", "HYBRID_SHARD"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
    errors = "\n".join(line for line in capsys.readouterr().err.splitlines() if "error:" in line)
    expecttest.TestCase().assertExpectedInline(
        errors,
        """\
bench_step.py: error: torch FSDP2 has no NO_SHARD; compare ours' NO_SHARD with ddp (--impls ddp,ours)
bench_step.py: error: --strategy HYBRID_SHARD shards over groups of 2 ranks and replicates across at least 2: --world-size must be a multiple of 2, at least 4""",  # noqa: E501
    )
    hybrid = parse_args(["--strategy", "HYBRID_SHARD", "--world-size", "4", "--impls", "torch-fsdp2,ours"])
    assert hybrid.world_size == 4


def test_floor_is_cpu_only() -> None:
    from benchmarks._impls import build

    with pytest.raises(ValueError, match="floor' measures gloo on the CPU; got device cuda"):
        build("floor", SMALL, strategy="FULL_SHARD", bf16=False, device=torch.device("cuda"), world_size=2)


# ---------------------------------------------------------------------------- comm counter
def count_known_collectives() -> dict:
    """Runs on every rank of a world-size-2 gloo pool."""
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    original = dist.all_reduce
    with CommCounter() as counter:
        dist.all_reduce(torch.ones(10))  # 40 B
        out = torch.empty(6)
        dist.all_gather_into_tensor(out, torch.ones(3))  # calls all_gather_single inside: count once, 24 B
        dist.reduce_scatter_single(torch.empty(2), torch.ones(4))  # 16 B
        dist.broadcast(torch.ones(5), src=0)  # 20 B
        peer = 1 - dist.get_rank()
        requests = [dist.isend(torch.ones(7), peer), dist.irecv(torch.empty(7), peer)]  # sends 28 B
        for request in requests:
            request.wait()
        wrapped = dist.all_reduce is not original
    dispatch = DispatchCommCounter(dist.get_world_size())
    with LiveBytesTracker(on_op=dispatch.observe):
        dist.all_reduce(torch.ones(10))
        dist.all_gather_single(torch.empty(6), torch.ones(3))
        requests = [dist.isend(torch.ones(7), peer), dist.irecv(torch.empty(7), peer)]
        for request in requests:
            request.wait()
    return {
        "py": counter.snapshot(),
        "dispatch": dispatch.snapshot(),
        "wrapped": wrapped,
        "restored": dist.all_reduce is original,
    }


def test_comm_counter_counts_known_collectives_once(dist_run) -> None:
    for r in dist_run(2, count_known_collectives):
        assert r["wrapped"] and r["restored"]
        ops = {name: (v["calls"], v["payload_bytes"], v["wire_bytes"]) for name, v in r["py"]["ops"].items()}
        assert ops == {
            "all_reduce": (1, 40, 40.0),  # ring all-reduce sends 2(N-1)/N of the tensor
            "all_gather_into_tensor": (1, 24, 12.0),
            "reduce_scatter_single": (1, 16, 8.0),
            "broadcast": (1, 20, 10.0),
            "isend": (1, 28, 28.0),  # point to point: the bytes sent, exactly
        }
        assert r["py"]["payload_bytes_by_kind"] == {
            "all_reduce": 40,
            "all_gather": 24,
            "reduce_scatter": 16,
            "broadcast": 20,
            "send": 28,
        }
        dispatch = {name: (v["calls"], v["payload_bytes"]) for name, v in r["dispatch"]["ops"].items()}
        assert dispatch == {"c10d::allreduce_": (1, 40), "c10d::_allgather_base_": (1, 24), "c10d::send": (1, 28)}


# ---------------------------------------------------------------------------- live bytes tracker
def test_live_bytes_tracker_peak_views_resize_and_preexisting() -> None:
    before = torch.empty(100)  # 400 B alive before the step
    unseen = torch.empty(50)  # 200 B alive before the step and after it, first seen when an op reads it
    original_resize = torch.UntypedStorage.resize_
    with LiveBytesTracker() as tr:
        tr.add_existing([before, None])
        a = torch.empty(1000)  # +4000
        b = torch.empty(2000)  # +8000 -> 12000
        view = b.view(2, 1000)  # same storage: +0
        del a  # -4000 -> 8000
        c = unseen + 1  # +200 -> 8200
        storage = c.untyped_storage()
        storage.resize_(0)  # -200 -> 8000 (how FSDP frees an unsharded parameter)
        storage.resize_(4000)  # +4000 -> 12000
        # a buffer allocated outside the dispatcher (like gloo's) and freed within the step counts
        # from when an op first reads it
        hidden = torch.frombuffer(bytearray(300), dtype=torch.uint8)
        hidden.add_(1)  # +300 -> 12300
        d = torch.empty(10)  # +40 -> 12340 (peak)
        del storage, c, d, hidden  # -4340 -> 8000
    assert torch.UntypedStorage.resize_ is original_resize
    assert tr.baseline == 600
    assert tr.found_alive == {"aten.add.Tensor": 200} and tr.found_transient == {"aten.add_.Tensor": 300}
    assert tr.peak_bytes == 600 + 12340
    assert tr.live_bytes == 600 + 8000
    del view, b


def test_live_bytes_tracker_phase_peaks() -> None:
    with LiveBytesTracker() as tr:
        a, b = torch.empty(100), torch.empty(100)  # 800
        tr.mark("one")
        del a
        c = torch.empty(10)  # 440: the phase starts at 800
        tr.mark("two")
        del b, c
        d = torch.empty(20)  # 80
        tr.mark("three")
    assert tr.phase_peaks == {"one": 800, "two": 800, "three": 440}
    assert (tr.peak_bytes, tr.live_bytes, tr.peak_op) == (800, 80, "aten.empty.memory_format")
    del d


def test_live_bytes_tracker_peak_sources() -> None:
    """What is alive at each phase's peak, by source, adds up to that peak ([Note: what is alive at a peak])."""
    params, state = torch.empty(100), torch.empty(50)
    unseen = torch.empty(25)  # alive before and after, first read by an op in phase "one"
    unsharded = torch.empty(10).untyped_storage()
    unsharded.resize_(0)  # freed before the step, as FSDP leaves an unsharded parameter
    with LiveBytesTracker() as tr:
        tr.add_existing([params], "params")
        tr.add_existing([state, params], "state")  # params keeps its first label
        act = torch.empty(200)  # made by aten.empty in "one"
        grown = torch.empty(10)
        grown.untyped_storage().resize_(0)
        grown.untyped_storage().resize_(1000)  # keeps its source, now 1000 B
        kept = unseen * 2  # found alive (100 B) + 100 B made by aten.mul
        unsharded.resize_(500)
        tr.mark("one")  # peak: 600 + 800 + 1000 + 100 + 100 + 500 = 3100
        del act
        unsharded.resize_(0)
        hidden = torch.frombuffer(bytearray(2000), dtype=torch.uint8)
        hidden.add_(1)  # found, dies in the step, counted from here: 3100 - 800 - 500 + 2000 = 3800
        del hidden
        tr.mark("two")
    assert tr.phase_peaks == {"one": 3100, "two": 3800}
    common = {"params": 400, "state": 200, "one: aten.mul.Tensor": 100, "found alive (aten.mul.Tensor)": 100}
    assert tr.peak_sources == {
        "one": {**common, "one: aten.empty.memory_format": 1800, "regrown by resize_": 500},
        "two": {**common, "one: aten.empty.memory_format": 1000, "two: found (aten.add_.Tensor)": 2000},
    }
    assert all(sum(tr.peak_sources[p].values()) == tr.phase_peaks[p] for p in tr.phase_peaks)
    del kept, grown


# ---------------------------------------------------------------------------- theory, table, CLI
def test_theory_bytes_halve_with_bf16() -> None:
    psi = 1000
    assert theory_bytes("ours", "FULL_SHARD", 2, psi, "fp32")["bytes"] == 0.5 * psi * 3 * 4
    assert theory_bytes("ours", "FULL_SHARD", 2, psi, "bf16")["bytes"] == 0.5 * psi * 3 * 2
    assert theory_bytes("ours", "SHARD_GRAD_OP", 4, psi, "fp32")["bytes"] == 0.75 * psi * 2 * 4
    assert (
        theory_bytes("ours", "NO_SHARD", 2, psi, "fp32")["bytes"]
        == theory_bytes("ddp", "FULL_SHARD", 2, psi, "fp32")["bytes"]
    )
    assert theory_bytes("torch-fsdp2", "FULL_SHARD", 4, psi, "fp32")["bytes"] == 0.75 * psi * 3 * 4
    assert theory_bytes("local", "FULL_SHARD", 1, psi, "fp32")["bytes"] == 0


def _fake_result(impl: str, step_s: float, live_mib: float, wire_mib: float, failed: bool = False) -> dict:
    mib = 2**20
    if failed:
        return {"impl": impl, "status": "failed", "error": "RuntimeError: gloo says no\ntraceback..."}
    comm = {"wire_bytes": wire_mib * mib, "payload_bytes_by_kind": {"all_gather": 2 * wire_mib * mib}}
    return {
        "impl": impl,
        "variant": "FULL_SHARD" if impl == "ours" else "",
        "status": "ok",
        "median_step_time_s": step_s,
        "min_step_time_s": step_s * 0.9,
        "peak_live_bytes": live_mib * mib,
        "peak_rss_bytes": 400 * mib,
        "comm_py_api_per_step": comm,
        "comm_dispatcher_tracked_step": comm,
        "theory": {"bytes": wire_mib * mib},
        "losses_rank0": [9.1, 9.0],
    }


def test_format_table() -> None:
    table = format_table(
        [
            _fake_result("local", 0.5, 512, 0),
            _fake_result("local-ranks", 0.8, 512, 0),
            _fake_result("ours", 1.0, 300, 48),
            _fake_result("torch-fsdp2", 0, 0, 0, True),
        ]
    )
    expecttest.TestCase().assertExpectedInline(
        table,
        """\
| impl | step (s, median) | step (s, min) | x local | x local-ranks | peak live/rank (MiB) | peak RSS/rank (MiB) | comm wire/step, py API (MiB) | comm wire/step, c10d ops (MiB) | theory (MiB) | all-gather payload (MiB) | reduce-scatter payload (MiB) | all-reduce payload (MiB) | point-to-point sent (MiB) | last loss |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
| local | 0.500 | 0.450 | 1.00 | 0.62 | 512.0 | 400.0 | 0.0 | 0.0 | 0.0 | 0.0 | 0.0 | 0.0 | 0.0 | 9.0000 |
| local-ranks | 0.800 | 0.720 | 1.60 | 1.00 | 512.0 | 400.0 | 0.0 | 0.0 | 0.0 | 0.0 | 0.0 | 0.0 | 0.0 | 9.0000 |
| ours (FULL_SHARD) | 1.000 | 0.900 | 2.00 | 1.25 | 300.0 | 400.0 | 48.0 | 48.0 | 48.0 | 96.0 | 0.0 | 0.0 | 0.0 | 9.0000 |
| torch-fsdp2 | FAILED: RuntimeError: gloo says no | | | | | | | | | | | | | |""",  # noqa: E501
    )


def test_cli_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--impls", "ours,bogus"])
    with pytest.raises(SystemExit):
        parse_args(["--impls", "ours,ddp", "--param-dtype", "bf16"])
    errors = "\n".join(line for line in capsys.readouterr().err.splitlines() if "error:" in line)
    expecttest.TestCase().assertExpectedInline(
        errors,
        """\
bench_step.py: error: --impls: unknown implementation(s) ['bogus']; choose from ours,torch-fsdp2,ddp,local,local-ranks,floor
bench_step.py: error: --param-dtype bf16 applies to ours and torch-fsdp2 only; drop ddp""",  # noqa: E501
    )
    args = parse_args(["--impls", "local,ddp,torch-fsdp2,ours"])
    assert args.impl_list == ["local", "ddp", "torch-fsdp2", "ours"] and args.world_size == 2 and args.steps == 6


def _finished(bench_runs: dict[str, Future], name: str) -> tuple[Finished, list[Any]]:
    """The run of test ``name``, checked to have succeeded and drawn its chart, and its JSON's results."""
    proc, out = bench_runs[name].result()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert os.path.getsize(out[: -len(".json")] + ".png") > 0
    with open(out) as f:
        return proc, json.load(f)["results"]


def test_bench_collectives_small_runs(bench_runs: dict[str, Future]) -> None:
    proc, rows = _finished(bench_runs, "test_bench_collectives_small_runs")
    assert [r["kind"] for r in rows] == ["all_gather"] * 2 + ["reduce_scatter"] * 3 + ["all_reduce"]
    assert all(r["median_s"] > 0 for r in rows)
    assert rows[0]["wire_bytes"] == 0.5 * 1002 * 4  # padded to 1002, each rank sends the other half


def test_bench_overhead_small_runs(bench_runs: dict[str, Future]) -> None:
    proc, rows = _finished(bench_runs, "test_bench_overhead_small_runs")
    assert [r["impl"] for r in rows] == ["local", "ours", "torch-fsdp2"]
    assert rows[0]["overhead_s"] == 0 and all(r["median_s"] > 0 for r in rows)


def test_bench_scaling_quick_runs(bench_runs: dict[str, Future]) -> None:
    proc, (report,) = _finished(bench_runs, "test_bench_scaling_quick_runs")
    assert [r["size"] for r in report["sizes"]] == ["small", "small-x2"]
    for row in report["sizes"]:
        assert row["world_size"] == 2 and row["ours_vs_floor"] > 0
        for impl in ("ours", "torch-fsdp2", "floor"):
            assert row[impl]["median_s"] > 0 and row[impl]["peak_live_bytes"] > 0
    assert [r["units"] for r in report["units"]] == [2, 4]
    assert set(report["ws1"]["speed_vs_local"]) == {"ours", "torch-fsdp2"}
    assert "| world size 1 |" in proc.stdout and "| units |" in proc.stdout


def test_bench_safety_small_runs(bench_runs: dict[str, Future]) -> None:
    proc, rows = _finished(bench_runs, "test_bench_safety_small_runs")
    assert [r["variant"] for r in rows] == [
        "every check on",
        "headers off",
        "edit_checks off",
        "grad_bookkeeping off",
        "every check off",
    ]
    assert rows[0]["cost_s"] == 0 and all(r["median_s"] > 0 for r in rows)


def test_bench_optimizer_step_small_runs(bench_runs: dict[str, Future]) -> None:
    proc, rows = _finished(bench_runs, "test_bench_optimizer_step_small_runs")
    assert [r["variant"] for r in rows] == ["faces", "faces, foreach", "plain", "plain, foreach"]
    assert all(len(r["step_times_s"]) == 2 and r["median_s"] > 0 and r["params"] > 0 for r in rows)
    assert rows[2]["vs_plain"] == 1.0 and "| AdamW over |" in proc.stdout


def test_bench_first_step_small_runs(bench_runs: dict[str, Future]) -> None:
    proc, rows = _finished(bench_runs, "test_bench_first_step_small_runs")
    got = [(r["impl"], r["mode"], r["group_size"]) for r in rows]
    modes = [("foreach", None), ("groups", 4), ("loop", None)]
    assert got == [(impl, *mode) for impl in ("ours", "torch-fsdp2") for mode in modes]
    assert all(len(r["step_times_s"]) == 2 and r["first_s"] > 0 and r["later_median_s"] > 0 for r in rows)
    assert len({r["params"] for r in rows}) == 1 and rows[0]["params"] > 4  # the model's parameters, all six
    groups = [-(-r["params"] // 4) if r["mode"] == "groups" else 1 for r in rows]
    assert [r["param_groups"] for r in rows] == groups and max(groups) > 1  # AdamW's groups as asked
    assert "| first step (s) |" in proc.stdout and "| foreach, groups of <= 4 |" in proc.stdout


def test_bench_paired_small_runs(bench_runs: dict[str, Future]) -> None:
    proc, rows = _finished(bench_runs, "test_bench_paired_small_runs")
    assert [r["impl"] for r in rows] == ["ours", "ours-no-forward-prefetch", "local-ranks"]
    assert all(len(r["step_times_s"]) == 3 and r["median_s"] > 0 for r in rows)
    assert rows[0]["ratio_to_first"] == 1.0 and all(r["ratio_to_first"] > 0 for r in rows)
    assert all(len(r["minor_faults_by_rank"]) == 2 and min(r["minor_faults_by_rank"]) >= 0 for r in rows)
    assert "| ours-no-forward-prefetch |" in proc.stdout and "| page faults/step by rank |" in proc.stdout


def test_bench_before_after_small_runs(bench_runs: dict[str, Future]) -> None:
    proc, rows = _finished(bench_runs, "test_bench_before_after_small_runs")
    assert [r["impl"] for r in rows] == ["ours", "ours-before", "floor"]
    assert all(len(r["step_times_s"]) == 2 and r["median_s"] > 0 for r in rows)
    assert "(ours-before: HEAD, exported to" in proc.stdout, proc.stdout  # built by the exported package


def test_command_line_carries_the_allocator_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run under tuned malloc settings records them, so its command reproduces it."""
    script = os.path.join(REPO_ROOT, "benchmarks", "bench_paired.py")
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(sys, "argv", ["bench_paired.py", "--rounds", "3"])
    for name in _report._ALLOCATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    assert command_line(script) == "python benchmarks/bench_paired.py --rounds 3"
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1073741824")
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "0")
    assert command_line(script) == (
        "MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1073741824 python benchmarks/bench_paired.py --rounds 3"
    )


def test_small_benchmarks_reject_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import (
        bench_collectives,
        bench_compile,
        bench_first_step,
        bench_optimizer_step,
        bench_overhead,
        bench_paired,
        bench_safety,
        bench_scaling,
    )

    for parse, argv in (
        (bench_collectives.parse_args, ["--world-size", "1"]),
        (bench_collectives.parse_args, ["--reps", "0"]),
        (bench_compile.parse_args, ["--warmup", "0"]),
        (bench_overhead.parse_args, ["--world-size", "1"]),
        (bench_overhead.parse_args, ["--units", "0"]),
        (bench_safety.parse_args, ["--world-size", "1"]),
        (bench_paired.parse_args, ["--impls", "ours,fsdp1"]),
        (bench_paired.parse_args, ["--impls", "ours,ours"]),
        (bench_paired.parse_args, ["--d", "100"]),
        (bench_safety.parse_args, ["--n-layers", "0"]),
        (bench_scaling.parse_args, ["--sizes", "1T"]),
        (bench_scaling.parse_args, ["--steps", "0"]),
        (bench_scaling.parse_args, ["--world-sizes", "1,2"]),
        (bench_optimizer_step.parse_args, ["--d", "100"]),
        (bench_first_step.parse_args, ["--d", "100"]),
        (bench_first_step.parse_args, ["--layers", "16,x"]),
        (bench_first_step.parse_args, ["--steps", "1"]),
        (bench_first_step.parse_args, ["--group-size", "0"]),
    ):
        with pytest.raises(SystemExit):
            parse(argv)
    errors = "\n".join(line for line in capsys.readouterr().err.splitlines() if "error:" in line)
    expecttest.TestCase().assertExpectedInline(errors, """\
bench_collectives.py: error: --world-size must be at least 2, got 1
bench_collectives.py: error: --numel and --reps must be positive and --warmup not negative
bench_compile.py: error: --world-size, --rounds, --threads and --warmup must be positive (the first step compiles)
bench_overhead.py: error: --world-size must be at least 2, got 1
bench_overhead.py: error: --units, --d, --batch, --steps and --threads must be positive and --warmup not negative
bench_safety.py: error: --world-size must be at least 2 (the headers run between ranks), got 1
bench_paired.py: error: --impls: unknown ['fsdp1']; choose from ours,ours-no-forward-prefetch,ours-before,torch-fsdp2,ddp,local,local-ranks,floor
bench_paired.py: error: --impls lists one more than once: ours,ours
bench_paired.py: error: argument --d: must be positive and divisible by its 6 heads, got 100
bench_safety.py: error: argument --n-layers: must be positive, got 0
bench_scaling.py: error: unknown --sizes ['1T']; choose from 10M, 34M, 97M, 218M, 305M
bench_scaling.py: error: --steps, --unit-steps, --rounds and --threads must be positive, --warmup not negative, --fake-world-size at least 2
bench_scaling.py: error: --world-sizes must each be at least 2 (the sizes part shards across ranks), got 1,2
bench_optimizer_step.py: error: argument --d: must be positive and divisible by its 6 heads, got 100
bench_first_step.py: error: argument --d: must be positive and divisible by its 6 heads, got 100
bench_first_step.py: error: --layers must be comma-separated integers, got '16,x'
bench_first_step.py: error: --world-size, --threads, --group-size and --layers must be positive and --steps at least 2
bench_first_step.py: error: --world-size, --threads, --group-size and --layers must be positive and --steps at least 2""")  # noqa: E501
