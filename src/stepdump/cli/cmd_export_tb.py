"""stepdump export-tb: write a run's scalars, stats and histograms as TensorBoard event files."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from stepdump.cli.common import add_run_arg, console, int_arg, open_run, print_error
from stepdump.cli.exitcodes import Exit

EXAMPLES = """examples:
  stepdump export-tb demo-run tb/demo     # then: tensorboard --logdir tb
  stepdump export-tb demo-run tb/demo --stats norm,nan --histograms grads --histogram-steps 5
  stepdump export-tb demo-run tb/demo --no-stats --histograms none
  stepdump export-tb demo-run tb --compare demo-run-2 --label demo --label again   # side by side, with compare/* in tb/again
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("logdir", help="directory for the event files (created)")
    p.add_argument("--stats", default="norm,mean,std,min,max,nan,inf",
                   help="comma-separated stats per tensor (default norm,mean,std,min,max,nan,inf)")
    p.add_argument("--no-stats", action="store_true", help="no per-tensor stats")
    p.add_argument("--kinds", help="comma-separated kinds whose stats are exported (default all)")
    p.add_argument("--histograms", default="params,grads",
                   help="comma-separated kinds to draw histograms of, or 'none' (default params,grads)")
    p.add_argument("--histogram-steps", type=int_arg(1, 10**6, "--histogram-steps"), default=20,
                   help="at most this many full steps get histograms (default 20)")
    p.add_argument("--profile", action="store_true", help="also export the recorder's sys/* timings")
    p.add_argument("--compare", action="append", default=None, metavar="RUN",
                   help="also export this run (repeatable), each run to LOGDIR/<label>, and in each compared "
                        "run's directory its comparison with RUN: compare/<scalar>/a_minus_b, rel_diff, "
                        "compare/diverged, compare/first_divergent_step, compare/divergence (text)")
    p.add_argument("--label", action="append", default=None,
                   help="with --compare: a run's directory name, once per run in order (default: directory names)")


def run(args: argparse.Namespace) -> int:
    from stepdump.render.tensorboard import export_tensorboard

    hist = None if args.histograms.strip().lower() == "none" else _split(args.histograms)
    options = {"stats": None if args.no_stats else _split(args.stats),
               "stat_kinds": _split(args.kinds) if args.kinds else None,
               "histograms": hist, "max_histogram_steps": args.histogram_steps, "profile": args.profile}
    if args.compare:
        return _compare(args, options)
    if args.label:
        print_error("--label names the runs of --compare: give --compare RUN, or leave --label out")
        return Exit.USAGE
    with open_run(args.run) as r:
        out = export_tensorboard(r, args.logdir, **options)
    console.print(f"wrote {out.scalars} scalars, {out.stats} stat points and {out.histograms} histograms "
                  f"to {out.logdir}")
    return Exit.OK


def _compare(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from stepdump.render.tensorboard_compare import export_tensorboard_runs

    with contextlib.ExitStack() as stack:
        runs = [stack.enter_context(open_run(p)) for p in (args.run, *args.compare)]
        out = export_tensorboard_runs(runs, args.logdir, args.label, **options)
    for e in out.runs:
        console.print(f"wrote {e.scalars} scalars, {e.stats} stat points and {e.histograms} histograms to {e.logdir}")
    for a, b, first in out.compared:
        where = f"parts at step {first}" if first is not None else "no divergent step (see compare/divergence)"
        console.print(f"{b} vs {a}: {where}; comparison in {out.logdir / b}")
    return Exit.OK


def _split(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]
