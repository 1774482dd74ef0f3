"""stepdump show: one tensor at one step, its stats and a preview of its values."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from stepdump.cli.common import add_run_arg, int_arg, kinds_arg, open_run, step_arg
from stepdump.cli.exitcodes import Exit
from stepdump.cli.output import add_format_args, print_record
from stepdump.errors import StepNotFoundError

if TYPE_CHECKING:
    from stepdump.read.reader import RunReader

EXAMPLES = """examples:
  stepdump show demo-run 0.weight --step 10
  stepdump show demo-run 0.weight --step 10 --kind grads
  stepdump show demo-run 0.weight.exp_avg --kind optimizer          # last stored step
  stepdump show demo-run 1.running_mean                             # a module buffer (kind found by name)
  stepdump show demo-run 0.weight --values 0 --json | jq .values    # every value
"""

# Which kind a bare name means when --kind is not given and several kinds have it.
_KIND_ORDER = ("params", "buffers")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("name", help="tensor name (see `stepdump ls RUN`)")
    p.add_argument("--step", type=step_arg, help="step (default: the last step stored in full)")
    p.add_argument("--kind", type=kinds_arg(), help="params, grads, optimizer, buffers, ... (default: params, else the kind that "
                                  "has NAME, e.g. buffers for a BatchNorm's running_mean)")
    p.add_argument("--values", type=int_arg(0, 10**9, "--values"), default=8, help="how many values to preview (default 8; 0 = all)")
    add_format_args(p, json_help="write the tensor's dtype, shape, stats and values as one JSON object")


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: `stepdump show --help` must not load torch.
    import torch

    from stepdump.core.stats import compute_stats
    from stepdump.store.catalog import STAT_COLUMNS

    with open_run(args.run) as r:
        kind = args.kind or _kind_of(r, args.name)
        step = args.step
        if step is None:
            if not r.steps:
                raise StepNotFoundError(f"{r.path} has no step stored in full yet")
            step = r.steps[-1]
        t = r.tensor(args.name, step, kind=kind)
        count = t.numel() if args.values <= 0 else min(args.values, t.numel())
        sparse = t.layout == torch.sparse_coo
        # A sparse grad: its values shown as the dense tensor it stands for, its structure named.
        flat = (t.to_dense() if sparse else t).detach().reshape(-1)[:count]
        if flat.dtype in (torch.bfloat16, torch.float16) or flat.dtype.itemsize == 1 and flat.is_floating_point():
            flat = flat.float()  # exact: every half and 8-bit float is a float32
        values = flat.tolist()
        stats = dict(zip(STAT_COLUMNS, compute_stats(t), strict=True))
        dtype = str(t.dtype).replace("torch.", "")
        shape = list(t.shape)
        more = t.numel() > count
        fields: list[tuple[str, str, object]] = [
            ("run", "run", str(r.path)), ("kind", "kind", kind), ("name", "name", args.name), ("step", "step", step),
            ("dtype", "dtype", dtype), ("shape", "shape", str(tuple(shape))),
        ]
        layout = (f"sparse COO, {t._nnz()} stored elements, {'coalesced' if t.is_coalesced() else 'not coalesced'}"
                  if sparse else "strided")
        if sparse:
            fields.append(("layout", "layout", layout))
        fields += [(c, c, v) for c, v in stats.items()]
        from stepdump.cli.output import cell, output_format

        fmt = output_format(args)
        text = ", ".join(cell(v, "table" if fmt == "table" else "tsv") for v in values) + (" ..." if more else "")
        fields.append(("values", "values", text))
        print_record(fields, args, title=f"{kind} {args.name} @ step {step}", json_obj={
            "run": str(r.path), "kind": kind, "name": args.name, "step": step, "dtype": dtype, "shape": shape,
            "layout": layout, "stats": stats, "values": values, "values_truncated": more,
        })
    return Exit.OK


def _kind_of(r: RunReader, name: str) -> str:
    """The kind ``name`` belongs to: params when it is a param, else the first kind that has it
    (module buffers are a kind of their own, recorded at full steps); params when none does,
    so the reader's error ("did you mean ...") is the one the user sees."""
    kinds = r.kinds()
    ordered = [k for k in _KIND_ORDER if k in kinds] + [k for k in kinds if k not in _KIND_ORDER]
    for k in ordered:
        if name in r.names(k):
            return k
    return "params"
