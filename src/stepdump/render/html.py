"""``stepdump report``: one self-contained HTML file that opens offline.

The page carries everything inline: CSS and the plotting script (package data
``report.css`` / ``report.js``, plain JS on ``<canvas>``, no libraries) and the
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
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from stepdump.read.run import Run

_ASSET_PACKAGE = "stepdump.render"
_CODE_MISSING, _CODE_ZERO, _CODE_FIRST, _CODE_LAST = 0, 1, 2, 65535


def render_report(data: dict[str, Any]) -> str:
    """The report page for ``data`` (from :func:`stepdump.analysis.report.build_report_data`)."""
    s = data["summary"]
    payload = json.dumps(_pack(data), separators=(",", ":"), allow_nan=False, ensure_ascii=True)
    payload = payload.replace("<", "\\u003c")  # no "</script>" can end the blob early
    title = f"stepdump report — {s['path']}"
    return _PAGE.format(
        title=_e(title),
        path=_e(s["path"]),
        css=_asset("report.css"),
        js=_asset("report.js"),
        summary=_summary_html(s),
        findings=_findings_html(data.get("findings", []), data.get("checks", "given")),
        nfindings=len(data.get("findings", [])),
        data=payload,
    )


def write_report(run: Run, path: str | os.PathLike[str], findings: list[Any] | None = None) -> Path:
    """Build the report data for ``run`` and write the page to ``path``; returns the path."""
    from stepdump.analysis.report import build_report_data

    out = Path(path)
    out.write_text(render_report(build_report_data(run, findings)), encoding="utf-8")
    return out


# -- data packing -----------------------------------------------------------------
def _pack(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``data`` for the page: heatmaps packed, floats rounded."""
    out = dict(data)
    if out.get("grad_norms"):
        out["grad_norms"] = _packed(out["grad_norms"])
    if out.get("update_ratio"):
        out["update_ratio"] = {k: _packed(v) if v else v for k, v in out["update_ratio"].items()}
    return _round(out)


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


def _findings_html(findings: list[dict[str, Any]], checks: str) -> str:
    if not findings:
        text = {"unavailable": "Checks are not available in this stepdump version; no findings to show.",
                "ran": "The checks found nothing."}.get(checks, "No findings.")
        return f'<p class="muted">{_e(text)}</p>'
    order = {"error": 0, "warning": 1, "info": 2}
    ranked = sorted(findings, key=lambda f: (order.get(str(f.get("severity")), 3),
                                             f.get("step") if f.get("step") is not None else -1))
    head = "".join(f"<th>{h}</th>" for h in ("Severity", "Step", "Rule", "Where", "Value", "Threshold", "Message"))
    body = []
    for f in ranked:
        where = " ".join(str(x) for x in (f.get("kind"), f.get("tensor")) if x)
        sev = str(f.get("severity"))
        body.append(
            f'<tr data-step="{_e(f.get("step"))}"><td><span class="sev sev-{_e(sev)}">{_e(sev)}</span></td>'
            f'<td class="num">{_e(f.get("step", ""))}</td><td>{_e(f.get("rule"))}</td><td class="mono">{_e(where)}</td>'
            f'<td class="num">{_e(_fmt(f.get("value")))}</td><td class="num">{_e(_fmt(f.get("threshold")))}</td>'
            f"<td>{_e(f.get('message'))}</td></tr>"
        )
    return f'<table class="findings"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


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
<header><h1>stepdump report</h1><div class="path mono">{path}</div></header>
<main>
<section id="summary"><h2>Run</h2>
{summary}
</section>
<section id="findings"><h2>Findings <span class="badge">{nfindings}</span></h2>
{findings}
</section>
<section id="scalars"><h2>Scalars</h2><div class="grid" id="scalar-charts"></div></section>
<section id="grad-norms"><h2>Gradient L2 norm per tensor</h2><div id="grad-heatmap"></div></section>
<section id="update-ratio"><h2>Update / weight ratio per tensor</h2><div id="ratio-heatmaps"></div></section>
<section id="moments"><h2>Optimizer moment norms</h2><div class="grid" id="moment-charts"></div></section>
<section id="nonfinite"><h2>NaN / Inf timeline</h2><div id="nonfinite-chart"></div></section>
</main>
<footer class="muted">Made by stepdump. Hover a chart for values; dashed lines mark findings.</footer>
<div id="tip" hidden></div>
<script type="application/json" id="stepdump-data">{data}</script>
<script>
{js}
</script>
</body>
</html>
"""
