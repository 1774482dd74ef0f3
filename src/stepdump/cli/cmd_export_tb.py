"""stepdump export-tb: write a run's scalars, stats and histograms as TensorBoard event files."""

from __future__ import annotations

import argparse

from stepdump.cli.common import add_run_arg, console, open_run
from stepdump.cli.exitcodes import Exit

EXAMPLES = """examples:
  stepdump export-tb demo-run tb/demo && tensorboard --logdir tb
  stepdump export-tb demo-run tb/demo --stats norm,nan --histograms grads --histogram-steps 5
  stepdump export-tb demo-run tb/demo --no-stats --histograms none
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("logdir", help="directory for the event files (created)")
    p.add_argument("--stats", default="norm,mean,std,min,max,nan,inf",
                   help="comma-separated stats per tensor (default norm,mean,std,min,max,nan,inf)")
    p.add_argument("--no-stats", action="store_true", help="no per-tensor stats")
    p.add_argument("--stat-kinds", help="comma-separated kinds whose stats are exported (default all)")
    p.add_argument("--histograms", default="params,grads",
                   help="comma-separated kinds to draw histograms of, or 'none' (default params,grads)")
    p.add_argument("--histogram-steps", type=int, default=20,
                   help="at most this many full steps get histograms (default 20)")
    p.add_argument("--profile", action="store_true", help="also export the recorder's sys/* timings")


def run(args: argparse.Namespace) -> int:
    from stepdump.render.tensorboard import export_tensorboard

    hist = None if args.histograms.strip().lower() == "none" else _split(args.histograms)
    with open_run(args.run) as r:
        out = export_tensorboard(
            r, args.logdir,
            stats=None if args.no_stats else _split(args.stats),
            stat_kinds=_split(args.stat_kinds) if args.stat_kinds else None,
            histograms=hist,
            max_histogram_steps=args.histogram_steps,
            profile=args.profile,
        )
    console.print(f"wrote {out.scalars} scalars, {out.stats} stat points and {out.histograms} histograms "
                  f"to {out.logdir}")
    return Exit.OK


def _split(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]
