"""scripts/relayout.py's rewriting of references to moved modules: import statements (split by new
parent, comments kept), dotted paths in code and strings, file paths, and package imports written as
text; names that are not moved modules are left alone."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import expecttest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "relayout.py"
RENAMED = {
    "fsdp_composable._collectives": "fsdp_composable._comm._collectives",
    "fsdp_composable._reduce_utils": "fsdp_composable._grads._reduce_utils",
    "fsdp_composable._fsdp1_static": "fsdp_composable._compat.fsdp1._fsdp1_static",
}


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("relayout", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_rewrites_python_sources() -> None:
    source = textwrap.dedent(
        '''
        import fsdp_composable._collectives as collectives
        from fsdp_composable import ModuleWrapPolicy, _collectives, _flat_param, _reduce_utils as grads
        from fsdp_composable._reduce_utils import (  # the reductions
            PendingReduce,
            # the one the test patches
            start_reduce,
        )
        from fsdp_composable.lightning import FabricStrategy  # noqa: E402
        from torch.distributed.algorithms._comm_hooks import default_hooks


        def spy(monkeypatch) -> None:
            from fsdp_composable import _fsdp1_static

            monkeypatch.setattr("fsdp_composable._collectives.all_reduce", None)
            script = """
        from fsdp_composable import _collectives, fully_shard
        """
            note = "see fsdp_composable/_reduce_utils.py; fsdp_composable._collectives_x is another name"
        '''
    ).lstrip("\n")
    relayout = _load_script()
    rewritten = relayout.rewrite_text(relayout.rewrite_python_imports(source, RENAMED, "tests/x.py"), RENAMED)
    expecttest.TestCase().assertExpectedInline(
        rewritten,
        '''\
import fsdp_composable._comm._collectives as collectives
from fsdp_composable import ModuleWrapPolicy, _flat_param
from fsdp_composable._comm import _collectives
from fsdp_composable._grads import _reduce_utils as grads
# the reductions
# the one the test patches
from fsdp_composable._grads._reduce_utils import PendingReduce, start_reduce
from fsdp_composable.lightning import FabricStrategy  # noqa: E402
from torch.distributed.algorithms._comm_hooks import default_hooks


def spy(monkeypatch) -> None:
    from fsdp_composable._compat.fsdp1 import _fsdp1_static

    monkeypatch.setattr("fsdp_composable._comm._collectives.all_reduce", None)
    script = """
from fsdp_composable._comm import _collectives
from fsdp_composable import fully_shard
"""
    note = "see fsdp_composable/_grads/_reduce_utils.py; fsdp_composable._collectives_x is another name"
''',
    )
    # a second run changes nothing
    assert relayout.rewrite_text(relayout.rewrite_python_imports(rewritten, RENAMED, "x.py"), RENAMED) == rewritten


def test_rewrites_markdown() -> None:
    text = textwrap.dedent(
        """
        Read [Note: x] in `fsdp_composable/_collectives.py`, or run `python -m fsdp_composable`.

        ```python
        import fsdp_composable._collectives as collectives
        from fsdp_composable import fully_shard, _reduce_utils  # private
        ```
        """
    )
    expecttest.TestCase().assertExpectedInline(
        _load_script().rewrite_text(text, RENAMED),
        """\

Read [Note: x] in `fsdp_composable/_comm/_collectives.py`, or run `python -m fsdp_composable`.

```python
import fsdp_composable._comm._collectives as collectives
from fsdp_composable import fully_shard  # private
from fsdp_composable._grads import _reduce_utils  # private
```
""",
    )
