"""stepdump verify: re-read every blob and check its checksum."""

from __future__ import annotations

import argparse
from dataclasses import asdict

from rich.progress import Progress

from stepdump.cli.common import add_run_arg, console, human_bytes, open_run
from stepdump.cli.exitcodes import Exit
from stepdump.cli.output import print_json

EXAMPLES = """examples:
  stepdump verify demo-run && echo intact
  stepdump verify demo-run --json | jq '.ok, .problems[].where'
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("--json", action="store_true",
                   help="write the report as JSON (ok, counts, problems with where/detail/tensors, unchecked)")


def run(args: argparse.Namespace) -> int:
    from stepdump.analysis.verify import verify

    # No bar off a terminal: there it would only leave an empty line in the output.
    bar_off = not console.is_terminal
    with open_run(args.run) as r, Progress(console=console, transient=True, disable=bar_off) as bar:
        task = bar.add_task("verifying blobs", total=None)
        report = verify(r, progress=lambda done, total: bar.update(task, completed=done, total=total))
    if args.json:
        print_json({"ok": report.ok, "blobs_checked": report.blobs_checked, "bytes_checked": report.bytes_checked,
                    "segments_checked": report.segments_checked, "unchecked": report.unchecked,
                    "problems": [asdict(p) for p in report.problems]})
        return Exit.OK if report.ok else Exit.FOUND
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
