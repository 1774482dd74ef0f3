"""stepdump report: one self-contained HTML file about one run or several overlaid; --watch serves it live."""

from __future__ import annotations

import argparse
import contextlib
import sys

from stepdump.cli.common import console, float_arg, int_arg, open_run
from stepdump.cli.exitcodes import Exit

EXAMPLES = """examples:
  stepdump report demo-run -o report.html
  stepdump report demo-run demo-run-2 -o compare.html          # both runs' curves overlaid
  stepdump report demo-run demo-run-2 --label baseline --label again -o compare.html
  stepdump report --watch demo-run                     # a page that follows the training live
  stepdump report --watch demo-run --port 8765 --interval 5
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="run directory written by stepdump.Recorder; give several to overlay them")
    p.add_argument("-o", "--out", default="report.html", help="HTML file to write (default report.html)")
    p.add_argument("--label", action="append", default=None,
                   help="a run's name in the legend, once per run in order (default: directory names)")
    p.add_argument("--watch", action="store_true",
                   help="serve the report on a local port and refresh it while the runs are being recorded "
                        "(Ctrl-C stops); writes no file")
    p.add_argument("--port", type=int_arg(0, 65535, "--port"), default=8765, help="--watch: port to serve on (0: any free port; default 8765)")
    p.add_argument("--host", default="127.0.0.1", help="--watch: address to bind (default 127.0.0.1, this machine only)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="--watch: also answer requests for this host name (a name other machines use for this "
                        "one, with --host 0.0.0.0); others than localhost, 127.0.0.1, [::1] and --host are "
                        "refused (403), which stops web pages from reading the report through DNS rebinding")
    p.add_argument("--interval", type=float_arg(0, 86400, "--interval", lo_open=True), default=2.0, help="--watch: seconds between page refreshes (default 2)")


def run(args: argparse.Namespace) -> int:
    if args.watch:
        return _watch(args)
    from stepdump.render.html import write_report

    with contextlib.ExitStack() as stack:
        runs = [stack.enter_context(open_run(p)) for p in args.runs]
        out = write_report(runs[0] if len(runs) == 1 else runs, args.out, labels=args.label)
    console.print(f"wrote {out}")
    return Exit.OK


def _watch(args: argparse.Namespace) -> int:
    import os

    from stepdump.render.live import LiveReport, serve

    def ready(url: str) -> None:
        console.print(f"serving the report of {', '.join(args.runs)} at {url} (Ctrl-C stops)")
        sys.stdout.flush()  # a pipe buffers: whoever waits for the URL gets it now

    paths = [os.path.expanduser(p) for p in args.runs]
    with contextlib.ExitStack() as stack:  # open once up front: a wrong path fails here, exit 3
        for p in paths:
            stack.enter_context(open_run(p))
    serve(LiveReport(paths, args.label, interval_s=args.interval), args.host, args.port, ready, args.allow_host)
    return Exit.OK
