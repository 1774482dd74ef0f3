"""stepdump scalars: loss, lr and every other logged scalar, one row per step."""

from __future__ import annotations

import argparse

from stepdump.cli.common import add_run_arg, open_run, parse_steps
from stepdump.cli.exitcodes import Exit
from stepdump.cli.tables import print_frame

EXAMPLES = """examples:
  stepdump scalars demo-run
  stepdump scalars demo-run --steps 100:200 --csv > scalars.csv
  stepdump scalars demo-run --json | jq '.[0]'
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("--names", help="comma-separated globs over scalar names")
    p.add_argument("--steps", help="N, A:B, A:B:K or N,M,...")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--csv", action="store_true", help="write CSV to stdout")
    fmt.add_argument("--json", action="store_true", help="write JSON records to stdout")
    p.add_argument("--limit", type=int, default=50, help="rows shown in the table (default 50; 0 = all)")


def run(args: argparse.Namespace) -> int:
    with open_run(args.run) as r:
        names = args.names.split(",") if args.names else None
        df = r.scalars(names=names, steps=parse_steps(args.steps))
    print_frame(df.reset_index(), args, columns=None, index=False)
    return Exit.OK
