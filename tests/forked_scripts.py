"""Run scripts as ``python script.py`` would, in children forked from an interpreter that has
already imported torch and the package (the docs' examples, the benchmarks' smoke runs).

[Note: docs examples in forked interpreters]
Every docs example used to start a fresh interpreter, and about 4 s of each one's CPU went to
importing torch, fsdp_composable, torch._dynamo (which `fully_shard` loads for its hooks) and
torch.distributed.checkpoint before the example's first line of its own. A `Preloaded` server is
one interpreter that imports those and nothing else happens in it: no thread, no process group, no
tensor computed. For each script it forks a child that becomes what ``python script.py`` gives
after its imports: the script's directory first on ``sys.path``, the script's environment, its own
stdout and stderr files, ``__main__`` running the file (so ``torch.multiprocessing.spawn`` under
``if __name__ == "__main__":`` starts fresh rank interpreters as usual). The child leads its own
process group, so a timeout kills it with every rank it started. What a fork cannot give: an
environment variable a script sets for torch's import itself (the examples set only what
``init_process_group`` reads later); the README's first command still runs in a fresh virtualenv in CI.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

_SERVER = r"""
import json, os, sys
import gc
import torch, torch._dynamo, torch.distributed.checkpoint, fsdp_composable  # what every example pays
gc.freeze()  # and lives as long as every child: their full collections walk only what the script makes

def _child(request):
    os.setpgrp()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    import tempfile
    tempfile.tempdir = None  # read TMPDIR again
    out = os.open(os.path.join(request["out"], "stdout.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(os.path.join(request["out"], "stderr.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.argv = [request["script"], *request["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))
    code = 0
    try:
        import runpy
        runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # as the interpreter reports it (torch's hook prefixes "[rank0]:")
        code = 1
    import logging
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        _child(request)
    print(pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str


class Preloaded:
    """One server interpreter; `run` one script at a time (use one server per concurrent run)."""

    def __init__(self, env: dict[str, str]) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )

    def run(
        self,
        script: Path,
        env: dict[str, str],
        timeout: float,
        args: Sequence[str] = (),
        cwd: Optional[Path] = None,
        out: Optional[Path] = None,
    ) -> Finished:
        """``python script *args`` in ``cwd`` (default: the script's directory); its stdout and stderr
        go through files in ``out`` (default: the script's directory)."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        cwd, out = cwd or script.parent, out or script.parent
        request = {"script": str(script), "args": list(args), "env": env, "cwd": str(cwd), "out": str(out)}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        started = self._proc.stdout.readline()
        if not started:
            raise RuntimeError(f"the preloaded interpreter died before running {script}")
        timer = _Killer(int(started), timeout)
        try:
            line = self._proc.stdout.readline()
        finally:
            timer.cancel()
        if not line:
            raise RuntimeError(f"the preloaded interpreter died running {script}")
        code = int(line)
        stdout, stderr = ((out / name).read_text(errors="replace") for name in ("stdout.txt", "stderr.txt"))
        if timer.fired:
            raise subprocess.TimeoutExpired([str(script)], timeout, stdout, stderr)
        return Finished(code, stdout, stderr)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class PreloadedPool:
    """``size`` servers for as many concurrent runs; `run` borrows one for the length of a run."""

    def __init__(self, env: dict[str, str], size: int) -> None:
        self._free: queue.Queue[Preloaded] = queue.Queue()
        for _ in range(size):
            self._free.put(Preloaded(env))

    def run(self, *args: Any, **kwargs: Any) -> Finished:
        """`Preloaded.run` on a free server."""
        server = self._free.get()
        try:
            return server.run(*args, **kwargs)
        finally:
            self._free.put(server)

    def __enter__(self) -> "PreloadedPool":
        return self

    def __exit__(self, *exc: object) -> None:
        while not self._free.empty():
            self._free.get().close()


class _Killer:
    """Kill ``pid``'s process group (the script and the ranks it started) after ``timeout`` seconds."""

    def __init__(self, pid: int, timeout: float) -> None:
        self.fired = False
        self._pid = pid
        self._timer = threading.Timer(timeout, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        self.fired = True
        try:
            os.killpg(self._pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def cancel(self) -> None:
        self._timer.cancel()
