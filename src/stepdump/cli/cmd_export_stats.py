"""stepdump export-stats: every rank's and step's stats as one Parquet file (needs pyarrow).

With no filter, each store's own ``stats.parquet`` (written by ``Recorder.close()``) is copied,
or concatenated for a multi-rank run, once it checks out against its catalog; otherwise, and for
a store whose copy is stale or damaged, the rows are read from the catalog.
"""

from __future__ import annotations

import argparse

from stepdump.cli.common import add_run_arg, console, globs_arg, kinds_arg, open_run, steps_arg
from stepdump.cli.exitcodes import Exit

EXAMPLES = """examples:
  stepdump export-stats demo-run -o stats.parquet
  stepdump export-stats demo-run -o grads.parquet --kind grads --names '0.*' --steps 0:10
  then, in DuckDB: SELECT rank, max(norm) FROM 'stats.parquet' WHERE kind = 'grads' GROUP BY rank
"""


def one_glob_arg(text: str) -> str:
    """argparse type for ``--names`` here: the vocabulary's comma list, of one glob (the export
    filters by one glob in SQL; run it once per glob for more)."""
    globs = globs_arg(text)
    if len(globs) > 1:
        raise argparse.ArgumentTypeError(f"export-stats takes one glob in --names, not {len(globs)} ({text!r}): "
                                         "export once per glob")
    return globs[0]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("-o", "--out", required=True, help="the Parquet file to write (replaced if it exists)")
    p.add_argument("--kind", type=kinds_arg(), help="only this kind (params, grads, optimizer, buffers, ...)")
    p.add_argument("--names", type=one_glob_arg, help="a glob over tensor names, e.g. 'fc1.*' (one: the export filters in SQL)")
    p.add_argument("--steps", type=steps_arg, help="N, A:B, A:B:K or N,M,...")


def run(args: argparse.Namespace) -> int:
    from stepdump.read.columnar import export_parquet

    with open_run(args.run) as r:
        done = export_parquet(r, args.out, kind=args.kind, name=args.names, steps=args.steps)
        ranked = bool(getattr(r, "ranks", None))
    where = f"{done.stores} ranks" if ranked else "1 store"
    console.print(f"wrote {done.rows} rows ({where}) to {args.out}")
    if done.copied:
        console.print(f"copied from the run's stats.parquet ({done.copied} of {done.stores} "
                      f"{'ranks' if ranked else 'store'}, each checked against its catalog)")
    if done.rebuilt:  # what was wrong with the copies not used: read from the catalog instead
        more = f" (and {len(done.rebuilt) - 1} more)" if len(done.rebuilt) > 1 else ""
        console.print(f"read from the catalog: {done.rebuilt[0]}{more}")
    return Exit.OK
