"""stepdump check: run the health rules over a run."""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from stepdump.cli.common import add_run_arg, console, open_run
from stepdump.cli.exitcodes import Exit

EXAMPLES = """examples:
  stepdump check demo-run
  stepdump check demo-run --rules nan_inf,loss_spike --fail-on error
  stepdump check demo-run --json
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("--rules", help="comma-separated rule names (default: all)")
    p.add_argument("--fail-on", default="warning", choices=("info", "warning", "error"),
                   help="exit 1 when a finding at or above this severity exists (default warning)")
    p.add_argument("--json", action="store_true", help="print findings as JSON")


def run(args: argparse.Namespace) -> int:
    from stepdump.checks import Severity, check

    with open_run(args.run) as r:
        findings = check(r, rules=args.rules.split(",") if args.rules else None)
    fail = Severity.parse(args.fail_on)
    if args.json:
        print(json.dumps([f.to_dict() for f in findings], indent=1))
    elif not findings:
        console.print("no findings")
    else:
        t = Table("severity", "rule", "step", "kind", "tensor", "message")
        for f in findings:
            t.add_row(f.severity.name.lower(), f.rule, str(f.step), f.kind or "", f.tensor or "", f.message)
        console.print(t)
    return Exit.FOUND if any(f.severity >= fail for f in findings) else Exit.OK
