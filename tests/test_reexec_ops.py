"""Op level (issue 24 items 2 and 4, docs/reexecute.md): ``stepdump.localize(..., level="op")``
names the one op a port changed, with its module and source line, through the engine
``reexecute`` uses; the module level is unchanged; ``stepdump reexecute --trace`` names the op that
makes a step nondeterministic.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import reexec_loops as L
import stepdump
from stepdump.analysis.localize import localize as module_localize
from stepdump.errors import ConfigError


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reexec_ops")
    out = {mode: L.record_gpt(root / mode, mode, steps=3) for mode in ("full", "gradlog")}
    out["nan"] = L.record_nan(root / "nan", "full", bad_step=99, steps=2)
    return out


def _gelu_tanh(parts: tuple) -> None:
    parts[0].transformer.h[1].mlp.gelu = torch.nn.GELU(approximate="tanh")


def _ln_eps(parts: tuple) -> None:
    parts[0].transformer.h[0].ln_2.eps = 1e-6


def _softsign(parts: tuple) -> None:
    parts[0].act = torch.nn.Softsign()


# (run, factory, the port's one change, op, module, reason); each port differs from its reference in one op.
PORTS: list[tuple[str, Callable[[], Any], Callable[[tuple], None], str, str, str]] = [
    ("gradlog", L.gpt_factory, _gelu_tanh, "aten.gelu.default", "transformer.h.1.mlp.gelu",
     "same inputs, different output"),
    ("full", L.gpt_factory, _ln_eps, "aten.native_layer_norm.default", "transformer.h.0.ln_2",
     "same inputs, different output"),
    ("nan", L.nan_factory, _softsign, "aten.tanh.default", "act", "the op sequences part at op #"),
]


@pytest.mark.parametrize(("run_name", "factory", "change", "op", "module", "reason"), PORTS,
                         ids=["gelu-tanh", "layernorm-eps", "tanh-softsign"])
def test_op_level_localize_names_the_op_a_port_changed(runs: dict[str, Path], run_name: str,
                                                       factory: Callable[[], Any], change: Callable[[tuple], None],
                                                       op: str, module: str, reason: str) -> None:
    run = stepdump.open(runs[run_name])
    port = factory()
    change(port)
    found = stepdump.localize(run, 1, factory(), port, level="op")
    assert found.op is not None, found.summary()
    assert (found.op.op, found.op.module, found.op.phase) == (op, module, "forward")
    assert found.reason.startswith(reason), found.reason
    assert found.op.source.startswith("reexec_loops.py:"), found.op.source
    assert f"first op that differs: {op} in module {module!r} at reexec_loops.py:" in found.summary()


@pytest.mark.parametrize("run_name", ["full", "gradlog", "nan"])
def test_op_level_localize_of_the_same_code_finds_no_op(runs: dict[str, Path], run_name: str) -> None:
    factory = L.nan_factory if run_name == "nan" else L.gpt_factory
    found = stepdump.localize(stepdump.open(runs[run_name]), 1, factory(), factory(), level="op")
    assert found.op is None and found.ops_compared > 20, found.summary()
    assert "ops agree, bit for bit" in found.summary()


@pytest.mark.parametrize("level", [None, "module"])
def test_module_level_is_unchanged(runs: dict[str, Path], level: str | None) -> None:
    run = stepdump.open(runs["nan"])
    port = L.nan_factory()
    _softsign(port)
    kw = {} if level is None else {"level": level}
    loc = stepdump.localize(run, 1, L.nan_factory(), port, **kw)
    port2 = L.nan_factory()
    _softsign(port2)
    direct = module_localize(run, 1, L.nan_factory(), port2)
    assert isinstance(loc, stepdump.types.Localization)
    assert (loc.module, loc.phase, loc.compared) == ("act", "forward", direct.compared)
    assert loc.summary() == direct.summary()


@pytest.mark.parametrize(("kw", "words"), [({"level": "ops"}, "level='ops'"),
                                           ({"level": "op", "atol": 1e-3}, "bitwise")])
def test_bad_level_or_tolerance_is_refused(runs: dict[str, Path], kw: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        stepdump.localize(stepdump.open(runs["nan"]), 1, L.nan_factory(), L.nan_factory(), **kw)


# -- item 2: stepdump reexecute --trace ----------------------------------------------------------------------
CALLS: list[int] = []


def noisy_entry() -> tuple:
    """``--entry test_reexec_ops:noisy_entry``: the GPT with an op fed from an OS-seeded generator;
    its train_step counts the iterations run (``CALLS``)."""
    model, opt, train_step = L.gpt_factory(noisy=True)

    def counted(m: Any, o: Any, b: Any) -> Any:
        CALLS.append(1)
        return train_step(m, o, b)

    return model, opt, counted


def clean_entry() -> tuple:
    return L.gpt_factory()


NOISE_OP = "aten.randn.generator in module 'transformer.h.0.mlp.noise' at reexec_loops.py:"


# (run, flags, exit code, iterations run, what the output says, what it must not say)
TRACE_ROWS: list[tuple[str, list[str], int, int | None, list[str], list[str]]] = [
    ("noisy", ["--trace"], 1, 2, ["nondeterministic here", f"first op that differs: {NOISE_OP}",
                                  "(same inputs, different output)"], []),
    ("noisy", ["--trace", "--repeat", "3"], 1, 3, [f"first op that differs: {NOISE_OP}"], []),
    ("noisy", [], 1, 4, ["nondeterministic here", f"first op that differs: {NOISE_OP}"], []),
    ("noisy", ["--no-trace"], 1, 2, ["nondeterministic here", "op not traced (--no-trace / trace=False)"],
     ["first op that differs"]),
    ("clean", ["--trace"], 0, None, ["step 1: reproduces"], ["first op"]),
]


@pytest.fixture(scope="module")
def noisy_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reexec_trace")
    return {"noisy": L.record_gpt(root / "noisy", "full", steps=2, noisy=True),
            "clean": L.record_gpt(root / "clean", "full", steps=2)}


@pytest.mark.parametrize(("run_name", "flags", "code", "calls", "says", "never"), TRACE_ROWS,
                         ids=["trace", "trace-repeat3", "default", "no-trace", "trace-reproduces"])
def test_cli_reexec_trace_names_the_nondeterministic_op(noisy_runs: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch, run_name: str,
                                                        flags: list[str], code: int, calls: int | None,
                                                        says: list[str], never: list[str]) -> None:
    from stepdump.cli.main import main

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    CALLS.clear()
    entry = f"test_reexec_ops:{run_name}_entry"
    assert main(["reexecute", str(noisy_runs[run_name]), "--step", "1", "--entry", entry, *flags]) == code
    out = capsys.readouterr().out
    for words in says:
        assert words in out, out
    for words in never:
        assert words not in out, out
    if calls is not None:  # --trace traces the re-executions themselves; the default runs two more, traced
        assert len(CALLS) == calls


def test_cli_reexec_trace_json_names_the_op_and_why(noisy_runs: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from stepdump.cli.main import main

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    assert main(["reexecute", str(noisy_runs["noisy"]), "--step", "1", "--entry", "test_reexec_ops:noisy_entry",
                 "--trace", "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert got["verdict"] == "nondeterministic" and got["op"].startswith(NOISE_OP), got
    assert got["op_reason"] == "same inputs, different output"


def test_cli_reexec_trace_needs_two_re_executions(noisy_runs: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from stepdump.cli.main import main

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    assert main(["reexecute", str(noisy_runs["noisy"]), "--step", "1", "--entry", "test_reexec_ops:noisy_entry",
                 "--trace", "--repeat", "1"]) == 5
    assert "--trace compares re-executions op by op: give --repeat 2 or more" in capsys.readouterr().err
