"""stepdump ls: list steps, kinds or tensor names."""

from __future__ import annotations

import argparse

from stepdump.cli.common import add_run_arg, console, open_run
from stepdump.cli.exitcodes import Exit

EXAMPLES = """examples:
  stepdump ls demo-run              # kinds and tensor names
  stepdump ls demo-run --steps      # steps stored in full
  stepdump ls demo-run --kind grads
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("--steps", action="store_true", help="list steps stored in full")
    p.add_argument("--all-steps", action="store_true", help="list every step seen (with stats or scalars only too)")
    p.add_argument("--kind", help="list the tensor names of one kind")


def run(args: argparse.Namespace) -> int:
    with open_run(args.run) as r:
        if args.steps or args.all_steps:
            steps = r.all_steps if args.all_steps else r.steps
            console.print(" ".join(map(str, steps)) if steps else "(no steps)", soft_wrap=True)
            return Exit.OK
        kinds = [args.kind] if args.kind else r.kinds()
        for kind in kinds:
            names = r.names(kind)
            console.print(f"[bold]{kind}[/] ({len(names)})")
            for n in names:
                console.print(f"  {n}", soft_wrap=True)
    return Exit.OK
