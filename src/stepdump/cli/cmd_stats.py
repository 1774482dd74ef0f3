"""stepdump stats: the per-tensor health stats table."""

from __future__ import annotations

import argparse

from stepdump.cli.common import add_run_arg, open_run, parse_steps
from stepdump.cli.exitcodes import Exit
from stepdump.cli.tables import print_frame

EXAMPLES = """examples:
  stepdump stats demo-run --kind grads --name '0.*' --steps 0:50
  stepdump stats demo-run --kind params --csv > params.csv
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("--kind", help="only this kind (params, grads, optimizer, ...)")
    p.add_argument("--name", help="glob over tensor names, e.g. 'fc1.*'")
    p.add_argument("--steps", help="N, A:B, A:B:K or N,M,...")
    p.add_argument("--columns", default="step,kind,name,norm,min,max,mean,std,nan,posinf,neginf,zero_frac",
                   help="comma-separated columns to show in the table")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--csv", action="store_true", help="write CSV to stdout (all columns)")
    fmt.add_argument("--json", action="store_true", help="write JSON records to stdout (all columns)")
    p.add_argument("--limit", type=int, default=50, help="rows shown in the table (default 50; 0 = all)")


def run(args: argparse.Namespace) -> int:
    with open_run(args.run) as r:
        df = r.stats(kind=args.kind, name=args.name, steps=parse_steps(args.steps))
    print_frame(df, args, columns=args.columns.split(","), index=False)
    return Exit.OK
