"""Tables, target verdicts and RESULTS.md from the measured results."""

from __future__ import annotations

import math
import os
import platform
from dataclasses import dataclass
from typing import Any

from measure import Result

MB = 1e6


@dataclass
class WorkloadReport:
    name: str
    title: str
    n_params: int
    tensors: int
    record_bytes: int  # raw bytes of one full record (params + grads + optimizer state)
    results: dict[str, Result]
    write_only_ms: float | None  # writing stepdump-raw's bytes per step, no training
    order: list[str]
    spare_core: tuple[float, float] | None = None  # training ms/step alone, beside a busy thread


def machine_info(torch_threads: int) -> dict[str, Any]:
    import torch

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gb = None
    try:
        with open("/proc/meminfo") as f:
            mem_gb = int(f.readline().split()[1]) / 1024 / 1024
    except (OSError, ValueError, IndexError):
        pass
    return {"cores": os.cpu_count(), "cpu": cpu, "torch": torch.__version__, "python": platform.python_version(),
            "torch_threads": torch_threads, "mem_gb": mem_gb, "os": platform.platform(), "stepdump": _stepdump_rev()}


def _stepdump_rev() -> str:
    """stepdump's version and the git commit of the tree benchmarked (read-only git calls)."""
    import subprocess

    import stepdump

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=root, capture_output=True,
                               text=True, timeout=10, check=True).stdout.strip()
        rev = f"git {sha}" + (" + uncommitted changes in src/" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        rev = "git revision unknown"
    return f"{stepdump.__version__} ({rev})"


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def _fmt(v: float | None, spec: str = ".1f", suffix: str = "") -> str:
    if v is None or (isinstance(v, float) and (math.isnan(v) or math.isinf(v))):
        return "–"
    return f"{v:{spec}}{suffix}"


def baseline_ms(rep: WorkloadReport, key: str) -> float | None:
    r = rep.results.get(key)
    return r.ms_per_step if r and r.seconds else None


def table(rep: WorkloadReport) -> list[list[str]]:
    none_ms = baseline_ms(rep, "none")
    ts = rep.results.get("torch.save")
    ts_ms = ts.ms_per_step if ts and ts.seconds else None
    ts_b = ts.bytes_per_step if ts and ts.bytes_on_disk else None
    rows = [["way of recording", "ms/step", "× no recording", "× torch.save", "MB/step", "× torch.save bytes",
             "runs (ms/step each) / notes"]]
    for key in rep.order:
        r = rep.results[key]
        if r.error:
            rows.append([r.label, "–", "–", "–", "–", "–", f"not run: {r.error}"])
            continue
        ms = r.ms_per_step
        mark = " †" if r.extrapolated else ""
        b = r.bytes_per_step if r.bytes_on_disk else None
        runs = "/".join(f"{x:.0f}" for x in r.ms_samples)
        note = f"{len(r.seconds)}×: {runs}"
        if r.probe_ms and r.key != "none":
            probes = "/".join(f"{x:.0f}" for x in r.probe_ms)
            note += f"; probe {probes} → {r.probe_ratio:.2f}×"
        note += f"; {r.note}" if r.note else ""
        rows.append([
            r.label + mark,
            _fmt(ms, ".0f"),
            _fmt(ms / none_ms if none_ms else None, ".2f", "×"),
            _fmt(ms / ts_ms if ts_ms else None, ".2f", "×"),
            _fmt(b / MB if b is not None else None, ".1f"),
            _fmt(b / ts_b if (b is not None and ts_b) else None, ".2f", "×"),
            note,
        ])
    return rows


def markdown_table(rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "|".join(["---"] + ["---:"] * 5 + ["---"]) + "|"]
    out += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows[1:]]
    return "\n".join(out)


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for j, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:-1], widths[1:], strict=True)]
        lines.append("  ".join(cells) + "  " + r[-1])
        if j == 0:
            lines.append("-" * (sum(widths) + 2 * len(widths) + 20))
    return "\n".join(lines)


# -- targets ----------------------------------------------------------------------------
@dataclass
class Verdict:
    workload: str
    target: str
    ok: bool | None  # None: could not be evaluated
    detail: str


def evaluate_targets(rep: WorkloadReport, codecs: list[str]) -> list[Verdict]:
    res = rep.results
    out: list[Verdict] = []
    none_ms = baseline_ms(rep, "none")
    ts = res.get("torch.save")
    ts_ms = ts.ms_per_step if ts and ts.seconds else None
    ts_b = ts.bytes_per_step if ts and ts.bytes_on_disk else None
    plain = baseline_ms(rep, "plain-write")
    wl = rep.name

    for codec in codecs:
        r = res.get(f"sd-full-{codec}")
        if r is None or not r.seconds:
            continue
        ms = r.ms_per_step
        if ts_ms:
            lim = 0.33 * ts_ms
            unreachable = (f"; unreachable as stated here: training alone ({none_ms:.0f} ms) is already "
                           f"{none_ms / ts_ms:.2f} × torch.save" if none_ms and none_ms > lim else "")
            out.append(Verdict(wl, f"full every step ({codec}) ≤ 0.33 × torch.save time", ms <= lim,
                               f"{ms:.0f} ms vs limit {lim:.0f} ms (= {ms / ts_ms:.2f} × torch.save {ts_ms:.0f} ms)"
                               + unreachable))
            if none_ms and ts_ms > none_ms:
                over, ts_over = ms - none_ms, ts_ms - none_ms
                out.append(Verdict(
                    wl, f"… read as overhead: full every step ({codec}) − no recording ≤ 0.33 × (torch.save − no "
                        "recording)", over <= 0.33 * ts_over,
                    f"{over:.0f} ms vs limit {0.33 * ts_over:.0f} ms (= {over / ts_over:.2f} × torch.save's "
                    f"{ts_over:.0f} ms overhead)"))
        if none_ms and rep.write_only_ms is not None:
            floor = max(none_ms, rep.write_only_ms)
            lim = 1.25 * floor
            out.append(Verdict(
                wl, f"full every step ({codec}) ≤ 1.25 × max(no recording, plain write of the same bytes)",
                ms <= lim,
                f"{ms:.0f} ms vs limit {lim:.0f} ms (= {ms / floor:.2f} × max({none_ms:.0f} ms no recording, "
                f"{rep.write_only_ms:.0f} ms writing {res['sd-full-raw'].bytes_per_step / MB:.0f} MB alone))"
                + (f"; against the in-loop plain write ({plain:.0f} ms/step) it is {ms / plain:.2f}×" if plain else ""),
            ))
    for key, what in (("sd-tiered", "tiered (as measured: 1 full step in the timed steps)"),
                      ("sd-tiered-steady", "tiered (steady state: 1 full step per 100, derived)")):
        r = res.get(key)
        if r is None or not r.seconds or not none_ms:
            continue
        ms = r.ms_per_step
        local = f"; against the unrecorded steps timed just before it: {r.probe_ratio:.2f}×" if r.probe_ratio else ""
        copy = baseline_ms(rep, "copy")
        floor = (f"; the floor row \"copy_ into preallocated buffers\" alone (no stats, no I/O) is "
                 f"{copy / none_ms:.2f}× no recording" if copy else "")
        out.append(Verdict(wl, f"{what} ≤ 1.03 × no recording", ms <= 1.03 * none_ms,
                           f"{ms:.0f} ms vs limit {1.03 * none_ms:.0f} ms (= {ms / none_ms:.3f} × {none_ms:.0f} ms)"
                           + local + floor))
    best = None
    for codec in codecs:
        r = res.get(f"sd-full-{codec}")
        if r is not None and r.bytes_on_disk and (best is None or r.bytes_per_step < best[1]):
            best = (codec, r.bytes_per_step)
    if best and ts_b:
        ratio = best[1] / ts_b
        out.append(Verdict(wl, "lossless bytes on disk (best codec) ≤ 0.80 × torch.save bytes", ratio <= 0.80,
                           f"{best[0]}: {best[1] / MB:.1f} MB/step = {ratio:.3f} × torch.save {ts_b / MB:.1f} MB/step"))
    return out


def readside_targets(rs: dict[str, Any]) -> list[Verdict]:
    """Issue 4's read-side targets: random read ≤ 10 ms, stats series ≤ 50 ms, RSS flat."""
    out: list[Verdict] = []
    for key, label in (("random_reads", "raw"), ("random_reads_delta", "delta-lz4")):
        rd = rs.get(key)
        if rd:
            out.append(Verdict("read", f"read one tensor at a random step of a 1000-step run ({label}) ≤ 10 ms",
                               rd["p95_ms"] <= 10, f"p95 {rd['p95_ms']:.2f} ms, median {rd['median_ms']:.2f} ms, "
                               f"max {rd['max_ms']:.2f} ms over {rd['picks']} picks"))
    sr = rs.get("stats_series")
    if sr:
        out.append(Verdict("read", f"stats series of one tensor over a {sr['rows']:,}-step run ≤ 50 ms",
                           sr["median_ms"] <= 50,
                           f"median {sr['median_ms']:.1f} ms, best {sr['min_ms']:.1f} ms of {sr['repeats']} "
                           f"(fresh `stepdump.open` each, included), {sr['rows']} rows"))
    for key, label in (("mem_full_run", "full every step"), ("stats_run", "stats only")):
        run = rs.get(key)
        g = growth(run) if run else None
        if g:
            # Flat: no growth to speak of over the second half of the run (< 0.5 MB). The
            # first few hundred steps fill SQLite's page cache (bounded, ~2 MB); a leak of
            # even one small object per step keeps growing and shows here.
            out.append(Verdict("read", f"RSS flat over run length ({label}, {run['steps']} steps)",
                               g["late_mb"] < 0.5,
                               f"{g['late_mb']:+.1f} MB over steps {g['mid']}-{g['to']}; {g['rss_mb']:+.1f} MB "
                               f"from step {g['from']}; peak {g['hwm_mb']:.0f} MB"))
    return out


def verdict_lines(verdicts: list[Verdict]) -> list[str]:
    lines = ["| workload | target | result | numbers |", "|---|---|---|---|"]
    for v in verdicts:
        mark = "n/a" if v.ok is None else ("**pass**" if v.ok else "**FAIL**")
        lines.append(f"| {v.workload} | {v.target} | {mark} | {v.detail} |")
    return lines


# -- RESULTS.md -------------------------------------------------------------------------
def results_markdown(
    *, date: str, info: dict[str, Any], command: str, duration_s: float, load_before: str, load_after: str,
    settings: dict[str, Any], reports: list[WorkloadReport], verdicts: list[Verdict], readside: dict[str, Any] | None,
) -> str:
    L: list[str] = []
    L.append("# stepdump benchmarks: results")
    L.append("")
    L.append("Written by `make bench` (`benchmarks/run.py`); see `benchmarks/README.md` for what each row means. "
             "Everything here comes from one run of one process, so the ratios compare like with like; the "
             "absolute milliseconds are only good for this machine on this day.")
    L.append("")
    L.append(f"- date: {date}")
    L.append(f"- machine: {info['cores']} cores, {info['cpu']}, "
             f"{_fmt(info['mem_gb'], '.0f')} GB RAM, {info['os']}")
    L.append(f"- python {info['python']}, torch {info['torch']}, torch intra-op threads: {info['torch_threads']}")
    L.append(f"- stepdump {info['stepdump']}")
    L.append(f"- load average before / after: {load_before} / {load_after} (the machine is shared; expect noise)")
    L.append(f"- command: `{command}` (the full run is `make bench`)")
    L.append("- settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    L.append(f"- wall time of the whole benchmark: {duration_s / 60:.1f} min")
    L.append("")
    L.append("ms/step: wall time from the first timed step until after the recorder's `close()` (so deferred "
             "writer work counts), divided by the steps; the median over the runs listed in the last column. "
             "Bytes: size of the output directory after close, per step. † = measured on fewer steps "
             "(see its note) and taken as the per-step figure for the whole run. ‡ = derived, not timed (see note).")
    for rep in reports:
        L.append("")
        L.append(f"## Workload {rep.name}: {rep.title}")
        L.append("")
        L.append(f"{rep.n_params / 1e6:.1f} M parameters; one full record = {rep.tensors} tensors, "
                 f"{rep.record_bytes / MB:.1f} MB raw (params + grads + optimizer state).")
        if rep.write_only_ms is not None:
            L.append(f"Writing stepdump-raw's bytes per step with plain `write()` and no training takes "
                     f"{rep.write_only_ms:.0f} ms/step (the I/O floor used by the targets).")
        if rep.spare_core:
            a, b = rep.spare_core
            L.append(f"Spare-core check: the training loop alone {a:.0f} ms/step, beside one thread busy on torch "
                     f"reductions (no I/O) {b:.0f} ms/step ({b / a:.2f}×): "
                     + ("there is no spare core here, so any CPU a background writer uses is taken from training."
                        if b / a > 1.15 else "a background thread costs training little here."))
        L.append("")
        L.append(markdown_table(table(rep)))
    L.append("")
    L.append("## Targets")
    L.append("")
    L.append("Evaluated from the tables above (same run). \"no recording\" and \"torch.save\" are the medians of "
             "their repeated runs. Times include training, as the targets are stated; where training alone already "
             "exceeds 0.33 × torch.save the first target cannot be met by any recorder, so it is also read as "
             "overhead above no recording (rows starting with …).")
    L.append("")
    L.extend(verdict_lines(verdicts))
    if readside:
        L.append("")
        L.extend(readside_markdown(readside))
    L.append("")
    return "\n".join(L)


def readside_markdown(rs: dict[str, Any]) -> list[str]:
    L = ["## Reading and long runs", ""]
    full = rs.get("full_run")
    if full:
        rd = rs.get("random_reads", {})
        L.append(f"**Random tensor reads.** A {full['steps']}-step run of Linear({full['d']},{full['d']}) + Adam "
                 f"recorded in full every step ({full['tensors_per_step']} tensors, "
                 f"{full['bytes_per_full_step'] / MB:.1f} MB raw per step; recording took {full['seconds']:.1f} s, "
                 f"{full['seconds'] / full['steps'] * 1e3:.1f} ms/step). `run.tensor(name, step, kind)` over "
                 f"{rd.get('picks')} random (step, kind, name) picks, page cache warm (the run was just written), "
                 f"mean tensor {rd.get('mean_tensor_kb', 0):.0f} KiB:")
        L.append("")
        L.append(f"- median {rd.get('median_ms', float('nan')):.2f} ms, p95 {rd.get('p95_ms', float('nan')):.2f} ms, "
                 f"max {rd.get('max_ms', float('nan')):.2f} ms; `stepdump.open` {rd.get('open_ms', float('nan')):.1f} ms")
        L.append("")
        dd, dr = rs.get("delta_run"), rs.get("random_reads_delta")
        if dd and dr:
            L.append(f"- the same run with `codec=\"delta-lz4\"` (delta_chain 8: a read decodes up to 8 blobs; "
                     f"recording took {dd['seconds'] / dd['steps'] * 1e3:.1f} ms/step): median "
                     f"{dr['median_ms']:.2f} ms, p95 {dr['p95_ms']:.2f} ms, max {dr['max_ms']:.2f} ms")
            L.append("")
    st = rs.get("stats_run")
    if st:
        sr = rs.get("stats_series", {})
        L.append(f"**Stats series.** A {st['steps']}-step stats-only run (every=None, stats_every=1) of "
                 f"Linear({st['d']},{st['d']}) + Adam ({st['tensors_per_step']} tensors per step; recording took "
                 f"{st['seconds']:.1f} s, {st['seconds'] / st['steps'] * 1e3:.2f} ms/step). "
                 f"`run.stats(kind=\"{sr.get('kind')}\", name=\"{sr.get('name')}\")` "
                 f"({sr.get('rows')} rows, fresh `stepdump.open` each time, {sr.get('repeats')} repeats): "
                 f"median {sr.get('median_ms', float('nan')):.1f} ms, min {sr.get('min_ms', float('nan')):.1f} ms.")
        L.append("")
    mem_full = rs.get("mem_full_run") or full
    L.append("**Memory over a long run** (child process per run, so its peak is its own; VmRSS / VmHWM from "
             "/proc/self/status" + (f"; \"full every step\" is a {mem_full['steps']}-step run of "
                                   f"Linear({mem_full['d']},{mem_full['d']}), long enough to see SQLite's page "
                                   "cache stop growing" if mem_full is not full and mem_full else "") + "):")
    L.append("")
    L.append("| run | sampled at | VmRSS MB | VmHWM MB |")
    L.append("|---|---|---:|---:|")
    for label, run in (("full every step", mem_full), ("stats only", st)):
        if not run:
            continue
        for m in run["memory"]:
            L.append(f"| {label} | {m['step']} | {m['rss_kb'] / 1024:.1f} | {m['hwm_kb'] / 1024:.1f} |")
    for label, run in (("full every step", mem_full), ("stats only", st)):
        if not run:
            continue
        g = growth(run)
        if g:
            L.append("")
            L.append(f"- {label}: VmRSS grew {g['rss_mb']:+.1f} MB between step {g['from']} and step {g['to']} "
                     f"({g['per_1k'] * 1024:+.0f} KiB per 1000 steps), {g['late_mb']:+.1f} MB in the second half "
                     f"(steps {g['mid']}-{g['to']}); peak (VmHWM) {g['hwm_mb']:.1f} MB.")
    return L


def growth(run: dict[str, Any]) -> dict[str, Any] | None:
    mem = [m for m in run["memory"] if isinstance(m["step"], int)]
    if len(mem) < 2:
        return None
    a, b = mem[0], mem[-1]
    mid = next(m for m in mem if m["step"] >= b["step"] / 2)  # the sample that starts the second half
    d_mb = (b["rss_kb"] - a["rss_kb"]) / 1024
    return {"from": a["step"], "to": b["step"], "rss_mb": d_mb, "per_1k": d_mb / (b["step"] - a["step"]) * 1000,
            "mid": mid["step"], "late_mb": (b["rss_kb"] - mid["rss_kb"]) / 1024,
            "hwm_mb": max(m["hwm_kb"] for m in run["memory"]) / 1024}
