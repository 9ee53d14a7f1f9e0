"""The benchmarks without matplotlib (installed by the ``bench`` and ``test`` extras only): every
chart writer says that the plot was skipped and returns, after the JSON was written, instead of
crashing; the closing line names only the files written."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks import _report, bench_scaling  # noqa: E402


def test_charts_are_skipped_with_a_message_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    png = str(tmp_path / "run.png")
    _report.write_time_bars(["ours"], [1.0], ["tab:blue"], png, "title", "ms")
    _report.write_chart([{"status": "ok"}], png, "title")
    bench_scaling.write_plot({}, png)
    said = capsys.readouterr().out.splitlines()
    assert said == [_report.NO_MATPLOTLIB] * 3, said
    assert "pip install -e '.[bench]'" in _report.NO_MATPLOTLIB
    assert not os.path.exists(png)
    assert _report.wrote("run.json", png) == "wrote run.json (no plot)"


def test_bench_extra_installs_matplotlib() -> None:
    text = Path(REPO_ROOT, "pyproject.toml").read_text(encoding="utf-8")
    extras = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    assert 'bench = ["matplotlib>=3.7"]' in extras, extras
    readme = Path(REPO_ROOT, "README.md").read_text(encoding="utf-8")
    assert "pip install -e '.[bench]'" in readme
