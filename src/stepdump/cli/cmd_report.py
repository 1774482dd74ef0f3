"""stepdump report: one self-contained HTML file about a run."""

from __future__ import annotations

import argparse

from stepdump.cli.common import add_run_arg, console, open_run
from stepdump.cli.exitcodes import Exit

EXAMPLES = """examples:
  stepdump report demo-run -o report.html
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("-o", "--output", default="report.html", help="HTML file to write (default report.html)")


def run(args: argparse.Namespace) -> int:
    from stepdump.render.html import write_report

    with open_run(args.run) as r:
        out = write_report(r, args.output)
    console.print(f"wrote {out}")
    return Exit.OK
