"""Entry point: parse, dispatch to one command module, map errors to exit codes.

Startup cost matters here (``stepdump --help`` must answer in well under a
second), so this module imports nothing heavy: the one-line summaries of the
commands live in :data:`SUMMARIES`, and only the module of the command being
run is imported (it brings torch, pandas and rich with it when it needs them).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import logging
import sys
from collections.abc import Iterator, Sequence

from stepdump.cli.exitcodes import Exit
from stepdump.errors import (
    CorruptDataError,
    FormatVersionError,
    NotARunError,
    StepdumpError,
    StepNotFoundError,
    TensorNotFoundError,
)

# One module per command: stepdump/cli/cmd_<name with - as _>.py, with
# add_arguments(parser), run(args) -> int and optionally EXAMPLES (the epilog).
COMMANDS = (
    "demo", "info", "ls", "show", "stats", "scalars", "diff", "check", "export", "export-tb", "export-stats",
    "report", "verify", "reexecute", "bundle",
)

# What `stepdump --help` lists, and each command's description in `stepdump CMD --help`.
SUMMARIES: dict[str, str] = {
    "demo": "train a small model with stepdump recording every step and its batch, re-execute a step, summarise",
    "info": "summarise a run: steps, kinds, tensors, size, how it was recorded",
    "ls": "list the steps, kinds or tensor names of a run",
    "show": "show one tensor at one step: dtype, shape, stats and a preview of its values",
    "stats": "per-tensor health stats (norm, min, max, NaN/Inf counts, ...) per step",
    "scalars": "logged scalars (loss, lr, ...) one row per step, with the skipped flag",
    "diff": "compare two runs: the first divergent step, its cause and tensors (exit 0 identical, 1 divergent, "
            "6 nothing to compare)",
    "check": "check a run for NaN/Inf, exploding/vanishing grads, loss spikes, ... (exit 1 on findings >= --fail-on)",
    "export": "write a step as a checkpoint: torch.save dict, safetensors, or one the HF Trainer / Lightning resumes from",
    "export-tb": "write scalars, per-tensor stats and histograms as TensorBoard event files (needs tensorboard)",
    "export-stats": "write every rank's and step's per-tensor stats as one Parquet table (needs pyarrow), for "
                    "DuckDB, pandas, Polars, Spark",
    "report": "write a self-contained HTML report (curves, per-tensor charts, findings) of one run or several "
              "overlaid; --watch serves it live while a run records",
    "verify": "re-read every stored blob, check checksums and fingerprints; exit 1 naming any corruption",
    "reexecute": "re-execute one recorded step with your code: reproduces (exit 0), nondeterministic or differs from "
              "the record (exit 1); --find-nan names the op",
    "bundle": "write one recorded step as a small self-contained store (state, RNG, batch, recorded "
              "fingerprints) that reexecute reads anywhere: attach it to a bug report",
}

EPILOG = """\
exit codes: 0 ok, 1 difference/finding/corruption found, 2 usage (any bad value), 3 run/step/tensor
            not found or a filter matched nothing, 4 corrupt or unknown-format store, 5 other error,
            6 diff: nothing to compare, 130 interrupted (docs/cli.md).
examples:
  stepdump demo --out demo-run --steps 200
  stepdump info demo-run
  stepdump show demo-run 0.weight --step 10 --kind grads
  stepdump reexecute demo-run --step 10 --entry stepdump.demo:make_step
  stepdump diff demo-run demo-run-2     # demo-run-2: stepdump demo --out demo-run-2, the same training
"""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``stepdump`` parser; only ``command`` (if given) gets its arguments.

    Every command is listed (so ``--help`` and "invalid choice" errors are
    complete), but a command's module is imported only when it is the one
    asked for: importing all of them would pull in torch for ``--help``.
    """
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
        summary = SUMMARIES[name]
        if name != command:
            sub.add_parser(name, help=summary, description=summary)
            continue
        mod = importlib.import_module(f"stepdump.cli.cmd_{name.replace('-', '_')}")
        p = sub.add_parser(
            name, help=summary, description=summary, epilog=getattr(mod, "EXAMPLES", None),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)
    return parser


def _command_in(argv: Sequence[str]) -> str | None:
    """The command named in ``argv``: the first word that is not an option.

    The global options take no values, so the first non-option word is the
    command (or a typo, which argparse then reports).
    """
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def _version() -> str:
    import stepdump

    return f"stepdump {stepdump.__version__} (store format {stepdump.FORMAT_VERSION})"


def main(argv: list[str] | None = None) -> int:
    """Run the ``stepdump`` command line; returns the exit code (see :class:`Exit`)."""
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(_command_in(words))
    args = parser.parse_args(words)  # a bad value on the command line exits 2 here, with usage
    if args.command is None:
        parser.print_help()
        return Exit.USAGE
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    # Loaded by now: the command module imports it.
    from stepdump.cli.common import err_console, print_error

    try:
        with _printable_output():
            return int(args.func(args))
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return Exit.INTERRUPTED
    except StepdumpError as e:
        if args.traceback:
            raise
        print_error(e)
        return _code(e)
    except BrokenPipeError:  # `stepdump diff a b | head -1`: the reader left; the verdict stands
        if argv is None:  # the real process: later flushes of stdout would fail again, loudly, at exit
            _silence_stdout()
        return int(getattr(args, "verdict", Exit.OK))


@contextlib.contextmanager
def _printable_output() -> Iterator[None]:
    """Text that cannot be encoded for stdout or stderr (a path with bytes that are not UTF-8, kept
    by Python as lone surrogates) printed as ``\\udcff``, never a UnicodeEncodeError."""
    streams = [s for s in (sys.stdout, sys.stderr) if isinstance(s, io.TextIOWrapper) and s.errors == "strict"]
    for s in streams:
        s.reconfigure(errors="backslashreplace")
    try:
        yield
    finally:
        for s in streams:
            try:
                s.reconfigure(errors="strict")
            except ValueError:  # closed meanwhile
                pass


def _silence_stdout() -> None:
    """Point stdout at /dev/null so Python's flush at exit has nowhere to fail (no BrokenPipe noise)."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _code(e: StepdumpError) -> Exit:
    if isinstance(e, (NotARunError, StepNotFoundError, TensorNotFoundError)):
        return Exit.NOT_FOUND
    if isinstance(e, (CorruptDataError, FormatVersionError)):
        return Exit.CORRUPT
    return Exit.ERROR


if __name__ == "__main__":
    sys.exit(main())
