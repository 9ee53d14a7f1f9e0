"""Which device the package's collectives are placed on, read from its source: nothing asks for the
current CUDA device where a unit's device is known (with ``device_id=k`` and no ``set_device(k)``
every rank would use cuda:0), and the communication device is always asked with the unit's device.
tests/test_device_id_index.py drives the same places with two fake CUDA devices."""

from __future__ import annotations

import ast
import glob
import os

from expecttest import TestCase

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fsdp_composable")

# where the current CUDA device is the right answer, and why
_CURRENT_DEVICE_ALLOWED = {
    "_collectives.py:comm_device": "no unit to ask (an entry point without one), or a unit on another device type",
    "_init_utils.py:_init_device": "a model all on meta without device_id lands on the current device, as FSDP1's",
    "_init_utils.py:_check_device_id": "device_id=torch.device('cuda') without an index means the current device",
    "_to_empty.py:_normal": "a 'cuda' without an index given to to_empty means the current device",
}
# helpers whose device argument falls back to the current device when left out
_NEEDS_DEVICE = {"comm_device": 2, "comm_tensor": 3, "comm_device_current": 2}


def _findings() -> list[str]:
    found: list[str] = []
    for path in sorted(glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True)):  # subpackages too
        name = os.path.basename(path)
        with open(path) as f:
            tree = ast.parse(f.read())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for call in ast.walk(fn):
                if not isinstance(call, ast.Call):
                    continue
                func = call.func
                attr = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
                where = f"{name}:{fn.name}"
                if attr == "current_device" and where not in _CURRENT_DEVICE_ALLOWED:
                    found.append(f"{where} asks for the current CUDA device")
                needed = _NEEDS_DEVICE.get(attr)
                given = len(call.args) + len(call.keywords)
                if needed is not None and given < needed and not (name == "_collectives.py" and fn.name == attr):
                    found.append(f"{where} calls {attr} without the unit's device")
    return sorted(set(found))


class TestDeviceChoice(TestCase):
    def test_no_current_device_where_the_units_device_is_known(self) -> None:
        self.assertExpectedInline("\n".join(_findings()), """""")
