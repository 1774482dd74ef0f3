"""stepdump diff: where two runs part, the earliest cause there, and what was compared."""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import asdict
from typing import Any

from stepdump.cli.common import DIFF_KINDS, console, float_arg, kinds_arg, open_run, print_error
from stepdump.cli.exitcodes import Exit

EXAMPLES = """examples:
  stepdump demo --out demo-run-2 --steps 200 --no-report   # the same training again
  stepdump diff demo-run demo-run-2                        # exit 0: identical, bit for bit
  stepdump diff demo-run demo-run-2 --atol 1e-6 --kinds params,grads
  stepdump diff demo-run demo-run-2 --json
  stepdump diff demo-run demo-run-2 --ignore rng --ignore scalars.acc
  stepdump diff demo-run demo-run-2 --noise demo-run-3 demo-run-4   # beyond the noise among A's repeats (two more demos; 1% false alarms)

exit codes: 0 identical (over what was compared: the output says what was not; an RNG that
  differs while nothing computed does is a note, not a difference), 1 the runs differ,
  2 bad arguments (an unknown --ignore part), 6 nothing to compare (no tensor recorded by
  both at a common step), or nothing differs in what was compared but some tensors were not
  compared because the runs fingerprint them in two kinds (xxh3, dmix64) and stored no bytes
"""

_SHOWN = 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_a", help="first run")
    p.add_argument("run_b", help="second run")
    p.add_argument("--atol", type=float_arg(0, sys.float_info.max, "--atol"), default=0.0,
                   help="absolute tolerance (default 0: bitwise)")
    p.add_argument("--rtol", type=float_arg(0, sys.float_info.max, "--rtol"), default=0.0,
                   help="relative tolerance (default 0)")
    p.add_argument("--kinds", type=kinds_arg(DIFF_KINDS, many=True),
                   help="comma-separated tensor kinds to compare (default all)")
    p.add_argument("--ignore", action="append", metavar="PART",
                   help="leave PART out of the comparison (repeatable, or a comma list): rng, rng.torch, rng.cuda, "
                        "rng.numpy, rng.python, hyperparameters, scheduler, scaler, batch, scalars, scalars.NAME, "
                        "or a tensor kind")
    p.add_argument("--noise", nargs="+", metavar="REPEAT",
                   help="repeats of run A (same code and settings): a difference counts only where B stands out "
                        "from A and the repeats, with at most --noise-alpha false alarms over the whole run if B "
                        "is just another repeat (docs/cli.md says how many repeats to record)")
    p.add_argument("--noise-alpha", type=float, default=0.01,
                   help="with --noise: the run-level false-alarm rate (default 0.01)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    from stepdump.analysis.diff import diff
    from stepdump.analysis.diff_ignore import parse_ignore
    from stepdump.analysis.noise_stat import check_alpha
    from stepdump.errors import ConfigError

    kinds = args.kinds
    ignore = [w.strip() for item in args.ignore or () for w in item.split(",")]
    try:
        parse_ignore(ignore)  # a bad word is a bad command line: refused before any run is opened
        check_alpha(args.noise_alpha)
    except ConfigError as e:
        print_error(e)
        return Exit.USAGE
    with contextlib.ExitStack() as stack:
        a, b = (stack.enter_context(open_run(p)) for p in (args.run_a, args.run_b))
        noise = [stack.enter_context(open_run(p)) for p in args.noise or ()]
        res = diff(a, b, atol=args.atol, rtol=args.rtol, kinds=kinds, ignore=ignore, noise=noise or None,
                   noise_alpha=args.noise_alpha)
    # Decided before printing: under `| head -1` the printing may stop midway, the verdict stands (cli/main.py).
    # Nothing found but tensors left uncompared for two fingerprint kinds: neither 0 nor "differ".
    args.verdict = (Exit.NOTHING_COMPARED if not res.comparable else Exit.OK if res.identical
                    else Exit.FOUND if res.first_step is not None else Exit.NOTHING_COMPARED)
    if args.json:
        from stepdump.cli.output import print_json

        print_json(_as_json(res))
    else:
        console.print(res.summary(), soft_wrap=True, markup=False)
        if res.tensors:
            console.print(f"tensors that differ at step {res.first_tensor_step}:")
        for t in res.tensors[:_SHOWN]:
            console.print(f"  {t.describe()}", soft_wrap=True, markup=False)
        if len(res.tensors) > _SHOWN:
            console.print(f"  ... and {len(res.tensors) - _SHOWN} more (--json lists them all)")
        if res.noise is not None and res.first_step is not None:
            nd = res.noise
            limit = f"counts above {nd.critical:.3g}" if nd.critical is not None else "compared exactly"
            console.print(f"beyond the noise at step {res.first_step} (B's deviation in standard deviations of A and "
                          f"its {nd.repeats} repeat(s); {limit}):")
            rows = sorted((r for r in nd.exceeded if r.step == res.first_step), key=lambda r: -r.score)
            for r in rows[:_SHOWN]:
                console.print(f"  {r.kind} {r.name} ({r.measure}): |B - A| {r.difference:.3g}, spread "
                              f"{r.spread:.3g}, score {r.score:.3g}", soft_wrap=True, markup=False)
        if res.noise is not None and res.noise.tests:
            console.print(f"false-alarm rate: at most {res.noise.alpha * 100:g}% over the whole run "
                          f"({res.noise.tests} tests against {res.noise.repeats} repeat(s))")
        if res.first_scalar_diff and res.noise is None:
            console.print(f"first differing scalar: {res.first_scalar_diff[1]} at step {res.first_scalar_diff[0]}")
    return int(args.verdict)


def _as_json(res: Any) -> dict[str, Any]:
    return {
        "identical": res.identical, "comparable": res.comparable, "complete": res.complete,
        "first_step": res.first_step, "headline": res.headline(), "reading": res.reading,
        "differences": [{"step": d.step, "stage": d.stage, "what": d.what, "a": d.a, "b": d.b,
                         "description": d.describe()} for d in res.differences],
        "first_tensor_step": res.first_tensor_step, "steps_compared": res.steps_compared,
        "tensors": [vars(t) for t in res.tensors],
        "steps_only_in_a": res.steps_only_in_a, "steps_only_in_b": res.steps_only_in_b,
        "names_only_in_a": res.names_only_in_a, "names_only_in_b": res.names_only_in_b,
        "first_scalar_diff": res.first_scalar_diff, "coverage": asdict(res.coverage),
        "config": [{"key": k, "a": a, "b": b} for k, a, b in res.config], "rank": res.rank,
        "notes": res.notes, "rng": [asdict(d) for d in res.rng], "ignored": res.ignored,
        "noise": None if res.noise is None else {
            "repeats": res.noise.repeats, "alpha": res.noise.alpha, "tests": res.noise.tests,
            "critical": res.noise.critical, "first_noisy_step": res.noise.first_noisy_step,
            "state_left_out": res.noise.state_left_out, "rows": [asdict(r) for r in res.noise.rows]},
    }
