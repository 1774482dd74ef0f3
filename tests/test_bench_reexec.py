"""benchmarks/reexec.py (issue 24's Done-when line): in ``make bench``, its section of RESULTS.md
replaced in place, the goal's verdict computed from the numbers. Timings belong to ``make bench``,
never to these tests: the numbers here are made up."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import reexec as bench  # noqa: E402


def test_make_bench_runs_it_before_the_doc_numbers() -> None:
    text = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^bench:.*?\n((?:\t.*\n)+)", text, re.M)
    assert recipe is not None
    lines = [ln.split("#")[0].strip() for ln in recipe.group(1).splitlines()]
    assert "$(PY) benchmarks/reexec.py" in lines
    assert lines.index("$(PY) benchmarks/reexec.py") < lines.index("$(PY) benchmarks/docs_numbers.py")


def _res(train: float, reexec: float) -> dict:
    ms = {"train step": [train] * 3, "re-execute": [reexec] * 3, "restore (full)": [5.0] * 3,
          "restore (gradient log)": [7.0] * 3, "reexecute(repeat=1)": [reexec + 5] * 3,
          "step under the tracer": [train * 9] * 3, "step under the tracer, no source lines": [train * 8] * 3}
    return {"ms": ms, "ops_per_step": 774, "params": 108352,
            "ratios": {a: [x / t for x, t in zip(v, ms["train step"])] for a, v in ms.items() if a != "train step"}}


@pytest.mark.parametrize(("reexec", "verdict"), [(29.0, "pass"), (30.0, "pass"), (31.0, "FAIL")])
def test_goal_verdict_follows_the_ratio(reexec: float, verdict: str) -> None:
    s = bench.summary(_res(10.0, reexec), 3, "today")
    assert s["reexec_ratio"] == reexec / 10.0 and s["pass"] is (verdict == "pass")
    assert (s["restore_full_ms"], s["restore_gradlog_ms"], s["tracer_ratio"]) == (5.0, 7.0, 9.0)
    text = bench.section(s, ((1.0, 1.0, 1.0), (2.0, 2.0, 2.0)))
    assert f"**{reexec / 10:.2f}×** a training step, goal ≤ 3× plus the restore: **{verdict}**" in text
    assert "| restore (full) | 5.00 | 0.50× |" in text


@pytest.mark.parametrize("where", ["end", "middle", "absent"])
def test_its_section_is_replaced_in_place(tmp_path: Path, where: str) -> None:
    out = tmp_path / "RESULTS.md"
    old = "\n## Re-execution (issue 24)\n\nold numbers\n"
    other = "\n## Keyframes\n\nkept\n"
    body = {"end": "# results\n" + other + old, "middle": "# results\n" + old + other, "absent": "# results\n" + other}
    out.write_text(body[where])
    for _ in range(2):  # twice: still one section
        bench.write_section(out, bench.section(bench.summary(_res(10.0, 20.0), 3, "today"), ((0, 0, 0), (0, 0, 0))))
    text = out.read_text()
    assert "old numbers" not in text and "\n## Keyframes\n\nkept\n" in text
    assert text.count("## Re-execution (issue 24)") == 1 and text.startswith("# results\n")
