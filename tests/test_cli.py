"""Every CLI command on its happy path and an error path, run in this process through
``stepdump.cli.main.main`` (the ``cli`` fixture), plus one subprocess smoke test of the
installed ``stepdump`` entry point."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import record_run

import stepdump
import stepdump.demo


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(a, b, base): two 8-step runs of the same training; b has one weight bit flipped at step 4."""
    base = tmp_path_factory.mktemp("cli")

    def flip(step, model, opt):
        if step == 4:
            with torch.no_grad():
                model[0].weight.view(torch.int32)[0, 0] ^= 1
    return record_run(base / "a", steps=8), record_run(base / "b", steps=8, before_step=flip), base


def test_installed_entry_point_smoke(runs):
    """The one subprocess test: the ``stepdump`` script that pip installed runs a real command
    whose output goes into a pipe (every other CLI test calls ``main()`` in this process)."""
    a, _, _ = runs
    exe = Path(sys.executable).with_name("stepdump")
    assert exe.exists(), f"no console script at {exe}: pip install -e ."
    proc = subprocess.run(["bash", "-c", f"set -o pipefail; '{exe}' ls '{a}' --full-steps | cat"], capture_output=True,
                          text=True, check=False, timeout=120, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split() == [str(i) for i in stepdump.open(a).steps]
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr


def test_help_lists_every_command(cli):
    out = cli("--help").stdout
    for cmd in ("demo", "info", "ls", "show", "stats", "scalars", "diff", "check", "export", "report", "verify"):
        assert f"    {cmd} " in out
    assert "exit codes" in out
    assert "examples:" in cli("diff", "--help").stdout


def test_demo_records_and_summarises(cli, tmp_path):
    """The demo records every step with its batch (so reexecute and bundle work on it), says why 30
    steps are 31 records, re-executes a step with its verdict, and prints no timing: its two arms
    could not be timed alike (docs/performance.md has the measured cost)."""
    out = cli("demo", "--out", tmp_path / "demo", "--steps", "30", "--no-report").stdout
    assert "31 (30 optimizer steps and the final record)" in out
    assert "reexecute: step 10: reproduces" in out
    assert "ms/step" not in out and "faster" not in out
    run = stepdump.open(tmp_path / "demo")
    assert run.steps == list(range(31))
    x, y = stepdump.demo.batch(10)
    assert torch.equal(run.tensor("batch/0", 10, "inputs"), x) and torch.equal(run.tensor("batch/1", 10, "inputs"), y)
    assert cli("demo", "--out", tmp_path / "demo", "--steps", "0", ok=2).stderr.startswith("usage:")


def test_info_ls_show(cli, runs):
    a, _, base = runs
    out = cli("info", a).stdout
    steps = stepdump.open(a).all_steps
    assert "Sequential" in out and f"{len(steps)} (0..{steps[-1]})" in out
    assert "raw (1.00×)" in out  # the fixture's runs use the raw codec: stored == raw
    assert "0.weight" in cli("ls", a).stdout
    assert cli("ls", a, "--full-steps").stdout.split() == [str(i) for i in stepdump.open(a).steps]
    out = cli("show", a, "0.weight", "--step", "3", "--kind", "grads").stdout
    assert "(16, 8)" in out and "norm" in out
    err = cli("show", a, "0.wieght", "--step", "3", ok=3).stderr
    assert "0.weight" in err and "Traceback" not in err
    err = cli("info", base / "nope", ok=3).stderr
    assert err.startswith("error:") and "Traceback" not in err


def test_traceback_flag_lets_the_error_out(cli, runs):
    """``--traceback`` re-raises the library's error (Python then prints it and exits 1)."""
    _, _, base = runs
    with pytest.raises(stepdump.NotARunError):
        cli("--traceback", "info", base / "nope")


def test_stats_names_takes_several_globs(cli, runs):
    """``stats --names`` is a comma list of globs, as ``scalars --names``: the union, each row once."""
    a, _, _ = runs
    rows = json.loads(cli("stats", a, "--kind", "grads", "--names", "0.*,2.w*,2.*", "--steps", "1", "--json").stdout)
    assert [r["name"] for r in rows] == sorted(n for n in stepdump.open(a).names("grads") if n[0] in "02")
    assert len(rows) == 4


def test_stats_and_scalars_formats(cli, runs):
    a, _, _ = runs
    rows = json.loads(cli("stats", a, "--kind", "grads", "--names", "2.*", "--steps", "2:4", "--json").stdout)
    assert {(r["step"], r["name"]) for r in rows} == {(s, n) for s in (2, 3) for n in ("2.weight", "2.bias")}
    live = stepdump.open(a).tensor("2.weight", 3, kind="grads")
    norm = next(r["norm"] for r in rows if r["step"] == 3 and r["name"] == "2.weight")
    assert norm == pytest.approx(float(live.double().norm()), rel=1e-6)
    csv = cli("scalars", a, "--csv").stdout.splitlines()
    assert csv[0].split(",") == ["step", "loss", "lr", "skipped"] and len(csv) == 1 + len(stepdump.open(a).scalars())
    assert "bad step range" in cli("stats", a, "--steps", "x:y", ok=2).stderr  # a usage error (docs/cli.md)
    assert "not a stepdump run" in cli("scalars", a / "segments", ok=3).stderr


def test_diff_exit_codes(cli, runs, tmp_path):
    a, b, _ = runs
    assert "identical" in cli("diff", a, a).stdout
    out = cli("diff", a, b, ok=1).stdout
    assert "diverge at step 4" in out and "params 0.weight" in out
    res = json.loads(cli("diff", a, b, "--json", ok=1).stdout)
    assert res["first_step"] == 4 and res["tensors"][0]["n_diff"] == 1
    assert cli("diff", a, tmp_path / "missing", ok=3).stderr.startswith("error:")


def test_export_and_verify(cli, runs, tmp_path):
    a, _, _ = runs
    cli("export", a, "--step", "5", "-o", tmp_path / "c.pt")
    assert torch.load(tmp_path / "c.pt", weights_only=True)["step"] == 5
    cli("export", a, "--step", "5", "-o", tmp_path / "c.safetensors", "--format", "safetensors")
    assert "nearest" in cli("export", a, "--step", "50", "-o", tmp_path / "d.pt", ok=3).stderr
    assert cli("verify", a).stdout.strip().startswith("ok:")
    broken = tmp_path / "broken"
    shutil.copytree(a, broken)
    seg = next((broken / "segments").glob("*.seg"))
    data = bytearray(seg.read_bytes())
    data[100] ^= 0xFF
    seg.write_bytes(bytes(data))
    out = cli("verify", broken, ok=1).stdout
    assert "problem" in out and "checksum" in out


def test_check_exit_codes(cli, runs, tmp_path):
    a, _, _ = runs
    proc = cli("check", a, "--json", ok=None)
    assert proc.code in (0, 1)
    findings = json.loads(proc.stdout)
    assert isinstance(findings, list)
    # a planted NaN gradient is an error: exit 1 at --fail-on error, and the finding names it
    def plant(step, model, opt):
        if step == 3:
            model[0].weight.grad[0, 0] = float("nan")
    bad = record_run(tmp_path / "bad", steps=6, before_step=plant)
    out = cli("check", bad, "--fail-on", "error", ok=1).stdout
    assert "nan_inf" in out and "0.weight" in out
    assert "unknown" in cli("check", bad, "--rules", "no_such_rule", ok=2).stderr.lower()
