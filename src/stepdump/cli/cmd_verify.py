"""stepdump verify: re-read every blob and check its checksum."""

from __future__ import annotations

import argparse

from rich.progress import Progress

from stepdump.cli.common import add_run_arg, console, human_bytes, open_run
from stepdump.cli.exitcodes import Exit

EXAMPLES = "examples:\n  stepdump verify demo-run && echo intact\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)


def run(args: argparse.Namespace) -> int:
    from stepdump.analysis.verify import verify

    with open_run(args.run) as r, Progress(console=console, transient=True) as bar:
        task = bar.add_task("verifying blobs", total=None)
        report = verify(r, progress=lambda done, total: bar.update(task, completed=done, total=total))
    for note in report.unchecked:
        console.print(f"not checked: {note}", soft_wrap=True)
    if report.ok:
        segments = f", {report.segments_checked} gradient-log segments re-applied" if report.segments_checked else ""
        console.print(f"ok: {report.blobs_checked} blobs, {human_bytes(report.bytes_checked)} verified{segments}")
        return Exit.OK
    console.print(f"[bold red]{len(report.problems)} problem(s)[/] in {args.run}:")
    for p in report.problems:
        console.print(f"  {p.where}: {p.detail}", soft_wrap=True)
        for t in p.tensors[:5]:
            console.print(f"    used by {t}")
    return Exit.FOUND
