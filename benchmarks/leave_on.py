"""Issue 14 (leave it on): lean mode, the gradient log, and a GPT-2-small-sized memory check.

    .venv/bin/python benchmarks/leave_on.py                      # every piece; writes its sections of RESULTS.md
    .venv/bin/python benchmarks/leave_on.py --only lean --quick  # one piece, few steps, prints only
    .venv/bin/python benchmarks/leave_on.py --only gradlog
    .venv/bin/python benchmarks/leave_on.py --only gpt2

Pieces (``--only lean,gradlog,gpt2``):

* **lean** (workloads A and B): the two lean spellings, ``every=None,
  stats_every=1`` ("lean, stats only") and ``every=100, stats_every=1`` ("lean
  tiered"), and two floors that run in the training loop without stepdump
  (``torch._foreach_norm(grads + params)``: one fused read pass; and the same
  plus xxh3 of every recorded tensor's bytes). Each is timed as interleaved
  pairs against no recording, in one process on one workload, after warm-up:
  the machine is shared and its no-recording time drifts by 30 % between
  minutes, so only a ratio taken the same second means anything. The figure is
  the median of the per-pair ratios, with their spread.
* **gradlog** (workload A): ``gradient_log=100`` over one whole keyframe period
  (100 steps, so its bytes and time per step are the steady state), against
  torch.save and no recording, repeated and interleaved; then
  ``stepdump.open(run).state_dict(K - 1)`` on a fresh Run against K x the
  optimizer step alone.
* **gpt2**: a 124 M-parameter GPT-2-style transformer, a few steps per mode,
  each mode in a fresh child process (peak RSS is per process).

With every piece run (the default), the issue-14 targets go into a short
section near the top of RESULTS.md and the details into a section at its end;
with ``--only`` nothing is written unless ``--results`` is given, so a partial
run never replaces the numbers of a full one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# This file: the command line, the order of the pieces, the targets and the RESULTS.md
# sections. The pieces themselves: leave_on_lean.py, leave_on_gradlog.py, leave_on_gpt2.py.
import torch
import workloads
from leave_on_gpt2 import GPT2_MODES, bench_gpt2, child_main
from leave_on_gradlog import bench_gradlog
from leave_on_lean import bench_lean
from neighbour import busy, default_neighbours
from results_json import update as update_results_json

MB = 1e6
TOP_MARKER = "\n## Issue 14 targets"
DETAIL_MARKER = "\n## Leave it on (issue 14)"
PIECES = ("lean", "gradlog", "gpt2")

# The targets of issue 14, as stated.
LEAN_RATIO = 1.05  # lean ≤ 1.05 × no recording (A and B)
FLOOR_SLACK = 0.01  # issue 40: lean within the floor + 0.01, wall and CPU (A and B)
GL_BYTES_RATIO = 0.30  # gradient log bytes/step ≤ 0.30 × torch.save's
GL_TIME_RATIO = 0.33  # gradient log time/step ≤ 0.33 × torch.save's
GPT2_RSS_RATIO = 1.05  # lean peak RSS ≤ 1.05 × no recording's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(PIECES), help="comma-separated pieces: lean, gradlog, gpt2")
    ap.add_argument("--quick", action="store_true", help="few pairs / steps / repeats: a smoke run")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, as run.py)")
    ap.add_argument("--workloads", default="A,B", help="workloads of the lean piece (default A,B)")
    ap.add_argument("--batch-b", type=int, default=2, help="batch size of workload B (default 2, as run.py)")
    ap.add_argument("--pairs", type=int, default=7, help="lean: interleaved (none, arm) pairs per arm (default 7)")
    ap.add_argument("--pair-steps", type=int, default=6, help="lean: timed steps per segment (default 6)")
    ap.add_argument("--no-busy", dest="busy", action="store_false",
                    help="lean: skip the pairs timed again with every other core busy (benchmarks/neighbour.py)")
    ap.add_argument("--neighbours", type=int, default=default_neighbours(),
                    help="lean --busy: spinning processes (default: one per core but one)")
    ap.add_argument("--gl-every", type=int, default=100, help="gradlog: K of gradient_log=K (default 100)")
    ap.add_argument("--gl-steps", type=int, default=None,
                    help="gradlog: recorded steps per run (default K: one keyframe period, the steady state)")
    ap.add_argument("--gl-repeats", type=int, default=3, help="gradlog: interleaved repeats (default 3)")
    ap.add_argument("--gl-ref-steps", type=int, default=10,
                    help="gradlog: steps of each no-recording / torch.save run (default 10)")
    ap.add_argument("--gl-standin", action="store_true",
                    help="gradlog: record with every=1 instead of gradient_log=K (before the capture side exists)")
    ap.add_argument("--gpt2-steps", type=int, default=3, help="gpt2: recorded steps per mode (default 3)")
    ap.add_argument("--gpt2-seq", type=int, default=128, help="gpt2: sequence length (default 128)")
    ap.add_argument("--gpt2-batch", type=int, default=1, help="gpt2: batch size (default 1)")
    ap.add_argument("--work", type=Path, default=HERE / "_work" / "leave_on",
                    help="scratch directory on disk for the lean and gradlog runs (emptied, removed)")
    ap.add_argument("--results", type=Path, default=None,
                    help="RESULTS.md to update (default: benchmarks/RESULTS.md when every piece runs, else none)")
    ap.add_argument("--json", type=Path, default=None, help="also dump the raw numbers as JSON here")
    a = ap.parse_args(argv)
    a.pieces = [p.strip() for p in a.only.split(",") if p.strip()]
    unknown = set(a.pieces) - set(PIECES)
    if unknown:
        ap.error(f"--only: unknown piece(s) {sorted(unknown)}; choose from {', '.join(PIECES)}")
    if a.quick:
        a.pairs = min(a.pairs, 3)
        a.pair_steps = min(a.pair_steps, 5)
        a.gl_repeats = 1
        a.gl_ref_steps = min(a.gl_ref_steps, 5)
        a.gl_steps = a.gl_steps or 20
        a.gpt2_steps = min(a.gpt2_steps, 2)
    a.gl_steps = a.gl_steps or a.gl_every
    if a.results is None and set(a.pieces) == set(PIECES):
        a.results = HERE / "RESULTS.md"
    return a


# -- verdicts and markdown ---------------------------------------------------------------------
@dataclass
class Target:
    what: str
    ok: bool | None  # None: could not be measured
    numbers: str
    floor: str = "–"


def floor_targets(res: dict[str, Any]) -> list[Target]:
    """Issue 40's lean targets on the large workloads: lean (stats only) within the floor (one
    ``_foreach_norm`` over grads + params) + FLOOR_SLACK, in wall time *and* in the CPU time of all
    the process's threads, on the machine as it is and with every other core busy."""
    T: list[Target] = []
    busy = res.get("lean_busy_load") or {}
    for load, by_name in (("idle", res.get("lean", {})), ("busy", res.get("lean_busy", {}))):
        for name, lean in by_name.items():
            p, fl = lean["pairs"]["lean-stats"], lean["pairs"]["floor-norm"]
            what = (f"{name}, {load}: lean (stats only) ≤ floor + {FLOOR_SLACK}, wall and CPU"
                    + (f" ({busy.get('neighbours')} neighbour(s) spinning)" if load == "busy" else ""))
            if p["error"] or fl["error"] or not p["ratios"] or not fl["ratios"]:
                T.append(Target(what, None, p["error"] or fl["error"] or "not measured"))
                continue
            ok = p["median"] <= fl["median"] + FLOOR_SLACK and p["cpu_median"] <= fl["cpu_median"] + FLOOR_SLACK
            T.append(Target(what, ok,
                            f"wall {p['median']:.3f}× vs floor {fl['median']:.3f}×; CPU {p['cpu_median']:.3f}× vs "
                            f"floor {fl['cpu_median']:.3f}× (medians of {len(p['ratios'])} interleaved pairs)",
                            f"wall {fl['median']:.3f}×, CPU {fl['cpu_median']:.3f}×"))
    return T


def _mark(ok: bool | None) -> str:
    return "n/a" if ok is None else "**pass**" if ok else "**FAIL**"


def targets(res: dict[str, Any]) -> list[Target]:
    """The issue-14 targets with pass/fail, the numbers, and the floor beside each."""
    T: list[Target] = []
    for name, lean in res.get("lean", {}).items():
        p, fl, fx = lean["pairs"]["lean-stats"], lean["pairs"]["floor-norm"], lean["pairs"]["floor-xxh3"]
        floor = (f"floor {fl['median']:.3f}× (one `_foreach_norm` over grads + params); "
                 f"{fx['median']:.3f}× with xxh3 of the whole record")
        for key, label in (("lean-stats", "stats only"), ("lean-tiered", "tiered, stats steps")):
            p = lean["pairs"][key]
            if p["error"] or not p["ratios"]:
                T.append(Target(f"{name}: lean ({label}) ≤ {LEAN_RATIO} × no recording", None,
                                p["error"] or "not measured", floor))
                continue
            r = sorted(p["ratios"])
            extra = ""
            if key == "lean-tiered" and lean.get("tiered_amortized") is not None:
                extra = f"; with its full step every 100 amortized {lean['tiered_amortized']:.3f}×"
            T.append(Target(
                f"{name}: lean ({label}) ≤ {LEAN_RATIO} × no recording", p["median"] <= LEAN_RATIO,
                f"median {p['median']:.3f}× of {len(r)} interleaved pairs (spread {r[0]:.3f}–{r[-1]:.3f}; "
                f"{statistics.median(p['arm_ms']):.0f} vs {statistics.median(p['none_ms']):.0f} ms/step; "
                f"process CPU time {p['cpu_median']:.3f}×){extra}",
                floor))
    T.extend(floor_targets(res))
    gl = res.get("gradlog")
    if gl:
        T.extend(gradlog_targets(gl))
    g2 = res.get("gpt2")
    if g2:
        modes = g2["modes"]
        none = modes.get("none", {})
        for key in ("lean-stats", "lean-tiered"):
            m = modes.get(key, {})
            what = f"GPT-2 small: peak RSS of {GPT2_MODES[key][0]} ≤ {GPT2_RSS_RATIO} × no recording"
            if "hwm_kb" not in m or "hwm_kb" not in none:
                T.append(Target(what, None, m.get("error") or none.get("error") or "not measured"))
                continue
            ratio = m["hwm_kb"] / none["hwm_kb"]
            rec = m["hwm_recorded_kb"] / none["hwm_recorded_kb"]
            T.append(Target(what, ratio <= GPT2_RSS_RATIO and rec <= GPT2_RSS_RATIO,
                            f"whole process {m['hwm_kb'] / 1024:.0f} MiB vs {none['hwm_kb'] / 1024:.0f} MiB = "
                            f"{ratio:.3f}× ({(m['hwm_kb'] - none['hwm_kb']) / 1024:+.0f} MiB); during the recorded "
                            f"steps alone {m['hwm_recorded_kb'] / 1024:.0f} vs {none['hwm_recorded_kb'] / 1024:.0f} "
                            f"MiB = {rec:.3f}×",
                            f"one full copy of the record would add {_gpt2_record_mb(none):.0f} MB"))
    return T


def _gpt2_record_mb(none: dict[str, Any]) -> float:
    return none.get("params", 0) * 4 * 4 / MB  # params + grads + exp_avg + exp_avg_sq, fp32


def gradlog_targets(gl: dict[str, Any]) -> list[Target]:
    T: list[Target] = []
    K = gl["K"]
    label = "gradient log" + (" (STAND-IN: every=1)" if gl.get("standin") else "")
    if gl.get("error") or not gl["gl_ms"]:
        why = gl.get("error") or "not measured"
        for what in (f"bytes/step ≤ {GL_BYTES_RATIO} × torch.save", f"time/step ≤ {GL_TIME_RATIO} × torch.save",
                     f"read params at step {K - 1} ≤ {K} × optimizer step"):
            T.append(Target(f"A: {label} {what}", None, why))
        return T
    none, ts, gms = (statistics.median(gl[k]) for k in ("none_ms", "torch_save_ms", "gl_ms"))
    tsb, gb = statistics.median(gl["torch_save_bytes"]), statistics.median(gl["gl_bytes"])
    opt = statistics.median(gl["opt_ms"])
    steady = "" if gl["steps"] == K else f" (over {gl['steps']} steps, 1 keyframe in them: not the steady state)"
    grads_note = ""
    rd = gl.get("read", {})
    if rd.get("grads_every_step") is False:
        grads_note = "; WARNING: no grads stored at step 1, so this run is not a gradient log"
    b = gb / tsb
    T.append(Target(f"A: {label} bytes/step ≤ {GL_BYTES_RATIO} × torch.save", b <= GL_BYTES_RATIO,
                    f"{gb / MB:.1f} MB vs {tsb / MB:.1f} MB = {b:.3f}×{steady}{grads_note}",
                    f"grads alone {gl.get('grads_mb', 0):.1f} MB = {gl.get('grads_mb', 0) * MB / tsb:.3f}×"))
    t = gms / ts
    T.append(Target(f"A: {label} time/step ≤ {GL_TIME_RATIO} × torch.save", t <= GL_TIME_RATIO,
                    f"{gms:.0f} ms vs {ts:.0f} ms = {t:.3f}× (medians of {len(gl['gl_ms'])} interleaved runs)"
                    f"{steady}", f"no recording alone {none:.0f} ms = {none / ts:.3f}×"))
    ov = (gms - none) / (ts - none)
    T.append(Target(f"A: … read as overhead: {label} − no recording ≤ {GL_TIME_RATIO} × (torch.save − no recording)",
                    ov <= GL_TIME_RATIO, f"{gms - none:.0f} ms vs {ts - none:.0f} ms = {ov:.3f}×"))
    n = rd.get("step", K - 1) + 1  # optimizer steps the read re-applies at most (K at step K - 1)
    what = f"A: {label} read params at step {n - 1} (fresh Run) ≤ {n} × optimizer.step()"
    if "state_dict_ms" not in rd:
        T.append(Target(what, None, rd.get("error", "not measured"), f"{n} × {opt:.1f} ms = {n * opt:.0f} ms"))
    else:
        r = rd["state_dict_ms"] / (n * opt)
        eq = {True: "; bitwise equal to the live model", False: "; NOT equal to the live model",
              None: ""}[rd.get("equal")]
        T.append(Target(what, r <= 1.0 and rd.get("equal") is not False,
                        f"open + state_dict({n - 1}) {rd['state_dict_ms']:.0f} ms = {r:.2f} × ({n} × {opt:.1f} ms)"
                        f"{eq}; open + one tensor {rd['tensor_ms']:.0f} ms",
                        f"{n} optimizer steps = {n * opt:.0f} ms"))
    return T


def top_section(T: list[Target], date: str) -> str:
    L = ["", "## Issue 14 targets (leave it on)", "",
         (f"`benchmarks/leave_on.py`, {date}; details in \"Leave it on (issue 14)\" below. Lean ratios are "
         "medians of interleaved (no recording, lean) pairs in one process; the floor is the same kind of pair "
         "with a fused read pass of the tensors in the loop instead of stepdump."), "",
         "| target | result | numbers | floor |", "|---|---|---|---|"]
    L += [f"| {t.what} | {_mark(t.ok)} | {t.numbers} | {t.floor} |" for t in T]
    return "\n".join(L) + "\n"


def detail_section(res: dict[str, Any], args: argparse.Namespace) -> str:
    L = ["", "## Leave it on (issue 14)", "",
         f"`benchmarks/leave_on.py` (torch threads {args.threads}); see benchmarks/README.md."]
    busy_load = res.get("lean_busy_load") or {}
    for name, lean, load in [*((n, x, "") for n, x in res.get("lean", {}).items()),
                             *((n, x, f", busy ({busy_load.get('neighbours')} neighbour process(es) spinning, "
                                      f"{busy_load.get('share', float('nan')):.0%} of a core each)")
                               for n, x in res.get("lean_busy", {}).items())]:
        L += ["", (f"**Lean, workload {name}{load}** ({lean['title']}; {lean['record_bytes'] / MB:.1f} MB per record, "
              f"grads + params {lean['gp_bytes'] / MB:.1f} MB). Interleaved pairs, {lean['pair_steps']} timed steps "
              "per segment, each recording built and its first step run untimed; `close()` (which writes the "
              "final record: the trained state in full, once per run) timed apart, in the last column:"), "",
              ("| arm | × no recording (median of pairs) | spread (min–max) | ms/step arm / none (medians) | "
              "CPU time × (median of pairs) | pairs | close() ms (median) |"),
              "|---|---:|---|---|---:|---:|---:|"]
        for p in lean["pairs"].values():
            if p["error"]:
                L.append(f"| {p['label']} | FAILED | {p['error']} | – | – | 0 |")
                continue
            r = sorted(p["ratios"])
            close = p.get("arm_close_ms") or []
            L.append(f"| {p['label']} | {p['median']:.3f}× | {r[0]:.3f}–{r[-1]:.3f} | "
                     f"{statistics.median(p['arm_ms']):.1f} / {statistics.median(p['none_ms']):.1f} | "
                     f"{p['cpu_median']:.3f}× | {len(r)} | "
                     f"{f'{statistics.median(close):.0f}' if close and p['key'].startswith('lean') else '–'} |")
        fp = lean["tiered_full_pair"]
        if fp["ratios"]:
            r = sorted(fp["ratios"])
            L.append(f"| lean tiered, segments holding its full step (step 100) | {fp['median']:.3f}× | "
                     f"{r[0]:.3f}–{r[-1]:.3f} | {statistics.median(fp['arm_ms']):.1f} / "
                     f"{statistics.median(fp['none_ms']):.1f} | {fp['cpu_median']:.3f}× | {len(r)} | – |")
        if lean.get("tiered_amortized") is not None:
            L.append(f"| lean tiered, 1 full step per 100 (amortized from the two rows above) ‡ | "
                     f"{lean['tiered_amortized']:.3f}× | – | – | – | – | – |")
    gl = res.get("gradlog")
    if gl:
        L += ["", (f"**Gradient log, workload A** (`{gl['spelling']}`, {gl['steps']} steps per run = "
              f"{'one keyframe period' if gl['steps'] == gl['K'] else 'not a whole keyframe period'}; "
              f"{len(gl['gl_ms'])} runs interleaved with no recording and torch.save):"), ""]
        if gl.get("error"):
            L.append(f"- {gl['error']}")
        L += ["| row | ms/step (each run) | MB/step |", "|---|---|---:|"]
        for label, ms, b in (("no recording", gl["none_ms"], None),
                             ("torch.save (clone + dict per step)", gl["torch_save_ms"], gl["torch_save_bytes"]),
                             (f"stepdump {gl['spelling']}", gl["gl_ms"], gl["gl_bytes"])):
            if ms:
                L.append(f"| {label} | {statistics.median(ms):.0f} ({'/'.join(f'{x:.0f}' for x in ms)}) | "
                         + (f"{statistics.median(b) / MB:.1f}" if b else "0") + " |")
        if gl["opt_ms"]:
            L.append(f"| optimizer.step() alone (inside the no-recording runs) | "
                     f"{statistics.median(gl['opt_ms']):.1f} (median of {len(gl['opt_ms'])}) | – |")
        rd = gl.get("read")
        if rd:
            L += ["", f"Read at step {rd['step']} on a fresh `stepdump.open`: " + (
                rd["error"] if "error" in rd else
                f"`state_dict({rd['step']})` {rd['state_dict_ms']:.0f} ms, `tensor(name, {rd['step']})` "
                f"{rd['tensor_ms']:.0f} ms (open included); bitwise equal to the live model: {rd.get('equal')}; "
                f"grads stored at a non-keyframe step: {rd.get('grads_every_step')}.")]
    g2 = res.get("gpt2")
    if g2:
        L += ["", (f"**GPT-2 small memory** (124 M params, seq {g2['seq']}, batch {g2['batch']}, AdamW, one unrecorded "
              f"step then {g2['steps']} recorded; each mode a fresh process; peak RSS = VmHWM of the whole process, "
              "and of the recorded steps alone (VmHWM reset after the unrecorded step, whose AdamW state "
              "allocation can hide what a recorder adds); records in a temp dir under /tmp on disk, deleted after):"), "",
              ("| mode | peak RSS MiB | × no recording | peak during recorded steps MiB | × no recording | "
              "RSS before Recorder MiB | ms/step | MB/step on disk |"),
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
        none = g2["modes"].get("none", {})
        for key, m in g2["modes"].items():
            if "error" in m:
                L.append(f"| {GPT2_MODES[key][0]} | FAILED: {m['error']} | – | – | – | – |")
                continue
            ratio = f"{m['hwm_kb'] / none['hwm_kb']:.3f}×" if "hwm_kb" in none else "–"
            rec = f"{m['hwm_recorded_kb'] / none['hwm_recorded_kb']:.3f}×" if "hwm_kb" in none else "–"
            L.append(f"| {GPT2_MODES[key][0]} | {m['hwm_kb'] / 1024:.0f} | {ratio} | "
                     f"{m['hwm_recorded_kb'] / 1024:.0f} | {rec} | {m['rss_before_kb'] / 1024:.0f} | "
                     f"{m['ms_per_step']:.0f} | {m['bytes_on_disk'] / g2['steps'] / MB:.1f} |")
    return "\n".join(L) + "\n"


def _cut(body: str, marker: str) -> str:
    """``body`` without the section that starts at ``marker`` (up to the next ``## `` heading)."""
    if marker not in body:
        return body
    start = body.index(marker)
    nxt = body.find("\n## ", start + len(marker))
    return body[:start] + (body[nxt:] if nxt != -1 else "\n")


def write_results(path: Path, top: str, detail: str) -> None:
    """Put the targets right before the first ``## `` section and the details at the end,
    replacing this script's sections from an earlier run and leaving the rest alone."""
    body = path.read_text() if path.exists() else "# stepdump benchmarks: results\n"
    body = _cut(_cut(body, TOP_MARKER), DETAIL_MARKER)
    first = body.find("\n## ")
    body = body.rstrip("\n") + "\n" + top if first == -1 else body[:first].rstrip("\n") + "\n" + top + body[first:]
    path.write_text(body.rstrip("\n") + "\n" + detail)


def keep_other_pieces(res: dict[str, Any], json_path: Path) -> dict[str, Any]:
    """``res`` plus the pieces (lean, gradlog, gpt2) it lacks from the last results.json, each marked
    with the date of the run that measured it, so ``--only lean`` leaves the other numbers in place."""
    from results_json import load

    old = load(json_path).get("leave_on", {})
    kept = {k: old[k] | {"measured": old[k].get("measured", old.get("date"))}
            for k in PIECES if k not in res and isinstance(old.get(k), dict)}
    return res | kept


def main(argv: list[str] | None = None) -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "gpt2-child" and argv is None:
        return child_main()
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    res: dict[str, Any] = {"date": date, "args": {k: str(v) for k, v in vars(args).items()}}
    try:
        if "lean" in args.pieces:
            res["lean"] = {n.strip(): bench_lean(n.strip(), args) for n in args.workloads.split(",") if n.strip()}
            if args.busy:  # the same pairs with no idle core: the recorder's threads' CPU is the training's
                with busy(args.neighbours) as used:
                    res["lean_busy"] = {n.strip(): bench_lean(n.strip(), args)
                                        for n in args.workloads.split(",") if n.strip()}
                res["lean_busy_load"] = {"neighbours": used.neighbours, "share": used.share}
        if "gradlog" in args.pieces:
            res["gradlog"] = bench_gradlog(args)
            w = workloads.mlp()
            res["gradlog"]["grads_mb"] = sum(p.numel() * p.element_size() for p in w.model.parameters()) / MB
        if "gpt2" in args.pieces:
            res["gpt2"] = bench_gpt2(args)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
    res["duration_s"] = time.perf_counter() - t_start
    if args.results is not None:  # a run of some pieces keeps the others' last results (each with its own date)
        res = keep_other_pieces(res, args.results.with_name("results.json"))
    T = targets(res)
    print("\n== issue 14 targets")
    for t in T:
        print(f"  [{'n/a' if t.ok is None else 'PASS' if t.ok else 'FAIL'}] {t.what}: {t.numbers}  |  {t.floor}")
    print(f"\nwall time {res['duration_s'] / 60:.1f} min")
    if args.results is not None:
        write_results(args.results, top_section(T, date), detail_section(res, args))
        print(f"wrote {args.results}")
        update_results_json("leave_on", res | {"targets": [t.__dict__ for t in T]},
                            args.results.with_name("results.json"))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
