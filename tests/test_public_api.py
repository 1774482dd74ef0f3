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
    "StepdumpError", "BatchMismatchError", "ConfigError", "CorruptDataError", "FormatVersionError", "InterruptedWriteError",
    "NotARunError", "ReadBudgetError", "RebuildError", "ReplayDiverged", "RestoreMismatchError", "RunExistsError",
    "RunLockedError", "StepNotFoundError", "TensorNotFoundError", "WriterError",
])
OPTIONS = ["GradientLogSchedule", "KeyframeSchedule", "RecordOptions", "Remote", "ResolvedOptions", "RingSchedule",
           "Schedule", "StepSchedule", "StoreOptions", "TriggerInfo"]
TYPES = ["DiffResult", "DistributedRun", "Finding", "JointRun", "Localization", "LocalizeSetup", "OpLocalization",
         "ReexecResult", "ReplayResult", "RemoteRun", "Run", "RunReader", "Severity", "VerifyReport"]
# Top-level spellings 0.1.0 shipped as deprecated aliases before any release; removed, not kept.
OLD_SPELLINGS = ("RecordOptions", "StepSchedule", "KeyframeSchedule", "GradientLogSchedule", "RingSchedule",
                 "StoreOptions", "RecorderOptions", "Remote", "RunReader", "Run", "DistributedRun", "RemoteRun",
                 "Finding", "Severity", "DiffResult", "VerifyReport", "Localization", "Setup", "ReplayResult",
                 "ReexecResult")
INTERNAL_PACKAGES = ("capture", "store", "read", "analysis", "render", "core", "cli", "reexec")
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


def test_the_old_top_level_spellings_are_gone() -> None:
    """Nothing was released with them: each lives in one place (stepdump.options / stepdump.types)."""
    present = [old for old in OLD_SPELLINGS if hasattr(stepdump, old)]
    assert present == []
    with pytest.raises(AttributeError, match="has no attribute 'Run'"):
        stepdump.Run  # noqa: B018
    assert stepdump.types.Run and stepdump.options.StoreOptions  # their one home


def test_every_error_the_library_defines_is_exported() -> None:
    """An error a public function raises (BatchMismatchError from reexecute) can be caught by name."""
    import stepdump.errors

    defined = sorted(n for n, v in vars(stepdump.errors).items()
                     if isinstance(v, type) and issubclass(v, stepdump.StepdumpError))
    assert [n for n in defined if n not in stepdump.__all__] == []


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

_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
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


# -- what the docs send users to -------------------------------------------------------------------

# Public beyond __all__ and PUBLIC_SUBMODULES: documented modules a user imports or names.
PUBLIC_MODULES = (*PUBLIC_SUBMODULES, "integrations", "demo")
# A dotted name in running text or code: not a file name (profile_stepdump.py, src/stepdump/...),
# not inside a string literal (a metadata key "stepdump.trainer", a logger or profiler range name).
_DOTTED = re.compile(r"""(?<![\w/.\-"'])stepdump((?:\.[A-Za-z_]\w*)+)(?::(\w+))?""")
_FROM = re.compile(r"^\s*from (stepdump[\w.]*) import \(?([\w ,]+)", re.M)


def _public(dotted: str) -> str | None:
    """None if ``dotted`` (``stepdump.a.b``) is a public name; else why not."""
    parts = dotted.split(".")[1:]
    head, rest = parts[0], parts[1:]
    if head in stepdump.__all__ or head in ("open", "__all__"):
        obj: object = getattr(stepdump, head)
    elif head in PUBLIC_MODULES and head != "integrations":
        obj = importlib.import_module(f"stepdump.{head}")
        exported = getattr(obj, "__all__", None)
        if rest and exported is not None and rest[0] not in exported:
            return f"stepdump.{head}.{rest[0]} is not in stepdump.{head}.__all__"
    elif head == "integrations":
        # Checked without importing Lightning / transformers: a public module that defines the name.
        if not rest:
            return None
        source = INIT.parent / "integrations" / f"{rest[0]}.py"
        if rest[0].startswith("_") or not source.exists():
            return f"no public module stepdump.integrations.{rest[0]}"
        defined = {n.name for n in ast.parse(source.read_text()).body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
        return None if len(rest) == 1 or rest[1] in defined else f"stepdump.integrations.{rest[0]} has no {rest[1]}"
    else:
        return f"stepdump.{head} is neither in stepdump.__all__ nor a public module"
    for part in rest:
        if part.startswith("_") or not hasattr(obj, part):
            return f"{dotted}: no public {part}"
        obj = getattr(obj, part)
    return None


def _doc_references() -> dict[str, list[str]]:
    """Every ``stepdump.<dotted name>`` (and ``from stepdump... import x``) of README and docs/, by doc."""
    refs: dict[str, list[str]] = {}
    for doc in _DOCS:
        text = doc.read_text()
        found = [m.group(0) for m in _DOTTED.finditer(text)]
        found += [m.group(1) + "." + n.split(" as ")[0].strip() for m in _FROM.finditer(text)
                  for n in m.group(2).split(",") if n.strip()]
        refs[str(doc.relative_to(ROOT))] = found
    return refs


def test_the_docs_send_users_only_to_public_names() -> None:
    """Every name README and docs/ send a user to is public: in stepdump.__all__, or exported by a
    public module (stepdump.options, types, checks, export, integrations, demo). Internals are named
    by their source file (``reexec/bundle.py``) where a doc explains how something works."""
    refs = _doc_references()
    assert sum(map(len, refs.values())) > 150  # the scan finds the docs' references
    bad = []
    for doc, names in refs.items():
        for name in names:
            dotted, _, attr = name.partition(":")
            why = _public(dotted) or (None if not attr or hasattr(importlib.import_module(dotted), attr)
                                      else f"{dotted} has no {attr}")
            if why:
                bad.append(f"{doc}: {name}: {why}")
    assert bad == []
