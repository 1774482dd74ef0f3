"""``stepdump check`` at scale: wall time, CPU and peak RSS of the default rules on a long lean run.

Writes the run ``report_scale.py`` times (``synth_run.py``: ``--tensors`` small parameters x
``--steps`` steps, stats only, in stat chunks as a lean recording stores them, a gradient spike a
third of the way in and a NaN half way), then, in a fresh process (so its peak RSS is the check's),
runs ``stepdump.check`` rule by rule (the default rules, one shared ``CachedRun`` view, as
``check`` does; the rules that walk every tensor's history together, as ``check`` runs them: one
shared walk) and prints each rule's seconds, the total wall and CPU seconds, the peak RSS and the
findings. It writes nothing: the numbers are printed (docs/design-measurements.md, "Checking a long run",
quotes them). The run lives in a temporary directory, deleted at the end, unless ``--run`` names
one written before.

    python benchmarks/check_scale.py --steps 10000            # 500 x 10,000
    python benchmarks/check_scale.py                          # 500 x 100,000 (issue 26's size)
    python benchmarks/check_scale.py --run /tmp/r --steps 10000   # a run synth_run wrote before
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from pathlib import Path

from report_scale import peak_rss_mib, record  # benchmarks/ is sys.path[0] when run as a script


def timed_check(run_dir: str) -> tuple[list[tuple[str, float, int]], float, float, float, list[str]]:
    """In a fresh process: the default rules on ``run_dir``, one shared view, as ``check`` runs them.

    Returns ([(rule, seconds, findings)], wall s, CPU s, peak RSS MiB, ["rule step tensor"] of the findings).
    """
    import stepdump
    from stepdump.analysis.checks import resolve_rules
    from stepdump.analysis.rule_runner import CachedRun, run_rules
    from stepdump.analysis.rules._walk import shares_walk

    with stepdump.open(run_dir) as run:
        t, c = time.perf_counter(), time.process_time()
        view = CachedRun(run)
        per_rule = []
        findings = []
        rules = resolve_rules(None)
        walking = [rule for rule in rules if shares_walk(rule)]  # one shared walk over the tensors
        for rule in rules:
            if rule in walking and rule is not walking[0]:
                continue
            group = walking if walking and rule is walking[0] else [rule]
            r = time.perf_counter()
            got = run_rules(view, group)
            per_rule.append(("+".join(str(g.name) for g in group), time.perf_counter() - r, len(got)))
            findings.extend(got)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
    return per_rule, wall, cpu, peak_rss_mib(), [f"{f.rule} {f.step} {f.tensor}" for f in findings]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=500)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--run", help="a run synth_run.py wrote before (kept)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(args.run) if args.run else Path(d) / "run"
        if not args.run:
            t = time.perf_counter()
            record(run_dir, args.tensors, args.steps)
            print(f"write: {time.perf_counter() - t:.1f} s ({args.tensors} tensors x {args.steps} steps, stats only)")
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            per_rule, wall, cpu, rss, found = pool.apply(timed_check, (str(run_dir),))
    for name, s, n in per_rule:
        print(f"  {name:22s} {s:8.2f} s  {n} finding(s)")
    print(f"check: {wall:.1f} s wall ({cpu:.1f} s CPU), peak RSS {rss:.0f} MiB, {args.tensors} tensors x "
          f"{args.steps} steps ({2 * args.tensors * args.steps / 1e6:.0f} M stats rows), {os.cpu_count()} cores; "
          f"load average now {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print("findings: " + "; ".join(found))


if __name__ == "__main__":
    main()
