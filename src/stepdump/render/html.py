"""``stepdump report``: one self-contained HTML file that opens offline.

One run, or several overlaid (:mod:`stepdump.analysis.report_overlay`); the
page always draws the overlay layout, a single run being a run of one. The
live view (:mod:`stepdump.render.live`) serves the same page with a small
``#stepdump-live`` blob that makes it poll for fresh data.

The page carries everything inline: CSS and the plotting script (package data
``report.css`` / ``report_draw.js`` / ``report.js``, plain JS on ``<canvas>``, no libraries) and the
report data as a JSON blob in ``<script type="application/json">``. Nothing is
fetched. The summary and findings table are plain HTML, so they read even with
scripts off.

Heatmap matrices (up to tensors x ``max_points`` cells) are the bulk of the
data; to keep a 10,000-step, 200-tensor report a few MB they travel as
base64 uint16 codes of log10(value) over the matrix's own range (resolution
about 1/65,000 of that range; 0 = no value, 1 = zero). Other floats are
rounded to 6 significant digits. That is for the page only; the dict from
``build_report_data`` keeps full values.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import zlib
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from stepdump.read.reader import RunReader

_ASSET_PACKAGE = "stepdump.render"
_CODE_MISSING, _CODE_ZERO, _CODE_FIRST, _CODE_LAST = 0, 1, 2, 65535


#: Series colours, one per run (the page's palette; the first is also a single run's colour).
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")


def page_data(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` in the page's layout: several runs (:func:`~stepdump.analysis.report_overlay.combine`)
    as they are, one run's :func:`~stepdump.analysis.report.build_report_data` as a run of one."""
    if "runs" in data:
        return data
    from stepdump.analysis.report_overlay import combine

    return combine([data], [Path(str(data["summary"]["path"])).name or str(data["summary"]["path"])])


def render_report(data: dict[str, Any], *, live: dict[str, Any] | None = None, lazy: bool | None = None) -> str:
    """The report page for ``data``: one run's :func:`stepdump.analysis.report.build_report_data`,
    or several runs' :func:`stepdump.analysis.report_overlay.build_overlay_data`.

    ``live`` (``{"url": ..., "interval_ms": ...}``, from :mod:`stepdump.render.live`) makes the
    page poll ``url`` for fresh data; without it the page fetches nothing.

    ``lazy``: embed the per-tensor matrices (:data:`LAZY_KEYS`) each in a deflate-compressed
    element of its own, decoded by the page only when a section that draws them is scrolled to
    (or its "load" button pressed); the first view parses and draws only the summary, findings
    and scalars. None (default): lazy when those matrices take more than :data:`LAZY_BYTES`.
    """
    d = page_data(data)
    runs = d["runs"]
    title = f"stepdump report — {runs[0]['summary']['path']}" if len(runs) == 1 else \
        f"stepdump report — {len(runs)} runs: " + ", ".join(r["label"] for r in runs)
    frag = fragments(d)
    return _PAGE.format(
        title=_e(title),
        path=_e(runs[0]["summary"]["path"] if len(runs) == 1 else " · ".join(r["summary"]["path"] for r in runs)),
        css=_asset("report.css"),
        js="\n".join(_asset(n) for n in ("report_draw.js", "report_heat.js", "report.js")),
        summary=frag["summary_html"],
        findings=frag["findings_html"],
        nfindings=frag["nfindings"],
        compare=frag["compare_html"],
        ranks=frag["ranks_html"],
        ranks_hidden="" if frag["ranks_html"] else " hidden",
        compare_hidden="" if len(runs) > 1 else " hidden",
        **_page_parts(d, lazy),
        live="" if live is None else
        f'<script type="application/json" id="stepdump-live">{_script_json(live)}</script>',
    )


def page_json(d: dict[str, Any]) -> str:
    """The page data (already in page layout) as the JSON the page reads: packed, rounded, safe
    inside a ``<script>`` element."""
    return _script_json(_pack(d))


#: Per-run data the page decodes only when a section needs them (see :func:`render_report`).
LAZY_KEYS = ("grad_norms", "param_norms", "update_ratio", "dist")
#: Above this many bytes of those (as JSON), :func:`render_report` makes them lazy by default.
LAZY_BYTES = 1 << 20


def _page_parts(d: dict[str, Any], lazy: bool | None) -> dict[str, str]:
    """``data`` (the JSON blob) and ``lazy`` (the compressed elements, '' when none) of a page."""
    packed = _pack(d)
    parts: list[tuple[str, str]] = []  # (element id, JSON text)
    for i, r in enumerate(packed["runs"]):
        for key in LAZY_KEYS:
            if r.get(key):
                parts.append((f"stepdump-lazy-{i}-{key}", _script_json(r[key])))
    if lazy is None:
        lazy = sum(len(text) for _, text in parts) > LAZY_BYTES
    if not lazy or not parts:
        return {"data": _script_json(packed), "lazy": ""}
    runs = [dict(r) for r in packed["runs"]]
    elements = []
    for eid, text in parts:
        run, key = eid.removeprefix("stepdump-lazy-").split("-", 1)
        runs[int(run)][key] = {"lazy": eid}
        # zlib's format is what the page's DecompressionStream("deflate") reads; base64 keeps it text.
        b64 = base64.b64encode(zlib.compress(text.encode("utf-8"), 6)).decode("ascii")
        elements.append(f'<script type="application/octet-stream" id="{eid}" data-codec="deflate">{b64}</script>')
    return {"data": _script_json(dict(packed, runs=runs)), "lazy": "\n".join(elements)}


def fragments(d: dict[str, Any]) -> dict[str, Any]:
    """The static HTML parts of a page (summary, findings) for page-layout data ``d``; the
    live view sends them with each update."""
    runs = d["runs"]
    findings = [f for r in runs for f in r["findings"]]
    checks = {r["checks"] for r in runs}
    return {
        "summary_html": _summaries_html(runs),
        "findings_html": _findings_html(findings, checks.pop() if len(checks) == 1 else "given",
                                        [r["label"] for r in runs] if len(runs) > 1 else None)
        + _reexec_html(runs),
        "nfindings": len(findings),
        "compare_html": comparison_html(d),
        "ranks_html": ranks_html(runs),
    }


def write_report(
    run: RunReader | Sequence[RunReader],
    path: str | os.PathLike[str],
    findings: list[Any] | None = None,
    *,
    labels: Sequence[str] | None = None,
) -> Path:
    """Build the report data and write the page to ``path``; returns the path.

    Args:
        run: A run, or several runs to overlay (their curves on shared axes, one colour each).
        path: The HTML file to write.
        findings: For one run, findings to mark (None: run the checks). Several runs are
            always checked.
        labels: For several runs, a label per run (default: their directory names).
    """
    from stepdump.analysis.report import build_report_data
    from stepdump.analysis.report_overlay import build_overlay_data

    out = Path(path)
    if isinstance(run, RunReader):
        data = build_report_data(run, findings)
        if labels:
            data = page_data(data)
            data["runs"][0]["label"] = labels[0]
    else:
        data = build_overlay_data(list(run), labels)
    # A run's path may hold bytes that are not UTF-8 (lone surrogates in Python): shown as U+FFFD.
    out.write_bytes(render_report(data).encode("utf-8", "surrogateescape").decode("utf-8", "replace").encode("utf-8"))
    return out


def _script_json(x: Any) -> str:
    text = json.dumps(x, separators=(",", ":"), allow_nan=False, ensure_ascii=True)
    return text.replace("<", "\\u003c")  # no "</script>" can end the blob early


# -- data packing -----------------------------------------------------------------
def _pack(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of page-layout ``data`` for the page: heatmaps packed, floats rounded, the palette added."""
    out = dict(data, palette=list(PALETTE))
    runs = []
    for r in data["runs"]:
        r = dict(r)
        for key in ("grad_norms", "param_norms"):
            if r.get(key):
                r[key] = _packed(r[key])
        if r.get("update_ratio"):
            r["update_ratio"] = {k: _packed(v) if v else v for k, v in r["update_ratio"].items()}
        if r.get("dist"):
            r["dist"] = {k: _packed_dist(v) for k, v in r["dist"].items()}
        runs.append(r)
    out["runs"] = runs
    out["norm_diff"] = [dict(d, heatmap=_packed(d["heatmap"])) for d in data.get("norm_diff", [])]
    return _round(out)


def _packed_dist(entry: dict[str, Any]) -> dict[str, Any]:
    """Bands ``[stat][tensor][column]`` and quantiles ``[level][tensor][step]`` as base64 float32."""
    bands = [{k: v for k, v in b.items() if k not in _BAND_STATS} | {"f32": _f32([b[c] for c in _BAND_STATS])}
             for b in entry["bands"]]
    quants = [{k: v for k, v in q.items() if k != "q"} | {"f32": _f32(q["q"])} for q in entry["quantiles"]]
    return {"probs": entry["probs"], "bands": bands, "quantiles": quants}


_BAND_STATS = ("min", "max", "mean", "std")


def _f32(nested: Any) -> str:
    """Nested lists of floats (None: no value) as base64 little-endian float32 (NaN: no value)."""
    a = np.array(nested, dtype=object)
    flat = np.array([np.nan if v is None else v for v in a.reshape(-1).tolist()], dtype="<f4")
    return base64.b64encode(flat.tobytes()).decode("ascii")


def _packed(hm: dict[str, Any]) -> dict[str, Any]:
    d = {k: v for k, v in hm.items() if k != "values"}
    d["packed"] = _pack_matrix(hm["values"])
    return d


def _pack_matrix(rows: list[list[float | None]]) -> dict[str, Any]:
    m = np.array([[np.nan if v is None else v for v in r] for r in rows], dtype=np.float64).reshape(len(rows), -1)
    pos = m[np.isfinite(m) & (m > 0)]
    lo, hi = (float(np.log10(pos.min())), float(np.log10(pos.max()))) if pos.size else (0.0, 0.0)
    codes = np.full(m.shape, _CODE_MISSING, dtype="<u2")
    with np.errstate(divide="ignore", invalid="ignore"):
        lg = np.log10(m)
    span = hi - lo if hi > lo else 1.0
    ok = np.isfinite(lg)
    codes[ok] = np.round(_CODE_FIRST + (lg[ok] - lo) / span * (_CODE_LAST - _CODE_FIRST)).astype("<u2")
    codes[np.isfinite(m) & (m <= 0)] = _CODE_ZERO
    return {"lo": lo, "hi": hi, "rows": m.shape[0], "cols": m.shape[1],
            "b64": base64.b64encode(codes.tobytes()).decode("ascii")}


def _round(x: Any) -> Any:
    if isinstance(x, float):
        return float(f"{x:.6g}") if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    return x


def _asset(name: str) -> str:
    return resources.files(_ASSET_PACKAGE).joinpath(name).read_text(encoding="utf-8")


# -- static HTML parts ----------------------------------------------------------------
def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def comparison_html(d: dict[str, Any]) -> str:
    """Where the runs part (``stepdump diff``) and the run table, differing rows marked; '' for one run."""
    runs = d["runs"]
    if len(runs) < 2:
        return ""
    parts = ['<div id="divergence">']
    for v in d.get("divergence", []):
        b = runs[v["run"]]["label"]
        where = f'step {v["step"]}' if v.get("step") is not None else ("identical" if v.get("identical") else "—")
        parts.append(f'<p class="diverge" data-run="{v["run"]}" data-step="{_e(v.get("step"))}">'
                     f'<b>{_e(runs[0]["label"])} vs {_e(b)}</b>: <span class="mono">{_e(where)}</span> · '
                     f'{_e(v.get("headline"))}{" · " + _e(v["reading"]) if v.get("reading") else ""}</p>')
    parts.append("</div>")
    head = "".join(f"<th>{_e(r['label'])}</th>" for r in runs)
    rows = "".join(
        f'<tr class="{"differs" if row["differs"] else "same"}" data-key="{_e(row["key"])}"><th>{_e(row["key"])}</th>'
        + "".join(f'<td class="mono">{_e(v)}</td>' for v in row["values"]) + "</tr>"
        for row in d.get("run_table", []))
    ndiff = sum(1 for row in d.get("run_table", []) if row["differs"])
    parts.append(f'<details open class="run-table-box"><summary>Run settings ({ndiff} differ, highlighted)</summary>'
                 f'<table class="run-table"><thead><tr><th></th>{head}</tr></thead><tbody>{rows}</tbody></table></details>')
    return "\n".join(parts)


def ranks_html(runs: list[dict[str, Any]]) -> str:
    """Each multi-rank run's ranks table (:mod:`stepdump.analysis.report_ranks`), outlier ranks
    marked and said first; '' when no run has ranks."""
    parts = []
    for r in runs:
        s = r.get("ranks")
        if not s:
            continue
        if len(runs) > 1:
            parts.append(f'<h3 class="run-head">{_e(r["label"])}</h3>')
        out = s["outliers"]
        spread = f'{s["grad_spread"]:.3g}' if isinstance(s.get("grad_spread"), float) else "—"
        parts.append(f'<p class="ranks-head" data-outliers="{_e(",".join(map(str, out)))}">'
                     f'{len(s["rows"])} ranks · outlier ranks: <b>{_e(", ".join(map(str, out)) or "none")}</b>'
                     f' · total grad-norm spread (max − min) / median at the last common step: {_e(spread)}'
                     f'{" · replicas part at step " + _e(s["split"]) if s.get("split") is not None else ""}</p>')
        head = "".join(f"<th>{h}</th>" for h in ("Rank", "Steps", "Last step", "Loss (last)", "Grad norm (last)",
                                                 "Largest grad-norm deviation from the ranks' median", "Outlier because"))
        rows = "".join(
            f'<tr class="{"outlier" if x["outlier"] else "ok"}" data-rank="{_e(x["rank"])}">'
            f'<td class="num">{_e(x["rank"])}</td><td class="num">{_e(x["steps"])}</td><td class="num">{_e(x["last_step"])}</td>'
            f'<td class="num">{_e(_fmt(x["loss_last"]))}</td><td class="num">{_e(_fmt(x["grad_norm_last"]))}</td>'
            f'<td class="num">{_e(_deviation(x))}</td>'
            f'<td>{_e("; ".join(x["why"]))}</td></tr>' for x in s["rows"])
        parts.append(f'<table class="ranks"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>')
    return "\n".join(parts)


def _deviation(row: dict[str, Any]) -> str:
    if row.get("grad_dev") is None:
        return ""
    return f'{row["grad_dev"]:.2%} at step {row["grad_dev_step"]}'


def _summaries_html(runs: list[dict[str, Any]]) -> str:
    if len(runs) == 1:
        return _summary_html(runs[0]["summary"])
    parts = []
    for i, r in enumerate(runs):
        colour = PALETTE[i % len(PALETTE)]
        parts.append(f'<h3 class="run-head" data-run="{i}"><span class="swatch" style="background:{colour}"></span>'
                     f'{_e(r["label"])} <span class="mono muted">{_e(r["summary"]["path"])}</span></h3>\n'
                     + _summary_html(r["summary"]))
    return "\n".join(parts)


def _summary_html(s: dict[str, Any]) -> str:
    steps = f"{s['steps_recorded']:,}"
    if s["steps_recorded"]:
        steps += f" (steps {s['first_step']}–{s['last_step']})"
    skipped = f"{s['skipped_steps']:,}"
    if s["skipped_steps"]:
        shown = ", ".join(str(x) for x in s["skipped_list"][:20])
        skipped += f": {shown}{', …' if s['skipped_steps'] > 20 else ''}"
    kinds = ", ".join(f"{k} {n:,}" for k, n in s["tensors"].items())
    rows = [
        ("Model", s["model_class"]),
        ("Optimizer", s["optimizer_class"]),
        ("Scheduler", s["scheduler_class"] or "none"),
        ("Steps recorded", steps),
        ("Stored in full / with stats", f"{s['full_steps']:,} / {s['stats_steps']:,}"),
        ("Skipped steps", skipped),
        ("Tensors", f"{s['tensors_total']:,} ({kinds})" if kinds else "0"),
        ("Size on disk", f"{_bytes(s['bytes'])} ({s['bytes']:,} bytes)"),
        ("Created", s["created"]),
        ("Versions", f"stepdump {s['stepdump_version']}, torch {s['torch_version']}, "
                     f"python {s['python_version']}, format_version {s['format_version']}"),
        ("Schedule", f"every={s['every']}, stats_every={s['stats_every']}, codec={s['codec']}"),
    ]
    if s.get("live"):
        rows.append(("Status", "still being recorded when this report was made"))
    items = "\n".join(
        f'<div class="kv" data-key="{_e(k)}"><dt>{_e(k)}</dt><dd>{_e(v)}</dd></div>' for k, v in rows
    )
    return f'<dl class="summary">\n{items}\n</dl>'


def _findings_html(findings: list[dict[str, Any]], checks: str, labels: list[str] | None = None) -> str:
    if not findings:
        text = {"unavailable": "Checks are not available in this stepdump version; no findings to show.",
                "ran": "The checks found nothing."}.get(checks, "No findings.")
        return f'<p class="muted">{_e(text)}</p>'
    order = {"error": 0, "warning": 1, "info": 2}
    ranked = sorted(findings, key=lambda f: (order.get(str(f.get("severity")), 3),
                                             f.get("step") if f.get("step") is not None else -1))
    cols = ("Run",) * bool(labels) + ("Severity", "Step", "Rule", "Where", "Value", "Threshold", "Message")
    head = "".join(f"<th>{h}</th>" for h in cols)
    body = []
    for f in ranked:
        where = " ".join(str(x) for x in (f.get("kind"), f.get("tensor")) if x)
        sev = str(f.get("severity"))
        run = f'<td>{_e(labels[int(f.get("run") or 0)])}</td>' if labels else ""
        body.append(
            f'<tr data-step="{_e(f.get("step"))}">{run}<td><span class="sev sev-{_e(sev)}">{_e(sev)}</span></td>'
            f'<td class="num">{_e(f.get("step", ""))}</td><td>{_e(f.get("rule"))}</td><td class="mono">{_e(where)}</td>'
            f'<td class="num">{_e(_fmt(f.get("value")))}</td><td class="num">{_e(_fmt(f.get("threshold")))}</td>'
            f"<td>{_e(f.get('message'))}</td></tr>"
        )
    return f'<table class="findings"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _reexec_html(runs: list[dict[str, Any]]) -> str:
    """One row per re-execution written back into a run (docs/reexecute.md): its step and verdict,
    under the findings (a verdict other than *reproduces* is also a ``reexecution`` finding)."""
    rows = [(i, x) for i, r in enumerate(runs) for x in r.get("reexecutions") or []]
    if not rows:
        return ""
    labels = len(runs) > 1
    head = "".join(f"<th>{h}</th>" for h in ("Run",) * labels + ("Step", "Verdict", "First difference",
                                                                   "First NaN/Inf op", "Tensors captured"))
    body = "".join(
        f'<tr data-step="{_e(x["step"])}" data-verdict="{_e(x["verdict"])}">'
        + (f'<td>{_e(runs[i]["label"])}</td>' if labels else "")
        + f'<td class="num">{_e(x["step"])}</td><td>{_e(x["verdict"])}'
        + (f' ({_e(x["cause"])})' if x.get("cause") else "")
        + f'</td><td class="mono">{_e(x.get("first"))}</td><td class="mono">{_e(x.get("nan_op"))}</td>'
        f'<td class="num">{_e(x.get("captured", 0))}</td></tr>'
        for i, x in rows)
    return (f'<h3>Re-executed steps</h3><div id="reexec-body"><table class="findings reexec"><thead><tr>{head}'
            f'</tr></thead><tbody>{body}</tbody></table></div>')


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
{css}
</style>
</head>
<body>
<header><h1>stepdump report <span id="live-status" class="badge" hidden></span></h1><div class="path mono">{path}</div>
<label class="toggle steps-label" title="stepdump step t is optimizer update t, counted from 0 (the record holds the weights before it and the scalars logged with it). A Hugging Face or Lightning Trainer's global_step counts updates from 1, after the update: the same update is global_step t + 1.">step numbers
<select id="step-numbering"><option value="0">stepdump step t (from 0)</option><option value="1">Trainer global_step (t + 1)</option></select></label>
</header>
<main>
<section id="summary"><h2>Run</h2><div id="summary-body">
{summary}
</div></section>
<section id="ranks"{ranks_hidden}><h2>Ranks</h2><div id="ranks-body">
{ranks}
</div></section>
<section id="findings"><h2>Findings <span class="badge" id="nfindings">{nfindings}</span></h2><div id="findings-body">
{findings}
</div></section>
<section id="compare"{compare_hidden}><h2>Where the runs part</h2><div id="compare-body">
{compare}
</div><div id="norm-diff"></div></section>
<div id="controls" class="controls"></div>
<section id="scalars"><h2>Scalars</h2><div class="grid" id="scalar-charts"></div></section>
<section id="sys"><h2>System (sys/*)</h2><div class="grid" id="sys-charts"></div></section>
<section id="layers"><h2>Per tensor</h2><div id="layer-charts"></div></section>
<section id="grad-norms"><h2>Gradient L2 norm per tensor</h2><div id="grad-heatmap"></div></section>
<section id="update-ratio"><h2>Update / weight ratio per tensor</h2><div id="ratio-heatmaps"></div></section>
<section id="moments"><h2>Optimizer moment norms</h2><div class="grid" id="moment-charts"></div></section>
<section id="nonfinite"><h2>NaN / Inf timeline</h2><div id="nonfinite-chart"></div></section>
</main>
<footer class="muted">Made by stepdump. Hover a chart for values; dashed lines mark findings; click a heatmap row
to see that tensor's curves.</footer>
<div id="tip" hidden></div>
{live}
<script type="application/json" id="stepdump-data">{data}</script>
{lazy}
<script>
{js}
</script>
</body>
</html>
"""
