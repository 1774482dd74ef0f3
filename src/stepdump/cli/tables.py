"""DataFrames (stats, scalars) out through cli/output.py: column choice, missing values, row limits."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from stepdump.cli.common import int_arg
from stepdump.cli.output import MISSING, output_format, print_rows
from stepdump.store.queries import MAX_STEP
from stepdump.errors import ConfigError

if TYPE_CHECKING:  # the frames come from the caller; the module itself needs no pandas
    import pandas as pd

#: The columns that say which row is which: ``--columns`` always keeps those the frame has.
IDENTIFYING = ("step", "rank", "kind", "name")

#: Rows a table shows when ``--limit`` is not given (TSV, CSV and JSON show all).
TABLE_LIMIT = 50


def add_limit_arg(p: argparse.ArgumentParser) -> None:
    """``--limit N``: at most N rows (0 = all); without it a table shows 50 and the rest all."""
    p.add_argument("--limit", type=int_arg(0, MAX_STEP, "--limit"), default=None,
                   help=f"at most this many rows (0 = all; default {TABLE_LIMIT} in a table, all otherwise)")


def select_columns(available: Sequence[str], asked: str | None, default: Sequence[str] | None = None) -> list[str]:
    """The columns to print: ``asked`` (``--columns``, comma-separated) or ``default`` (else all),
    always after the identifying ones (step, rank, kind, name) the frame has.

    Raises:
        ConfigError: ``asked`` names a column the frame does not have.
    """
    avail = list(available)
    if asked is None:
        wanted = list(default) if default is not None else avail
    else:
        wanted = [c.strip() for c in asked.split(",") if c.strip()]
        unknown = [c for c in wanted if c not in avail]
        if unknown:
            raise ConfigError(f"unknown column(s) {', '.join(unknown)} for --columns; "
                              f"choose from {','.join(avail)}")
    keep = [c for c in IDENTIFYING if c in avail]
    return keep + [c for c in wanted if c in avail and c not in keep]


def print_frame(df: pd.DataFrame, args: argparse.Namespace, columns: Sequence[str] | None = None, *,
                missing: pd.DataFrame | None = None, title: str | None = None) -> None:
    """Print ``df[columns]`` (default all) in the format the command line asks for.

    Args:
        missing: Booleans shaped like ``df``: True where a cell has no value (printed ``-``,
            an empty CSV field, JSON null). Default ``df.isna()``: in a frame that cannot tell a
            NaN from a NULL, every NaN is "no value". Cells not marked missing print NaN as ``nan``.
        title: Shown above a table.
    """
    cols = list(columns) if columns is not None else [str(c) for c in df.columns]
    mask = (df.isna() if missing is None else missing)[cols].to_numpy()
    values = df[cols].to_numpy(dtype=object)
    limit = getattr(args, "limit", None)
    if limit is None:
        limit = TABLE_LIMIT if output_format(args) == "table" else 0
    rows = ([MISSING if gone else v for v, gone in zip(row, row_mask, strict=True)]
            for row, row_mask in zip(values, mask, strict=True))
    print_rows(cols, rows, args, title=title, limit=limit)
