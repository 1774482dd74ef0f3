"""Where stepdump's time goes: wall-clock timers around its internals, per thread.

    .venv/bin/python benchmarks/profile_stepdump.py [--workload A] [--steps 20] [--mode full|tiered|stats]

Wraps (in this process only; src/ is not touched) the functions the training
thread runs in the optimizer pre-hook and those the writer thread runs per
step, and prints milliseconds per recorded step for each. Nested timers are
inclusive (``Recorder.capture`` contains ``Stager.stage`` and so on).
Also times the same loop without recording, and the stats kernels alone on the
workload's tensors, so the numbers can be read against each other.
"""

from __future__ import annotations

import argparse
import collections
import functools
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import workloads  # noqa: E402

TOTALS: dict[tuple[str, str], float] = collections.defaultdict(float)
COUNTS: dict[tuple[str, str], int] = collections.defaultdict(int)


def _wrap(owner: Any, attr: str, label: str) -> None:
    fn = getattr(owner, attr, None)
    if fn is None:  # stepdump's internals move; time what is there
        return

    @functools.wraps(fn)
    def timed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            key = (threading.current_thread().name, label)
            TOTALS[key] += time.perf_counter() - t
            COUNTS[key] += 1

    setattr(owner, attr, timed)


def instrument() -> None:
    from stepdump.capture import recorder, staging, writer
    from stepdump.store import catalog, codecs, storage

    R, W = recorder.Recorder, writer.Writer
    for name in ("capture", "_begin_iteration", "_stage", "_full_state", "_put"):
        _wrap(R, name, f"Recorder.{name}")
    _wrap(staging.StagingPool, "acquire", "StagingPool.acquire (wait for a free slot)")
    _wrap(staging.Stager, "stage", "Stager.stage (copy_ into staging)")
    _wrap(W, "_write", "Writer._write (one step)")
    _wrap(W, "_item_row", "Writer._item_row (per tensor)")
    _wrap(W, "_append_blob", "Writer._append_blob")
    _wrap(W, "_flush_buffer", "Writer._flush_buffer")
    for name in ("raw_bytes", "fingerprint_bytes", "compute_stats"):
        _wrap(writer, name, name)
    for cls in (codecs.RawCodec, codecs.ZstdCodec, codecs.BloscCodec):
        _wrap(cls, "encode", f"{cls.__name__}.encode")
    _wrap(storage.LocalStorage, "append", "LocalStorage.append (write)")
    _wrap(storage.LocalStorage, "sync", "LocalStorage.sync")
    for name in ("add_tensors", "add_step", "add_blob", "add_blobs", "add_scalars", "commit", "series_id"):
        _wrap(catalog.CatalogWriter, name, f"CatalogWriter.{name}")


def stats_kernels(w: workloads.Workload) -> dict[str, float]:
    """Seconds per full set of the workload's tensors for compute_stats and cheaper equivalents."""
    from stepdump.core.hashing import fingerprint_bytes, raw_bytes
    from stepdump.core.stats import compute_stats

    ts = [t.detach().clone() for _, t in w.tensors()]
    cands = {
        "compute_stats (as shipped)": lambda x: compute_stats(x),
        "  aminmax": lambda x: torch.aminmax(x.reshape(-1)) if x.numel() else None,
        "  sum": lambda x: float(x.sum()),
        "  dot(x, x)": lambda x: float(torch.dot(x.reshape(-1), x.reshape(-1))) if x.is_floating_point() else None,
        "  count_nonzero": lambda x: int(torch.count_nonzero(x)),
        "  (for reference) std_mean(correction=0)": lambda x: torch.std_mean(x, correction=0),
        "xxh3 fingerprint (fingerprint_bytes(raw_bytes(x)))": lambda x: fingerprint_bytes(raw_bytes(x)),
        "clone (a copy of every tensor)": lambda x: x.clone(),
    }
    out = {}
    for label, f in cands.items():
        for x in ts[:2]:
            f(x)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for x in ts:
                f(x)
            best = min(best, time.perf_counter() - t)
        out[label] = best
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="A")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--mode", choices=("full", "tiered", "stats"), default="full")
    ap.add_argument("--codec", default="raw")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kernels", action="store_true", help="also time the stats kernels alone")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import stepdump

    make = workloads.WORKLOADS[a.workload]
    w = make()
    for _ in range(2):
        w.step(None)
    t = time.perf_counter()
    for _ in range(a.steps):
        w.step(None)
    base = (time.perf_counter() - t) / a.steps * 1e3

    instrument()
    kwargs = {"full": {"every": 1}, "tiered": {"every": 100}, "stats": {"every": None}}[a.mode]
    out = HERE / "_work" / "profile"
    shutil.rmtree(out, ignore_errors=True)
    w = make()
    for _ in range(2):
        w.step(None)
    rec = stepdump.Recorder(out, w.model, w.optimizer, stats_every=1, codec=a.codec, **kwargs)
    TOTALS.clear()
    COUNTS.clear()
    t = time.perf_counter()
    step_times = []
    for _ in range(a.steps):
        ts = time.perf_counter()
        w.step(None)
        step_times.append(time.perf_counter() - ts)
    t_loop = time.perf_counter() - t
    rec.close()
    wall = time.perf_counter() - t
    shutil.rmtree(out, ignore_errors=True)

    n = a.steps
    print(f"workload {a.workload}, mode {a.mode}, codec {a.codec}, {n} steps, {a.threads} torch thread(s)")
    print(f"  no recording:                 {base:8.1f} ms/step")
    print(f"  recording, loop only:         {t_loop / n * 1e3:8.1f} ms/step")
    print(f"  recording, incl. close():     {wall / n * 1e3:8.1f} ms/step")
    print(f"  close() alone:                {(wall - t_loop) * 1e3:8.1f} ms")
    for thread in sorted({k[0] for k in TOTALS}):
        print(f"  -- thread {thread}: ms per recorded step (calls per step)")
        rows = sorted(((lbl, v) for (th, lbl), v in TOTALS.items() if th == thread), key=lambda r: -r[1])
        for lbl, v in rows:
            print(f"     {v / n * 1e3:9.2f}  {lbl} ({COUNTS[(thread, lbl)] / n:.0f})")
    if a.kernels:
        print("  -- kernels alone, single thread of work, ms per full set of the workload's tensors")
        for lbl, v in stats_kernels(w).items():
            print(f"     {v * 1e3:9.2f}  {lbl}")


if __name__ == "__main__":
    main()
