"""Raw or misleading errors on a damaged store: a stepdump error that names the damage, and a
``stepdump verify`` that sees what the other commands send people to it for.

* A bundle whose ``meta.bundle`` is ``5`` (not the object stepdump writes) made ``reexecute(...,
  write_back=True)`` die with ``AttributeError``; it is refused as a bundle all the same.
* A step whose recorded state is malformed made ``diff`` say "`stepdump verify` checks a run",
  and ``verify`` then exited 0: it now lists every step whose state cannot be read (exit 1).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import reexec_loops as L
from helpers import catalog_sql, record_run

import stepdump
from stepdump.cli.exitcodes import Exit
from stepdump.cli.main import main
from stepdump.errors import ConfigError


def test_a_bundle_with_a_damaged_bundle_meta_is_still_refused_for_write_back(tmp_path: Path) -> None:
    from stepdump.reexec.bundle import bundle

    src = L.record_nan(tmp_path / "full", "full", bad_step=99, steps=3)
    out = tmp_path / "b.stepdump"
    bundle(stepdump.open(src), 1, out)
    catalog_sql(out, "UPDATE meta SET value = '5' WHERE key = 'bundle'")
    model, opt, train_step = L.nan_factory()
    with pytest.raises(ConfigError, match="is a bundle"):
        stepdump.reexecute(out, 1, model, opt, train_step, activations="fc1", write_back=True)


@pytest.mark.parametrize("state", ['{"rng": ', '[1, 2]', "[" * 5000 + "]" * 5000])
def test_verify_sees_a_malformed_step_state_that_diff_sends_people_to_it_for(
        tmp_path: Path, state: str, capsys: pytest.CaptureFixture[str]) -> None:
    a = record_run(tmp_path / "a", steps=3)
    b = record_run(tmp_path / "b", steps=3)
    catalog_sql(b, "UPDATE steps SET state = ? WHERE step = 1", (state,))
    assert main(["diff", str(a), str(b)]) == Exit.CORRUPT
    err = capsys.readouterr().err
    assert "stepdump verify" in err and "Traceback" not in err
    with stepdump.open(b) as run:
        report = stepdump.verify(run)
    assert not report.ok
    assert [p.where for p in report.problems] == ["step 1"], report.problems
    assert main(["verify", str(b)]) == Exit.FOUND
    assert "step 1" in capsys.readouterr().out
    with stepdump.open(a) as run:  # an intact run still verifies clean
        assert stepdump.verify(run).ok
