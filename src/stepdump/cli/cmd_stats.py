"""stepdump stats: the per-tensor health stats table."""

from __future__ import annotations

import argparse

from typing import Any

from stepdump.cli.common import add_run_arg, globs_arg, kinds_arg, open_run, report_no_match, steps_arg
from stepdump.cli.exitcodes import Exit
from stepdump.cli.output import add_format_args
from stepdump.cli.tables import add_limit_arg, print_frame, select_columns

EXAMPLES = """examples:
  stepdump stats demo-run --kind grads --names '0.*,1.*' --steps 0:10
  stepdump stats demo-run --columns norm,nan | grep running_var    # one TSV line per row in a pipe
  stepdump stats demo-run --kind params --csv > params.csv
"""

# What a table shows without --columns (TSV, CSV and JSON have every column).
TABLE_COLUMNS = ("norm", "min", "max", "mean", "std", "nan", "posinf", "neginf", "zero_frac")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("--kind", type=kinds_arg(), help="only this kind (params, grads, optimizer, buffers, ...)")
    p.add_argument("--names", type=globs_arg, help="comma-separated globs over tensor names, e.g. '0.*,1.*'")
    p.add_argument("--steps", type=steps_arg, help="N, A:B, A:B:K or N,M,...")
    p.add_argument("--columns",
                   help="comma-separated stat columns, e.g. norm,nan (step, kind and name are always kept; "
                        f"default: {','.join(TABLE_COLUMNS)} in a table, every column otherwise)")
    add_format_args(p, json_help="write JSON records to stdout")
    add_limit_arg(p)


def run(args: argparse.Namespace) -> int:
    from stepdump.cli.output import output_format

    with open_run(args.run) as r:
        df = _stats(r, args.kind, args.names, args.steps)
        if args.names and df.empty:  # the globs, or only the steps? Ask about every step.
            names = r.stats(kind=args.kind)["name"]
            if _stats(r, args.kind, args.names, None).empty:
                return report_no_match("tensor", args.names, names)
    default = TABLE_COLUMNS if output_format(args) == "table" else None
    # A NULL stat is "nothing to describe" (stats skip non-finite elements; an empty tensor has
    # none): df.isna(), the default, prints it as "-".
    print_frame(df, args, select_columns(df.columns, args.columns, default))
    return Exit.OK


def _stats(r: Any, kind: str | None, names: list[str] | None, steps: Any) -> Any:
    """``r.stats`` of every glob in ``names`` (None: every tensor), each row once, in step order."""
    if not names or len(names) == 1:
        return r.stats(kind=kind, name=names[0] if names else None, steps=steps)
    import pandas as pd

    frames = [r.stats(kind=kind, name=n, steps=steps) for n in names]
    df = pd.concat(frames, ignore_index=True).drop_duplicates(subset=["step", "kind", "name"])
    return df.sort_values(["step", "kind", "name"], kind="stable").reset_index(drop=True)
