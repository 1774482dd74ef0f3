"""Helpers every command uses: the console, step ranges, opening runs."""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence

from rich.console import Console
from rich.markup import escape

import stepdump
from stepdump.errors import ConfigError
from stepdump.store.format import ALL_KINDS, TENSOR_KINDS
from stepdump.store.queries import MAX_STEP

# The kinds `diff --kinds` takes: analysis.diff.KIND_ORDER (a test keeps them equal), named here
# without importing torch, so that `stepdump diff --help` stays quick.
DIFF_KINDS = (*TENSOR_KINDS, "buffers")

# Into a pipe, a file or a CI log, rich would wrap every line and squeeze every table to 80
# columns (COLUMNS is rarely set there): a finding's message over eleven lines, "tra…" for a
# tensor name. There, lines are as long as their text and tables as wide as their content.
# (Commands that print data pick TSV there anyway: cli/output.py.)
_UNWRAPPED = 10_000  # columns: wider than any table we draw (soft_wrap: text lines are never cut)


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """The reader of a pipe left (``| head -1``): raise, so cli/main.py keeps the command's verdict.

        rich's own handler exits 1, which would turn ``diff``'s "identical" (0) into "differ" (1).
        """
        self.quiet = True
        # What rich had buffered can never be delivered: dropped, or the next print (an in-process
        # caller's next command) would write it first.
        del self._buffer[:]
        raise BrokenPipeError(32, "the reader of stdout has gone")


def _console(stream: object, stderr: bool) -> Console:
    try:
        terminal = bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError):
        terminal = False
    if terminal:
        return _Console(stderr=stderr, highlight=False, emoji=False)
    # emoji=False: text such as "A:B:K" or a tensor named ":b:" is printed as written, never as an emoji.
    return _Console(stderr=stderr, highlight=False, emoji=False, soft_wrap=True, width=_UNWRAPPED)


console = _console(sys.stdout, stderr=False)
err_console = _console(sys.stderr, stderr=True)


def parse_steps(text: str | None) -> range | list[int] | None:
    """``"10"``, ``"10:20"``, ``"10:100:10"``, ``":50"`` or ``"1,5,9"`` -> steps."""
    if text is None:
        return None
    try:
        if ":" in text:
            parts = [int(p) if p else None for p in text.split(":")]
            if len(parts) > 3 or parts[2:] == [0]:
                raise ValueError(text)  # A:B:C:D, or a stride of 0
            start = parts[0] or 0
            stop = parts[1] if len(parts) > 1 and parts[1] is not None else 2**62
            step = parts[2] if len(parts) > 2 and parts[2] else 1
            return range(start, stop, step)
        return [int(p) for p in text.split(",")]
    except ValueError:
        raise ConfigError(f"bad step range {text!r}; use N, A:B, A:B:K or N,M,...") from None


def print_error(message: object) -> None:
    """``error: MESSAGE`` on stderr, the message printed literally (no console markup in it)."""
    err_console.print(f"[bold red]error:[/] {escape(str(message))}", soft_wrap=True)


# argparse types: a bad value is a usage error (exit 2 with usage) before any run is opened.

def int_arg(lo: int, hi: int | None, what: str) -> Callable[[str], int]:
    """argparse type for a whole number from ``lo`` to ``hi`` (None: no upper bound); ``what``
    names it in the usage error, which states the range."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < lo or (hi is not None and n > hi):
            valid = f"{lo} to {hi}" if hi is not None else f"{lo} or more"
            raise argparse.ArgumentTypeError(f"{what} {text}: give {valid}")
        return n
    parse.__name__ = what  # argparse names the type in its message
    return parse


def float_arg(lo: float, hi: float, what: str, *, lo_open: bool = False) -> Callable[[str], float]:
    """argparse type for a finite number from ``lo`` (above it, with ``lo_open``) to ``hi``."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(x) or x < lo or (lo_open and x == lo) or x > hi:
            low = f"more than {lo:g}" if lo_open else f"{lo:g}"
            raise argparse.ArgumentTypeError(f"{what} {text}: give a number from {low} to {hi:g}")
        return x
    parse.__name__ = what
    return parse


#: argparse type for ``--step``: a step a catalog can hold.
step_arg = int_arg(0, MAX_STEP, "step")


def steps_arg(text: str) -> range | list[int]:
    """argparse type for ``--steps``: what :func:`parse_steps` accepts, every number in it a step
    a catalog can hold (0 to MAX_STEP), else a usage error."""
    try:
        steps = parse_steps(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if steps is None:  # parse_steps gives None only for no text at all
        raise argparse.ArgumentTypeError("give steps: N, A:B, A:B:K or a comma list")
    numbers = [steps.start, steps.stop, steps.step] if isinstance(steps, range) else steps
    if any(not 0 <= n <= MAX_STEP for n in numbers):
        raise argparse.ArgumentTypeError(f"steps {text!r}: every step, bound and stride is 0 to {MAX_STEP}")
    return steps


def kinds_arg(choices: Sequence[str] = ALL_KINDS, *, many: bool = False) -> Callable[[str], object]:
    """argparse type for ``--kind`` (one of ``choices``) or ``--kinds`` (a comma list of them)."""
    def parse(text: str) -> str | list[str]:
        words = text.split(",") if many else [text]
        for w in words:
            if w not in choices:
                near = difflib.get_close_matches(w, choices, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                where = f" in {text!r}" if many else ""
                raise argparse.ArgumentTypeError(f"unknown kind {w!r}{where}{hint} (kinds: {', '.join(choices)})")
        return words if many else words[0]
    parse.__name__ = "kinds" if many else "kind"  # argparse names the type in its message
    return parse


def positive_int(text: str) -> int:
    """argparse type for a count that must be at least 1 (``demo --steps``)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give 1 or more")
    return n


def glob_arg(text: str) -> str:
    """argparse type for one glob: not empty, every ``[`` closed by a ``]``."""
    if not text:
        raise argparse.ArgumentTypeError("an empty glob matches nothing; leave the option out to see all")
    depth_open = text.rfind("[")
    if depth_open >= 0 and "]" not in text[depth_open + 1:]:
        raise argparse.ArgumentTypeError(f"bad glob {text!r}: '[' at {depth_open} is never closed by ']'")
    return text


def globs_arg(text: str) -> list[str]:
    """argparse type for a comma list of globs (``--names loss,lr*``)."""
    try:
        return [glob_arg(w) for w in text.split(",")]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"in {text!r}: {e}") from None


def report_no_match(what: str, patterns: Iterable[str], available: Iterable[str]) -> int:
    """A filter matched nothing: say so with the nearest names; returns :data:`Exit.NOT_FOUND` (3)."""
    from stepdump.cli.exitcodes import Exit

    names = sorted(set(available))
    wanted = list(patterns)
    near = [m for w in wanted for m in difflib.get_close_matches(w.rstrip("*"), names, n=3, cutoff=0.5)]
    shown = list(dict.fromkeys(near)) or names[:10]
    more = " ..." if not near and len(names) > 10 else ""
    hint = f"; did you mean {', '.join(repr(n) for n in shown)}{more}?" if shown else f"; the run has no {what}"
    print_error(f"no {what} matches {', '.join(repr(w) for w in wanted)}{hint}")
    return Exit.NOT_FOUND


def open_run(path: str) -> stepdump.types.RunReader:
    """Open the run a command names (``~`` expanded): any reader kind, local, remote or multi-rank."""
    return stepdump.open(os.path.expanduser(path))


def add_run_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run directory written by stepdump.Recorder")


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units (KiB = 1024 B, MiB, GiB, TiB): ``"1.5 MiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def run_bytes(path: os.PathLike[str] | str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total
