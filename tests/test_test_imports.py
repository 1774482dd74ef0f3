"""The suite's own wiring: a test module that borrows a name from another test module or from
``helpers`` (often inside a function, so collection does not notice) names something that exists.

A review that renamed ``test_distributed._free_port`` to ``helpers.free_port`` left one lazy import
behind; only the module fixture that ran it failed, in CI. This reads every ``from X import names``
under tests/ and checks each name is defined at the top level of X.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def top_level_names(path: Path) -> set[str]:
    """Names a module defines or imports at its top level (what ``from module import name`` can find)."""
    return _defined(ast.parse(path.read_text()).body)


def _defined(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):  # optional imports at the top level
            names |= _defined([*node.body, *node.orelse, *getattr(node, "finalbody", [])])
    return names


def borrowed(root: Path = TESTS) -> list[tuple[str, int, str, str]]:
    """(file, line, module, name) for every ``from <sibling test module> import name`` under tests/."""
    local = {p.stem: p for p in root.rglob("*.py")}
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in local:
                out.extend((str(path.relative_to(root)), node.lineno, node.module, a.name) for a in node.names)
    return out


def test_the_suite_borrows_between_modules() -> None:
    # the check below has something to check: helpers and a few shared fixtures are borrowed
    modules = {m for _, _, m, _ in borrowed()}
    assert "helpers" in modules and len(modules) >= 3


def test_every_borrowed_name_exists() -> None:
    # one case for the behaviour (every borrowed name resolves), not one per import line; the
    # message lists every dangling import at once
    defined: dict[str, set[str]] = {}
    missing = []
    for where, line, module, name in borrowed():
        if module not in defined:
            defined[module] = top_level_names(next(TESTS.rglob(f"{module}.py")))
        if name not in defined[module]:
            missing.append(f"{where}:{line} imports {name} from {module}, which has no {name}")
    assert not missing, "\n".join(missing)


def test_the_check_sees_a_missing_name(tmp_path: Path) -> None:
    (tmp_path / "lender.py").write_text("LOOPBACK = {}\ndef free_port():\n    return 0\n")
    (tmp_path / "user.py").write_text("def f():\n    from lender import _free_port, LOOPBACK\n")
    found = borrowed(tmp_path)
    assert [(m, n) for _, _, m, n in found] == [("lender", "_free_port"), ("lender", "LOOPBACK")]
    names = top_level_names(tmp_path / "lender.py")
    assert "_free_port" not in names and {"LOOPBACK", "free_port"} <= names
