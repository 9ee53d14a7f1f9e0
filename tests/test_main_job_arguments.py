"""The main job's argument checks, `python -m fsdp_composable --...`: one line naming the option for a
bad value, and what the job would run (the job end to end: test_main_job.py)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import tempfile
from pathlib import Path
from unittest import mock

from expecttest import TestCase
from job_helpers import LAUNCHER_VARS
from job_helpers import assert_fits as _assert_fits

from fsdp_composable.__main__ import build_parser, describe_run, model_params, parse_args
from fsdp_composable._job.demo import GPT


def _fake_checkpoint(root: Path, step: int, **job: object) -> None:
    """A checkpoint directory as the job leaves it (DIR/latest -> DIR/step_N with job.json), without
    the tensors: enough for the checks made before any rank starts."""
    record = {"vocab": 64, "d_model": 64, "layers": 4, "heads": 4, "seq": 32, "step": step, "global_batch": 16}
    record["files"] = {".metadata": hashlib.sha256(b"").hexdigest()}
    record.update(job)
    (root / f"step_{step}").mkdir(parents=True)
    (root / f"step_{step}" / "job.json").write_text(json.dumps(record))
    (root / f"step_{step}" / ".metadata").write_bytes(b"")
    (root / "latest").write_text(f"step_{step}\n")


class TestArguments(TestCase):
    def _errors(self, cases: list[list[str]]) -> str:
        messages = []
        for argv in cases:
            err = io.StringIO()
            with self.assertRaises(SystemExit) as cm, contextlib.redirect_stderr(err):
                parse_args(argv)
            self.assertEqual(cm.exception.code, 2)
            lines = err.getvalue().strip().splitlines()
            self.assertEqual(len(lines), 1, lines)  # one line, no usage block
            messages.append(lines[0].replace("python -m fsdp_composable: error: ", "").replace(" (see --help)", ""))
        return "\n".join(messages)

    def test_bad_values_exit_2_with_one_line_naming_the_option(self) -> None:
        bad = [
            ["--world-size", "0"],
            ["--d-model", "30", "--heads", "4"],
            ["--steps", "0"],
            ["--lr", "nan"],
            ["--lr", "-1"],
            ["--timeout", "inf"],
            ["--timeout", "1e300"],
            ["--seed", "-1"],
            ["--steps", "1e3"],
            ["--resume"],
            ["--checkpoint-dir", "ckpt", "--checkpoint-every", "-1"],
            ["--checkpoint-dir", "/nonexistent/ckpt", "--resume"],
            ["--world-size", "4", "--global-batch", "6"],
            ["--shard-group-size", "2"],
            ["--strategy", "HYBRID_SHARD", "--world-size", "4", "--shard-group-size", "3"],
            ["--plot", "/nonexistent/loss.png"],
            ["--plot", "/"],
            ["--checkpoint-dir", "/dev/null"],
        ]
        self.assertExpectedInline(
            self._errors(bad),
            """\
--world-size must be from 1 to 4096, got 0
--heads 4 must divide --d-model 30
--steps must be from 1 to 1000000000, got 0
--lr must be a finite number above 0 and at most 10, got nan
--lr must be a finite number above 0 and at most 10, got -1.0
--timeout must be a finite number above 0 and at most 604800, got inf
--timeout must be a finite number above 0 and at most 604800, got 1e+300
--seed must be from 0 to 4294967295, got -1
argument --steps: invalid int value: '1e3'
--resume and --checkpoint-every need --checkpoint-dir DIR
--checkpoint-every must be from 0 to 1000000000, got -1
--resume: no checkpoint in '/nonexistent/ckpt' (no latest file); save one first with --checkpoint-dir
--global-batch 6 must be a multiple of the world size 4 (every rank takes an equal slice)
--shard-group-size is only for --strategy HYBRID_SHARD, not FULL_SHARD
--shard-group-size 3 must divide the world size 4 (HYBRID_SHARD lays the ranks out as replicas x shard group)
--plot /nonexistent/loss.png: directory '/nonexistent' does not exist
--plot /: is a directory; give a file name such as loss.png
--checkpoint-dir /dev/null: exists and is not a directory""",  # noqa: E501
        )

    def test_every_numeric_option_refuses_what_is_out_of_range(self) -> None:
        """Negative, zero, nan, inf and absurdly large values of every numeric option: exit status 2 and
        one line naming the option, before any rank starts (never a traceback from the ranks)."""
        numeric = [a for a in build_parser()._actions if a.type in (int, float)]
        self.assertEqual(len(numeric), 14)
        for action in numeric:
            option = action.option_strings[0]
            for value in ["-1", "0", "nan", "inf", "-inf", "1e300", str(10**20)]:
                argv = [option, value]
                if option == "--checkpoint-every":
                    argv += ["--checkpoint-dir", "ckpt"]
                if option == "--shard-group-size":
                    argv += ["--strategy", "HYBRID_SHARD"]
                if value == "0" and option in ("--seed", "--checkpoint-every"):
                    continue  # in range
                with self.subTest(argv=argv):
                    message = self._errors([argv])
                    self.assertIn(option, message)

    def test_model_that_cannot_be_built_on_this_machine(self) -> None:
        self.assertEqual(model_params(parse_args(["--world-size", "1"])), 210_304)  # the demo GPT's count
        gpt = GPT(vocab=64, d_model=64, n_layers=4, seq=32, n_heads=4)
        self.assertEqual(sum(p.numel() for p in gpt.parameters()), 210_304)
        with mock.patch("fsdp_composable.__main__._physical_memory", return_value=2**30):
            message = self._errors([["--d-model", "4096", "--layers", "8"]])
        self.assertExpectedInline(message, """the model has 1,611,702,272 parameters and each of the 2 ranks on this machine builds it whole (4 bytes a parameter) before sharding: 12.0 GiB, more than the machine's 1.0 GiB; lower --d-model, --layers or --vocab""")  # noqa: E501

    def test_malformed_launcher_environment(self) -> None:
        """RANK and WORLD_SIZE set: the launcher's variables are checked like options (exit 2, one line)."""
        good = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
        cases = [
            {**good, "WORLD_SIZE": "two"},
            {**good, "WORLD_SIZE": "0"},
            {**good, "RANK": "2"},
            {**good, "RANK": "-1"},
            {**good, "LOCAL_WORLD_SIZE": "0"},
            {**good, "LOCAL_WORLD_SIZE": "3"},
            {**good, "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "1"},
            {**good, "MASTER_PORT": "70000"},
            {k: v for k, v in good.items() if k != "MASTER_ADDR"},
            {"RANK": "1"},
        ]
        messages = []
        for env in cases:
            with mock.patch.dict(os.environ):
                for name in LAUNCHER_VARS:
                    os.environ.pop(name, None)
                os.environ.update(env)
                messages.append(self._errors([["--strategy", "HYBRID_SHARD"]]))
        self.assertExpectedInline("\n".join(messages), """\
environment variable WORLD_SIZE='two' is not an integer; the launcher (torchrun) sets it
environment variable WORLD_SIZE=0 must be from 1 to 4096
environment variable RANK=2 must be from 0 to 1
environment variable RANK=-1 must be from 0 to 1
environment variable LOCAL_WORLD_SIZE=0 must be from 1 to 2
environment variable LOCAL_WORLD_SIZE=3 must be from 1 to 2
environment variable LOCAL_RANK=1 must be from 0 to 0
environment variable MASTER_PORT=70000 must be from 0 to 65535
RANK and WORLD_SIZE are set but MASTER_ADDR or MASTER_PORT is not: the env:// rendezvous needs all four (torchrun sets them)
environment variable RANK is set but WORLD_SIZE is not: a launcher such as torchrun sets both; unset RANK to have this command start the ranks""")  # noqa: E501
        with mock.patch.dict(os.environ, {**good, "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}):
            args = parse_args(["--strategy", "HYBRID_SHARD"])
        self.assertEqual((args.world_size, args.shard_group_size), (2, 2))

    def test_first_lines_say_what_actually_runs(self) -> None:
        """A group of one rank shards nothing (`fully_shard` runs it as NO_SHARD, no collective): the
        first lines say so for world size 1 and for HYBRID_SHARD's default shard group at 2 ranks."""
        runs = [
            ["--world-size", "1"],
            ["--world-size", "1", "--strategy", "SHARD_GRAD_OP"],
            ["--strategy", "HYBRID_SHARD"],
            ["--strategy", "HYBRID_SHARD", "--shard-group-size", "2"],
            ["--strategy", "HYBRID_SHARD", "--world-size", "4"],
            ["--strategy", "NO_SHARD", "--world-size", "4"],
        ]
        text = "\n\n".join("\n".join(describe_run(parse_args(argv))[1:]) for argv in runs)
        self.assertExpectedInline(text, """\
FULL_SHARD on 1 CPU rank (gloo, in this process)
with 1 rank there is nothing to shard or reduce: every unit runs as NO_SHARD, without communication

SHARD_GRAD_OP on 1 CPU rank (gloo, in this process)
with 1 rank there is nothing to shard or reduce: every unit runs as NO_SHARD, without communication

HYBRID_SHARD (2 replicas x shard group 1) on 2 CPU ranks (gloo, starting them)
a shard group of 1 rank shards nothing: this runs as NO_SHARD over 2 ranks (as DDP does)

HYBRID_SHARD (1 replica x shard group 2) on 2 CPU ranks (gloo, starting them)
1 replica replicates nothing: this runs as FULL_SHARD over 2 ranks

HYBRID_SHARD (2 replicas x shard group 2) on 4 CPU ranks (gloo, starting them)

NO_SHARD on 4 CPU ranks (gloo, starting them)""")

    def test_help_fits_100_columns(self) -> None:
        for columns in ("60", "100", "300"):
            with mock.patch.dict(os.environ, {"COLUMNS": columns}):
                text = build_parser().format_help()
            _assert_fits(text)
            self.assertIn("--checkpoint-every", text)

    def test_plot_without_matplotlib(self) -> None:
        real = importlib.util.find_spec
        with mock.patch("importlib.util.find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)):
            self.assertExpectedInline(
                self._errors([["--plot", "loss.png"]]),
                """--plot loss.png: needs matplotlib, which is not installed (pip install matplotlib)""",
            )

    def test_checkpoint_directory_checks(self) -> None:
        """Before any rank starts: a fresh run does not write over a checkpoint, a resume refuses
        another model's checkpoint and a --steps it has already reached, in one line each."""
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp, "ckpt")
            _fake_checkpoint(root, 10, d_model=32)
            other = Path(tmp, "other")
            other.mkdir()
            (other / "latest").write_text("step_3\n")  # names a directory that is not there
            ckpt = ["--checkpoint-dir", str(root)]
            message = self._errors(
                [
                    [*ckpt, "--steps", "20"],
                    [*ckpt, "--steps", "20", "--resume"],
                    [*ckpt, "--steps", "20", "--resume", "--layers", "2"],
                    [*ckpt, "--steps", "10", "--resume", "--d-model", "32"],
                    ["--checkpoint-dir", str(other), "--resume"],
                ]
            )
            args = parse_args([*ckpt, "--steps", "20", "--resume", "--d-model", "32", "--world-size", "4"])
            self.assertEqual((args.world_size, args.global_batch), (4, 16))
        self.assertExpectedInline(message.replace(tmp, "TMP"), """\
--checkpoint-dir TMP/ckpt already holds a checkpoint (TMP/ckpt/step_10); add --resume to continue it, or choose another directory
--resume: TMP/ckpt/step_10 was saved for a different model (--d-model 32 there, 64 here); pass the same options
--resume: TMP/ckpt/step_10 was saved for a different model (--d-model 32 there, 64 here; --layers 4 there, 2 here); pass the same options
--resume: TMP/ckpt/step_10 is already at step 10 and --steps is 10: nothing to train; pass --steps greater than 10
--checkpoint-dir: TMP/other/latest names 'step_3', but TMP/other/step_3/job.json cannot be read ([Errno 2] No such file or directory: 'TMP/other/step_3/job.json')""")  # noqa: E501

    def test_checkpoint_files_must_be_the_ones_saved(self) -> None:
        """job.json's sha256 of every saved file: a file changed, planted, missing or not a file, or a
        record without digests, is refused in one line before any rank starts (loading would unpickle it)."""
        empty = hashlib.sha256(b"").hexdigest()
        records: dict[str, dict[str, object]] = {
            "missing": {"files": {".metadata": empty, "__1_0.distcp": empty}},
            "bad_digest": {"files": {".metadata": "0"}},
        }
        with tempfile.TemporaryDirectory() as tmp:
            cases = []
            for change in ["changed", "planted", "missing", "directory", "no_digests", "bad_digest"]:
                root = Path(tmp, change)
                _fake_checkpoint(root, 10, **records.get(change, {}))
                step = root / "step_10"
                if change == "changed":  # a pickle that would run code when DCP loads it
                    (step / ".metadata").write_bytes(b"cos\nsystem\n(S'true'\ntR.")
                elif change == "planted":
                    (step / "__0_0.distcp").write_bytes(b"x")
                elif change == "directory":
                    (step / "extra").mkdir()
                elif change == "no_digests":
                    record = json.loads((step / "job.json").read_text())
                    del record["files"]
                    (step / "job.json").write_text(json.dumps(record))
                cases.append(["--checkpoint-dir", str(root), "--steps", "20", "--resume"])
            message = self._errors(cases)
        self.assertExpectedInline(message.replace(tmp, "TMP"), """\
--checkpoint-dir: TMP/changed/step_10: '.metadata' was changed after the save (its sha256 is not the one job.json recorded); refusing it, since loading a checkpoint unpickles its files: restore the directory as the job saved it, or start a fresh run
--checkpoint-dir: TMP/planted/step_10: '__0_0.distcp' is not a file the job saved there; refusing it, since loading a checkpoint unpickles its files: restore the directory as the job saved it, or start a fresh run
--checkpoint-dir: TMP/missing/step_10: '__1_0.distcp', which the job saved, is missing; refusing it, since loading a checkpoint unpickles its files: restore the directory as the job saved it, or start a fresh run
--checkpoint-dir: TMP/directory/step_10 holds 'extra', which is not a regular file (a save writes only files)
--checkpoint-dir: TMP/no_digests/step_10/job.json is not the job's record: 'files' is missing (the digests of the saved files, which every save of the job records)
--checkpoint-dir: TMP/bad_digest/step_10/job.json is not the job's record: 'files' must map each file's name to its sha256, got {'.metadata': '0'}""")  # noqa: E501

    def test_corrupt_or_escaping_checkpoint_is_refused_in_one_line(self) -> None:
        """A hand-edited or damaged checkpoint directory: ``job.json`` with non-numbers, wrong types,
        missing keys or no JSON at all, ``latest`` naming ``..``, an absolute path or a symbolic link
        out of the directory, a save without its metadata: exit 2 and one line, before any rank starts."""
        good = {"vocab": 64, "d_model": 64, "layers": 4, "heads": 4, "seq": 32, "step": 10, "global_batch": 16}
        jobs = [
            '{"step": Infinity}',
            '{"step": NaN, "vocab": 64}',
            json.dumps({**good, "step": "10"}),
            json.dumps({**good, "step": True}),
            json.dumps({**good, "step": 10**30}),
            json.dumps({**good, "world_size": 2.5}),
            json.dumps({k: v for k, v in good.items() if k != "d_model"}),
            json.dumps([good]),
            "step=10",
            "[" * 100_000,
        ]
        with tempfile.TemporaryDirectory() as tmp:
            cases = []
            for i, text in enumerate(jobs):
                root = Path(tmp, f"job{i}")
                _fake_checkpoint(root, 10)
                (root / "step_10" / "job.json").write_text(text)
                cases.append(root)
            outside = Path(tmp, "outside")
            _fake_checkpoint(outside, 10)
            for i, name in enumerate(["..", "../outside/step_10", str(outside / "step_10"), "escape", "."]):
                root = Path(tmp, f"pointer{i}")
                root.mkdir()
                (root / "escape").symlink_to(outside / "step_10")
                (root / "latest").write_text(name + "\n")
                cases.append(root)
            root = Path(tmp, "linked_latest")
            root.mkdir()
            (root / "latest").symlink_to(outside / "latest")
            cases.append(root)
            root = Path(tmp, "unfinished")
            _fake_checkpoint(root, 10)
            (root / "step_10" / ".metadata").unlink()
            cases.append(root)
            message = self._errors([["--checkpoint-dir", str(root), "--resume"] for root in cases])
            linked = Path(tmp, "linked")  # a step directory that is a link inside the directory is fine
            _fake_checkpoint(linked, 10)
            (linked / "step_12").symlink_to(linked / "step_10")
            (linked / "latest").write_text("step_12\n")
            self.assertEqual(parse_args(["--checkpoint-dir", str(linked), "--resume"]).checkpoint_dir, str(linked))
        self.assertExpectedInline(message.replace(os.path.realpath(tmp), "TMP").replace(tmp, "TMP"), """\
--checkpoint-dir: TMP/job0/latest names 'step_10', but TMP/job0/step_10/job.json cannot be read (Infinity is not a number a step or a size can be)
--checkpoint-dir: TMP/job1/latest names 'step_10', but TMP/job1/step_10/job.json cannot be read (NaN is not a number a step or a size can be)
--checkpoint-dir: TMP/job2/step_10/job.json is not the job's record: 'step' must be an integer from 1 to 1000000000, got '10'
--checkpoint-dir: TMP/job3/step_10/job.json is not the job's record: 'step' must be an integer from 1 to 1000000000, got True
--checkpoint-dir: TMP/job4/step_10/job.json is not the job's record: 'step' must be an integer from 1 to 1000000000, got 1000000000000000000000000000000
--checkpoint-dir: TMP/job5/step_10/job.json is not the job's record: 'world_size' must be an integer from 1 to 1000000000, got 2.5
--checkpoint-dir: TMP/job6/step_10/job.json is not the job's record: 'd_model' is missing
--checkpoint-dir: TMP/job7/step_10/job.json is not the job's record: a JSON object was expected, got list
--checkpoint-dir: TMP/job8/latest names 'step_10', but TMP/job8/step_10/job.json cannot be read (Expecting value: line 1 column 1 (char 0))
--checkpoint-dir: TMP/job9/latest names 'step_10', but TMP/job9/step_10/job.json cannot be read (maximum recursion depth exceeded while decoding a JSON array from a unicode string)
--checkpoint-dir: TMP/pointer0/latest names '..', which is not the name of a directory in TMP/pointer0
--checkpoint-dir: TMP/pointer1/latest names '../outside/step_10', which is not the name of a directory in TMP/pointer1
--checkpoint-dir: TMP/pointer2/latest names 'TMP/outside/step_10', which is not the name of a directory in TMP/pointer2
--checkpoint-dir: TMP/pointer3/latest names 'escape', which resolves to TMP/outside/step_10, outside TMP/pointer3
--checkpoint-dir: TMP/pointer4/latest names '.', which is not the name of a directory in TMP/pointer4
--checkpoint-dir: TMP/linked_latest/latest is not a regular file (the job writes it as one)
--checkpoint-dir: TMP/unfinished/step_10 has no .metadata: its save did not complete""")  # noqa: E501

    def test_defaults(self) -> None:
        args = parse_args([])
        self.assertEqual(
            (args.world_size, args.steps, args.global_batch, args.strategy, args.mixed_precision, args.device),
            (2, 20, 16, "FULL_SHARD", "none", "cpu"),
        )
        hybrid = parse_args(["--strategy", "HYBRID_SHARD", "--world-size", "4"])
        self.assertEqual(hybrid.shard_group_size, 2)
