"""Print the package's structural counts: files over 600 lines, module-level containers changed at run
time, ``global`` statements, and function-level imports of the package.

    python scripts/package_counts.py [PACKAGE_DIR]      # default: fsdp_composable next to this script

Everything is read with `ast` (no imports, no regular expressions):

- a *module-level container* is a name bound at module level (outside functions and classes) to a
  list, dict or set display or comprehension, or to a call of ``list``, ``dict``, ``set``,
  ``collections.{defaultdict, OrderedDict, Counter, deque}`` or
  ``weakref.{WeakKeyDictionary, WeakValueDictionary, WeakSet}``; or to an instance of a class the
  same module defines (``N = Registry()``), or to an attribute of such an instance (an alias,
  ``M = N.states``). It is *changed at run time* when a function (or lambda) of the same module,
  without a local of that name, stores or deletes an item or attribute of it (``N[k] = v``,
  ``del N[k]``, ``N[k] += 1``, ``N.count += 1``, also ``N[a][b] = v`` and ``N.a[b] = v``), refers to
  one of its mutating methods (``N.append(x)``, ``N[k].add(x)``, ``N.a.add(x)``,
  ``finalize(obj, N.pop, k)``), or rebinds it under ``global N``. A container only filled at
  import time is not counted.
- a *function-level import of the package* is an ``import`` or ``from ... import`` inside a function
  whose module is the package, one of its submodules, or relative.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Union

MAX_LINES = 600
CONTAINER_CALLS = {
    "list",
    "dict",
    "set",
    "defaultdict",
    "OrderedDict",
    "Counter",
    "deque",
    "WeakKeyDictionary",
    "WeakValueDictionary",
    "WeakSet",
}
CONTAINER_NODES = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
MUTATING_METHODS = {
    "append",
    "appendleft",
    "clear",
    "difference_update",
    "discard",
    "extend",
    "extendleft",
    "insert",
    "intersection_update",
    "pop",
    "popitem",
    "popleft",
    "remove",
    "reverse",
    "setdefault",
    "sort",
    "symmetric_difference_update",
    "update",
    "add",
    "__setitem__",
    "__delitem__",
}
Function = Union[ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda]


@dataclass
class Container:
    name: str
    kind: str
    line: int
    changed_in: list[str] = field(default_factory=list)


@dataclass
class FileCounts:
    path: str
    lines: int
    containers: list[Container]
    globals_: list[tuple[int, str, str]]  # (line, names, function)
    imports: list[tuple[int, str, str]]  # (line, statement, function)


def _container_kind(value: Optional[ast.expr]) -> Optional[str]:
    if isinstance(value, CONTAINER_NODES):
        return type(value).__name__.lower()
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name in CONTAINER_CALLS:
            return name
    return None


def _module_containers(tree: ast.Module) -> dict[str, Container]:
    found: dict[str, Container] = {}
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    for node in tree.body:  # top-level statements only: not functions, not class bodies
        targets: list[ast.expr] = []
        value: Optional[ast.expr] = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        kind = _container_kind(value)
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in classes:
            kind = f"{value.func.id} instance"
        elif isinstance(value, ast.Attribute) and _root_name(value) in found:
            kind = f"alias of {ast.unparse(value)}"
        for target in targets:
            if isinstance(target, ast.Name) and kind is not None:
                found[target.id] = Container(target.id, kind, node.lineno)
    return found


def _root_name(node: ast.expr) -> Optional[str]:
    """``N`` for ``N``, ``N[k]``, ``N[a][b]``, ``N.a``, ``N.a[b]``; None otherwise."""
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _functions(tree: ast.AST) -> Iterator[tuple[Function, str]]:
    """Every function and lambda, with a dotted name for messages."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[Function, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                yield child, name
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.Lambda):
                yield child, f"{prefix}<lambda>"
                yield from walk(child, prefix)
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def _own_nodes(fn: Function) -> Iterator[ast.AST]:
    """The nodes of ``fn``'s body, not those of functions nested in it (they are visited on their own)."""
    nested = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
    stack: list[ast.AST] = list(fn.body) if isinstance(fn.body, list) else [fn.body]
    while stack:
        node = stack.pop()
        if isinstance(node, nested):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _locals(fn: Function, declared: set[str]) -> set[str]:
    args = fn.args
    names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
    names |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    for node in _own_nodes(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names - declared


def _changes(fn: Function, containers: dict[str, Container]) -> set[str]:
    """The module containers ``fn`` changes (see the module docstring)."""
    declared: set[str] = set()
    for node in _own_nodes(fn):
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            declared |= set(node.names)
    shadowed = _locals(fn, declared)
    changed: set[str] = set()
    for node in _own_nodes(fn):
        name: Optional[str] = None
        if isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, (ast.Store, ast.Del)):
            name = _root_name(node.value)
        elif isinstance(node, ast.Attribute) and node.attr in MUTATING_METHODS:
            name = _root_name(node.value)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)) and node.id in declared:
            name = node.id  # rebound under `global`
        if name in containers and name not in shadowed:
            changed.add(name)
    return changed


def _is_package_import(node: Union[ast.Import, ast.ImportFrom], package: str) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == package
    return any(alias.name.split(".")[0] == package for alias in node.names)


def count_file(path: Path, rel: str, package: str) -> FileCounts:
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, filename=str(path))
    containers = _module_containers(tree)
    globals_: list[tuple[int, str, str]] = []
    imports: list[tuple[int, str, str]] = []
    for fn, fn_name in _functions(tree):
        for name in sorted(_changes(fn, containers)):
            containers[name].changed_in.append(fn_name)
        for node in _own_nodes(fn):
            if isinstance(node, ast.Global):
                globals_.append((node.lineno, ", ".join(node.names), fn_name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)) and _is_package_import(node, package):
                imports.append((node.lineno, ast.unparse(node), fn_name))
    changed = sorted((c for c in containers.values() if c.changed_in), key=lambda c: c.line)
    return FileCounts(rel, len(source.splitlines()), changed, sorted(globals_), sorted(imports))


def count_package(package_dir: Path) -> list[FileCounts]:
    package = package_dir.name
    files = sorted(p for p in package_dir.rglob("*.py") if "__pycache__" not in p.parts)
    return [count_file(p, p.relative_to(package_dir).as_posix(), package) for p in files]


def report(package_dir: Path) -> str:
    counts = count_package(package_dir)
    long_files = sorted((c for c in counts if c.lines > MAX_LINES), key=lambda c: -c.lines)
    with_containers = [c for c in counts if c.containers]
    lines = [f"files over {MAX_LINES} lines: {len(long_files)}"]
    lines += [f"  {c.path}: {c.lines}" for c in long_files]
    n_containers = sum(len(c.containers) for c in counts)
    lines.append(f"module-level containers changed at run time: {n_containers} in {len(with_containers)} files")
    for c in with_containers:
        for k in c.containers:
            where = ", ".join(dict.fromkeys(k.changed_in))
            lines.append(f"  {c.path}:{k.line}: {k.name} ({k.kind}) changed in {where}")
    n_globals = sum(len(c.globals_) for c in counts)
    lines.append(f"global statements: {n_globals}")
    lines += [f"  {c.path}:{line}: global {names} in {fn}" for c in counts for line, names, fn in c.globals_]
    n_imports = sum(len(c.imports) for c in counts)
    lines.append(f"function-level imports of the package: {n_imports}")
    lines += [f"  {c.path}:{line}: {stmt} in {fn}" for c in counts for line, stmt, fn in c.imports]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = Path(__file__).resolve().parent.parent / "fsdp_composable"
    parser.add_argument("package_dir", nargs="?", type=Path, default=default)
    args = parser.parse_args(argv)
    if not (args.package_dir / "__init__.py").is_file():
        parser.error(f"{args.package_dir} is not a package directory (no __init__.py)")
    print(report(args.package_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
