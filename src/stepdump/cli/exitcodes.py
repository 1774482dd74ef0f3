"""Documented exit codes of the ``stepdump`` command (also in docs/cli.md)."""

from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    OK = 0  # success; for diff: runs identical; for check: nothing at/above --fail-on
    FOUND = 1  # diff: runs differ; check: findings at/above --fail-on; verify: corruption
    USAGE = 2  # bad command line, every bad value included (argparse types in cli/common.py)
    NOT_FOUND = 3  # no such run, step or tensor; a filter (--names, --name) that matches nothing
    CORRUPT = 4  # the store is damaged or of an unknown format
    ERROR = 5  # any other stepdump error
    NOTHING_COMPARED = 6  # diff: no tensor recorded by both at a common step, or some left uncompared (two fp kinds)
    INTERRUPTED = 130  # Ctrl-C
