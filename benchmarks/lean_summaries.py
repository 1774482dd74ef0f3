"""What a per-step distribution summary would cost a lean (stats-only) step (issue 26 item 3).

A lean step records per tensor numel, NaN/±Inf counts, min, max, the L2 norm and the exact
fingerprint (mean/std/zero fraction only up to 4096 elements). The report's distribution view
of a lean run draws from those: the min–max envelope at every step, mean ± std where measured.
Would a richer summary per step be worth recording? Candidates, each measured on a real step's
params and grads (what every lean step reads; optimizer state is read every 10th step only):

* ``loghist16``: a 16-bin histogram of log2|x| (frexp exponent, clamped to [-24, -9], zeros
  counted in the lowest bin): the shape of the distribution over 5 orders of magnitude.
* ``quantiles5``: the 5/25/50/75/95 % quantiles of an evenly strided sample of at most 4096
  elements (the report's quantile view, at every step instead of at full steps).
* ``meanstd``: mean, std and zero fraction of the tensors over 4096 elements, which lean steps
  leave unmeasured (a sum pass and a ``count_nonzero`` pass).

For each: bytes per step in the catalog (deterministic: values per tensor × 8 bytes, SQLite's
row overhead not counted), elements read per step (deterministic), and time per step next to
the lean rows' own time (``capture.lean.lean_rows`` of the same tensors) and the training step
with no recording, timed as interleaved repeats (median). Timings on a loaded machine are not
worth much; the deterministic columns are.

    .venv/bin/python benchmarks/lean_summaries.py --json /tmp/lean_summaries.json
    .venv/bin/python benchmarks/lean_summaries.py --results   # make bench: section lean_summaries of results.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import gpt  # noqa: E402
from workloads_tiny import nanogpt_tiny  # noqa: E402

from stepdump.capture.lean import lean_rows  # noqa: E402
from stepdump.capture.step_state import Entry  # noqa: E402

log = logging.getLogger("lean_summaries")
SMALL = 4096  #: lean steps measure every stat up to this many elements
PROBS = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64)


def loghist16(t: torch.Tensor) -> np.ndarray:
    """16 counts of the frexp exponent of |x| clamped to [-24, -9] (zeros in the lowest bin)."""
    x = t.reshape(-1)
    e = torch.where(x == 0, -24, torch.frexp(x)[1])  # frexp(0) has exponent 0: zeros go to the lowest bin
    return torch.bincount((e.clamp(-24, -9) + 24).to(torch.int64), minlength=16).numpy()


def quantiles5(t: torch.Tensor) -> np.ndarray:
    flat = t.reshape(-1)
    if flat.numel() > SMALL:
        flat = flat[:: -(-flat.numel() // SMALL)]
    return torch.quantile(flat.double(), PROBS).numpy()


def meanstd(t: torch.Tensor) -> tuple[float, float, float] | None:
    """What lean leaves unmeasured above 4096 elements (None below: already recorded)."""
    n = t.numel()
    if n <= SMALL:
        return None
    x = t.reshape(-1)
    s, sq = float(x.sum()), float(torch.dot(x, x))
    mean = s / n
    return mean, max(sq / n - mean * mean, 0.0) ** 0.5, 1 - int(torch.count_nonzero(x)) / n


CANDIDATES: dict[str, tuple[Callable[[torch.Tensor], Any], int, Callable[[int], int]]] = {
    # name: (function, values stored per tensor, elements read for a tensor of n elements)
    "loghist16": (loghist16, 16, lambda n: 2 * n),  # frexp and the zero test read it; bincount reads the exponents
    "quantiles5": (quantiles5, 5, lambda n: min(n, SMALL)),
    "meanstd": (meanstd, 3, lambda n: 2 * n if n > SMALL else 0),
}


def _median_ms(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(name: str, make: Callable[[], Any], reps: int) -> dict[str, Any]:
    w = make()
    for _ in range(2):
        w.step(None)  # warm up; grads and state exist from here on
    grabbed: list[tuple[str, torch.Tensor]] = []

    def grab() -> None:
        grabbed.clear()
        grabbed.extend((f"params/{n}", p.detach().clone()) for n, p in w.model.named_parameters())
        grabbed.extend((f"grads/{n}", p.grad.detach().clone()) for n, p in w.model.named_parameters() if p.grad is not None)

    w.step(grab)
    tensors = [t for _, t in grabbed]
    entries = [Entry(k.split("/", 1)[0], k.split("/", 1)[1], t, False) for k, t in grabbed]
    numels = [t.numel() for t in tensors]
    out: dict[str, Any] = {"workload": w.title, "tensors": len(tensors), "elements": sum(numels),
                           "large_tensors": sum(n > SMALL for n in numels),
                           # what a lean row stores now: 10 stat columns and the fingerprint, 8 bytes each
                           "lean_row_bytes_per_step": len(tensors) * 11 * 8}
    arms: dict[str, Callable[[], Any]] = {"step": lambda: w.step(None), "lean_rows": lambda: lean_rows(entries, set())}
    for cand, (fn, _, _) in CANDIDATES.items():
        arms[cand] = lambda fn=fn: [fn(t) for t in tensors]  # on the grabbed copies: no autograd involved
    samples: dict[str, list[float]] = {a: [] for a in arms}
    for _ in range(reps):  # interleaved: each arm sees the same load
        for a, fn in arms.items():
            samples[a].append(_median_ms(fn, 1))
    ms = {a: statistics.median(v) for a, v in samples.items()}
    out["ms"] = {"step (no recording)": ms["step"], "lean rows (params+grads)": ms["lean_rows"]}
    out["candidates"] = {}
    for cand, (_, values, read) in CANDIDATES.items():
        stored = sum(values for n in numels if cand != "meanstd" or n > SMALL)
        out["candidates"][cand] = {
            "bytes_per_step": stored * 8,
            "elements_read_per_step": sum(read(n) for n in numels),
            "ms": ms[cand],
            "vs_lean_rows": ms[cand] / ms["lean_rows"],
            "vs_step": ms[cand] / ms["step"],
        }
    log.info("%s: %d tensors, %d elements, step %.2f ms, lean rows %.2f ms, %d B/step", name, len(tensors),
             sum(numels), ms["step"], ms["lean_rows"], out["lean_row_bytes_per_step"])
    for cand, c in out["candidates"].items():
        log.info("  %-10s %6d B/step  %9d elements read  %7.2f ms  (%.2fx lean rows, %.1f%% of the step)", cand,
                 c["bytes_per_step"], c["elements_read_per_step"], c["ms"], c["vs_lean_rows"], 100 * c["vs_step"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--reps", type=int, default=15, help="interleaved repeats per arm (default 15)")
    p.add_argument("--json", type=Path, help="also write the numbers here")
    p.add_argument("--results", action="store_true",
                   help="also store them in benchmarks/results.json, section lean_summaries (make bench)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    results = {name: measure(name, make, args.reps) for name, make in (("tiny", nanogpt_tiny), ("gpt", gpt))}
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
        log.info("wrote %s", args.json)
    if args.results:
        from results_json import update

        log.info("wrote %s", update("lean_summaries", results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
