"""Entry point: parse, dispatch to one command module, map errors to exit codes."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from stepdump.cli.common import err_console
from stepdump.cli.exitcodes import Exit
from stepdump.errors import (
    CorruptDataError,
    FormatVersionError,
    NotARunError,
    StepdumpError,
    StepNotFoundError,
    TensorNotFoundError,
)

COMMANDS = (
    "demo", "info", "ls", "show", "stats", "scalars", "diff", "check", "export", "export-tb", "report", "verify",
)

EPILOG = """\
exit codes: 0 ok, 1 difference/finding/corruption found, 2 usage, 3 run/step/tensor not found,
            4 corrupt or unknown-format store, 5 other error, 130 interrupted.
examples:
  stepdump demo --out demo-run --steps 200
  stepdump info demo-run
  stepdump show demo-run fc1.weight --step 10 --kind grads
  stepdump diff run-a run-b
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepdump",
        description="Flight recorder and time machine for PyTorch training: inspect, check, diff and export runs.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument("--traceback", action="store_true", help="show the full traceback on errors")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what stepdump does")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        mod = importlib.import_module(f"stepdump.cli.cmd_{name.replace('-', '_')}")
        p = sub.add_parser(
            name, help=mod.HELP, description=mod.HELP, epilog=getattr(mod, "EXAMPLES", None),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)
    return parser


def _version() -> str:
    import stepdump

    return f"stepdump {stepdump.__version__} (store format {stepdump.FORMAT_VERSION})"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return Exit.USAGE
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return Exit.INTERRUPTED
    except StepdumpError as e:
        if args.traceback:
            raise
        err_console.print(f"[bold red]error:[/] {e}", soft_wrap=True)
        return _code(e)
    except BrokenPipeError:  # `stepdump scalars run | head`
        return Exit.OK


def _code(e: StepdumpError) -> Exit:
    if isinstance(e, (NotARunError, StepNotFoundError, TensorNotFoundError)):
        return Exit.NOT_FOUND
    if isinstance(e, (CorruptDataError, FormatVersionError)):
        return Exit.CORRUPT
    return Exit.ERROR


if __name__ == "__main__":
    sys.exit(main())
