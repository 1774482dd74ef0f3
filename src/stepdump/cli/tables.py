"""Printing DataFrames as rich tables, CSV or JSON."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from rich.table import Table

from stepdump.cli.common import console

if TYPE_CHECKING:  # the frames come from the caller; the module itself needs no pandas
    import pandas as pd


def print_frame(df: pd.DataFrame, args: argparse.Namespace, columns: list[str] | None, index: bool) -> None:
    if getattr(args, "csv", False):
        df.to_csv(sys.stdout, index=index)
        return
    if getattr(args, "json", False):
        sys.stdout.write(df.to_json(orient="records", indent=1) + "\n")
        return
    cols = [c for c in (columns or list(df.columns)) if c in df.columns]
    limit = args.limit or len(df)
    table = Table(*cols)
    for row in df[cols].head(limit).itertuples(index=False):
        table.add_row(*(_fmt(v) for v in row))
    console.print(table)
    if len(df) > limit:
        console.print(f"({len(df) - limit} more rows; --limit 0 shows all, --csv exports)")


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return "-" if v != v else f"{v:.6g}"
    return str(v)
