"""stepdump ls: list steps, kinds or tensor names."""

from __future__ import annotations

import argparse
import sys

from stepdump.cli.common import add_run_arg, console, kinds_arg, open_run
from stepdump.cli.exitcodes import Exit
from stepdump.cli.output import add_format_args, output_format, print_json, print_rows

EXAMPLES = """examples:
  stepdump ls demo-run              # kinds and tensor names
  stepdump ls demo-run --full-steps     # steps stored in full (--all-steps: every step seen)
  stepdump ls demo-run --kind grads
  stepdump ls demo-run | grep exp_avg_sq | cut -f2    # piped: one "kind<TAB>name" line per tensor
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("--full-steps", action="store_true", help="list the steps stored in full")
    p.add_argument("--all-steps", action="store_true", help="list every step seen (with stats or scalars only too)")
    p.add_argument("--kind", type=kinds_arg(), help="list the tensor names of one kind")
    add_format_args(p, json_help='write JSON: a list of steps, or {"kind": [names]}')


def run(args: argparse.Namespace) -> int:
    fmt = output_format(args)
    with open_run(args.run) as r:
        if args.full_steps or args.all_steps:
            steps = r.all_steps if args.all_steps else r.steps
            if fmt == "json":
                print_json(steps)
            elif fmt == "table":  # a person reads it: one line, not one row per step
                console.print(" ".join(map(str, steps)) if steps else "(no steps)", soft_wrap=True)
            elif fmt == "csv":
                print_rows(("step",), [(s,) for s in steps], args)
            else:  # TSV: one bare step a line, no header, for `for s in $(stepdump ls RUN --full-steps)`
                sys.stdout.write("".join(f"{s}\n" for s in steps))
            return Exit.OK
        kinds = [args.kind] if args.kind else r.kinds()
        names = {kind: r.names(kind) for kind in kinds}
    if fmt == "json":
        print_json(names)
    elif fmt == "table":
        from rich.markup import escape

        for kind, ns in names.items():
            console.print(f"[bold]{escape(kind)}[/] ({len(ns)})")
            for n in ns:
                console.print(f"  {escape(n)}", soft_wrap=True)
    else:
        print_rows(("kind", "name"), [(kind, n) for kind, ns in names.items() for n in ns], args)
    return Exit.OK
