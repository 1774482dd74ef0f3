"""stepdump export-stats: every rank's and step's stats as one Parquet file (needs pyarrow)."""

from __future__ import annotations

import argparse

from stepdump.cli.common import add_run_arg, console, glob_arg, kinds_arg, open_run, steps_arg
from stepdump.cli.exitcodes import Exit

EXAMPLES = """examples:
  stepdump export-stats demo-run -o stats.parquet
  stepdump export-stats demo-run -o grads.parquet --kind grads --steps 0:10
  then, in DuckDB: SELECT rank, max(norm) FROM 'stats.parquet' WHERE kind = 'grads' GROUP BY rank
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("-o", "--output", required=True, help="the Parquet file to write (replaced if it exists)")
    p.add_argument("--kind", type=kinds_arg(), help="only this kind (params, grads, optimizer, buffers, ...)")
    p.add_argument("--name", type=glob_arg, help="glob over tensor names, e.g. 'fc1.*'")
    p.add_argument("--steps", type=steps_arg, help="N, A:B, A:B:K or N,M,...")


def run(args: argparse.Namespace) -> int:
    from stepdump.read.columnar import write_parquet

    with open_run(args.run) as r:
        rows, stores = write_parquet(r, args.output, kind=args.kind, name=args.name, steps=args.steps)
        ranked = bool(getattr(r, "ranks", None))
    where = f"{stores} ranks" if ranked else "1 store"
    console.print(f"wrote {rows} rows ({where}) to {args.output}")
    return Exit.OK
