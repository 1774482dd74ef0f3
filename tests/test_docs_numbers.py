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


# --- no measured number on docs/performance.md outside a marked region --------------------------

# A number with a unit of time, size or ratio, written in the page's prose or tables.
_MEASURE = re.compile(r"(?<![\w.])[-+~]?\d[\d,]*(?:\.\d+)?(?:[–-]\d[\d,]*(?:\.\d+)?)?\s?"
                      r"(?:×|%|ms\b|µs\b|s\b|MB\b|MiB\b|KiB\b|Ki\b|GB\b|GiB\b|TB\b|elements\b)")


def _settings() -> dict[str, bool]:
    """Numbers on the page that are settings, not measurements: each must equal the code's value."""
    from stepdump.capture import lean, writer
    from stepdump.capture.options import StoreOptions

    return {"64 MiB": StoreOptions().staging_bytes == 64 << 20,
            "1 MiB": writer._DIRECT_WRITE == 1 << 20,
            "4 MiB": writer._MIN_PENDING == 4 << 20,
            "2 MiB": lean.INLINE_BYTES == 2 << 20,
            "128 Ki": lean._CHUNK == 128 * 1024,
            "4096 elements": lean._SMALL == 4096,
            "1.00×": True}  # the no-recording row: 1.00× of itself by definition


def _unmarked_measures(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # commands and diagrams
    text = docs_numbers.REGION.sub("", text)  # rendered from results.json
    text = re.sub(r"`[^`]*`", "", text)  # code: option values, module names
    settings = _settings()
    out = []
    for m in _MEASURE.finditer(text):
        before = text[max(0, m.start() - 2):m.start()]
        if "≤" in before:  # a target as an issue states it, not a measurement
            continue
        if m.group() in settings:
            assert settings[m.group()], f"docs/performance.md says {m.group()!r}, the code says otherwise"
            continue
        out.append(f"{m.group()!r} in ...{text[max(0, m.start() - 40):m.end() + 10]!r}")
    return out


def test_performance_page_has_no_unmarked_measured_number() -> None:
    """Issue 23: docs/performance.md has no number that is not generated from results.json (one-off
    measurements behind design decisions live in docs/design-measurements.md, dated)."""
    assert _unmarked_measures((ROOT / "docs" / "performance.md").read_text()) == []


@pytest.mark.parametrize("text", ["lean costs 1.21× here", "it took 288 ms/step", "+1.1% of RSS",
                                  "a 134 MB record", "the default is 32 MiB"])
def test_an_unmarked_measurement_is_found(text: str) -> None:
    assert _unmarked_measures(text)


@pytest.mark.parametrize("text", ["lean ≤ 1.05 × no recording", "`every=100` steps", "a 2 MiB record",
                                  "<!-- bench: run/x .2f -->1.21<!-- /bench -->×"])
def test_marked_numbers_targets_and_settings_pass(text: str) -> None:
    assert _unmarked_measures(text) == []


def test_run_py_keeps_the_sections_other_scripts_wrote(tmp_path: Path) -> None:
    """benchmarks/run.py writes RESULTS.md whole; run alone it must not drop the other scripts' sections."""
    import run as bench_run

    old = tmp_path / "RESULTS.md"
    old.write_text("# results\n\nold head\n\n## Workload A\nold A\n\n## Keyframe mode\nkf\n\n## Startup\nst\n")
    got = bench_run.keep_other_sections("# results\n\nnew head\n\n## Workload A\nnew A\n", old)
    assert got == "# results\n\nnew head\n\n## Workload A\nnew A\n\n## Keyframe mode\nkf\n\n## Startup\nst\n"
    assert bench_run.keep_other_sections("# r\n", tmp_path / "absent.md") == "# r\n"


@pytest.mark.parametrize("where", ["start", "middle", "end", "absent"])
def test_a_script_replaces_only_its_own_section_of_results_md(tmp_path: Path, where: str) -> None:
    import results_md

    mine_old, mine_new = "## Mine (issue 1)\n\nold numbers\n", "\n## Mine (issue 1)\n\nnew numbers\n"
    a, b = "## Other A\n\nkept a\n", "## Other B\n\nkept b\n"
    body = {"start": [mine_old, a, b], "middle": [a, mine_old, b], "end": [a, b, mine_old], "absent": [a, b]}[where]
    path = tmp_path / "RESULTS.md"
    path.write_text("# results\n\n" + "\n".join(body))
    for _ in range(2):  # twice: still one section, in the same place
        results_md.replace_section(path, "## Mine (issue 1)", mine_new)
    text = path.read_text()
    assert "old numbers" not in text and text.count("## Mine (issue 1)") == 1 and "new numbers" in text
    assert "kept a" in text and "kept b" in text and text.startswith("# results\n")
    order = [line for line in text.splitlines() if line.startswith("## ")]
    want = {"start": ["## Mine (issue 1)", "## Other A", "## Other B"],
            "middle": ["## Other A", "## Mine (issue 1)", "## Other B"]}.get(where, ["## Other A", "## Other B",
                                                                                     "## Mine (issue 1)"])
    assert order == want
