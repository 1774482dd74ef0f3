"""Every value on the command line is range-checked, every path printable: no traceback on a bad value.

A step of 10**22 used to give an ``OverflowError`` traceback (exit 1) in ``show``, ``export``,
``stats --steps`` and the API (SQLite takes 64-bit integers); ``report`` of a run at a path that
is not UTF-8 died with ``UnicodeEncodeError``. Now a value out of range is a usage error (exit 2)
that names the valid range, the API raises a stepdump error, and a path is printed (and put in
the report) with its undecodable bytes shown as replacement characters.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import record_run

import stepdump
from stepdump.cli.exitcodes import Exit
from stepdump.cli.main import main
from stepdump.errors import StepdumpError

HUGE = str(10**22)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_run(tmp_path_factory.mktemp("ranges") / "run", steps=3)


def _exit(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's usage errors
        return int(e.code or 0)


@pytest.mark.parametrize("argv", [
    ["show", "{run}", "0.weight", "--step", HUGE],
    ["show", "{run}", "0.weight", "--step", "-1"],
    ["show", "{run}", "0.weight", "--values", HUGE],
    ["show", "{run}", "0.weight", "--values", "-3"],
    ["export", "{run}", "--step", HUGE, "--out", "{tmp}/x.pt"],
    ["stats", "{run}", "--steps", HUGE],
    ["stats", "{run}", "--steps", f"0:{HUGE}"],
    ["stats", "{run}", "--steps", f"0:10:{HUGE}"],
    ["stats", "{run}", "--steps", f"1,{HUGE}"],
    ["scalars", "{run}", f"--steps=-{HUGE}:"],
    ["bundle", "{run}", "--step", HUGE, "--out", "{tmp}/b"],
    ["report", "{run}", "--watch", "--port", "70000"],
    ["report", "{run}", "--watch", "--interval", "nan"],
    ["report", "{run}", "--watch", "--interval", "-1"],
    ["diff", "{run}", "{run}", "--atol", "nan"],
    ["diff", "{run}", "{run}", "--rtol", "-1"],
    ["export-tb", "{run}", "--out", "{tmp}/tb", "--histogram-steps", "0"],
], ids=lambda a: " ".join(a[:1] + a[2:]).replace("{run}", "").replace("{tmp}", "")[:60])
def test_a_value_out_of_range_is_a_usage_error_naming_the_range(run_dir: Path, tmp_path: Path, argv: list[str],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.replace("{run}", str(run_dir)).replace("{tmp}", str(tmp_path)) for a in argv]
    assert _exit(argv) == Exit.USAGE
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert " to " in err or "at least" in err or "positive" in err or "or more" in err, err


def test_a_huge_step_through_the_api_is_a_stepdump_error(run_dir: Path) -> None:
    with stepdump.open(run_dir) as run:
        with pytest.raises(StepdumpError, match="out of range"):
            run.tensor("0.weight", 10**22)
        with pytest.raises(StepdumpError, match="out of range"):
            run.state_dict(-(10**22))
        assert run.stats(steps=range(0, 10**22)).equals(run.stats())  # a range past the end: the steps there are
        assert run.scalars(steps=range(-(10**22), 10**22, 10**21)).index.tolist() == [0]
        assert run.stats(steps=slice(10**22, None)).empty


def test_a_run_at_a_path_that_is_not_utf8_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = Path(os.fsdecode(bytes(tmp_path) + b"/run-\xff\xfe"))
    record_run(path, steps=2)
    out = tmp_path / "report.html"
    assert _exit(["report", str(path), "--out", str(out)]) == Exit.OK
    page = out.read_text(encoding="utf-8")  # valid UTF-8
    assert "run-\ufffd\ufffd" in page
    assert _exit(["info", str(path)]) == Exit.OK
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err


def test_a_start_step_outside_64_bits_is_refused_when_the_recorder_is_built(tmp_path: Path) -> None:
    import torch
    from helpers import tiny_model

    model = tiny_model()
    with pytest.raises(StepdumpError, match="start_step"):
        stepdump.Recorder(tmp_path / "run", model, torch.optim.SGD(model.parameters(), lr=0.1), start_step=10**22)
