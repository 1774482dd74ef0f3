"""stepdump demo: train a small model with recording on, re-execute one step, print a summary, write a report."""

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
  stepdump demo --out demo-run-2 --steps 200 --no-report     # the same training again: diff finds them identical

--steps 200 records 201 steps: one per optimizer step (0..199) and the final record 200, the
state after the last update (the trained model). Every step is stored in full with its batch, so
every command runs on the demo run, reexecute and bundle with --entry stepdump.demo:make_step.
The demo prints no timing: make bench measures what recording costs (docs/performance.md).
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--out", default="demo-run", help="run directory to create (an earlier demo run there is replaced)")
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
    table.add_row("steps recorded", f"{result.steps} ({args.steps} optimizer steps and the final record)")
    table.add_row("tensors per step", str(result.tensors))
    table.add_row("bytes on disk", human_bytes(result.bytes_on_disk))
    table.add_row("final loss", f"{result.final_loss:.4f}")
    console.print(table)
    console.print(f"reexecute: {result.reexec_summary}", markup=False)

    import stepdump

    with stepdump.open(result.path) as run_:
        findings = _check(run_)
        if findings is not None:
            console.print(f"check: {len(findings)} finding(s)" + ("" if not findings else ":"))
            for f in findings[:10]:
                console.print(f"  [{f.severity.name.lower()}] {f.rule} at step {f.step}: {f.message}", markup=False)
        if not args.no_report:
            report = _report(run_, Path(result.path) / "report.html", findings)
            if report is not None:
                console.print(f"report: {report}")
    k, path = result.reexecuted, result.path
    console.print("try:", markup=False)
    for example in (f"info {path}", f"show {path} 0.weight --step {k} --kind grads",
                    f"reexecute {path} --step {k} --entry stepdump.demo:make_step",
                    f"bundle {path} --step {k} -o step-{k}.stepdump"):
        console.print(f"  stepdump {example}", markup=False)
    return Exit.OK if result.reproduces else Exit.FOUND


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
