"""Leave it on for small, fast models: lean and gradient log on millisecond steps (issues 25, 40).

    .venv/bin/python benchmarks/leave_on_tiny.py            # writes its section of RESULTS.md
    .venv/bin/python benchmarks/leave_on_tiny.py --quick    # few pairs, prints only
    .venv/bin/python benchmarks/leave_on_tiny.py --loads busy --workloads rl --arms lean --pairs 5

Workloads (benchmarks/workloads_tiny.py): nanoGPT's tiny config called through ``model(x)``
and through ``model.encode(x)`` (the top module's forward hooks never fire), and a
PPO-sized update. Arms, each timed as interleaved (no recording, arm) pairs in one process,
one torch thread, each recording built and its first step run untimed, ``close()`` timed:
lean (``every=None, stats_every=1``), gradient log (``gradient_log=32``), and four floors: one
``torch._foreach_norm`` over params + grads in the loop (the least any per-tensor statistic
costs), one copy of them into a buffer made once (what an exact record must read), that copy
with lean's own stats and fingerprints of it, computed on a thread once per commit window (what
lean's numbers cost by themselves, without its bookkeeping, catalog or file), and the same for a
gradient-log step (the optimizer state copied and described too, and the grads' bytes written). The figure is the median of the per-pair ratios, of wall time and of the CPU time of
all the process's threads (``time.process_time``: the recorder's threads' work counts wherever
it ran). Each workload is timed twice: on the machine as it is (*idle*) and with every other
core busy (*busy*: benchmarks/neighbour.py, one spinning process per core but one), where every
millisecond of CPU the recorder's threads take is one the training thread waits for. For the
recorded arms the run's own ``sys/recorder_ms`` (and its parts: the hooks, the waits outside
them, ``sys/recorder_bg_ms``: its threads' CPU) is set beside the measured added time per step.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from neighbour import busy, default_neighbours  # noqa: E402
from workloads import Workload  # noqa: E402
from workloads_tiny import TINY, segment_steps  # noqa: E402

MARKER = "\n## Leave it on, small steps (issue 25)"
ARMS: dict[str, dict[str, Any] | None] = {
    "lean": {"every": None, "stats_every": 1},
    "gradient log K=32": {"gradient_log": 32},
    "floor: _foreach_norm(params + grads)": None,
    # What any exact per-step record must do before the update: read the params' and grads' bytes
    # (here, one copy into a buffer made once), with no Python per tensor.
    "floor: copy(params + grads)": None,
    # What a lean record's numbers cost by themselves: the same copy lean makes (stepdump's packed
    # snapshot) and the same stats and fingerprints of it (packed.describe_columns, numpy), described on
    # a thread once per commit window as lean's writer does; no hooks' bookkeeping, catalog or file.
    "floor: copy + stats(params + grads)": None,
    # The same for what a gradient-log step must do: its params' and optimizer state's copy and stats
    # (read at every step), its grads' copy and stats, and the grads' bytes written to a file.
    "floor: copy + stats(params + grads + optimizer) + write(grads)": None,
}
TARGETS = {"lean": 1.05, "gradient log K=32": 1.15}
RL_TARGETS = {"lean": 1.10, "gradient log K=32": 1.30}  # issue 40: the PPO update's own targets
LOADS = ("idle", "busy")
# Issue 25 item 2 / issue 40: the run's own sys/recorder_ms within this fraction of the measured added ms/step.
SELF_TIMING = 0.25
# Issue 40: the training thread's fixed cost per step, for a model with a handful of tensors.
FIXED_COST_MS = 0.5
SLUG = {"lean": "lean", "gradient log K=32": "gradlog", "floor: _foreach_norm(params + grads)": "floor",
        "floor: copy(params + grads)": "floor_copy",
        "floor: copy + stats(params + grads)": "floor_stats",
        "floor: copy + stats(params + grads + optimizer) + write(grads)": "floor_gradlog"}  # JSON keys
# results.json: the idle load's arms under "arms" (the key docs/performance.md reads), the busy one's under this.
BUSY_KEY = "busy_arms"


def target(name: str, arm: str) -> float | None:
    return (RL_TARGETS if name == "rl" else TARGETS).get(arm)


def self_timing(reported: float, added: float) -> bool:
    """Whether the reported recorder time is within SELF_TIMING of the measured difference."""
    return added > 0 and abs(reported - added) <= SELF_TIMING * added


def _stats_floor(w: Workload, written: Path | None = None) -> tuple[Callable[[], None], Callable[[], None]]:
    """The "copy + stats" floor's hook (copy the params and grads as lean does) and its stop (the
    thread that describes the copies, once per commit window, drained and joined). ``written``: the
    gradient log's floor instead: the optimizer state copied and described too, and the grads'
    copies' bytes written to this file."""
    import queue
    import threading

    from stepdump.capture.packed import Plans, Snapshot, describe_columns
    from stepdump.capture.step_state import Entry
    from stepdump.capture.writer import COMMIT_WINDOW

    params = list(w.model.named_parameters())
    plans, grad_plans = Plans(), Plans()
    copies: queue.SimpleQueue[tuple[Snapshot, Snapshot | None] | None] = queue.SimpleQueue()
    file = open(written, "wb") if written is not None else None  # noqa: SIM115 - closed by stop()

    def describe() -> None:
        while True:
            held = [copies.get()]
            time.sleep(COMMIT_WINDOW)  # the writer's group commit: what came meanwhile, described together
            while not copies.empty():
                held.append(copies.get())
            done = held[-1] is None
            snaps = [s for pair in held if pair is not None for s in pair if s is not None]
            describe_columns(snaps)
            if file is not None:
                for pair in held:
                    if pair is not None and pair[1] is not None:
                        for buf in pair[1].buffers:
                            file.write(buf.numpy().tobytes())
            for s in snaps:
                s.release()
            if done:
                return

    thread = threading.Thread(target=describe, name="floor-stats", daemon=True)
    thread.start()

    def hook() -> None:
        entries = [Entry("params", n, p.detach(), False) for n, p in params]
        grads = [Entry("grads", n, p.grad, False) for n, p in params if p.grad is not None]
        if file is None:
            entries += grads
            copies.put((plans.get(entries).snapshot(entries), None))
            return
        state = w.optimizer.state
        entries += [Entry("optimizer", f"{n}.{k}", v, False, n, k) for n, p in params
                    for k, v in state.get(p, {}).items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        copies.put((plans.get(entries).snapshot(entries), grad_plans.get(grads).snapshot(grads) if grads else None))

    def stop() -> None:
        copies.put(None)
        thread.join()
        if file is not None:
            file.close()

    return hook, stop


def segment(w: Workload, arm: str | None, out: Path, steps: int) -> dict[str, float]:
    """Per step of ``steps`` steps of ``w`` with ``arm`` (None: no recording): wall ms, CPU ms of
    every thread of the process, CPU ms of the training thread; ``close()`` timed apart."""
    shutil.rmtree(out, ignore_errors=True)
    gc.collect()
    rec = None
    hook: Callable[[], None] | None = None
    stop: Callable[[], None] | None = None
    if arm is not None and ARMS[arm] is not None:
        import stepdump

        rec = stepdump.Recorder(out / "run", w.model, w.optimizer, profile=True, **ARMS[arm])  # type: ignore[arg-type]
    elif arm is not None and arm.startswith("floor: copy + stats"):
        out.mkdir(parents=True, exist_ok=True)
        hook, stop = _stats_floor(w, out / "grads.bin" if "write(grads)" in arm else None)
    elif arm is not None and arm.startswith("floor: copy"):
        params = list(w.model.parameters())
        views: list[torch.Tensor] = []

        def hook() -> None:
            with torch.no_grad():
                ts = [p.detach() for p in params] + [p.grad for p in params if p.grad is not None]
                if len(views) != len(ts):  # the buffer and its views, made at the first step
                    buf = torch.empty(sum(t.numel() for t in ts))
                    offsets = [0, *itertools.accumulate(t.numel() for t in ts)]
                    views[:] = [buf[a:b].view(t.shape) for a, b, t in zip(offsets, offsets[1:], ts)]
                torch._foreach_copy_(views, ts)
    elif arm is not None:
        params = list(w.model.parameters())

        def hook() -> None:
            with torch.no_grad():
                torch._foreach_norm([p.detach() for p in params] + [p.grad for p in params if p.grad is not None])
    w.step(hook)  # untimed: the recording's first step
    t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
    for _ in range(steps):
        w.step(hook)
    t1, c1, m1 = time.perf_counter(), time.process_time(), time.thread_time()
    if stop is not None:
        stop()  # the copies still held, described after the timed steps, as a recorder's close() is timed apart
    got = {"ms": (t1 - t0) / steps * 1e3, "cpu_ms": (c1 - c0) / steps * 1e3, "train_cpu_ms": (m1 - m0) / steps * 1e3}
    if rec is not None:
        # close() writes the final record (the trained state in full), once per run: timed apart,
        # as leave_on.py does, so that a 30-step segment does not spread it over its steps.
        rec.close()
        got["close_ms"] = (time.perf_counter() - t1) * 1e3
        import stepdump

        prof = stepdump.open(out / "run").profile().iloc[1:steps + 1]  # the timed steps
        # Means over the timed steps, as the added time is (the segment's time / steps): the writer's
        # work comes in lumps (a group commit every COMMIT_WINDOW, the held steps' rows described
        # then), so a median step of sys/recorder_bg_ms says almost nothing of its cost.
        got["reported_ms"] = float(prof["sys/recorder_ms"].mean())
        got["bg_ms"] = float(prof["sys/recorder_bg_ms"].mean()) if "sys/recorder_bg_ms" in prof else float("nan")
        # The training thread's waits outside the hooks (profiling.ThreadWaits), part of reported's story.
        got["wait_ms"] = float(prof["sys/recorder_wait_ms"].mean()) if "sys/recorder_wait_ms" in prof else 0.0
        got["hooks_ms"] = float(prof["sys/recorder_hooks_ms"].mean())
    shutil.rmtree(out, ignore_errors=True)
    return got


FIELDS = ("ms", "cpu_ms", "train_cpu_ms", "reported_ms", "bg_ms", "wait_ms", "hooks_ms", "close_ms")


def pairs(w: Workload, name: str, load: str, args: argparse.Namespace, steps: int) -> dict[str, Any]:
    """Interleaved (no recording, arm) pairs of every arm: the raw per-segment numbers."""
    arms: dict[str, Any] = {}
    med = statistics.median
    for arm in args.arms:
        a: dict[str, list[float]] = {f"none_{k}": [] for k in ("ms", "cpu_ms", "train_cpu_ms")}
        a |= {f"arm_{k}": [] for k in FIELDS}
        for r in range(args.pairs):
            order = (None, arm) if r % 2 == 0 else (arm, None)
            got = {x: segment(w, x, args.work / (x or "none").replace(" ", "_"), steps) for x in order}
            for k in ("ms", "cpu_ms", "train_cpu_ms"):
                a[f"none_{k}"].append(got[None][k])
            for k in FIELDS:
                a[f"arm_{k}"].append(got[arm].get(k, float("nan")))
        arms[arm] = a
        s = stats(a)
        print(f"  {name:13s} {load:5s} {arm:38s} wall {s['ratio']:.3f}x ({s['spread'][0]:.3f}-{s['spread'][1]:.3f}), "
              f"CPU {s['cpu_ratio']:.3f}x; {med(a['arm_ms']):.2f} vs {med(a['none_ms']):.2f} ms; added {s['added_ms']:.2f} "
              f"ms wall, {s['added_cpu_ms']:.2f} CPU ({s['added_train_cpu_ms']:.2f} training thread); reported "
              f"{s['reported_ms']:.2f} = hooks {s['hooks_ms']:.2f} + threads {s['reported_ms'] - s['hooks_ms']:.2f} "
              f"(waits {s['wait_ms']:.2f}; bg {s['bg_ms']:.2f}); close {s['close_ms']:.1f} ms", flush=True)
    return arms


def median_ci(xs: list[float], level: float = 0.95) -> tuple[float, float, float] | None:
    """A distribution-free confidence interval of the median of ``xs`` (i.i.d. pairs' differences):
    the order statistics x_(k) and x_(n+1-k) with the largest k whose coverage, 1 - 2 P(Bin(n, 1/2) < k),
    is at least ``level``; and that coverage. None when n is too small for any k (below 6 at 95%)."""
    v, n = sorted(xs), len(xs)
    best: tuple[float, float, float] | None = None
    below = 0.0  # P(Bin(n, 1/2) < k)
    for k in range(1, n // 2 + 1):
        below += math.comb(n, k - 1) / 2 ** n
        coverage = 1 - 2 * below
        if coverage < level:
            break
        best = (v[k - 1], v[n - k], coverage)
    return best


def _nanmed(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def stats(a: dict[str, list[float]]) -> dict[str, Any]:
    """The medians an arm's pairs give: ratios of the pairs, differences of the pairs, the run's own figures."""
    med = statistics.median
    ratios = [x / y for x, y in zip(a["arm_ms"], a["none_ms"], strict=True)]
    cpu = [x / y for x, y in zip(a["arm_cpu_ms"], a["none_cpu_ms"], strict=True) if y > 0]
    return {"ratio": med(ratios), "spread": [min(ratios), max(ratios)],
            "cpu_ratio": med(cpu), "cpu_spread": [min(cpu), max(cpu)],
            "arm_ms": med(a["arm_ms"]), "none_ms": med(a["none_ms"]),
            "arm_cpu_ms": med(a["arm_cpu_ms"]), "none_cpu_ms": med(a["none_cpu_ms"]),
            "added_ms": med([x - y for x, y in zip(a["arm_ms"], a["none_ms"], strict=True)]),
            "added_ci": median_ci([x - y for x, y in zip(a["arm_ms"], a["none_ms"], strict=True)]),
            "added_cpu_ms": med([x - y for x, y in zip(a["arm_cpu_ms"], a["none_cpu_ms"], strict=True)]),
            "added_train_cpu_ms": med([x - y for x, y in zip(a["arm_train_cpu_ms"], a["none_train_cpu_ms"], strict=True)]),
            **{k: _nanmed(a[f"arm_{k}"]) for k in ("reported_ms", "bg_ms", "wait_ms", "hooks_ms", "close_ms")}}


def bench(name: str, args: argparse.Namespace) -> dict[str, Any]:
    w = TINY[name]()
    # A segment lasts at least MIN_SEGMENT_S: 30 steps of a 4 ms loop are one commit window, whose
    # writer work would all land in close(), timed apart.
    steps = segment_steps(w, args.steps, args.min_segment)
    res: dict[str, Any] = {"title": w.title, "steps": steps, "loads": {}}
    for load in args.loads:
        with busy(args.neighbours if load == "busy" else 0) as used:
            arms = pairs(w, name, load, args, steps)
        res["loads"][load] = {"arms": arms, "neighbours": used.neighbours, "share": used.share}
        if load == "busy":
            print(f"  {name:13s} busy: {used.neighbours} neighbour(s) got {used.share:.0%} of a core each", flush=True)
    return res


def _verdict(limit: float | None, value: float) -> str:
    return "–" if limit is None else f"≤ {limit} {'**pass**' if value <= limit else '**FAIL**'}"


def section(results: dict[str, Any], args: argparse.Namespace, date: str) -> str:
    busy_note = ""
    shares = {n: r["loads"]["busy"] for n, r in results.items() if "busy" in r["loads"]}
    if shares:
        b = next(iter(shares.values()))
        busy_note = (f" *busy*: {b['neighbours']} neighbour process(es) spinning at 100% (benchmarks/neighbour.py; "
                     "each got " + ", ".join(f"{x['share']:.0%} of a core beside {n}" for n, x in shares.items())
                     + "), so the training thread and the recorder's threads share what is left;")
    took = f" The whole run took {args.duration_s / 60:.1f} min." if getattr(args, "duration_s", None) else ""
    L = ["", MARKER.lstrip("\n"), "",
         (f"`benchmarks/leave_on_tiny.py`, {date}, torch threads 1, {args.pairs} interleaved (no recording, arm) "
          f"pairs per arm, workload and load, each segment at least {args.steps} steps and {args.min_segment:g} s (steps: "
          + ", ".join(f"{n} {r['steps']}" for n, r in results.items())
          + "), medians of the per-pair ratios (*wall*: wall time; *CPU*: CPU time of every thread of the process, "
          "the recorder's included); *idle*: the shared 2-core machine as it was (other people's jobs may run);"
          + busy_note +
          " *added* = median of the pair differences per step (wall; CPU of all threads). *reported* = the run's own mean "
          "`sys/recorder_ms` over the timed steps = *hooks* (`sys/recorder_hooks_ms`: wall time of the recorder's hooks "
          "on the training thread) + *threads*: the larger of *waits* (`sys/recorder_wait_ms`: the training thread "
          "off its CPU outside the hooks, at most its threads' CPU) and its threads' CPU that the hooks did not "
          "wait for already (their work holds the GIL or takes a core: docs/performance.md); *bg* = "
          "`sys/recorder_bg_ms`, the CPU time of all its threads (writer, appender, stats worker). "
          f"*self-timing* passes when reported is within {SELF_TIMING:.0%} of the added wall time; beside it, "
          "the added wall time's confidence interval (order statistics of the pairs' differences, coverage "
          "given): where a quarter of the added time is narrower than it, the pairs cannot tell a pass from a fail. "
          "`close()` (the final record, once per run) is timed apart." + took),
         "", "| workload | load | arm | wall × | spread | CPU × | ms/step arm / none | added ms (CPU) | "
         "reported = hooks + threads (waits; bg) | self-timing | close ms | target (wall) |",
         "|---|---|---|---:|---|---:|---|---|---|---|---:|---|"]
    for name, res in results.items():
        for load, lr in res["loads"].items():
            for arm, a in lr["arms"].items():
                s = stats(a)
                rep = timing = close = "–"
                if ARMS[arm] is not None:
                    rep = (f"{s['reported_ms']:.2f} = {s['hooks_ms']:.2f} + {s['reported_ms'] - s['hooks_ms']:.2f} "
                           f"({s['wait_ms']:.2f}; {s['bg_ms']:.2f})")
                    share = s["reported_ms"] / s["added_ms"] if s["added_ms"] > 0 else float("nan")
                    ci = s["added_ci"]
                    timing = (f"{share:.0%} of added {'**pass**' if self_timing(s['reported_ms'], s['added_ms']) else '**FAIL**'}"
                              + (f" (added {ci[0]:.2f}–{ci[1]:.2f} at {ci[2]:.0%})" if ci else ""))
                    close = f"{s['close_ms']:.1f}"
                L.append(f"| {name} | {load} | {arm} | {s['ratio']:.3f}× | {s['spread'][0]:.3f}–{s['spread'][1]:.3f} | "
                         f"{s['cpu_ratio']:.3f}× | {s['arm_ms']:.2f} / {s['none_ms']:.2f} | {s['added_ms']:.2f} "
                         f"({s['added_cpu_ms']:.2f}) | {rep} | {timing} | {close} | "
                         f"{_verdict(target(name, arm), s['ratio'])} |")
    L += fixed_cost_lines(results)
    L += ["", "Workloads: " + "; ".join(f"**{n}**: {r['title']}" for n, r in results.items()) + "."]
    if getattr(args, "note", ""):
        L += ["", args.note]
    return "\n".join(L) + "\n"


def fixed_cost_lines(results: dict[str, Any]) -> list[str]:
    """Issue 40's fixed cost per step on the training thread, for a model with a handful of tensors
    (the PPO update: 12 params): the wall time of the recorder's hooks there (``sys/recorder_hooks_ms``,
    median over the pairs), with the training thread's added CPU time beside it (hooks and whatever
    the recorder's threads cost it outside them), against FIXED_COST_MS."""
    res = results.get("rl")
    if res is None:
        return []
    out = []
    for load, lr in res["loads"].items():
        for arm, a in lr["arms"].items():
            if ARMS[arm] is None:
                continue
            s = stats(a)
            ok = s["hooks_ms"] <= FIXED_COST_MS
            out.append(f"{arm}, {load}: hooks {s['hooks_ms']:.2f} ms a step {'**pass**' if ok else '**FAIL**'} "
                       f"(training thread's added CPU {s['added_train_cpu_ms']:.2f} ms)")
    if not out:
        return []
    return ["", f"**Fixed cost per step, a model with a handful of tensors** (rl, 12 params; target ≤ {FIXED_COST_MS} ms "
            "on the training thread): " + "; ".join(out) + "."]


def summary(results: dict[str, Any], args: argparse.Namespace, date: str) -> dict[str, Any]:
    """What results.json holds: per workload, load and arm the medians shown in RESULTS.md, and the raw pairs.
    The idle load's arms are under ``arms`` (what docs/performance.md reads), the busy one's under ``busy_arms``."""
    out: dict[str, Any] = {"date": date, "pairs": args.pairs, "steps": args.steps, "min_segment_s": args.min_segment,
                           "duration_s": getattr(args, "duration_s", None), "note": getattr(args, "note", ""),
                           "self_timing": SELF_TIMING, "workloads": {}}
    for name, res in results.items():
        entry: dict[str, Any] = {"title": res["title"], "steps": res["steps"]}
        for load, lr in res["loads"].items():
            arms = {}
            for arm, a in lr["arms"].items():
                s = stats(a)
                limit = target(name, arm)
                recorded = ARMS[arm] is not None
                arms[SLUG[arm]] = s | {
                    "label": arm, "target": limit, "pass": None if limit is None else s["ratio"] <= limit,
                    "self_timing_pass": self_timing(s["reported_ms"], s["added_ms"]) if recorded else None,
                    "raw": a}
                if not recorded:
                    for k in ("reported_ms", "bg_ms", "wait_ms", "hooks_ms", "close_ms"):
                        arms[SLUG[arm]][k] = None
            entry["arms" if load == "idle" else BUSY_KEY] = arms
            if load == "busy":
                entry["busy_neighbours"], entry["busy_share"] = lr["neighbours"], lr["share"]
        out["workloads"][name] = entry
    return out


def write_results(path: Path, text: str) -> None:
    from results_md import replace_section  # benchmarks/ is sys.path[0] when run as a script

    replace_section(path, MARKER, text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(TINY))
    ap.add_argument("--pairs", type=int, default=15)  # single pairs spread +-20% on a shared machine
    ap.add_argument("--steps", type=int, default=30)
    # 0.7 s: about three commit windows of the writer's work in each segment; 15 pairs of 3 arms, 3 workloads
    # and 2 loads then take about 13 min on the shared 2-core machine (1 s: about 18).
    ap.add_argument("--min-segment", type=float, default=0.7, help="seconds a segment lasts at least")
    ap.add_argument("--arms", default=",".join(SLUG.values()), help="which arms, by their JSON keys: "
                    + ", ".join(SLUG.values()))
    ap.add_argument("--loads", default=",".join(LOADS), help="idle, busy or both (busy: every other core spinning)")
    ap.add_argument("--neighbours", type=int, default=default_neighbours(),
                    help="spinning processes for the busy load (default: one per core but one)")
    ap.add_argument("--note", default="", help="a sentence on this run's conditions, printed under its table")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--work", type=Path, default=HERE / "_work" / "leave_on_tiny")
    ap.add_argument("--results", type=Path, default=None, help="default: benchmarks/RESULTS.md unless --quick")
    args = ap.parse_args(argv)
    by_slug = {v: k for k, v in SLUG.items()}
    args.arms = [by_slug[a] for a in args.arms.split(",")]
    args.loads = [x for x in args.loads.split(",") if x]
    if not set(args.loads) <= set(LOADS):
        ap.error(f"--loads takes {', '.join(LOADS)}")
    if args.quick:
        args.pairs, args.steps, args.min_segment = 3, 15, 0.3
    torch.set_num_threads(1)
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    t0 = time.perf_counter()
    results = {n: bench(n, args) for n in args.workloads.split(",")}
    args.duration_s = time.perf_counter() - t0
    print(f"took {args.duration_s:.0f} s", flush=True)
    shutil.rmtree(args.work, ignore_errors=True)
    out = args.results or (None if args.quick else HERE / "RESULTS.md")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_results(out, section(results, args, date))
        print(f"wrote {out}")
        from results_json import update  # benchmarks/ is sys.path[0] when run as a script

        update("leave_on_tiny", summary(results, args, date), out.with_name("results.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
