"""Exit codes scripts can trust (issue 23 item 6; docs/cli.md "Exit codes").

Every bad value on the command line is a usage error (exit 2, with usage) caught
by the argparse types in cli/common.py before any run is opened; error text is
printed literally (no console markup or emoji codes); a filter that matches
nothing exits 3 with "did you mean"; a closed pipe keeps the command's verdict.
All in-process through ``main()`` except the one pipe test, which needs a real
``| head -1``.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import record_run

from stepdump.cli.exitcodes import Exit


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(a, b): two 6-step runs logging loss; b has one weight bit flipped at step 3."""
    base = tmp_path_factory.mktemp("exits")

    def flip(step, model, opt):
        if step == 3:
            with torch.no_grad():
                model[0].weight.view(torch.int32)[0, 0] ^= 1

    def log(step, loss):
        return {"loss": loss}

    return (record_run(base / "a", steps=6, log=log),
            record_run(base / "b", steps=6, log=log, before_step=flip))


BAD_VALUES = [
    ("scalars", "--steps", "abc"),
    ("scalars", "--steps", "1:x"),
    ("scalars", "--steps", "0:5:0"),
    ("scalars", "--steps", "1,,2"),
    ("stats", "--steps", "abc"),
    ("stats", "--kind", "nosuch"),
    ("ls", "--kind", "nosuch"),
    ("show", "--kind", "nosuch"),
    ("diff", "--kinds", "nosuch"),
    ("diff", "--kinds", "params,nosuch"),
    ("scalars", "--names", "loss["),
    ("scalars", "--names", "loss,,lr"),
    ("stats", "--names", "fc1.[weight"),
    ("export-stats", "--names", "0.*,2.*"),  # one glob: the export filters in SQL
    ("check", "--rules", "no_such_rule"),
    ("check", "--rules", "nan_inf,nope"),
    ("demo", "--steps", "0"),
    ("demo", "--steps", "ten"),
]


@pytest.mark.parametrize("cmd,opt,value", BAD_VALUES, ids=[f"{c}{o}={v}" for c, o, v in BAD_VALUES])
def test_bad_value_is_a_usage_error(cli, runs, cmd, opt, value):
    a, b = runs
    words = {"diff": [cmd, a, b], "show": [cmd, a, "0.weight"], "demo": [cmd, "--out", a.parent / "demo"],
             "export-stats": [cmd, a, "-o", a.parent / "s.parquet"]}.get(
        cmd, [cmd, a])
    res = cli(*words, opt, value, ok=None)
    assert res.code == Exit.USAGE, (res.code, res.stderr)
    assert "usage: stepdump" in res.stderr and opt in res.stderr and value in res.stderr


def test_error_text_is_printed_literally(cli, runs):
    res = cli("scalars", runs[0], "--steps", "abc", ok=Exit.USAGE)
    assert "A:B:K" in res.stderr and "\U0001f171" not in res.stderr


@pytest.mark.parametrize("text", ["[bold]x[/bold]", ":b:", "[red]"])
def test_library_error_text_is_printed_literally(cli, tmp_path, text):
    res = cli("info", tmp_path / text, ok=Exit.NOT_FOUND)
    assert text in res.stderr


NO_MATCH = [
    (["scalars", "{a}", "--names", "nope"], "did you mean"),
    (["scalars", "{a}", "--names", "los"], "'loss'"),
    (["stats", "{a}", "--names", "0.weigth"], "'0.weight'"),
    (["stats", "{a}", "--names", "nope*"], "no tensor"),
]


@pytest.mark.parametrize("words,says", NO_MATCH, ids=[" ".join(w[2:]) for w, _ in NO_MATCH])
def test_filter_matching_nothing_exits_3(cli, runs, words, says):
    res = cli(*[w.format(a=runs[0]) for w in words], ok=None)
    assert res.code == Exit.NOT_FOUND, (res.code, res.stdout, res.stderr)
    assert says in res.stderr and "matches" in res.stderr


@pytest.mark.parametrize("which,verdict", [("same", Exit.OK), ("differs", Exit.FOUND)])
def test_closed_pipe_keeps_the_verdict(cli, runs, monkeypatch, which, verdict):
    """In-process: the console's stream breaks on the first write, as under ``| head -1``."""
    from stepdump.cli import common

    class Closed(io.StringIO):
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(common.console, "_file", Closed())  # _file: None again after, so stdout is looked up anew
    monkeypatch.setattr(common.console, "quiet", False)  # the closed pipe turns it on: restored after the test
    a, b = runs
    assert cli("diff", a, a if which == "same" else b, ok=None).code == verdict
    monkeypatch.undo()  # the pipe's reader is back: the next command prints its own output only
    first = cli("diff", a, b, ok=1).stdout
    assert first == cli("diff", a, b, ok=1).stdout  # nothing of the broken command's output came first


@pytest.mark.parametrize("which,verdict", [("same", 0), ("differs", 1)])
def test_diff_into_head_keeps_verdict_and_is_quiet(runs, which, verdict):
    """The real pipe, whose reader leaves at once: exit status of stepdump (PIPESTATUS), nothing on stderr."""
    a, b = runs
    exe = Path(sys.executable).with_name("stepdump")
    script = f"'{exe}' diff '{a}' '{a if which == 'same' else b}' | true; echo ${{PIPESTATUS[0]}}"
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == str(verdict) and proc.stderr == "", (proc.stdout, proc.stderr)


def test_diff_kinds_are_the_library_kinds():
    from stepdump.analysis.diff import KIND_ORDER
    from stepdump.cli.common import DIFF_KINDS

    assert sorted(DIFF_KINDS) == sorted(KIND_ORDER)
