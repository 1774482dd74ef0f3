"""stepdump show: one tensor at one step, its stats and a preview of its values."""

from __future__ import annotations

import argparse

from stepdump.cli.common import add_run_arg, console, open_run
from stepdump.cli.exitcodes import Exit
from stepdump.errors import StepNotFoundError

EXAMPLES = """examples:
  stepdump show demo-run 0.weight --step 10
  stepdump show demo-run 0.weight --step 10 --kind grads
  stepdump show demo-run 0.weight.exp_avg --kind optimizer          # last stored step
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("name", help="tensor name (see `stepdump ls RUN`)")
    p.add_argument("--step", type=int, help="step (default: the last step stored in full)")
    p.add_argument("--kind", default="params", help="params, grads, optimizer, buffers, ... (default params)")
    p.add_argument("--values", type=int, default=8, help="how many values to preview (default 8)")


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: `stepdump show --help` must not load torch.
    import torch
    from rich.table import Table

    from stepdump.core.stats import compute_stats
    from stepdump.store.catalog import STAT_COLUMNS

    with open_run(args.run) as r:
        step = args.step
        if step is None:
            if not r.steps:
                raise StepNotFoundError(f"{r.path} has no step stored in full yet")
            step = r.steps[-1]
        t = r.tensor(args.name, step, kind=args.kind)
        table = Table(title=f"{args.kind} {args.name} @ step {step}", show_header=False)
        table.add_row("dtype", str(t.dtype).replace("torch.", ""))
        table.add_row("shape", str(tuple(t.shape)))
        for col, val in zip(STAT_COLUMNS, compute_stats(t), strict=True):
            table.add_row(col, _fmt(val))
        flat = t.reshape(-1)[: args.values]
        if flat.dtype == torch.bfloat16 or flat.dtype == torch.float16:
            flat = flat.float()
        table.add_row("values", ", ".join(_fmt(v) for v in flat.tolist()) + (" ..." if t.numel() > args.values else ""))
        console.print(table)
    return Exit.OK


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)
