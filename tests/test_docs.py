"""Every ```python block in README.md and docs/*.md runs, as written, as a script.

Blocks fenced ```python are meant to run: each starts its own process group (usually one gloo rank
on a `FileStore` in a temporary directory) and destroys it. Fragments that cannot run on their own
(``torchrun`` commands, signatures, excerpts) are fenced ```bash or ```text and are not collected.
Each block is written to its own file and run as ``python block.py`` would run it (in a child
forked from an interpreter that has imported torch and the package already: [Note: docs examples in
forked interpreters]), so a block may start ranks with ``torch.multiprocessing.spawn`` under
``if __name__ == "__main__":``.

The selected blocks run two at a time from the first block's test on (`concurrent_runs`); each
block's test reports its own block's result. Every block has its own directory and store, and picks
a free port if it needs one.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from concurrent.futures import Future
from pathlib import Path
from typing import Iterator, Optional

import pytest
from concurrent_runs import AT_ONCE, selected_tests, started_together
from forked_scripts import Finished, PreloadedPool

import fsdp_composable

REPO = Path(__file__).resolve().parent.parent
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
INLINE_CODE = re.compile(r"`+[^`\n]*`+")
# Blocks for an optional framework import it: they skip when the extra is not installed.
OPTIONAL = re.compile(r"^\s*(?:from|import)\s+(?:fsdp_composable\.)?(lightning|accelerate|torchao)\b", re.M)


def _blocks_of(text: str) -> list[tuple[str, str]]:
    return [(lang.strip(), body) for lang, body in FENCE.findall(text)]


def _blocks(path: Path) -> list[tuple[str, str]]:
    return _blocks_of(path.read_text(encoding="utf-8"))


def _python_blocks() -> list[tuple[str, str]]:
    out = []
    for path in DOC_FILES:
        python = [body for lang, body in _blocks(path) if lang == "python"]
        out += [(f"{path.relative_to(REPO).as_posix()}:{i}", body) for i, body in enumerate(python)]
    return out


PYTHON_BLOCKS = _python_blocks()


def _missing_extra(body: str) -> Optional[str]:
    return next((e for e in sorted(set(OPTIONAL.findall(body))) if importlib.util.find_spec(e) is None), None)


def _block_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run_block(servers: PreloadedPool, body: str, directory: Path) -> Finished:
    script = directory / "block.py"
    script.write_text(body, encoding="utf-8")
    # the examples' mkdtemp() stores land where pytest cleans up
    return servers.run(script, {**_block_env(), "TMPDIR": str(directory)}, timeout=120)


@pytest.fixture(scope="module")
def block_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future]]:
    selected = selected_tests(request)
    blocks = [
        (name, body)
        for name, body in PYTHON_BLOCKS
        if f"test_python_block_runs[{name}]" in selected and _missing_extra(body) is None
    ]
    # see [Note: docs examples in forked interpreters]
    with PreloadedPool(_block_env(), min(AT_ONCE, len(blocks))) as servers:
        jobs = {
            name: functools.partial(_run_block, servers, body, tmp_path_factory.mktemp("block"))
            for name, body in blocks
        }
        with started_together(jobs) as runs:
            yield runs


@pytest.mark.parametrize("name", [name for name, _ in PYTHON_BLOCKS], ids=[name for name, _ in PYTHON_BLOCKS])
def test_python_block_runs(name: str, block_runs: dict[str, Future]) -> None:
    body = dict(PYTHON_BLOCKS)[name]
    extra = _missing_extra(body)
    if extra is not None:
        pytest.skip(f"{extra} is not installed: pip install -e '.[{extra}]'")
    proc = block_runs[name].result()
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"


def test_docs_have_python_blocks() -> None:
    # the collection above silently finding nothing would make the docs untested
    assert len(PYTHON_BLOCKS) >= 8, [name for name, _ in PYTHON_BLOCKS]


def test_fences_are_closed_and_labelled() -> None:
    for path in DOC_FILES:
        text = path.read_text(encoding="utf-8")
        fences = [line for line in text.splitlines() if line.lstrip().startswith("```")]
        assert len(fences) % 2 == 0, f"{path.name}: an unclosed ``` fence"
        for lang, _ in _blocks(path):
            assert lang in ("python", "bash", "text"), f"{path.name}: fence ```{lang}: use python, bash or text"


def test_relative_links_resolve() -> None:
    for path in DOC_FILES:
        prose = INLINE_CODE.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))
        for target in LINK.findall(prose):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (path.parent / target).exists(), f"{path.relative_to(REPO)} links to missing {target}"


def test_every_public_name_is_documented() -> None:
    text = "\n".join(p.read_text(encoding="utf-8") for p in DOC_FILES)
    missing = [name for name in fsdp_composable.__all__ if f"`{name}" not in text]
    assert not missing, f"public names with no mention in README.md or docs/*.md: {missing}; add them to docs/api.md"


def test_quickstart_is_two_commands_and_ci_runs_the_test_one() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    bash = [body for lang, body in _blocks_of(quickstart) if lang == "bash"]
    commands = bash[0].strip().splitlines()
    assert commands == [
        "pip install -e . && python -m fsdp_composable",
        "pip install -e '.[test]' && python -m pytest -q",
    ]
    # a machine without a GPU needs torch's CPU build before `pip install -e .` pulls the CUDA one
    cpu_build = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert cpu_build in quickstart.split("```bash", 1)[0], "the CPU-build note must come before the commands"
    ci = REPO / ".ci" / "run"
    assert os.access(ci, os.X_OK), ".ci/run must be executable"
    lines = [line.strip() for line in ci.read_text(encoding="utf-8").splitlines()]
    assert "set -euo pipefail" in lines and commands[1] in lines
