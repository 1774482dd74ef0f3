"""Analysis cost against the number of ranks (issue 25 item 4): 8, 64 and 256 rank stores.

Writes an N-rank DDP recording of a small model with benchmarks/ranks_gen.py (the real Recorder
on each rank; tests/test_ranks_gen.py checks it against a real gloo job), copies it as a second
run, then times on each size, every command in a fresh subprocess (so peak RSS is that
command's): ``stepdump info``, ``check``, ``diff A B`` (identical runs: every step and rank
compared), the cross-rank comparison (``stepdump.analysis.cross_rank``), ``report`` and
``export-stats``. Prints wall and CPU seconds, the cost per rank and the peak RSS, and writes
its section of benchmarks/RESULTS.md (``--out``; ``--out ''`` writes nothing) and the
``ranks_scale`` key of results.json beside it.

    python benchmarks/ranks_scale.py                        # make bench: 8, 64, 256 ranks
    python benchmarks/ranks_scale.py --ranks 8,64 --out /tmp/x/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MARKER = "\n## Analysis at scale: ranks"

# One command, timed inside its own process after the imports; prints one JSON line.
_PROBE = r"""
import contextlib, io, json, resource, sys, time
import stepdump, pandas
from stepdump.cli.main import main
what, argv = sys.argv[1], sys.argv[2:]
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
before = rss_mib()
def children_cpu():  # check runs the ranks in forked workers: their CPU is the command's too
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime
def once():
    out = io.StringIO()
    t, c = time.perf_counter(), time.process_time() + children_cpu()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        if what == "cross_rank":
            from stepdump.analysis.cross_rank import cross_rank
            with stepdump.open(argv[0]) as run:
                code = len(cross_rank(run))
        else:
            code = main(argv)
    return code, time.perf_counter() - t, time.process_time() + children_cpu() - c, out.getvalue()[-300:]
# The first run also pays for the modules the command imports on first use; the second is the cost.
code, cold_wall, cold_cpu, tail = once()
code, wall, cpu, tail = once()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"code": code, "wall_s": wall, "cpu_s": cpu, "cold_wall_s": cold_wall, "cold_cpu_s": cold_cpu,
                  "rss_before_mib": before, "peak_rss_mib": peak, "tail": tail}))
"""

# Ranks recorded for real by the Recorder; later ranks are copies with their per-rank meta
# rewritten (ranks_gen.write_ranks(recorded=); the same stores but for the logged loss).
RECORDED = 8
COMMANDS = ("info", "check", "diff", "cross_rank", "report", "export-stats")


def probe(what: str, argv: list[str]) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-c", _PROBE, what, *argv], capture_output=True, text=True, env=env,
                          timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{what} {argv} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def argv_of(what: str, a: Path, b: Path, work: Path) -> list[str]:
    return {
        "info": ["info", str(a)],
        "check": ["check", str(a)],
        "diff": ["diff", str(a), str(b)],
        "cross_rank": [str(a)],
        "report": ["report", str(a), "-o", str(work / "report.html")],
        "export-stats": ["export-stats", str(a), "-o", str(work / "stats.parquet")],
    }[what]


def generate(root: Path, n: int, steps: int) -> float:
    sys.path.insert(0, str(HERE))
    from ranks_gen import write_ranks

    t = time.perf_counter()
    write_ranks(root / "a", n, steps=steps, recorded=RECORDED)
    shutil.copytree(root / "a", root / "b")
    return time.perf_counter() - t


def write_section(path: Path, text: str) -> None:
    """Replace this script's section of RESULTS.md (or add it at the end), leaving the rest alone."""
    from results_md import replace_section  # benchmarks/ is sys.path[0] when run as a script

    replace_section(path, MARKER, text)


def _slopes(results: dict[int, dict[str, Any]], sizes: list[int], what: str) -> str:
    """CPU per added rank between consecutive sizes: equal slopes mean linear growth; a slope
    that grows with the size means worse than linear."""
    out = []
    for a, b in zip(sizes, sizes[1:]):
        d = results[b][what]["cpu_s"] - results[a][what]["cpu_s"]
        out.append(f"{a}->{b}: {1000 * d / (b - a):.1f}")
    return ", ".join(out) or "-"


def table(results: dict[int, dict[str, Any]]) -> list[str]:
    sizes = sorted(results)
    lines = ["| command | " + " | ".join(f"{n} ranks: wall / CPU s (CPU ms per rank), peak RSS MiB" for n in sizes)
             + " | CPU ms per added rank, between sizes |",
             "|---|" + "---:|" * (len(sizes) + 1)]
    for what in COMMANDS:
        cells = []
        for n in sizes:
            r = results[n][what]
            cells.append(f"{r['wall_s']:.2f} / {r['cpu_s']:.2f} ({1000 * r['cpu_s'] / n:.1f}), {r['peak_rss_mib']:.0f}")
        cells.append(_slopes(results, sizes, what))
        name = "cross-rank comparison" if what == "cross_rank" else f"`{what}`"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="8,64,256", help="comma-separated rank counts (default 8,64,256)")
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per rank (default 8)")
    ap.add_argument("--out", default=str(HERE / "RESULTS.md"), help="RESULTS.md to update ('' for none)")
    ap.add_argument("--keep", help="keep the generated runs under this folder")
    ap.add_argument("--reuse", action="store_true",
                    help="with --keep: time the runs already there (ranks<N>/a and /b) instead of writing them again")
    args = ap.parse_args()
    sizes = [int(x) for x in args.ranks.split(",")]
    load_before = os.getloadavg()
    results: dict[int, dict[str, Any]] = {}
    gen_s: dict[int, float] = {}
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="stepdump-ranks-"))
    try:
        for n in sizes:
            root = base / f"ranks{n}"
            if args.reuse and args.keep and (root / "a").is_dir() and (root / "b").is_dir():
                print(f"{n} ranks: reusing {root}", flush=True)
            else:
                shutil.rmtree(root, ignore_errors=True)
                gen_s[n] = generate(root, n, args.steps)
                print(f"{n} ranks: generated in {gen_s[n]:.1f} s", flush=True)
            results[n] = {}
            for what in COMMANDS:
                r = probe(what, argv_of(what, root / "a", root / "b", root))
                if (what == "diff" and r["code"] != 0) or (what == "cross_rank" and r["code"] != 0) or \
                        (what not in ("diff", "cross_rank") and r["code"] not in (0, 1)):
                    raise RuntimeError(f"{what} on {n} ranks: unexpected result {r}")
                results[n][what] = r
                print(f"  {what:13s} wall {r['wall_s']:7.2f} s  CPU {r['cpu_s']:7.2f} s  (first run CPU "
                      f"{r['cold_cpu_s']:.2f} s)  "
                      f"{1000 * r['cpu_s'] / n:7.1f} ms CPU/rank  peak RSS {r['peak_rss_mib']:6.0f} MiB "
                      f"(after imports {r['rss_before_mib']:.0f})", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    load_after = os.getloadavg()
    lines = table(results)
    print("\n".join(lines))
    if args.out:
        from results_json import update  # benchmarks/ is sys.path[0] when run as a script

        update("ranks_scale", {"steps": args.steps, "generate_s": gen_s, "results": results,
                               "load_before": load_before, "load_after": load_after},
               Path(args.out).with_name("results.json"))
        date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        write_section(Path(args.out), "\n".join([
            "",
            "## Analysis at scale: ranks (issue 25)",
            "",
            f"`benchmarks/ranks_scale.py --ranks {args.ranks} --steps {args.steps}`, {date}, {os.cpu_count()} cores, "
            f"{platform.machine()}; load average before / after: {' '.join(f'{v:.2f}' for v in load_before)} / "
            f"{' '.join(f'{v:.2f}' for v in load_after)}. An N-rank DDP recording of a small MLP "
            f"(benchmarks/ranks_gen.py: the Recorder on ranks 0-{RECORDED - 1}, later ranks copies of those "
            "with their per-rank meta rewritten; 20 tensors a step, full every step) and a byte copy of it for "
            "`diff`; each command in its own process (peak RSS includes ~300 MiB of "
            "torch and pandas imports). Times are a second run in the same process (the first also imports "
            "what the command loads on first use); CPU includes the worker processes `check` (and `report`, "
            "which runs it) forks from 16 ranks on. Cost grows linearly when the CPU per added rank (last "
            "column) stays the same from size to size.",
            "",
            *lines,
            "",
            "Generating the runs: " + (", ".join(f"{n} ranks {s:.0f} s" for n, s in gen_s.items()) or
                                       "not timed (runs written before, --reuse)") + ".",
            "",
        ]))


if __name__ == "__main__":
    main()
