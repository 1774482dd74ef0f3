"""stepdump scalars: loss, lr and every other logged scalar, one row per step."""

from __future__ import annotations

import argparse

from stepdump.cli.common import add_run_arg, globs_arg, open_run, report_no_match, steps_arg
from stepdump.cli.exitcodes import Exit
from stepdump.cli.output import add_format_args
from stepdump.cli.tables import add_limit_arg, print_frame

EXAMPLES = """examples:
  stepdump scalars demo-run
  stepdump scalars demo-run --steps 5:15 --csv > scalars.csv
  stepdump scalars demo-run --json | jq '.[0]'
  stepdump scalars demo-run --names loss | awk -F'\\t' 'NR > 1 && $2 > 2'   # steps whose loss was above 2 ($2 == "nan": NaN)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("--names", type=globs_arg, help="comma-separated globs over scalar names")
    p.add_argument("--steps", type=steps_arg, help="N, A:B, A:B:K or N,M,...")
    add_format_args(p, json_help="write JSON records to stdout")
    add_limit_arg(p)


def run(args: argparse.Namespace) -> int:
    with open_run(args.run) as r:
        names, steps = args.names, args.steps
        df = r.scalars(names=names, steps=steps).reset_index()
        if names and not [c for c in df.columns if c not in ("step", "skipped")]:
            return report_no_match("scalar", names, r.scalars().columns.drop("skipped", errors="ignore"))
        # The wide frame has NaN both where a NaN was logged and where nothing was; the rows
        # tell them apart (a logged NaN is a row with value None).
        logged = {(step, name) for step, name, _ in r.scalar_rows(steps)}
    missing = df.isna()
    for col in df.columns:
        if col not in ("step", "skipped"):
            missing[col] = [(int(s), col) not in logged for s in df["step"]]
    print_frame(df, args, missing=missing)
    return Exit.OK
