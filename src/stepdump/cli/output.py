"""How a command writes data: a table on a terminal, TSV into a pipe, CSV or JSON on request.

Every command that prints data goes through here, so the rules hold everywhere:

- ``--json``, ``--csv``, ``--tsv`` and ``--table`` (:func:`add_format_args`) pick the format; with
  none of them, stdout decides: a rich table on a terminal, TSV anywhere else (a pipe, a file, a
  CI log), because a table squeezed to 80 columns ("tra…", "0.0009…") cannot be grepped.
- Outside the table nothing is truncated or wrapped: one line per row, full names, and floats in
  full precision (Python's shortest round-trip ``repr``).
- A value that is not there (a scalar not logged at a step, a stat with no finite element to
  describe) is :data:`MISSING` — ``-`` in tables and TSV, an empty CSV field, JSON ``null`` —
  and a NaN is ``nan`` (``"nan"`` in JSON, which has no NaN; likewise ``"inf"``, ``"-inf"``).

The API (stable; ``cmd_check``, ``cmd_diff`` and others may use it): :func:`add_format_args`,
:func:`output_format`, :func:`print_rows`, :func:`print_record`, :func:`print_json`,
:func:`cell`, :func:`json_value`, :data:`MISSING`.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

Format = Literal["table", "tsv", "csv", "json"]
FORMATS: tuple[Format, ...] = ("table", "tsv", "csv", "json")


class _Missing:
    """The type of :data:`MISSING`: no value here, as opposed to a value that is NaN."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()
"""A cell with no value (not logged, not computed); ``None`` means the same."""


def add_format_args(p: argparse.ArgumentParser, *, json_help: str = "write JSON to stdout") -> None:
    """Add ``--json``, ``--csv``, ``--tsv`` and ``--table`` (mutually exclusive) to a command.

    They set the booleans ``args.json``, ``args.csv``, ``args.tsv`` and ``args.table``, so
    ``if args.json:`` keeps working; :func:`output_format` resolves them.
    """
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json", action="store_true", help=json_help + " (NaN as \"nan\", missing as null)")
    g.add_argument("--csv", action="store_true", help="write CSV to stdout (NaN as nan, missing as an empty field)")
    g.add_argument("--tsv", action="store_true",
                   help="write tab-separated lines, one per row, nothing truncated (the default when stdout "
                        "is not a terminal)")
    g.add_argument("--table", action="store_true", help="draw a table even when stdout is not a terminal")


def stdout_is_terminal() -> bool:
    """Whether stdout is a terminal (checked when called: tests and callers may swap stdout)."""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream: treat it as a pipe
        return False


def output_format(args: argparse.Namespace) -> Format:
    """The format the command line asked for, else ``table`` on a terminal and ``tsv`` elsewhere."""
    for fmt in ("json", "csv", "tsv", "table"):
        if getattr(args, fmt, False):
            return fmt  # type: ignore[return-value]  # one of FORMATS by construction
    return "table" if stdout_is_terminal() else "tsv"


def _is_missing(v: object) -> bool:
    if v is None or v is MISSING:
        return True
    # pandas' NA and NaT: no value, but never import pandas here (this module loads for --help)
    return type(v).__name__ in ("NAType", "NaTType")


def _plain(v: object) -> object:
    """numpy scalars -> Python scalars (``.item()``), everything else as it is."""
    item = getattr(v, "item", None)
    if item is not None and type(v).__module__ == "numpy":
        return item()
    return v


def cell(v: object, fmt: Format) -> str:
    """One value as text for ``fmt`` (table, tsv or csv).

    Floats: 6 significant digits in a table (a person reads it), the shortest repr that round-trips
    elsewhere (a program reads it). NaN is ``nan``, a missing value ``-`` (an empty CSV field).
    TSV escapes tab, newline and backslash (``\\t``, ``\\n``, ``\\\\``) so a row stays one line.
    """
    if _is_missing(v):
        return "" if fmt == "csv" else "-"
    v = _plain(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        if fmt == "table":
            return f"{v:.6g}"
        return repr(v)
    text = str(v)
    if fmt == "tsv":
        text = text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")
    return text


def json_value(v: object) -> Any:
    """A value as strict JSON can hold it: MISSING/None -> null, NaN/Inf -> ``"nan"``/``"inf"``/``"-inf"``,
    numpy scalars -> Python ones, tuples -> lists; dicts and lists are converted all the way down."""
    if _is_missing(v):
        return None
    v = _plain(v)
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, complex):  # a complex tensor's values: JSON has no complex numbers
        return str(v)
    if isinstance(v, Mapping):
        return {str(k): json_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_value(x) for x in v]
    return v


def print_json(obj: object) -> None:
    """Write ``obj`` to stdout as strict JSON (see :func:`json_value`), one value, indented."""
    sys.stdout.write(json.dumps(json_value(obj), indent=1, allow_nan=False) + "\n")


def print_rows(columns: Sequence[str], rows: Iterable[Sequence[object]], args: argparse.Namespace, *,
               title: str | None = None, limit: int | None = None, more: str | None = None) -> None:
    """Rows of ``columns`` in the format :func:`output_format` picks.

    JSON is a list of objects (one per row). ``limit`` cuts the rows in every format; when rows
    were cut from a table, a note (``more``, default a hint at ``--limit 0``) follows it. In TSV
    the first line is the header.
    """
    fmt = output_format(args)
    cols = list(columns)
    shown: list[Sequence[object]] = []
    extra = 0
    for row in rows:
        if limit is not None and limit > 0 and len(shown) >= limit:
            extra += 1
            continue
        shown.append(row)
    if fmt == "json":
        print_json([dict(zip(cols, row, strict=True)) for row in shown])
    elif fmt == "csv":
        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(cols)
        w.writerows([cell(v, "csv") for v in row] for row in shown)
    elif fmt == "tsv":
        out = sys.stdout
        out.write("\t".join(cell(c, "tsv") for c in cols) + "\n")
        for row in shown:
            out.write("\t".join(cell(v, "tsv") for v in row) + "\n")
    else:
        from rich.table import Table
        from rich.text import Text

        from stepdump.cli.common import console

        table = Table(title=title)
        for c in cols:
            # fold, never "…": on a narrow terminal a value wraps inside its cell but stays whole
            table.add_column(c, overflow="fold")
        for row in shown:  # Text, not str: a "[...]" in a value is not rich markup
            table.add_row(*(Text(cell(v, "table")) for v in row))
        console.print(table)
        if extra:
            console.print(f"({extra} more rows; {more or '--limit 0 shows all, --tsv/--csv/--json export'})")


def print_record(fields: Sequence[tuple[str, str, object]], args: argparse.Namespace, *,
                 title: str | None = None, json_obj: object = MISSING) -> None:
    """One record as ``(key, label, value)`` fields: a two-column table of ``label`` and
    ``value``, ``label<TAB>value`` lines (TSV, under a ``field<TAB>value`` header), ``label,value``
    rows (CSV), or one JSON object of ``key: value`` (keys for programs, labels for grep and people).

    ``json_obj``, when given, is what ``--json`` prints instead: the machine-readable shape of the
    record (numbers in bytes, lists of steps) where the fields hold text for people.
    """
    fmt = output_format(args)
    if fmt == "json":
        print_json({key: value for key, _, value in fields} if json_obj is MISSING else json_obj)
        return
    if fmt in ("tsv", "csv"):
        print_rows(("field", "value"), [(label, value) for _, label, value in fields], args)
        return
    from rich.table import Table
    from rich.text import Text

    from stepdump.cli.common import console

    t = Table(show_header=False, title=title)
    t.add_column(overflow="fold")
    t.add_column(overflow="fold")
    for _, label, value in fields:
        t.add_row(Text(label), Text(cell(value, "table")))
    console.print(t)
