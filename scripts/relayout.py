"""Move fsdp_composable's modules into the folders of their layers and rewrite every reference to them.

    python scripts/package_counts.py | grep -A9 "modules in no layer"   # 0? else place them in LAYERS
    python scripts/relayout.py --dry-run      # the moves and the files it would rewrite
    python scripts/relayout.py                # moves, rewrites, checks; exit status 0 when all hold
    ruff check fsdp_composable tests scripts && mypy fsdp_composable
    git add -A && git commit -m "the package in the folders of its layers (scripts/relayout.py)"

Run at the repository root, on a clean tree (it refuses a dirty one: the moves and rewrites should be one
commit of their own, ``git add -A && git commit``). It is re-runnable: a module already in its folder is
left where it is, and a second run on a relaid tree changes nothing.

Where a module goes is read from `LAYERS` in scripts/package_counts.py (one table for the layering check
and for this script). A module the table does not know stops the run before anything changes, naming the
layers its imports and importers allow: add it to `LAYERS` first.

What it does:

1. ``git mv`` every package module whose folder is not its layer's folder, keeping its file name (so the
   name code binds, ``_collectives`` in ``from fsdp_composable._comm import _collectives``, is unchanged
   and only import statements and dotted paths change); writes an ``__init__.py`` holding the layer's
   description in every new folder. ``fsdp_composable._flat_param``, ``fsdp_composable._common_utils``,
   ``__init__``, ``__main__`` and the public modules stay at the top level (their layers put them there).
2. Rewrites, in every tracked text file but the CHANGELOG (history), benchmarks/results/ (recorded
   measurements) and this script and its test (they name old paths on purpose): in Python files,
   each ``from fsdp_composable import _a, b`` (split by the new parent of each name) and
   ``from fsdp_composable._a import x``; in every file, each dotted path
   ``fsdp_composable._a`` (``import fsdp_composable._a``, strings such as monkeypatch targets and
   ``mock.patch("fsdp_composable._a.f")``, ``python -m fsdp_composable._a``, docs) and each file path
   ``fsdp_composable/_a.py``; and single-line ``from fsdp_composable import ...`` that is text
   (Markdown, or a script inside a Python string). A name that is not a moved module
   (``fsdp_composable.lightning``, ``fsdp_composable.api``) is left alone.
3. Sorts and wraps the rewritten import blocks (``ruff check --select I --fix``, when ruff is installed).
4. Checks (unless ``--skip-checks``): scripts/package_counts.py reports no import cycle, no module in no
   layer, none outside its folder and no import against the layers; every module of the package
   imports; no tracked file (but those left as written) still names a moved module's old path.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path
from types import ModuleType
from typing import Optional

PACKAGE = "fsdp_composable"
REPO = Path(__file__).resolve().parent.parent
# kept as written: the changelog is history, benchmark results record the paths that were measured, and
# this script and its test name old paths on purpose
NOT_REWRITTEN = ("CHANGELOG.md", "benchmarks/results/", "scripts/relayout.py", "tests/test_relayout.py")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".cfg", ".ini", ".txt", ".yml", ".yaml", ".sh", ".json", ""}


def _load_counts() -> ModuleType:
    spec = importlib.util.spec_from_file_location("package_counts", REPO / "scripts" / "package_counts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout


def _dotted(rel: Path) -> str:
    """``_comm/_collectives.py`` -> ``fsdp_composable._comm._collectives``."""
    return ".".join([PACKAGE, *rel.with_suffix("").parts])


def plan_moves(counts: ModuleType) -> tuple[dict[Path, Path], dict[str, str]]:
    """(file moves, relative to the package; old dotted path -> new), or exit naming unknown modules."""
    places = counts.layer_places(counts.LAYERS)
    package_dir = REPO / PACKAGE
    moves: dict[Path, Path] = {}
    unknown: list[str] = []
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir)
        if "__pycache__" in rel.parts or rel.name == "__init__.py":
            continue
        place = places.get(rel.stem)
        if place is None:
            unknown.append(rel.as_posix())
            continue
        target = Path(place[1]) / rel.name if place[1] else Path(rel.name)
        if target != rel:
            moves[rel] = target
    if unknown:
        lines = counts.layer_report(counts.count_package(package_dir), PACKAGE, counts.LAYERS)
        report = "\n".join(line for line in lines if line.startswith("  " + PACKAGE) or "no layer" in line)
        sys.exit(
            f"relayout: {len(unknown)} module(s) in no layer of LAYERS (scripts/package_counts.py): "
            f"{', '.join(unknown)}; add each to the layer its imports allow, then run again:\n{report}"
        )
    renamed = {_dotted(old): _dotted(new) for old, new in moves.items()}
    return moves, renamed


def _folders_of(moves: dict[Path, Path]) -> list[Path]:
    """Every folder the moves need, parents first."""
    folders: set[Path] = set()
    for target in moves.values():
        for parent in target.parents:
            if parent != Path("."):
                folders.add(parent)
    return sorted(folders, key=lambda p: (len(p.parts), p.as_posix()))


def _init_text(counts: ModuleType, folder: Path) -> str:
    key = folder.as_posix()
    for name, what, folders in counts.LAYERS:
        if key in folders:
            children = sorted(f for f in folders if f.startswith(key + "/"))
            subs = f" Subfolders: {', '.join(c.rpartition('/')[2] + '/' for c in children)}." if children else ""
            text = f"The {name} layer, {what}.{subs} Nothing here imports a higher layer: the layers, bottom "
            text += "first, are `LAYERS` in scripts/package_counts.py."
            return '"""' + "\n".join(textwrap.wrap(text, 110)) + '\n"""\n'
    return '"""The layers, bottom first, are `LAYERS` in scripts/package_counts.py."""\n'


# ----------------------------------------------------------------------------------------------- rewriting
def _comments(source_lines: list[str], first: int, last: int) -> tuple[list[str], str]:
    """The comments inside lines ``first..last`` (1-based): (standalone or inner ones, the last line's)."""
    text = "\n".join(source_lines[first - 1 : last]) + "\n"
    found: list[tuple[int, str]] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                found.append((tok.start[0], tok.string))
    except tokenize.TokenError:
        pass
    trailing = found[-1][1] if found and found[-1][0] == last - first + 1 else ""
    inner = [c for _, c in (found[:-1] if trailing else found)]
    return inner, trailing


def _new_import_lines(node: ast.ImportFrom, renamed: dict[str, str]) -> Optional[list[str]]:
    """The statements replacing ``node`` (one per new parent, first appearance first), None to keep it."""
    module = node.module or ""
    if node.level or not (module == PACKAGE or module.startswith(PACKAGE + ".")):
        return None

    def alias(a: ast.alias) -> str:
        return f"{a.name} as {a.asname}" if a.asname else a.name

    if module != PACKAGE:
        if module not in renamed:
            return None
        return [f"from {renamed[module]} import {', '.join(alias(a) for a in node.names)}"]
    groups: dict[str, list[str]] = {}
    for a in node.names:
        new = renamed.get(f"{PACKAGE}.{a.name}")
        parent = new.rpartition(".")[0] if new else PACKAGE
        groups.setdefault(parent, []).append(alias(a))
    if list(groups) == [PACKAGE]:
        return None
    return [f"from {parent} import {', '.join(names)}" for parent, names in groups.items()]


def rewrite_python_imports(source: str, renamed: dict[str, str], where: str) -> str:
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    bare = [line.rstrip("\r\n") for line in lines]
    edits: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level and where.startswith(PACKAGE + "/"):
            sys.exit(f"relayout: {where}:{node.lineno}: a relative import; make it absolute first")
        if not isinstance(node, ast.ImportFrom):
            continue
        new = _new_import_lines(node, renamed)
        if new is None:
            continue
        first, last = node.lineno, node.end_lineno or node.lineno
        before = bare[first - 1][: node.col_offset]
        after = bare[last - 1][node.end_col_offset :]
        inner, trailing = _comments(bare, first, last)
        if before.strip() or (after.strip() and not after.strip().startswith("#")):
            sys.exit(f"relayout: {where}:{first}: an import sharing its line with another statement; split it first")
        indent = before
        suffix = f"  {trailing}" if trailing else ""
        text = "".join(f"{indent}{c}\n" for c in inner) + "".join(f"{indent}{s}{suffix}\n" for s in new)
        edits.append((first, last, text))
    for first, last, text in sorted(edits, reverse=True):
        lines[first - 1 : last] = [text]
    return "".join(lines)


def _dotted_pattern(renamed: dict[str, str]) -> Optional[re.Pattern[str]]:
    names = sorted((old.removeprefix(PACKAGE + ".") for old in renamed), key=len, reverse=True)
    if not names:
        return None
    return re.compile(rf"(?<![\w.]){PACKAGE}([./])({'|'.join(map(re.escape, names))})(?![\w])")


_MD_FROM_PACKAGE = re.compile(rf"^([ \t]*)from {PACKAGE} import ([\w, ]+?)([ \t]*(?:#.*)?)$", re.M)


def rewrite_text(text: str, renamed: dict[str, str]) -> str:
    """Dotted paths and file paths of moved modules, and single-line package imports that are text
    (Markdown, or code in a Python string: the statements themselves went through the AST)."""

    def split(m: re.Match[str]) -> str:
        names = [n.strip() for n in m.group(2).split(",") if n.strip()]
        node = ast.parse(f"from {PACKAGE} import {', '.join(names)}").body[0]
        assert isinstance(node, ast.ImportFrom)
        new = _new_import_lines(node, renamed)
        return m.group(0) if new is None else "\n".join(m.group(1) + s + m.group(3) for s in new)

    text = _MD_FROM_PACKAGE.sub(split, text)
    pattern = _dotted_pattern(renamed)
    if pattern is None:
        return text

    def repl(m: re.Match[str]) -> str:
        new = renamed[f"{PACKAGE}.{m.group(2)}"]
        if m.group(1) == ".":
            return new
        return new.replace(".", "/")  # a file path: fsdp_composable/_a(.py) -> fsdp_composable/_comm/_a(.py)

    return pattern.sub(repl, text)


def _tracked_text_files() -> list[Path]:
    files = []
    for name in _git("ls-files").splitlines():
        if name.startswith(NOT_REWRITTEN):
            continue
        path = REPO / name
        if path.suffix in TEXT_SUFFIXES and path.is_file():
            files.append(path)
    return files


def rewrite_all(renamed: dict[str, str], dry_run: bool) -> list[Path]:
    changed = []
    for path in _tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        rel = path.relative_to(REPO).as_posix()
        new = text
        if path.suffix == ".py":
            new = rewrite_python_imports(new, renamed, rel)
        new = rewrite_text(new, renamed)
        if new != text:
            changed.append(path)
            if not dry_run:
                path.write_text(new, encoding="utf-8")
    return changed


# ---------------------------------------------------------------------------------------------------- checks
def check(counts: ModuleType, renamed_ever: dict[str, str]) -> list[str]:
    problems = []
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "package_counts.py")], cwd=REPO, capture_output=True, text=True
    ).stdout
    for header in (
        "import cycles",
        "modules in no layer",
        "modules outside their layer's folder",
        "imports against the layers",
    ):
        line = next((x for x in out.splitlines() if x.startswith(header + ":")), f"{header}: (missing)")
        if line != f"{header}: 0":
            problems.append(f"package_counts: {line}")
    code = (
        "import importlib, pkgutil, fsdp_composable\n"
        "for info in pkgutil.walk_packages(fsdp_composable.__path__, 'fsdp_composable.'):\n"
        "    if info.name == 'fsdp_composable.__main__':\n"
        "        continue\n"
        "    try:\n"
        "        importlib.import_module(info.name)\n"
        "    except ImportError as e:\n"
        "        if (e.name or '').startswith('fsdp_composable'):\n"
        "            raise\n"  # an optional framework (lightning) not installed is fine
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's package, not an installed one
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env)
    if proc.returncode:
        problems.append(f"importing every module failed:\n{proc.stderr[-3000:]}")
    pattern = _dotted_pattern(renamed_ever)
    if pattern is not None:
        for path in _tracked_text_files():
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                problems.append(f"{path.relative_to(REPO)}:{line}: still names {m.group(0)}")
    return problems


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the moves and the files to rewrite only")
    parser.add_argument("--allow-dirty", action="store_true", help="run on a tree with uncommitted changes")
    parser.add_argument("--skip-checks", action="store_true", help="do not run the checks of step 4")
    args = parser.parse_args(argv)
    if Path.cwd().resolve() != REPO:
        parser.error(f"run it at the repository root ({REPO})")
    if not args.allow_dirty and _git("status", "--porcelain").strip():
        parser.error("the tree has uncommitted changes: commit them first (or pass --allow-dirty)")
    counts = _load_counts()
    moves, renamed = plan_moves(counts)
    for old, new in moves.items():
        print(f"move {PACKAGE}/{old.as_posix()} -> {PACKAGE}/{new.as_posix()}")
    if args.dry_run:
        for path in rewrite_all(renamed, dry_run=True):
            print(f"rewrite {path.relative_to(REPO)}")
        return 0
    package_dir = REPO / PACKAGE
    for folder in _folders_of(moves):
        init = package_dir / folder / "__init__.py"
        if not init.exists():
            init.parent.mkdir(parents=True, exist_ok=True)
            init.write_text(_init_text(counts, folder), encoding="utf-8")
            _git("add", str(init))
            print(f"create {PACKAGE}/{folder.as_posix()}/__init__.py")
    for old, new in moves.items():
        _git("mv", f"{PACKAGE}/{old.as_posix()}", f"{PACKAGE}/{new.as_posix()}")
    changed = rewrite_all(renamed, dry_run=False)
    for path in changed:
        print(f"rewrite {path.relative_to(REPO)}")
    python_files = [str(p) for p in changed if p.suffix == ".py"]
    ruff = shutil.which("ruff")
    if python_files and ruff is not None:  # the rewritten import blocks, sorted and wrapped to the line length
        subprocess.run([ruff, "check", "--select", "I", "--fix", "--quiet", *python_files], cwd=REPO)
    elif python_files:
        print("ruff not found: run `ruff check --select I --fix` on the rewritten files", file=sys.stderr)
    print(f"moved {len(moves)} modules, rewrote {len(changed)} files")
    if args.skip_checks:
        return 0
    # the old paths of every module now in a folder: none may be named anywhere any more
    everywhere = {
        f"{PACKAGE}.{Path(p).stem}": _dotted(Path(p).relative_to(PACKAGE))
        for p in _git("ls-files", PACKAGE).splitlines()
        if p.endswith(".py") and not p.endswith("__init__.py") and len(Path(p).parts) > 2
    }
    problems = check(counts, everywhere)
    for problem in problems:
        print(f"check: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(
        "checks: no import cycle, every module in its layer's folder, no import against the layers, "
        "every module imports, no old path left"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
