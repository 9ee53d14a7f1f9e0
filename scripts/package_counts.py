"""Print the package's structural counts: its size, files over 600 lines, import cycles, module-level
containers changed at run time, ``global`` statements, function-level imports of the package, stack-frame
reads, and patches (stores into torch, into another object's ``__dict__``, into a closure's cells); for
fsdp_composable also its layers (`LAYERS`): modules in no layer, modules outside their layer's folder,
names in the layers with no module, and imports against the layers.

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
- an *import cycle* is a set of two or more of the package's modules that import each other, directly or
  through others (a strongly connected component of the import graph), or a module that imports itself.
  Every ``import``/``from ... import`` of the package counts, wherever it stands, ``TYPE_CHECKING``
  blocks and functions included; ``from pkg.a import b`` is an edge to ``pkg.a.b`` when that is a
  module, else to ``pkg.a``. The parent packages Python initialises on the way are not edges.
- a *stack-frame read* is a call of ``sys._getframe``, ``inspect.currentframe``/``stack``/
  ``getouterframes``/``getframeinfo`` or ``traceback.extract_stack``/``walk_stack``, or a read of a
  frame's ``f_back``, ``f_locals`` or ``f_globals``.
- the *layers* (`LAYERS`, fsdp_composable's, bottom first) place every module, by its name (the last
  part of its dotted name, which a move into another folder keeps), in one layer and one folder of the
  package. An *import against the layers* is an import (counted as for cycles: ``TYPE_CHECKING`` blocks
  and functions included) of a module of a higher layer than the importing one's; imports within a
  layer go either way. A module in no layer is listed with the layers its imports and importers leave
  it (from the highest layer it imports to the lowest that imports it).
- a *patch* is a store (or ``del``) into an attribute of a name imported from torch
  (``torch.nn.utils.clip_grad_norm_ = f``) or a ``setattr`` on one; a store, ``del`` or mutating call
  on the ``__dict__`` of anything but ``self`` (``module.__dict__["f"] = g``, ``vars(m)[k] = v``); or
  a store into a closure cell (``cell.cell_contents = x``).
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

# [Note: the layers]
# fsdp_composable's layers, bottom first: (name, what it holds, {folder: its modules}); "" is the package's
# top level. Nothing imports a module of a higher layer (annotations included). A module is named by the
# last part of its dotted name, so the table reads the same before and after `scripts/relayout.py` moves
# the modules into their folders (a folder's ``__init__`` belongs to the folder's layer).
Layers = list[tuple[str, str, dict[str, str]]]
LAYERS: Layers = [
    (
        "base",
        "records every layer shares: public enums, configs and errors, unit configs, the registry, state "
        "machines, per-unit switches, gradient records, safety switches, copy refusal, param-major index arithmetic, "
        "contiguous strides",
        {
            "": "api _config _composable_state",
            "_base": "_state_machine _copy_guard _safety _unit_switches _grad_records _grad_mode _param_major _strides",
        },
    ),
    (
        "comm",
        "collectives and their communication device, streams and events, rank-agreement headers, tracing "
        "labels, tensor-parallel meshes and placements",
        {"_comm": "_header_fields _trace _rank_agreement _exchanges _collectives _tensor_parallel _custom_comms"},
    ),
    (
        "flat",
        "the flat buffers: FlatParameter and FlatParamHandle, their rank-major layout and copies, their layout "
        "as per-parameter pieces, their checkpoint collectives",
        {"": "_flat_param", "_flat": "_rank_major _faces _flat_layout _checkpoint_comm _extensions"},
    ),
    (
        "grads",
        "a unit's gradients: exposure as .grad, presence flags (agreed on the host off the CPU), reductions, CPU "
        "offload copies, communication hooks' call-out, the gradient scaler",
        {
            "_grads": "_exposed_grads _grad_presence _host_flags _offload_copies _comm_hooks _reduce_inputs "
            "_reduce_utils _grad_scaler _extension_grads"
        },
    ),
    (
        "runtime",
        "the state and its root context, hooks, execution order, prefetch, limiter, lazy init, entry points, "
        "no_sync and clipping, unshard/reshard, unshard_params; and the guards that keep the views consistent",
        {
            "": "_common_utils",
            "_runtime": "_root_context _exec_order_utils _limiter_utils _entry_points _lazy_init _prefetch "
            "_runtime_utils _forward_methods _cast_inputs _module_controls _grad_utils _unshard_param_utils "
            "_state_dict_open _state_dict_keys _flat_mode",
            "_guards": "_model_edit_checks _dtype_casts _ddp_guard",
        },
    ),
    (
        "names",
        "torch's FSDP1 and FSDP2 objects, names and auto-wrap policies, translated to ours where they enter",
        {"_names": "_fsdp1_names _fsdp2_names _torch_policies"},
    ),
    (
        "init",
        "policies and _get_submodule_to_states(), construction, placement, meta init, the sharding plan and "
        "memory model",
        {
            "_init": "_wrap_utils _group_units _init_utils _applied_checks _ignored_checks _post_forward_group "
            "_reset_params _to_empty _sharding_plan _memory_model _loss_memory _default_device"
        },
    ),
    (
        "state",
        "state dicts and optimizer state, and the routing of torch's state-dict, optimizer and clip APIs",
        {
            "_state": "_state_dict_settings _state_dict_local _state_dict_sharded _state_dict_full "
            "_state_dict_atomic _state_dict_utils _optim_convert _optim_utils _state_digest _torch_interop "
            "_torch_clip _extension_state"
        },
    ),
    (
        "api",
        "the public API over the core: fully_shard, describe/estimate_memory, checkpointing",
        {"": "fully_shard inspect checkpoint"},
    ),
    (
        "compat",
        "skins over the core: FSDP1's static methods and communication hooks, FSDP2's per-module switches",
        {
            "_compat": "",
            "_compat/fsdp1": "_fsdp1_static _register_comm_hook",
            "_compat/fsdp2": "_module_switches _reduce_controls _custom_comm_controls",
        },
    ),
    ("surface", "the wrapper class and the package's public names", {"": "wrapper __init__"}),
    ("integrations", "Lightning's strategies (an optional extra)", {"": "lightning"}),
    (
        "job",
        "the main job: python -m fsdp_composable, its demo training and checkpoints",
        {"": "__main__", "_job": "demo _job_checkpoint _job_processes"},
    ),
]


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
    targets: set[str] = field(default_factory=set)  # the package's modules this file imports
    target_lines: list[tuple[int, str]] = field(default_factory=list)  # (line, module) for each of them
    frame_reads: list[tuple[int, str, str]] = field(default_factory=list)  # (line, expression, function)
    patches: list[tuple[int, str, str]] = field(default_factory=list)  # (line, statement, function)


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


FRAME_CALLS = {
    ("sys", "_getframe"),
    ("inspect", "currentframe"),
    ("inspect", "stack"),
    ("inspect", "getouterframes"),
    ("inspect", "getframeinfo"),
    ("traceback", "extract_stack"),
    ("traceback", "walk_stack"),
}
FRAME_ATTRS = {"f_back", "f_locals", "f_globals"}


def _import_targets(node: Union[ast.Import, ast.ImportFrom], package: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` an import statement names, ``package`` being the dotted package the
    statement's file is in (where its relative imports start)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join([*parts, base] if base else parts)
    found = {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules}
    if len(found) < len(node.names) and base in modules:
        found.add(base)
    return found


def _torch_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" and not node.level:
            names |= {a.asname or a.name for a in node.names}
    return names


def _dotted(node: ast.expr) -> Optional[tuple[str, str]]:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id, node.attr
    return None


def _frame_read(node: ast.AST) -> bool:
    if isinstance(node, ast.Call) and _dotted(node.func) in FRAME_CALLS:
        return True
    return isinstance(node, ast.Attribute) and node.attr in FRAME_ATTRS and isinstance(node.ctx, ast.Load)


def _dict_of_other(node: ast.expr) -> bool:
    """``x.__dict__`` for any ``x`` but ``self``, or ``vars(x)``."""
    if isinstance(node, ast.Attribute) and node.attr == "__dict__":
        return not (isinstance(node.value, ast.Name) and node.value.id == "self")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars" and bool(node.args)


def _patch(node: ast.AST, torch_names: set[str]) -> bool:
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
        return node.attr == "cell_contents" or _root_name(node.value) in torch_names
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
        return _dict_of_other(node.value)
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args:
            return _root_name(node.args[0]) in torch_names
        return isinstance(func, ast.Attribute) and func.attr in MUTATING_METHODS and _dict_of_other(func.value)
    return False


def _statement_text(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str:
    while not isinstance(node, ast.stmt) and node in parents:
        node = parents[node]
    return ast.unparse(node).splitlines()[0]


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
    counts = FileCounts(rel, len(source.splitlines()), changed, sorted(globals_), sorted(imports))
    torch_names = _torch_names(tree)
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    owner = {id(node): name for fn, name in _functions(tree) for node in _own_nodes(fn)}
    for node in ast.walk(tree):
        where = owner.get(id(node), "<module>")
        if _frame_read(node) and not _frame_read(parents.get(node, tree)):  # the outermost of a chain
            counts.frame_reads.append((getattr(node, "lineno", 0), ast.unparse(node), where))
        elif _patch(node, torch_names):
            counts.patches.append((getattr(node, "lineno", 0), _statement_text(node, parents), where))
    counts.frame_reads.sort()
    counts.patches.sort()
    return counts


def _module_name(rel: str, package: str) -> str:
    return ".".join([package, *rel[: -len(".py")].split("/")]).removesuffix(".__init__")


def count_package(package_dir: Path) -> list[FileCounts]:
    package = package_dir.name
    files = sorted(p for p in package_dir.rglob("*.py") if "__pycache__" not in p.parts)
    counts = [count_file(p, p.relative_to(package_dir).as_posix(), package) for p in files]
    modules = {_module_name(c.path, package) for c in counts}
    for path, c in zip(files, counts):
        name = _module_name(c.path, package)
        home = name if c.path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and _is_package_import(node, package):
                found = _import_targets(node, home, modules)
                c.targets |= found
                c.target_lines += sorted((node.lineno, target) for target in found)
    return counts


def import_cycles(counts: list[FileCounts], package: str) -> list[list[str]]:
    """The strongly connected components of two or more modules (or one that imports itself), sorted."""
    graph = {_module_name(c.path, package): sorted(c.targets) for c in counts}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm; the package is small enough for recursion
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, []):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph.get(node, []):
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def _listed(counts: list[FileCounts], title: str, field_name: str, form: str) -> list[str]:
    """A section of (line, text, function) findings: its count, then one line each, file by file."""
    found = [(c.path, *item) for c in counts for item in getattr(c, field_name)]
    return [f"{title}: {len(found)}"] + [f"  {path}:{line}: {form.format(text, fn)}" for path, line, text, fn in found]


def layer_places(layers: Layers) -> dict[str, tuple[int, str]]:
    """Module name (or folder, for its ``__init__``) -> (layer index, folder)."""
    places: dict[str, tuple[int, str]] = {}
    for i, (_, _, folders) in enumerate(layers):
        for folder, names in folders.items():
            if folder:
                places[folder] = (i, folder)
            for name in names.split():
                places[name] = (i, folder)
    return places


def layer_report(counts: list[FileCounts], package: str, layers: Layers) -> list[str]:
    """The layer sections: modules in no layer, modules outside their layer's folder, names in the
    layers with no module (a module removed: strike it), imports against the layers (see the module
    docstring)."""
    places = layer_places(layers)
    modules = {_module_name(c.path, package): c for c in counts}
    is_folder = {m: c.path.endswith("__init__.py") and m != package for m, c in modules.items()}

    def key(module: str) -> tuple[str, str]:
        rel = module.removeprefix(package).lstrip(".").replace(".", "/")
        if not rel:
            return "__init__", ""
        if is_folder.get(module):
            return rel, rel.rpartition("/")[0]
        folder, _, name = rel.rpartition("/")
        return name, folder

    def layer(module: str) -> Optional[int]:
        place = places.get(key(module)[0])
        return None if place is None else place[0]

    importers: dict[str, list[str]] = {m: [] for m in modules}
    for m, c in modules.items():
        for target in c.targets:
            importers.setdefault(target, []).append(m)
    unplaced = sorted(m for m in modules if layer(m) is None)
    lines = [f"modules in no layer: {len(unplaced)}"]
    for m in unplaced:
        below = [x for x in (layer(t) for t in modules[m].targets) if x is not None]
        above = [x for x in (layer(t) for t in importers[m]) if x is not None]
        low, high = max(below, default=0), min(above, default=len(layers) - 1)
        fits = f"{layers[low][0]}..{layers[high][0]}" if low <= high else "none (imports a layer above an importer's)"
        lines.append(f"  {m}: fits layers {fits}")
    outside = []
    for m in sorted(modules):
        name, folder = key(m)
        place = places.get(name)
        if place is not None and place[1] != folder and not (is_folder.get(m) and name == place[1]):
            outside.append(f"  {modules[m].path}: belongs in {place[1] or 'the top level'}/ ({layers[place[0]][0]})")
    lines.append(f"modules outside their layer's folder: {len(outside)}")
    lines += outside
    known = {key(m)[0] for m in modules}
    stale = [
        name for _, _, folders in layers for names in folders.values() for name in names.split() if name not in known
    ]
    lines.append(f"names in the layers with no module: {len(stale)}")
    lines += [f"  {name}" for name in stale]
    against = []
    for m, c in sorted(modules.items()):
        mine = layer(m)
        for line, target in c.target_lines:
            theirs = layer(target)
            if mine is not None and theirs is not None and theirs > mine:
                against.append(f"  {c.path}:{line}: {target} ({layers[mine][0]} imports {layers[theirs][0]})")
    lines.append(f"imports against the layers: {len(against)}")
    return lines + against


def report(package_dir: Path, layers: Optional[Layers] = None) -> str:
    counts = count_package(package_dir)
    long_files = sorted((c for c in counts if c.lines > MAX_LINES), key=lambda c: -c.lines)
    with_containers = [c for c in counts if c.containers]
    lines = [f"lines in all: {sum(c.lines for c in counts)} in {len(counts)} files"]
    lines.append(f"files over {MAX_LINES} lines: {len(long_files)}")
    lines += [f"  {c.path}: {c.lines}" for c in long_files]
    cycles = import_cycles(counts, package_dir.name)
    lines.append(f"import cycles: {len(cycles)}")
    lines += [f"  {len(cycle)} module{'s' * (len(cycle) > 1)}: {', '.join(cycle)}" for cycle in cycles]
    n_containers = sum(len(c.containers) for c in counts)
    lines.append(f"module-level containers changed at run time: {n_containers} in {len(with_containers)} files")
    for c in with_containers:
        for k in c.containers:
            where = ", ".join(dict.fromkeys(k.changed_in))
            lines.append(f"  {c.path}:{k.line}: {k.name} ({k.kind}) changed in {where}")
    lines += _listed(counts, "global statements", "globals_", "global {} in {}")
    lines += _listed(counts, "function-level imports of the package", "imports", "{} in {}")
    lines += _listed(counts, "stack-frame reads", "frame_reads", "{} in {}")
    lines += _listed(counts, "patches (torch, another object's __dict__, closure cells)", "patches", "{} in {}")
    if layers is not None:
        lines += layer_report(counts, package_dir.name, layers)
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = Path(__file__).resolve().parent.parent / "fsdp_composable"
    parser.add_argument("package_dir", nargs="?", type=Path, default=default)
    args = parser.parse_args(argv)
    if not (args.package_dir / "__init__.py").is_file():
        parser.error(f"{args.package_dir} is not a package directory (no __init__.py)")
    print(report(args.package_dir, LAYERS if args.package_dir.name == "fsdp_composable" else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
