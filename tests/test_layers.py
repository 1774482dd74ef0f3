"""The package's layers run one way, and SQL lives in the catalog layer only.

docs/architecture.md draws the layers; this test is what keeps the drawing
true. It reads the source with ``ast`` (nothing is imported), so a new import
that points upwards, or a query written outside ``store/``'s catalog modules,
fails here with the file and line.
"""

from __future__ import annotations

import ast
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
