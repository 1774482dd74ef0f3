"""The package's layers run one way, and SQL lives in the catalog layer only.

docs/architecture.md draws the layers; this test is what keeps the drawing
true. It reads the source with ``ast`` (nothing is imported), so a new import
that points upwards, or a query written outside ``store/``'s catalog modules,
fails here with the file and line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "stepdump"

# What each package may import from stepdump (besides itself). Read it as the
# layer diagram: store at the bottom, core above it, capture and read side by
# side (neither imports the other), analysis on read, render on analysis, and
# the CLI and the top-level modules on everything.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "store": {"errors"},
    "core": {"errors", "store"},
    "capture": {"errors", "store", "core"},
    "read": {"errors", "store", "core"},
    "analysis": {"errors", "store", "core", "read"},
    "render": {"errors", "store", "core", "read", "analysis"},
    "integrations": {"errors", "store", "core", "capture", "read"},
    # re-execution uses restore/replay (read) and how log_batch names a batch (capture): above both
    "reexec": {"errors", "store", "core", "capture", "read", "analysis"},
}
TOP = {"cli", "__init__", "__main__", "demo", "checks", "export", "options", "types"}  # may import any layer

# Third-party modules a layer must not need: the store reads and writes bytes and
# SQLite, so a machine without torch could still verify or copy a store.
FORBIDDEN_THIRD_PARTY = {"store": {"torch"}}

# Modules allowed to talk SQL: the catalog layer (writer, reader queries, schema
# checks), and the fsspec snapshot, which copies a catalog with SQLite's backup API.
SQL_MODULES = ("store/catalog", "store/queries", "store/schema")


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def _layer(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _stepdump_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, first package under stepdump) for every import of stepdump, lazy ones included."""
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "stepdump":
                names = [f"stepdump.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "stepdump" and len(parts) > 1:
                out.append((node.lineno, parts[1]))
    return out


def _third_party_imports(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


def test_every_module_sits_in_a_known_layer() -> None:
    unknown = {_layer(p) for p in _modules()} - set(ALLOWED) - TOP
    assert not unknown, f"add these to the layer table (and docs/architecture.md): {sorted(unknown)}"


def test_imports_run_one_way() -> None:
    wrong = []
    for path in _modules():
        layer = _layer(path)
        if layer in TOP:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for line, target in _stepdump_imports(tree):
            if target != layer and target not in ALLOWED[layer]:
                wrong.append(f"{path.relative_to(SRC)}:{line} ({layer}) imports stepdump.{target}")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_store_is_torch_free() -> None:
    wrong = []
    for path in _modules():
        banned = FORBIDDEN_THIRD_PARTY.get(_layer(path), set())
        for line, name in _third_party_imports(ast.parse(path.read_text(), str(path))):
            if name in banned:
                wrong.append(f"{path.relative_to(SRC)}:{line} imports {name}")
    assert not wrong, "\n".join(wrong)


def _sql_calls(tree: ast.AST) -> list[int]:
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("execute", "executemany", "executescript")]


def test_sql_only_in_the_catalog_layer() -> None:
    wrong = []
    for path in _modules():
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(SQL_MODULES):
            continue
        wrong += [f"{rel}:{line}" for line in _sql_calls(ast.parse(path.read_text(), str(path)))]
    assert not wrong, "SQL outside the catalog layer (add a typed method there instead):\n" + "\n".join(wrong)


def test_no_private_reach_into_readers() -> None:
    """Nobody outside a reader touches its connection or blob reader (``run._con``, ``run._blobs``)."""
    wrong = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr in ("_con", "_blobs")
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                wrong.append(f"{path.relative_to(SRC)}:{node.lineno} .{node.attr}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("bad, layer", [("from stepdump.capture.recorder import Recorder", "read"),
                                        ("import stepdump.analysis.diff", "store")])
def test_the_checker_sees_an_upward_import(bad: str, layer: str) -> None:
    """The import walker finds both spellings (so the layer test can fail)."""
    targets = [t for _, t in _stepdump_imports(ast.parse(bad))]
    assert targets and all(t not in ALLOWED[layer] for t in targets)


# -- rooms in order: no import circle inside a package --------------------------------

def _module_name(path: Path) -> str:
    """``read/run.py`` -> ``read.run``; ``read/__init__.py`` -> ``read.__init__``."""
    return ".".join(path.relative_to(SRC).with_suffix("").parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _runtime_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted name) of every import that runs, lazy (function-level) ones included.

    ``from a.b import c`` gives ``a.b.c`` (c may be a module or a name in a.b); imports under
    ``if TYPE_CHECKING:`` are left out: they never run, so they cannot close a circle.
    """
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit_one(other)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.extend((node.lineno, f"{node.module}.{a.name}") for a in node.names)
        visit(node)

    visit(tree)
    return out


def _resolve(name: str, modules: set[str]) -> str | None:
    """The stepdump module an imported dotted name loads (the longest prefix that is one)."""
    parts = name.split(".")
    if parts[0] != "stepdump":
        return None
    parts = parts[1:]
    while parts:
        dotted = ".".join(parts)
        if dotted in modules:
            return dotted
        if f"{dotted}.__init__" in modules:
            return f"{dotted}.__init__"
        parts = parts[:-1]
    return None


def _package_graph() -> dict[str, dict[str, int]]:
    """module -> {module of the same package it imports at run time: line}."""
    paths = {_module_name(p): p for p in _modules()}
    graph: dict[str, dict[str, int]] = {}
    for name, path in paths.items():
        package = name.split(".")[0]
        if "." not in name:  # a top-level module (stepdump/types.py): no package of its own
            continue
        edges = graph.setdefault(name, {})
        for line, imported in _runtime_imports(ast.parse(path.read_text(), str(path))):
            target = _resolve(imported, set(paths))
            if target and target != name and target.split(".")[0] == package:
                edges.setdefault(target, line)
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle (a path back to its start) per strongly connected group of modules."""
    return [_circle_in(sorted(g)[0], g, graph) for g in _groups(graph)]


def _groups(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """The strongly connected groups of two or more modules (Tarjan): each one is a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return groups


def _circle_in(start: str, group: set[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """The shortest path start -> ... -> start inside ``group`` (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, {})):
                if w not in group or w in came_from:
                    continue
                came_from[w] = v
                if w == start:
                    path = [start]
                    while path[-1] != start or len(path) == 1:
                        path.append(came_from[path[-1]])
                    return path[::-1]
                nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle through {start}")  # a strongly connected group always has one


def _describe(circle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(circle, circle[1:])) + f" -> {circle[-1]}"


# The one circle kept, and why. A new circle fails the test below, and so does this entry once
# the circle is gone (then delete it).
KNOWN_CIRCLES: dict[frozenset[str], str] = {
    frozenset({"capture.recorder", "capture.joint"}):
        "Recorder(path, models=..., optimizers=...) returns its subclass JointRecorder: a constructor "
        "that picks a subclass has to name it (in __new__, lazily), and the subclass imports its base",
}


def test_no_import_circle_inside_a_package() -> None:
    """Within each package the modules import one way (lazy imports count, TYPE_CHECKING ones do not)."""
    graph = _package_graph()
    groups = _groups(graph)
    circles = [f"{_describe(_circle_in(sorted(g)[0], g, graph), graph)}  [all in it: {', '.join(sorted(g))}]"
               for g in groups if frozenset(g) not in KNOWN_CIRCLES]
    assert not circles, "import circles (move the shared piece down, or pass a callable):\n" + "\n".join(circles)
    gone = set(KNOWN_CIRCLES) - {frozenset(g) for g in groups}
    assert not gone, f"no longer circles, delete them from KNOWN_CIRCLES: {[sorted(g) for g in gone]}"


# read/'s floors, bottom up: a module imports only modules on a lower floor (lazy imports
# too). docs/architecture.md draws the same table. Run delegates to the gradient log, restore
# and export (its methods), which take a Run only as a type, so they sit below it; the
# readers built on Run (remote, joint, ranked) above it, and the opener that picks one on top.
READ_FLOORS: dict[str, int] = {
    "read.__init__": 0,
    "read.rows": 0, "read.blobs": 0, "read.reader": 0, "read.gradlog_why": 0, "read.activations": 0,
    "read.columnar": 0,
    "read.state": 1, "read.gradlog_chain": 1, "read.gradlog_budget": 1, "read.gradlog_snapshot": 1,
    "read.restore_checks": 2, "read.extra_rebuild": 2, "read.gradlog_verify": 2, "read.replay": 2,
    "read.export_files": 2, "read.gradlog_window": 2, "read.gradlog_check": 2,
    "read.extra": 3, "read.export_trainers": 3, "read.gradlog_keyframe": 3,
    "read.gradlog": 4, "read.restore": 4, "read.export": 4,
    "read.run": 5,
    "read.remote": 6, "read.joint": 6,
    "read.ranked": 7,
    "read.opener": 8,
}


def test_read_floors() -> None:
    graph = _package_graph()
    read = {m for m in graph if m.startswith("read.")}
    assert read == set(READ_FLOORS), (
        f"give each read/ module a floor: missing {sorted(read - set(READ_FLOORS))}, "
        f"gone {sorted(set(READ_FLOORS) - read)}")
    wrong = [f"{m} (floor {READ_FLOORS[m]}) imports {t} (floor {READ_FLOORS[t]}) at line {line}"
             for m in sorted(read) for t, line in sorted(graph[m].items())
             if READ_FLOORS[t] >= READ_FLOORS[m]]
    assert not wrong, "imports that do not point down a floor:\n" + "\n".join(wrong)


def test_architecture_draws_the_read_floors() -> None:
    """docs/architecture.md's floor table of read/ is READ_FLOORS, line for line."""
    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    drawn = {f"read.{name.strip()}": int(floor)
             for floor, names in re.findall(r"^floor (\d+)  (.+)$", doc, flags=re.M) for name in names.split(",")}
    assert drawn == {m: f for m, f in READ_FLOORS.items() if m != "read.__init__"}


@pytest.mark.parametrize("graph, circle", [
    ({"a.x": {"a.y": 1}, "a.y": {"a.x": 2}}, ["a.x", "a.y", "a.x"]),
    ({"a.x": {"a.y": 1}, "a.y": {"a.z": 2}, "a.z": {"a.x": 3}}, ["a.x", "a.y", "a.z", "a.x"]),
    ({"a.x": {"a.y": 1}, "a.y": {}}, None),
])
def test_the_checker_sees_a_circle(graph: dict[str, dict[str, int]], circle: list[str] | None) -> None:
    assert _cycles(graph) == ([circle] if circle else [])


@pytest.mark.parametrize("source, seen", [
    ("from stepdump.read.run import Run", ["stepdump.read.run.Run"]),
    ("def f():\n    import stepdump.read.run", ["stepdump.read.run"]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from stepdump.read.run import Run",
     ["typing.TYPE_CHECKING"]),
    ("import typing\nif typing.TYPE_CHECKING:\n    import a\nelse:\n    import b", ["typing", "b"]),
])
def test_the_checker_reads_lazy_imports_and_skips_type_checking(source: str, seen: list[str]) -> None:
    assert [n for _, n in _runtime_imports(ast.parse(source))] == seen
