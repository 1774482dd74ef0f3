"""Helpers every command uses: the console, step ranges, opening runs."""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console

import stepdump
from stepdump.errors import ConfigError

# Into a pipe, a file or a CI log, rich would wrap every line and squeeze every table to 80
# columns (COLUMNS is rarely set there): a finding's message over eleven lines, "tra…" for a
# tensor name. There, lines are as long as their text and tables as wide as their content.
# (Commands that print data pick TSV there anyway: cli/output.py.)
_UNWRAPPED = 10_000  # columns: wider than any table we draw (soft_wrap: text lines are never cut)


def _console(stream: object, stderr: bool) -> Console:
    try:
        terminal = bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError):
        terminal = False
    if terminal:
        return Console(stderr=stderr, highlight=False)
    return Console(stderr=stderr, highlight=False, soft_wrap=True, width=_UNWRAPPED)


console = _console(sys.stdout, stderr=False)
err_console = _console(sys.stderr, stderr=True)


def parse_steps(text: str | None) -> range | list[int] | None:
    """``"10"``, ``"10:20"``, ``"10:100:10"``, ``":50"`` or ``"1,5,9"`` -> steps."""
    if text is None:
        return None
    try:
        if ":" in text:
            parts = [int(p) if p else None for p in text.split(":")]
            start = parts[0] or 0
            stop = parts[1] if len(parts) > 1 and parts[1] is not None else 2**62
            step = parts[2] if len(parts) > 2 and parts[2] else 1
            return range(start, stop, step)
        return [int(p) for p in text.split(",")]
    except ValueError:
        raise ConfigError(f"bad step range {text!r}; use N, A:B, A:B:K or N,M,...") from None


def open_run(path: str) -> stepdump.RunReader:
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
