"""stepdump diff: the first step and tensor where two runs differ."""

from __future__ import annotations

import argparse
import json

from stepdump.cli.common import console, open_run
from stepdump.cli.exitcodes import Exit

EXAMPLES = """examples:
  stepdump diff run-a run-b
  stepdump diff ref port --atol 1e-6 --kinds params,grads
  stepdump diff run-a run-b --json
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_a", help="first run")
    p.add_argument("run_b", help="second run")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: bitwise)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0)")
    p.add_argument("--kinds", help="comma-separated kinds to compare (default all)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    from stepdump.analysis.diff import diff

    kinds = args.kinds.split(",") if args.kinds else None
    with open_run(args.run_a) as a, open_run(args.run_b) as b:
        res = diff(a, b, atol=args.atol, rtol=args.rtol, kinds=kinds)
    if args.json:
        print(json.dumps({
            "identical": res.identical, "first_step": res.first_step, "steps_compared": res.steps_compared,
            "tensors": [vars(t) for t in res.tensors],
            "steps_only_in_a": res.steps_only_in_a, "steps_only_in_b": res.steps_only_in_b,
            "names_only_in_a": res.names_only_in_a, "names_only_in_b": res.names_only_in_b,
            "first_scalar_diff": res.first_scalar_diff,
        }, indent=1))
    else:
        console.print(res.summary())
        for t in res.tensors[:20]:
            console.print(f"  {t.describe()}", soft_wrap=True)
        if len(res.tensors) > 20:
            console.print(f"  ... and {len(res.tensors) - 20} more")
        if res.first_scalar_diff:
            console.print(f"first differing scalar: {res.first_scalar_diff[1]} at step {res.first_scalar_diff[0]}")
    return Exit.OK if res.identical else Exit.FOUND
