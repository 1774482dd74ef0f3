"""stepdump bundle: write one recorded step as a small self-contained store (for a bug report)."""

from __future__ import annotations

import argparse

from stepdump.cli.common import add_run_arg, console, open_run, step_arg
from stepdump.cli.exitcodes import Exit

EXAMPLES = """examples:
  stepdump bundle demo-run --step 10 -o step-10.stepdump
  stepdump reexecute step-10.stepdump --step 10 --entry stepdump.demo:make_step      # anywhere, later

The bundle is a store like a run: step 45's params, buffers, optimizer state, RNG and batch, the
recorded fingerprints of its grads and of step 46 (what a re-execution is compared with), and the
recording's environment. --entry (pkg.module:factory, as for reexecute) is needed only when the run
holds the step neither in full nor in a gradient log: a keyframe run replays it with your code
(stepdump bundle runs/kf --step 45 -o step-45.stepdump --entry train:make_step).
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("--step", type=step_arg, required=True, help="the recorded step to bundle")
    p.add_argument("-o", "--out", required=True, help="the bundle's directory (new or empty)")
    p.add_argument("--entry", metavar="MODULE:FACTORY",
                   help="your factory returning model, optimizer, train_step: to replay a keyframe run's step")


def run(args: argparse.Namespace) -> int:
    from stepdump.cli.cmd_reexecute import load_entry
    from stepdump.reexec.bundle import bundle

    parts = load_entry(args.entry) if args.entry else {}
    with open_run(args.run) as r:
        made = bundle(r, args.step, args.out, **parts)
    console.print(made.summary(), soft_wrap=True, markup=False, highlight=False)
    return Exit.OK
