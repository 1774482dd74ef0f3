"""Issue 40: what each part of a recorded small step costs, on the training thread and on the others.

    .venv/bin/python benchmarks/lean_parts.py                          # rl and tiny-forward, idle and busy
    .venv/bin/python benchmarks/lean_parts.py --workloads rl --loads idle --rounds 9

For each workload (benchmarks/workloads_tiny.py) and load (idle; busy: every other core spinning,
benchmarks/neighbour.py), interleaved rounds of segments, one of each arm per round:

* **none**: no recording;
* **lean** (``every=None, stats_every=1``) and **gradient log** (``gradient_log=32``), as
  benchmarks/leave_on_tiny.py times them;
* the same two with **the writer's work dropped** (``Writer._write`` and ``_commit_held`` made
  no-ops in this process: the messages are taken and discarded, nothing is described, encoded or
  committed): what is left is the training thread's own part (hooks, copies, hashing, hand-off)
  and the stats worker's, so the difference to the full arm is what the writer's thread costs.

Per arm, medians of the per-round differences to *none*, per step: wall ms, CPU ms of the training
thread (``time.thread_time``) and of every thread of the process (``time.process_time``). Not in
``make bench`` (a diagnosis, not a target); its numbers are quoted in docs/performance.md.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from neighbour import busy, default_neighbours  # noqa: E402
from workloads import Workload  # noqa: E402
from workloads_tiny import TINY, segment_steps  # noqa: E402

LEAN: dict[str, Any] = {"every": None, "stats_every": 1}
GRADLOG: dict[str, Any] = {"gradient_log": 32}
ARMS: dict[str, tuple[dict[str, Any] | None, bool]] = {  # name -> (Recorder kwargs, writer's work dropped)
    "none": (None, False),
    "lean": (LEAN, False),
    "lean, writer's work dropped": (LEAN, True),
    "gradient log": (GRADLOG, False),
    "gradient log, writer's work dropped": (GRADLOG, True),
}


class DroppedWriter:
    """While ``on``, the writer thread takes its mail and drops it (no rows described, nothing written)."""

    def __init__(self) -> None:
        from stepdump.capture import writer

        self.on = False
        cls = writer.Writer
        write, commit = cls._write, cls._commit_held

        def _write(w: Any, msg: Any) -> None:
            if not self.on:
                write(w, msg)

        def _commit_held(w: Any) -> None:
            if not self.on:
                commit(w)

        cls._write, cls._commit_held = _write, _commit_held  # type: ignore[method-assign]


def segment(w: Workload, arm: str, out: Path, steps: int, dropped: DroppedWriter) -> dict[str, float]:
    kwargs, drop = ARMS[arm]
    shutil.rmtree(out, ignore_errors=True)
    gc.collect()
    rec = None
    if kwargs is not None:
        import stepdump

        rec = stepdump.Recorder(out / "run", w.model, w.optimizer, **kwargs)
    w.step(None)  # untimed: the recording's first step
    dropped.on = drop
    try:
        t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        for _ in range(steps):
            w.step(None)
        t1, c1, m1 = time.perf_counter(), time.process_time(), time.thread_time()
    finally:
        if rec is not None:
            rec.close()
        dropped.on = False
        shutil.rmtree(out, ignore_errors=True)
    return {"wall": (t1 - t0) / steps * 1e3, "cpu": (c1 - c0) / steps * 1e3, "train": (m1 - m0) / steps * 1e3}


def bench(name: str, load: str, args: argparse.Namespace, dropped: DroppedWriter) -> dict[str, Any]:
    w = TINY[name]()
    steps = segment_steps(w, 30, args.min_segment)
    arms = list(ARMS)
    got: dict[str, list[dict[str, float]]] = {a: [] for a in arms}
    with busy(args.neighbours if load == "busy" else 0) as used:
        for r in range(args.rounds):
            for a in (arms if r % 2 == 0 else arms[::-1]):
                got[a].append(segment(w, a, args.work / a.replace(" ", "_").replace(",", "").replace("'", ""),
                                      steps, dropped))
    med = statistics.median
    base = got["none"]
    out: dict[str, Any] = {"steps": steps, "share": used.share,
                           "none": {k: med([x[k] for x in base]) for k in ("wall", "cpu", "train")}, "arms": {}}
    print(f"== {name} ({load}{f', neighbours got {used.share:.0%} of a core' if load == 'busy' else ''}), "
          f"{steps} steps a segment, {args.rounds} rounds; none: {out['none']['wall']:.2f} ms wall, "
          f"{out['none']['train']:.2f} ms training-thread CPU", flush=True)
    for a in arms[1:]:
        d = {k: med([x[k] - y[k] for x, y in zip(got[a], base, strict=True)]) for k in ("wall", "cpu", "train")}
        ratio = {k: med([x[k] / y[k] for x, y in zip(got[a], base, strict=True)]) for k in ("wall", "cpu")}
        out["arms"][a] = {"added": d, "ratio": ratio}
        print(f"  {a:38s} wall {ratio['wall']:.3f}x ({d['wall']:+.3f} ms)  CPU of all threads {ratio['cpu']:.3f}x "
              f"({d['cpu']:+.3f} ms)  of it the training thread {d['train']:+.3f} ms, the others "
              f"{d['cpu'] - d['train']:+.3f} ms", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="rl,tiny-forward")
    ap.add_argument("--loads", default="idle,busy")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--min-segment", type=float, default=0.7, help="seconds a segment lasts at least")
    ap.add_argument("--neighbours", type=int, default=default_neighbours())
    ap.add_argument("--work", type=Path, default=HERE / "_work" / "lean_parts")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dropped = DroppedWriter()
    for name in args.workloads.split(","):
        for load in args.loads.split(","):
            bench(name, load, args, dropped)
    shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
