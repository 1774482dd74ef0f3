"""stepdump demo: train a small model with recording on, print a summary, write a report."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from stepdump.cli.common import console, human_bytes, positive_int
from stepdump.cli.exitcodes import Exit

EXAMPLES = """examples:
  stepdump demo                       # records into ./demo-run, writes ./demo-run/report.html
  stepdump demo --out /tmp/run --steps 500
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="demo-run", help="run directory to create (an earlier demo run there is replaced)")
    p.add_argument("--steps", type=positive_int, default=200, help="optimizer steps to train (default 200)")
    p.add_argument("--no-report", action="store_true", help="skip writing the HTML report")


def run(args: argparse.Namespace) -> int:
    from stepdump.demo import run_demo

    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console,
        transient=True, disable=not console.is_terminal,  # off a terminal a bar only leaves empty lines
    ) as bar:
        tasks: dict[str, Any] = {}  # label -> rich TaskID

        def progress(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=total)
            bar.update(tasks[label], completed=done)

        result = run_demo(args.out, args.steps, progress)

    table = Table(title="stepdump demo", show_header=False)
    table.add_row("run", str(result.path))
    table.add_row("steps recorded", str(result.steps))
    table.add_row("tensors per step", str(result.tensors))
    table.add_row("bytes on disk", human_bytes(result.bytes_on_disk))
    table.add_row("ms/step without recording", f"{result.ms_per_step_plain:.2f}")
    table.add_row("ms/step with recording", f"{result.ms_per_step_recorded:.2f}")
    table.add_row("final loss", f"{result.final_loss:.4f}")
    console.print(table)

    import stepdump

    with stepdump.open(result.path) as run_:
        findings = _check(run_)
        if findings is not None:
            console.print(f"check: {len(findings)} finding(s)" + ("" if not findings else ":"))
            for f in findings[:10]:
                console.print(f"  [{f.severity.name.lower()}] {f.rule} at step {f.step}: {f.message}")
        if not args.no_report:
            report = _report(run_, Path(result.path) / "report.html", findings)
            if report is not None:
                console.print(f"report: {report}")
    console.print(f"try: stepdump info {result.path}   |   stepdump show {result.path} 0.weight --step 10")
    return Exit.OK


def _check(run_):  # type: ignore[no-untyped-def]
    try:
        from stepdump.analysis.checks import check
    except ImportError:
        return None
    return check(run_)


def _report(run_, path: Path, findings):  # type: ignore[no-untyped-def]
    try:
        from stepdump.render.html import write_report
    except ImportError:
        return None
    return write_report(run_, path, findings=findings)
