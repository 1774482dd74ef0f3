"""Numbers come from data (issue 23, item 2): a marked benchmark number in docs/performance.md or
README.md is what benchmarks/docs_numbers.py renders from the committed benchmarks/results.json,
and the benchmark scripts leave that JSON beside RESULTS.md."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import docs_numbers  # noqa: E402
import results_json  # noqa: E402

DATA = {"run": {"workloads": {"A": {"torch.save": {"ms": 812.345, "runs": [3.0, 1.0, 2.0, 10.0]}}},
                "verdicts": [{"ok": True}, {"ok": False}]},
        "leave_on": {"lean": {"A": {"overhead_pct": 2.345}}, "targets": [{"ok": None}]}}


@pytest.mark.parametrize("text, want", [
    ("x <!-- bench: run/workloads/A/torch.save/ms .0f -->0<!-- /bench --> ms",
     "x <!-- bench: run/workloads/A/torch.save/ms .0f -->812<!-- /bench --> ms"),
    ("<!-- bench: leave_on/lean/A/overhead_pct .1f -->9.9<!-- /bench -->%",
     "<!-- bench: leave_on/lean/A/overhead_pct .1f -->2.3<!-- /bench -->%"),
    ("<!-- bench: run/verdicts/0/ok verdict -->FAIL<!-- /bench --> <!-- bench: run/verdicts/1/ok verdict -->pass<!-- /bench -->",
     "<!-- bench: run/verdicts/0/ok verdict -->pass<!-- /bench --> <!-- bench: run/verdicts/1/ok verdict -->FAIL<!-- /bench -->"),
    ("<!-- bench: leave_on/targets/0/ok verdict -->pass<!-- /bench -->",
     "<!-- bench: leave_on/targets/0/ok verdict -->n/a<!-- /bench -->"),
    ("no regions: 812 ms stays 812 ms", "no regions: 812 ms stays 812 ms"),
    # arithmetic of two values: a ratio, a difference, a signed percentage
    ("<!-- bench: leave_on/lean/A/overhead_pct / run/workloads/A/torch.save/ms .5f -->?<!-- /bench -->",
     "<!-- bench: leave_on/lean/A/overhead_pct / run/workloads/A/torch.save/ms .5f -->0.00289<!-- /bench -->"),
    ("<!-- bench: run/workloads/A/torch.save/ms - leave_on/lean/A/overhead_pct +.1f -->?<!-- /bench -->",
     "<!-- bench: run/workloads/A/torch.save/ms - leave_on/lean/A/overhead_pct +.1f -->+810.0<!-- /bench -->"),
    ("<!-- bench: run/workloads/A/torch.save/runs/@median .1f -->?<!-- /bench --> "
     "<!-- bench: run/workloads/A/torch.save/runs/@max .0f -->?<!-- /bench -->",
     "<!-- bench: run/workloads/A/torch.save/runs/@median .1f -->2.5<!-- /bench --> "
     "<!-- bench: run/workloads/A/torch.save/runs/@max .0f -->10<!-- /bench -->"),
    ("<!-- bench: run/workloads/A/torch.save/ms - leave_on/lean/A/overhead_pct / 1e3 .4f -->?<!-- /bench -->",
     "<!-- bench: run/workloads/A/torch.save/ms - leave_on/lean/A/overhead_pct / 1e3 .4f -->0.8100<!-- /bench -->"),
    ("<!-- bench: leave_on/lean/A/overhead_pct pct -->?<!-- /bench -->",
     "<!-- bench: leave_on/lean/A/overhead_pct pct -->+134.5%<!-- /bench -->"),
])
def test_regions_render_from_the_data(text: str, want: str) -> None:
    assert docs_numbers.render(text, DATA) == want
    assert docs_numbers.render(want, DATA) == want  # rendering twice changes nothing


@pytest.mark.parametrize("text", [
    "<!-- bench: run/workloads/B/torch.save/ms -->1<!-- /bench -->",  # no workload B
    "<!-- bench: run/verdicts/7/ok verdict -->pass<!-- /bench -->",  # no 8th verdict
    "<!-- bench: run/workloads -->1<!-- /bench -->",  # a table, not a number
    "<!-- bench: run/verdicts/0/ok / run/workloads/A/torch.save/ms -->1<!-- /bench -->",  # a verdict is no number
    "<!-- bench: run/workloads/A/torch.save/ms / run/nothing -->1<!-- /bench -->",  # right side missing
    "<!-- bench: run/verdicts/@median -->1<!-- /bench -->",  # a median of things that are not numbers
])
def test_a_region_without_its_number_is_refused(text: str) -> None:
    with pytest.raises(docs_numbers.MissingNumber):
        docs_numbers.render(text, DATA)


@pytest.mark.parametrize("page", docs_numbers.PAGES, ids=lambda p: p.name)
def test_every_marked_number_matches_the_committed_results(page: Path) -> None:
    text = page.read_text()
    if docs_numbers.REGION.search(text):
        assert results_json.DEFAULT.exists(), "marked numbers need benchmarks/results.json (make bench)"
    assert docs_numbers.stale(page, results_json.load()) == []


def test_the_benchmarks_json_keeps_each_script_s_section(tmp_path: Path) -> None:
    """Each script replaces only its own key, so `make bench`'s scripts add up to one file."""
    path = tmp_path / "results.json"
    results_json.update("run", {"a": 1}, path)
    results_json.update("startup", {"median_s": {"import": 0.1}}, path)
    results_json.update("run", {"a": 2}, path)
    assert results_json.load(path) == {"run": {"a": 2}, "startup": {"median_s": {"import": 0.1}}}
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no .partial left behind


def _bench_scripts() -> list[str]:
    """The benchmark scripts the Makefile's bench target runs, read from the Makefile itself."""
    recipe = (ROOT / "Makefile").read_text().split("\nbench:", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"benchmarks/(\w+\.py)", recipe)


def test_make_bench_runs_the_known_writers() -> None:
    assert {"run.py", "leave_on.py", "startup.py", "keyframes.py", "leave_on_tiny.py"} <= set(_bench_scripts())


@pytest.mark.parametrize("script", [s for s in _bench_scripts() if s != "docs_numbers.py"])
def test_every_results_md_writer_also_writes_the_json(script: str) -> None:
    """Every script `make bench` runs that writes a RESULTS.md section stores its numbers too."""
    source = (ROOT / "benchmarks" / script).read_text()
    if "RESULTS.md" in source:
        assert "results_json" in source and re.search(r"\bupdate\w*\(", source)
