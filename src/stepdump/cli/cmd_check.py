"""stepdump check: run the health rules over a run."""

from __future__ import annotations

import argparse
import json

from stepdump.cli.common import add_run_arg, console, open_run
from stepdump.cli.output import add_format_args, output_format, print_rows
from stepdump.cli.exitcodes import Exit

EXAMPLES = """examples:
  stepdump check demo-run
  stepdump check demo-run --rules nan_inf,loss_spike --fail-on error
  stepdump check demo-run --json
  stepdump check demo-run --objective loss   # the scalar whose fall means learning (none: no scalar should fall, as in RL)
  stepdump check demo-run --csv > findings.csv
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("--rules", type=_rules_arg, help="comma-separated rule names (default: all)")
    p.add_argument("--fail-on", default="warning", choices=("info", "warning", "error"),
                   help="exit 1 when a finding at or above this severity exists (default warning)")
    p.add_argument("--objective", help="the logged scalar whose fall means the model learns (default: what the "
                   "run was recorded with, else 'loss' unless the run looks like RL or a GAN); 'none': no such scalar")
    add_format_args(p, json_help="print findings as JSON (with every tensor of a grouped finding)")


def _rules_arg(text: str) -> list[str]:
    """argparse type for ``--rules``: registered rule names only, else a usage error (exit 2)."""
    import difflib

    from stepdump.analysis.checks import rule_names

    known = rule_names()
    for name in text.split(","):
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise argparse.ArgumentTypeError(f"unknown rule {name!r} in {text!r}; {hint}(rules: {', '.join(known)})")
    return text.split(",")


def run(args: argparse.Namespace) -> int:
    from stepdump.checks import Severity, check

    with open_run(args.run) as r:
        objective = False if args.objective == "none" else args.objective
        findings = check(r, rules=args.rules, objective=objective)
    fail = Severity.parse(args.fail_on)
    fmt = output_format(args)
    if fmt == "json":
        print(json.dumps([f.to_dict() for f in findings], indent=1))
    elif not findings and fmt == "table":
        console.print("no findings")
    else:
        # A grouped finding (one cause, several tensors) names its lead tensor and how many more
        # in a table; CSV/TSV list them all (';'-separated), --json under "tensors".
        rows = [(f.severity.name.lower(), f.rule, f.step, f.kind or "",
                 (f.tensor or "") + (f" (+{len(f.tensors) - 1})" if len(f.tensors) > 1 else "")
                 if fmt == "table" else ";".join(f.tensors) or (f.tensor or ""), f.message) for f in findings]
        print_rows(("severity", "rule", "step", "kind", "tensor", "message"), rows, args)
    return Exit.FOUND if any(f.severity >= fail for f in findings) else Exit.OK
