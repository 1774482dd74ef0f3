"""stepdump export: write one step as an ordinary checkpoint."""

from __future__ import annotations

import argparse

from stepdump.cli.common import add_run_arg, console, open_run
from stepdump.cli.exitcodes import Exit

EXAMPLES = """examples:
  stepdump export demo-run --step 100 -o step100.pt
  stepdump export demo-run --step 100 -o step100.safetensors --format safetensors --grads
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("--step", type=int, required=True, help="step to export (stored in full)")
    p.add_argument("-o", "--output", required=True, help="file to write")
    p.add_argument("--format", choices=("torch", "safetensors"), default="torch", help="default torch")
    p.add_argument("--grads", action="store_true", help="safetensors: include grads as grads/<name>")


def run(args: argparse.Namespace) -> int:
    with open_run(args.run) as r:
        out = r.export(args.step, args.output, format=args.format, grads=args.grads)
    console.print(f"wrote {out}")
    return Exit.OK
