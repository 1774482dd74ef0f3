"""The report at scale (issue 26 item 5): bucketing in the catalog, lazy sections, the synthetic run.

* A long run's per-tensor matrices are bucketed inside SQLite (``CatalogReader.stat_buckets``,
  ``analysis.matrices.bucketed_matrices``): the catalog hands back tensors x buckets rows, and the
  buckets keep a planted gradient spike and a planted NaN where a reader sees them.
* A large page embeds those matrices compressed, one element each; its first view draws the
  scalars without decoding them, and scrolling to a section (or its button) decodes and draws it.
* ``benchmarks/synth_run.py`` writes what a stats-only recording writes: checked here against a run
  recorded for real (same tables, same row shapes).

Timings belong to ``make bench`` (benchmarks/report_scale.py), never to these tests.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import open_page

import stepdump
from stepdump.analysis.matrices import bucketed_matrices, stat_matrices
from stepdump.analysis.report import build_report_data
from stepdump.render.html import LAZY_KEYS, render_report

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from synth_run import record_template, synth_run, tensor_names  # noqa: E402

TENSORS, STEPS, SPIKE, NAN = 40, 1500, 1234, 701
SPIKED, NANNED = tensor_names(TENSORS)[0], tensor_names(TENSORS)[1]


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_run(tmp_path_factory.mktemp("scale") / "run", TENSORS, STEPS, spike=SPIKE, nan_step=NAN)


@pytest.fixture(scope="module")
def big_data(big: Path) -> dict[str, Any]:
    with stepdump.open(big) as run:
        return build_report_data(run, findings=[], max_points=200, quantile_steps=0)


# -- the synthetic run is what a recording writes ----------------------------------------
def _shape(row: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(type(v).__name__ for v in row)


def test_synth_run_has_the_tables_and_row_shapes_of_a_recording(tmp_path: Path) -> None:
    synth_run(tmp_path / "synth", 12, 40, spike=10, nan_step=20)
    record_template(tmp_path / "real", 12, 40)
    with stepdump.open(tmp_path / "synth") as s, stepdump.open(tmp_path / "real") as r:
        assert s.all_steps == r.all_steps == list(range(41))
        assert s.stats_steps == r.stats_steps and s.steps == r.steps
        assert sorted(s.meta) == sorted(r.meta) and s.meta["final_step"] == r.meta["final_step"] == 40
        assert s.kinds() == r.kinds() and all(s.names(k) == r.names(k) for k in r.kinds())
        for step in (0, 1, 2, 25, 39, 40):
            srows, rrows = s.catalog.step_rows(step), r.catalog.step_rows(step)
            assert [x[:6] for x in srows] == [x[:6] for x in rrows], step  # kind, name, param, key, dtype, shape
            assert [_shape(x) for x in srows] == [_shape(x) for x in rrows], step
            assert s.catalog.level(step) == r.catalog.level(step)
            assert (s.catalog.step_state(step) is None) == (r.catalog.step_state(step) is None)
            assert sorted(n for _, n, _ in s.catalog.scalar_rows(step)) == sorted(n for _, n, _ in r.catalog.scalar_rows(step))
        assert s.skipped_steps == r.skipped_steps == []
        # the planted NaN is counted where a recording counts one
        assert [n for n, v in zip(s.names("grads"), s.stats(kind="grads", steps=20)["nan"]) if v] == [NANNED]


# -- bucketing in the catalog keeps what a reader looks for ---------------------------------
def test_bucketed_matrices_match_the_exact_matrix_reduced_by_step_buckets(big: Path) -> None:
    with stepdump.open(big) as run:
        b = bucketed_matrices(run, "grads", 200)
        exact = stat_matrices(run, "grads", ("norm", "min", "max"))
    assert b is not None and b["norm"].values.shape[1] <= 200 < exact["norm"].steps.size
    starts, ends = b["norm"].steps, b["norm"].last_steps
    for col in (0, 7, 100, starts.size - 1):
        inside = (exact["norm"].steps >= starts[col]) & (exact["norm"].steps <= ends[col])
        for c, f in (("norm", np.nanmax), ("min", np.nanmin), ("max", np.nanmax)):
            np.testing.assert_array_equal(b[c].values[:, col], f(exact[c].values[:, inside], axis=1))


def test_report_of_a_long_run_never_loads_every_stats_row(big: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The catalog hands back tensors x buckets rows for the matrices, not tensors x steps."""
    from stepdump.store.queries import CatalogReader

    sizes: list[int] = []
    real = CatalogReader._q

    def counting(self: CatalogReader, sql: str, args: Any = ()) -> list[Any]:
        rows = real(self, sql, args)
        sizes.append(len(rows))
        return rows

    monkeypatch.setattr(CatalogReader, "_q", counting)
    with stepdump.open(big) as run:
        build_report_data(run, findings=[], max_points=200, quantile_steps=0)
    # one kind's stats are TENSORS x (STEPS + 1) rows; the scalars are 6 x STEPS (loss, lr, sys/*)
    assert max(sizes) <= 6 * (STEPS + 1) < TENSORS * (STEPS + 1)
    assert sum(sizes) < TENSORS * (STEPS + 1)


def test_few_steps_are_not_bucketed(tmp_path: Path) -> None:
    synth_run(tmp_path / "small", 6, 30)
    with stepdump.open(tmp_path / "small") as run:
        assert bucketed_matrices(run, "grads", 200) is None


@pytest.mark.parametrize("where", ["grad_heatmap", "bands_max", "nonfinite", "loss", "update_bound"])
def test_bucketing_keeps_the_planted_spike_and_nan(big_data: dict[str, Any], where: str) -> None:
    def column(x0: list[int], x1: list[int], step: int) -> int:
        hits = [i for i, (a, b) in enumerate(zip(x0, x1)) if a <= step <= b]
        assert len(hits) == 1, (step, hits)
        return hits[0]

    if where == "grad_heatmap":
        hm = big_data["grad_norms"]
        assert hm["steps"] > len(hm["x0"])  # bucketed
        row = hm["names"].index(SPIKED)
        assert hm["values"][row][column(hm["x0"], hm["x1"], SPIKE)] > 1e3
        assert max(v for i, v in enumerate(hm["values"][row]) if i != column(hm["x0"], hm["x1"], SPIKE)) < 1
    elif where == "bands_max":
        band = big_data["dist"]["grads"]["bands"][0]
        row = band["names"].index(SPIKED)
        assert band["max"][row][column(band["x0"], band["x1"], SPIKE)] == 1e4
    elif where == "nonfinite":
        nf = big_data["nonfinite"]
        hot = [(a, b) for a, b, c in zip(nf["x0"], nf["x1"], nf["count"]) if c]
        assert len(hot) == 1 and hot[0][0] <= NAN <= hot[0][1]
    elif where == "loss":
        loss = next(c for c in big_data["scalars"] if c["name"] == "loss")
        assert len(loss["x"]) <= 200 and loss["nonfinite_steps"] == [NAN] and NAN in loss["x"]
    else:  # the update/weight bound of the spiked tensor's params stays small; each column covers its bucket
        ub = big_data["update_ratio"]["lower_bound"]
        assert ub["steps"] > len(ub["x0"]) and ub["x0"][0] == 0 and ub["x1"][-1] == STEPS


# -- the page: first view without the matrices, decoded when a section is scrolled to ----------
@pytest.fixture(scope="module")
def page_file(big_data: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The page of the long run, made lazy the way a larger one is by default (its matrices over
    LAZY_BYTES: here the threshold is lowered rather than the run made 20 times longer)."""
    out = tmp_path_factory.mktemp("page") / "report.html"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("stepdump.render.html.LAZY_BYTES", 50_000)
        out.write_text(render_report(big_data), encoding="utf-8")
    return out


def test_large_page_embeds_the_matrices_compressed_outside_the_data_blob(page_file: Path) -> None:
    html = page_file.read_text()
    blob = html.split('id="stepdump-data">', 1)[1].split("</script>", 1)[0]
    for key in LAZY_KEYS:
        assert f'"{key}":{{"lazy":"stepdump-lazy-0-{key}"}}' in blob
        assert f'<script type="application/octet-stream" id="stepdump-lazy-0-{key}" data-codec="deflate">' in html
    assert '"packed"' not in blob and '"f32"' not in blob


def test_small_page_stays_inline(tmp_path: Path) -> None:
    synth_run(tmp_path / "small", 6, 30)
    with stepdump.open(tmp_path / "small") as run:
        html = render_report(build_report_data(run, findings=[]))
    assert 'id="stepdump-lazy-' not in html and '"packed"' in html


def test_first_view_leaves_lazy_sections_undecoded_until_scrolled_to(browser: Any, page_file: Path) -> None:
    page, problems = open_page(browser, page_file.resolve().as_uri())
    try:
        assert page.locator("#scalar-charts canvas[data-plot]").count() >= 1
        for sec in ("grad-norms", "update-ratio"):
            assert page.get_attribute(f"#{sec}", "data-lazy") == "pending"
            assert page.locator(f"#{sec} canvas").count() == 0
        page.locator("#grad-norms").scroll_into_view_if_needed()
        page.wait_for_selector("#grad-norms[data-lazy='decoded'] canvas", timeout=15_000)
        assert page.get_attribute("#update-ratio", "data-lazy") == "decoded"
        assert page.locator("#ratio-heatmaps canvas").count() >= 1
        assert not problems, problems
    finally:
        page.close()


def test_lazy_section_button_decodes_it(browser: Any, page_file: Path) -> None:
    page, problems = open_page(browser, page_file.resolve().as_uri())
    try:
        assert page.get_attribute("#layers", "data-lazy") in ("pending", "decoded")
        if page.get_attribute("#layers", "data-lazy") == "pending":  # below the first screen
            page.evaluate("document.querySelector('#layers .lazy-load').click()")
        page.wait_for_selector("#layers[data-lazy='decoded'] #layer-select", timeout=15_000)
        assert page.locator("#layer-charts canvas[data-plot]").count() >= 3
        assert not problems, problems
    finally:
        page.close()


def test_watch_page_starts_lazy_and_takes_live_updates_inline(browser: Any, big: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``stepdump report --watch`` of a long run: the first page is lazy like a written one; an
    update (the run moved on) carries the data inline and the page draws every section from it."""
    import threading

    from stepdump.render.live import LiveReport, make_server

    monkeypatch.setattr("stepdump.render.html.LAZY_BYTES", 50_000)
    report = LiveReport([big], interval_s=0.2, max_points=200)
    server = make_server(report, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        host, port = server.server_address[:2]
        page, problems = open_page(browser, f"http://{host}:{port}/")
        try:
            assert page.get_attribute("#grad-norms", "data-lazy") == "pending"
            assert page.locator("#grad-norms canvas").count() == 0
            report._key = None  # as if the run had moved on: the next poll gets a new version
            # the server rebuilds the data first: slow on a loaded machine, hence the long limit
            page.wait_for_selector("body[data-version='2']", state="attached", timeout=120_000)
            assert page.get_attribute("#grad-norms", "data-lazy") is None  # inline now: drawn at once
            assert page.locator("#grad-heatmap canvas").count() >= 1
            assert page.locator("#layer-select").count() == 1
            # the browser's own /favicon.ico request is answered 404; the page's errors are the point
            assert [p for p in problems if "404" not in p] == [], problems
        finally:
            page.close()
    finally:
        server.shutdown()
        server.server_close()
