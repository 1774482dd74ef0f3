"""The public API: what ``import stepdump`` loads, what it offers, and what the docs import.

The public surface is ``stepdump.__all__`` (plus ``stepdump.open``, kept out of ``__all__`` so a
star-import leaves the builtin) and the submodules ``stepdump.options``, ``stepdump.types``,
``stepdump.checks`` and ``stepdump.export``; the list is pinned here (docs/concepts.md, "The public
API", says where each name lives). Import *cost* is measured in ``make bench``
(benchmarks/startup.py); here only *what* gets imported is checked, which does
not depend on the machine.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import stepdump

ROOT = Path(__file__).resolve().parents[1]
INIT = Path(stepdump.__file__)
PUBLIC_SUBMODULES = ("checks", "export", "options", "types")
TOP_LEVEL = sorted([
    "Recorder", "check", "diff", "verify", "replay", "reexecute", "localize", "FORMAT_VERSION", "__version__",
    "StepdumpError", "ConfigError", "CorruptDataError", "FormatVersionError", "InterruptedWriteError",
    "NotARunError", "ReadBudgetError", "RebuildError", "ReplayDiverged", "RestoreMismatchError", "RunExistsError",
    "RunLockedError", "StepNotFoundError", "TensorNotFoundError", "WriterError",
])
OPTIONS = ["GradientLogSchedule", "KeyframeSchedule", "RecordOptions", "Remote", "ResolvedOptions", "RingSchedule",
           "Schedule", "StepSchedule", "StoreOptions"]
TYPES = ["DiffResult", "DistributedRun", "Finding", "JointRun", "Localization", "LocalizeSetup", "OpLocalization",
         "ReexecResult", "ReplayResult", "RemoteRun", "Run", "RunReader", "Severity", "VerifyReport"]
# Old top-level spellings (issue 23 moved them): they warn, naming the new home, for one release.
MOVED = {"RecordOptions": "options.RecordOptions", "StepSchedule": "options.StepSchedule",
         "KeyframeSchedule": "options.KeyframeSchedule", "GradientLogSchedule": "options.GradientLogSchedule",
         "RingSchedule": "options.RingSchedule", "StoreOptions": "options.StoreOptions",
         "RecorderOptions": "options.ResolvedOptions", "Remote": "options.Remote", "RunReader": "types.RunReader",
         "Run": "types.Run", "DistributedRun": "types.DistributedRun", "RemoteRun": "types.RemoteRun",
         "Finding": "types.Finding", "Severity": "types.Severity", "DiffResult": "types.DiffResult",
         "VerifyReport": "types.VerifyReport", "Localization": "types.Localization", "Setup": "types.LocalizeSetup",
         "ReplayResult": "types.ReplayResult", "ReexecResult": "types.ReexecResult"}
INTERNAL_PACKAGES = ("capture", "store", "read", "analysis", "render", "core", "cli")
# Heavy modules a bare `import stepdump` must not load (pandas ~0.3 s, torch.distributed.tensor
# pulls in sympy: ~1 s).
HEAVY = ("torch", "pandas", "rich", "torch.distributed.tensor", "sympy")


def _loaded_after(code: str) -> set[str]:
    """Run ``code`` in a fresh interpreter; the names in sys.modules afterwards."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


# -- what gets imported ----------------------------------------------------------------------------


def test_import_stepdump_loads_nothing_heavy() -> None:
    loaded = _loaded_after("import stepdump")
    assert [m for m in HEAVY if m in loaded] == []


def test_using_the_api_does_not_load_the_cli_or_sympy() -> None:
    """Touching every public name loads torch (and pandas for the analyses), but not rich,
    and not torch.distributed.tensor (which pulls in sympy) for a non-distributed user."""
    loaded = _loaded_after("import stepdump, stepdump.options, stepdump.types\nfor n in stepdump.__all__: getattr(stepdump, n)")
    assert "torch" in loaded  # the probe did reach the heavy names
    assert [m for m in ("rich", "torch.distributed.tensor", "sympy") if m in loaded] == []


def test_recording_and_reading_tensors_do_not_load_pandas() -> None:
    """pandas is for the frame methods (stats(), scalars()) and the analyses only."""
    loaded = _loaded_after("import stepdump, stepdump.options\nstepdump.Recorder, stepdump.open, stepdump.options.Remote\n"
                           "from stepdump.read import run, ranked, remote, reader")
    assert "torch" in loaded
    assert "pandas" not in loaded


def test_cli_help_does_not_import_torch() -> None:
    """`stepdump --help` and every `stepdump CMD --help` answer without torch or pandas."""
    code = textwrap.dedent("""
        import contextlib, io
        from stepdump.cli.main import COMMANDS, main
        for argv in [["--help"], ["--version"]] + [[c, "--help"] for c in COMMANDS]:
            with contextlib.redirect_stdout(io.StringIO()):
                try:
                    main(argv)
                except SystemExit as e:
                    assert e.code == 0, (argv, e.code)
    """)
    loaded = _loaded_after(code)
    assert "stepdump.cli.cmd_show" in loaded  # every command's parser was built
    assert [m for m in ("torch", "pandas") if m in loaded] == []


def test_cli_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    from stepdump.cli.main import COMMANDS, SUMMARIES, main

    assert tuple(SUMMARIES) == COMMANDS
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)
    assert main([]) == 2  # no command: usage, exit 2


# -- what the top level offers ---------------------------------------------------------------------


def test_every_public_name_resolves() -> None:
    for name in stepdump.__all__:
        assert getattr(stepdump, name) is not None, name
    assert len(stepdump.__all__) == len(set(stepdump.__all__))
    assert set(stepdump.__all__) <= set(dir(stepdump))
    with pytest.raises(AttributeError):
        stepdump.no_such_name  # noqa: B018


def test_the_public_names_are_pinned() -> None:
    """The top level is what a user types in the first hour; option groups and types have a home."""
    assert sorted(stepdump.__all__) == TOP_LEVEL
    assert stepdump.open is importlib.import_module("stepdump.read.opener").open  # public, just not in __all__
    assert sorted(stepdump.options.__all__) == sorted(OPTIONS)
    assert sorted(stepdump.types.__all__) == sorted(TYPES)


def test_star_import_leaves_builtins_alone() -> None:
    import builtins

    ns: dict[str, object] = {}
    exec("from stepdump import *", ns)  # noqa: S102
    assert [n for n in ns if hasattr(builtins, n) and n != "__builtins__"] == []


def test_no_near_twins_or_generic_names() -> None:
    """No two public names one edit apart in spirit (RecordOptions vs RecorderOptions), no bare
    generic word (Setup, Options, Result) as a name."""
    public = TOP_LEVEL + OPTIONS + TYPES
    classes = [n for n in public if n[0].isupper() and not n.endswith("Error")]  # a function's result type may share its stem
    stems = [re.sub(r"(Options|Result|Report)$", "", n).lower() for n in classes]
    assert [n for n in public if n.lower().startswith("recorder") and n != "Recorder"] == []
    assert [n for n in public if n in ("Setup", "Options", "Result", "Config", "Settings")] == []
    assert len(set(stems)) == len(stems)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_name_warns_with_its_new_home(old: str) -> None:
    module, new = MOVED[old].split(".")
    with pytest.warns(DeprecationWarning, match=rf"stepdump\.{old} moved to stepdump\.{module}\.{new}"):
        value = getattr(stepdump, old)
    assert value is getattr(importlib.import_module(f"stepdump.{module}"), new)
    assert old not in stepdump.__all__


def test_the_api_names_the_contract() -> None:
    """DESIGN.md's entry points and the errors are at the top level."""
    for name in ("Recorder", "open", "check", "diff", "verify", "replay", "reexecute", "StepdumpError",
                 "FORMAT_VERSION", "__version__"):
        assert name in dir(stepdump), name
    errors = [n for n in stepdump.__all__ if n.endswith(("Error", "Diverged"))]
    assert all(issubclass(getattr(stepdump, n), stepdump.StepdumpError) for n in errors)


def test_lazy_table_type_checking_block_and_all_agree() -> None:
    """Each lazily loaded name is imported in the TYPE_CHECKING block from the same module
    (so mypy sees what run time gets), and the table is a literal of constant strings (the
    security scan allows import_module in __init__.py only for that reason)."""
    tree = ast.parse(INIT.read_text())
    table = next(n.value for n in tree.body if isinstance(n, ast.AnnAssign)
                 and isinstance(n.target, ast.Name) and n.target.id == "_LAZY")
    assert isinstance(table, ast.Dict)
    assert all(isinstance(x, ast.Constant) and isinstance(x.value, str) for x in table.keys + table.values)
    lazy = ast.literal_eval(table)
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    typed = {a.asname or a.name: node.module for node in block.body if isinstance(node, ast.ImportFrom)
             for a in node.names}
    assert {k: v for k, v in typed.items() if k not in PUBLIC_SUBMODULES} == lazy
    assert set(stepdump.__all__) == (set(lazy) - {"open"}) | set(stepdump._ERRORS) | {"FORMAT_VERSION", "__version__"}
    eager = [n for n in stepdump.__all__ if n not in lazy]  # light: no torch behind them
    assert all(n in ("__version__", "FORMAT_VERSION") or issubclass(getattr(stepdump, n), stepdump.StepdumpError)
               for n in eager)
    for name, module in lazy.items():
        assert getattr(stepdump, name) is getattr(importlib.import_module(module), name)


def test_public_submodules_resolve() -> None:
    for sub in PUBLIC_SUBMODULES:
        mod = getattr(stepdump, sub)  # also reachable as an attribute after a bare `import stepdump`
        assert mod is importlib.import_module(f"stepdump.{sub}")
        assert mod.__all__, sub
        for name in mod.__all__:
            assert getattr(mod, name) is not None, f"stepdump.{sub}.{name}"
    assert stepdump.checks.check is stepdump.check
    assert stepdump.checks.Finding is stepdump.types.Finding
    assert "cross_rank" in stepdump.checks.rule_names()  # registered by importing the public module


def test_internal_packages_say_so() -> None:
    for pkg in INTERNAL_PACKAGES:
        doc = importlib.import_module(f"stepdump.{pkg}").__doc__ or ""
        assert "Internal; public names are in stepdump/__init__.py" in doc, pkg


# -- what the docs import --------------------------------------------------------------------------

_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_IMPORT = re.compile(r"^\s*(from stepdump[\w.]* import .+|import stepdump[\w.]*.*)$")


def _doc_imports() -> list[tuple[str, str]]:
    out = []
    for doc in _DOCS:
        for block in _FENCE.findall(doc.read_text()):
            for line in block.splitlines():
                if _IMPORT.match(line):
                    out.append((doc.name, line.split("#")[0].strip()))
    return out


DOC_IMPORTS = _doc_imports()


def test_docs_import_something() -> None:
    assert len(DOC_IMPORTS) >= 8  # the extraction works (README and docs/checks.md at least)


@pytest.mark.parametrize(("doc", "line"), DOC_IMPORTS, ids=[f"{d}:{line}" for d, line in DOC_IMPORTS])
def test_documented_import_runs(doc: str, line: str) -> None:
    exec(line, {})  # noqa: S102 - a line of our own docs, not data


@pytest.mark.parametrize(("doc", "line"), DOC_IMPORTS, ids=[f"{d}:{line}" for d, line in DOC_IMPORTS])
def test_documented_imports_use_the_public_api(doc: str, line: str) -> None:
    internal = re.search(rf"stepdump\.({'|'.join(INTERNAL_PACKAGES)})\b", line)
    assert internal is None, f"{doc} imports from internal stepdump.{internal and internal.group(1)}: {line}"
