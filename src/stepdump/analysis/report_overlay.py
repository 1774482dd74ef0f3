"""Several runs in one report: their curves overlaid, the thing users reach for after a diff.

:func:`build_overlay_data` builds :func:`~stepdump.analysis.report.build_report_data` for each
run and :func:`combine` lays them over each other: a scalar chart or a moment chart per
quantity with one series per run (a quantity is matched across runs by any of its names, so
run A's ``lr = learning_rate`` chart takes run B's ``learning_rate``), one step axis covering
every run, and each run's own summary, heatmaps, NaN/Inf counts and findings. A single run is
the same layout with one run in it, which is what the page always draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stepdump.analysis.findings import Finding
from stepdump.analysis.report import build_report_data
from stepdump.analysis.report_scalars import wants_log
from stepdump.errors import ConfigError
from stepdump.read.reader import RunReader

#: Version of the combined (page) data; the per-run dicts keep ``REPORT_DATA_VERSION``.
OVERLAY_DATA_VERSION = 3

# What each run keeps for itself (drawn per run); scalars and moments are overlaid.
_PER_RUN = ("summary", "domain", "grad_norms", "param_norms", "update_ratio", "nonfinite", "findings", "checks",
            "times", "groups", "dist", "reexecutions", "ranks")


def run_labels(runs: Sequence[RunReader], labels: Sequence[str] | None = None) -> list[str]:
    """Labels for the runs' series: ``labels`` if given, else each run's directory name
    (its whole path where two names clash)."""
    if labels is not None:
        if len(labels) != len(runs):
            raise ConfigError(f"{len(labels)} labels for {len(runs)} runs: give one label per run, or none")
        return [str(x) for x in labels]
    names = [Path(str(r.path)).name or str(r.path) for r in runs]
    return names if len(set(names)) == len(names) else [str(r.path) for r in runs]


def build_overlay_data(
    runs: Sequence[RunReader],
    labels: Sequence[str] | None = None,
    findings: Sequence[Sequence[Finding] | None] | None = None,
    max_points: int = 2000,
    *,
    compare: bool = True,
    **kwargs: Any,
) -> dict[str, Any]:
    """The report data of several runs, overlaid (see the module docstring).

    Args:
        runs: One or more runs.
        labels: A label per run (default: the runs' directory names).
        findings: Findings per run (None for a run: run ``stepdump.check`` on it).
        max_points: As for :func:`~stepdump.analysis.report.build_report_data`.
        compare: With two runs or more, add where they part (``stepdump.diff`` of the first run
            against each other), difference curves and the run table
            (:mod:`stepdump.analysis.report_compare`); False leaves the diff out (the table and
            curves stay).
        **kwargs: Passed on to :func:`~stepdump.analysis.report.build_report_data`.
    """
    if not runs:
        raise ConfigError("a report needs at least one run")
    names = run_labels(runs, labels)
    given = list(findings) if findings is not None else [None] * len(runs)
    if len(given) != len(runs):
        raise ConfigError(f"findings for {len(given)} runs, but {len(runs)} runs: give one entry per run (None: check it)")
    per_run = [build_report_data(r, f, max_points, **kwargs) for r, f in zip(runs, given)]
    from stepdump.analysis.report_compare import comparison

    return comparison(runs, combine(per_run, names), max_points, diff_runs=compare)


def combine(per_run: Sequence[dict[str, Any]], labels: Sequence[str]) -> dict[str, Any]:
    """Lay per-run report dicts over each other (the page's data layout)."""
    if len(per_run) != len(labels) or not per_run:
        raise ConfigError(f"{len(per_run)} runs and {len(labels)} labels: give one label per run")
    runs = []
    for i, (d, label) in enumerate(zip(per_run, labels)):
        r = {k: d.get(k) for k in _PER_RUN}
        r["label"] = label
        r["findings"] = [dict(f, run=i) for f in d.get("findings", [])]
        runs.append(r)
    steps = [d["domain"] for d in per_run if d["summary"]["steps_recorded"]]
    domain = [min(a for a, _ in steps), max(b for _, b in steps)] if steps else [0, 0]
    scalars = _overlay(per_run, "scalars", lambda s: [s["name"], *s.get("aliases", []), *s.get("shifted", [])])
    for c in scalars:  # the recorder's own readings (sys/iter_ms ...) get their own section
        c["section"] = "sys" if all(_is_sys(n) for n in c["names"]) else "scalars"
    return {
        "version": OVERLAY_DATA_VERSION,
        "domain": domain,
        "runs": runs,
        "scalars": scalars,
        "moments": _overlay(per_run, "moments", lambda m: [m["key"]]),
        "run_table": [], "divergence": [], "norm_diff": [],
    }


def _is_sys(name: str) -> bool:
    """``sys/...`` or a rank's ``rank<r>/sys/...``."""
    head, _, rest = name.partition("/")
    return head == "sys" or (head.startswith("rank") and head[4:].isdigit() and rest.startswith("sys/"))


def _overlay(per_run: Sequence[dict[str, Any]], key: str, names_of: Any) -> list[dict[str, Any]]:
    """Charts of ``key`` (scalars or moments) matched across runs by any shared name; each
    chart holds one series per run that has it, and the union of the names."""
    charts: list[dict[str, Any]] = []
    for i, d in enumerate(per_run):
        for item in d.get(key, []):
            names = names_of(item)
            chart = next((c for c in charts if set(c["names"]) & set(names)), None)
            if chart is None:
                chart = {"id": names[0], "names": [], "title": item.get("title") or item.get("label") or names[0],
                         "notes": [], "series": []}
                charts.append(chart)
            chart["names"] += [n for n in names if n not in chart["names"]]
            chart.setdefault("shifted", []).extend(n for n in item.get("shifted", []) if n not in chart["shifted"])
            note = item.get("note")
            if note and note not in chart["notes"]:
                chart["notes"].append(note)
            chart["series"].append({"run": i, "name": names[0], **{k: item[k] for k in
                                    ("x", "y", "points", "nonfinite_steps", "tensors") if k in item}})
    for c in charts:
        if key == "scalars":  # every name any run gave this quantity
            c["title"] = " = ".join(n + " (one step later)" if n in c["shifted"] else n for n in c["names"])
        ys = [v for s in c["series"] for v in s["y"] if v is not None]
        c["log"] = wants_log(np.array(ys, dtype=np.float64))
    return charts
