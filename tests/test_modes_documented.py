"""Every recording mode is in README's "Recording modes" table and in ``help(stepdump.Recorder)``
(issue 23 item 7). The rows come from the code: every class of ``options.Schedule`` and every
flat schedule keyword of ``options._SCHEDULE``, so a new mode fails here until it is documented."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

import stepdump
from stepdump.capture import options

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _modes_table() -> str:
    m = re.search(r"^### Recording modes\n(.*?)(?=^#)", README, re.S | re.M)
    assert m, "README has no '### Recording modes' section"
    return m.group(1)


SCHEDULES = [cls.__name__ for cls in typing.get_args(options.Schedule)]
KEYWORDS = [k for k in options._SCHEDULE if k not in ("trigger", "after")]  # ring's own settings
MODES = ["full", "tiered", "lean", "keyframes", "ring", "gradient log"]


@pytest.mark.parametrize("word", SCHEDULES + [f"{k}=" for k in KEYWORDS])
def test_readme_table_names_every_schedule(word):
    assert word in _modes_table()


@pytest.mark.parametrize("word", MODES)
def test_readme_table_says_when_to_use_each_mode(word):
    rows = [r for r in _modes_table().splitlines() if r.startswith("|") and f"**{word}**" in r]
    assert len(rows) == 1, f"one row for mode {word!r}"
    assert len(rows[0].rstrip("|").split("|")[-1].strip()) > 20  # the "use it when" column says something


@pytest.mark.parametrize("word", SCHEDULES + [f"{k}=" for k in KEYWORDS] + MODES)
def test_recorder_help_names_every_mode(word):
    assert word in " ".join((stepdump.Recorder.__doc__ or "").split())
