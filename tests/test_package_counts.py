"""scripts/package_counts.py: the structural counts, on a fixture package (exact output) and on ours."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import expecttest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "package_counts.py"

FIXTURE = {
    "__init__.py": "from pkg.state import REGISTRY\n",
    "state.py": '''
        import collections
        import weakref
        from typing import Any

        REGISTRY: dict[str, int] = {}          # changed: item store
        _SEEN = weakref.WeakSet()              # changed: a mutating method
        _QUEUE = collections.deque()           # changed: appendleft in a lambda
        _COUNT = [0]                           # changed: N[0] += 1
        _NESTED = collections.defaultdict(list)  # changed: N[k].append(x)
        _FINAL = {}                            # changed: N.pop passed, not called
        _REBOUND = set()                       # changed: rebound under global
        _DELETED = {1: 2}                      # changed: del N[k]
        _IMPORT_TIME = []                      # filled at import time only
        _IMPORT_TIME.append(1)
        _READ_ONLY = {"a": 1}                  # only read
        _SHADOWED = []                         # a local of the same name is changed, not this
        _NOT_A_CONTAINER = None
        TUPLE = (1, 2)


        def register(name: str) -> None:
            REGISTRY[name] = len(REGISTRY)
            _COUNT[0] += 1
            _NESTED[name].append(_READ_ONLY["a"])
            del _DELETED[1]


        def reset() -> None:
            global _REBOUND, _NOT_A_CONTAINER
            _REBOUND = set()
            _NOT_A_CONTAINER = 1


        def shadow(_SHADOWED: list[int]) -> None:
            _SHADOWED.append(1)


        def local_copy() -> None:
            _SHADOWED = []
            _SHADOWED.append(1)


        class Tracker:
            push = staticmethod(lambda x: _QUEUE.appendleft(x))

            def see(self, obj: Any) -> None:
                _SEEN.add(obj)
                weakref.finalize(obj, _FINAL.pop, id(obj))

                def inner() -> None:
                    from pkg import helpers  # noqa: F401
                    global _TOP
                    _TOP = 1

                inner()
        ''',
    "helpers.py": '''
        import os


        def lazy() -> None:
            import json  # not the package
            from . import state  # relative: the package
            import pkg.state as s

            os.environ.get("X")
        ''',
    "sub/__init__.py": "",
    "sub/long.py": "x = 1\n" * 601,
    # a cycle through a TYPE_CHECKING import and a relative one: low -> high only for annotations
    "low.py": """
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from pkg.sub.high import High
        """,
    "sub/high.py": """
        from ..low import TYPE_CHECKING
        from pkg import helpers  # an edge out of the cycle, into another one
        """,
    "self_import.py": "import pkg.self_import\n",
    "frames_and_patches.py": """
        import inspect
        import sys

        import torch
        from torch.nn import utils


        class Box:
            def set(self, v: int) -> None:
                self.__dict__["v"] = v  # its own: not a patch


        def caller_locals() -> dict:
            return sys._getframe(1).f_locals


        def patch(module: torch.nn.Module, f: object) -> None:
            module.__dict__["forward"] = f
            vars(module)["x"] = 1
            module.__dict__.update(y=2)
            del module.__dict__["y"]
            torch.nn.utils.clip_grad_norm_ = f
            utils.clip_grad_norm_ = f
            setattr(torch.nn, "Linear", f)
            f.__closure__[0].cell_contents = 1
            module.weight = f  # an ordinary attribute of the user's module: not a patch
            frame = inspect.currentframe()
            frame.f_back
        """,
}


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("package_counts", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def test_counts_of_a_fixture_package(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    for name, text in FIXTURE.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    expecttest.TestCase().assertExpectedInline(
        _load_script().report(package),
        """\
lines in all: 701 in 9 files
files over 600 lines: 1
  sub/long.py: 601
import cycles: 3
  2 modules: pkg.helpers, pkg.state
  2 modules: pkg.low, pkg.sub.high
  1 module: pkg.self_import
module-level containers changed at run time: 8 in 1 files
  state.py:5: REGISTRY (dict) changed in register
  state.py:6: _SEEN (WeakSet) changed in Tracker.see
  state.py:7: _QUEUE (deque) changed in Tracker.<lambda>
  state.py:8: _COUNT (list) changed in register
  state.py:9: _NESTED (defaultdict) changed in register
  state.py:10: _FINAL (dict) changed in Tracker.see
  state.py:11: _REBOUND (set) changed in reset
  state.py:12: _DELETED (dict) changed in register
global statements: 2
  state.py:29: global _REBOUND, _NOT_A_CONTAINER in reset
  state.py:52: global _TOP in Tracker.see.inner
function-level imports of the package: 3
  helpers.py:6: from . import state in lazy
  helpers.py:7: import pkg.state as s in lazy
  state.py:51: from pkg import helpers in Tracker.see.inner
stack-frame reads: 3
  frames_and_patches.py:14: sys._getframe(1).f_locals in caller_locals
  frames_and_patches.py:27: inspect.currentframe() in patch
  frames_and_patches.py:28: frame.f_back in patch
patches (torch, another object's __dict__, closure cells): 8
  frames_and_patches.py:18: module.__dict__['forward'] = f in patch
  frames_and_patches.py:19: vars(module)['x'] = 1 in patch
  frames_and_patches.py:20: module.__dict__.update(y=2) in patch
  frames_and_patches.py:21: del module.__dict__['y'] in patch
  frames_and_patches.py:22: torch.nn.utils.clip_grad_norm_ = f in patch
  frames_and_patches.py:23: utils.clip_grad_norm_ = f in patch
  frames_and_patches.py:24: setattr(torch.nn, 'Linear', f) in patch
  frames_and_patches.py:25: f.__closure__[0].cell_contents = 1 in patch""",
    )


def test_runs_on_this_package() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(REPO / "fsdp_composable")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    headers = [line.split(":")[0] for line in proc.stdout.splitlines() if not line.startswith(" ")]
    assert headers == [
        "lines in all",
        "files over 600 lines",
        "import cycles",
        "module-level containers changed at run time",
        "global statements",
        "function-level imports of the package",
        "stack-frame reads",
        "patches (torch, another object's __dict__, closure cells)",
        "modules in no layer",
        "modules outside their layer's folder",
        "names in the layers with no module",
        "imports against the layers",
    ], proc.stdout
    # the registry is the one container the design allows; the script must see it
    assert "_composable_state.py" in proc.stdout, proc.stdout


LAYERED = {
    "__init__.py": "from pkg.top import Top\n",
    "base.py": """
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from pkg.top import Top  # an annotation counts
        """,
    "mid/__init__.py": "",
    "mid/work.py": "from pkg import base\n",
    "misplaced.py": "from pkg.mid import work\n",
    "top.py": """
        from pkg import misplaced
        from pkg.mid import work


        def late() -> None:
            from pkg import stray  # a function-level import counts
        """,
    "stray.py": "from pkg.mid import work\n",
}
FIXTURE_LAYERS = [
    ("low", "", {"": "base"}),
    ("mid", "", {"mid": "work misplaced gone"}),
    ("high", "", {"": "top __init__"}),
]


def test_layers_of_a_fixture_package(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    for name, text in LAYERED.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    script = _load_script()
    counts = script.count_package(package)
    expecttest.TestCase().assertExpectedInline(
        "\n".join(script.layer_report(counts, "pkg", FIXTURE_LAYERS)),
        """\
modules in no layer: 1
  pkg.stray: fits layers mid..high
modules outside their layer's folder: 1
  misplaced.py: belongs in mid/ (mid)
names in the layers with no module: 1
  gone
imports against the layers: 1
  base.py:4: pkg.top (low imports high)""",
    )


def test_refuses_a_directory_that_is_not_a_package(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "is not a package directory" in proc.stderr, proc.stderr
