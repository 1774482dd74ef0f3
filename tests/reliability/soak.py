"""`make soak`: the long reliability runs that `make test` only samples.

1. Crash soak: SIGKILL a recording training process at random moments, at
   least 50 times (default 6 chains x 9 kills, each chain one run directory that
   every kill leaves behind and the next process resumes); after every kill the
   store must open, verify, read back bit-exact and resume (tests/reliability/crash.py).
2. Load soak: 10,000 steps of a tiny model, stats-only (with and without a
   reader querying the growing run from the same process) and stored in full:
   resident memory must stay flat (growth < 50 MB) and catalog queries fast
   (each < 1 s); then half as many lean steps capturing activations: peak memory
   must stay flat (growth < 40 MB).
3. Loss soak: SIGKILL a fresh run recording in full, lean and gradient-log mode
   with ``flush`` and ``fsync`` (default 5 kills each); what each kill lost must be
   within docs/reliability.md's promise (tests/reliability/losses.py).

    .venv/bin/python tests/reliability/soak.py [--kills 54] [--load-steps 10000] [--loss-kills 5] [--seed 1] [--keep]

Exits non-zero on the first failed check, printing what failed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reliability import losses  # noqa: E402
from reliability.crash import run_chain  # noqa: E402
from reliability.load import activation_load, check_complete, run_load  # noqa: E402
from reliability.procs import Zygote  # noqa: E402

RSS_LIMIT_MB = 50.0
QUERY_LIMIT_S = 1.0


def crash_soak(work: Path, kills: int, seed: int, per_chain: int = 9) -> None:
    chains = -(-kills // per_chain)
    phases: Counter = Counter()
    total_steps = lost = done = 0
    started = time.monotonic()
    with Zygote() as z:
        for c in range(chains):
            n = min(per_chain, kills - done)
            r = run_chain(z, work / f"chain{c:02d}", trials=n, seed=seed * 1000 + c, max_delay=0.6)
            phases.update(r.phases)
            total_steps += r.steps
            lost += r.lost_scalars
            done += r.trials
            print(f"  chain {c}: {r.trials} kills, {r.steps} steps verified bit-exact, {r.seconds:.1f} s", flush=True)
    print(f"crash soak: {done} SIGKILLs in {time.monotonic() - started:.0f} s, every check passed; "
          f"{total_steps} steps in {chains} runs read back bit-exact after resuming")
    print("  where the kills landed: " + ", ".join(f"{k}: {v}" for k, v in phases.most_common()))
    print(f"  losses missing from the final runs: {lost} (each of a step that was the last visible at a kill: "
          "a step's scalars commit with the next step)")


def load_soak(work: Path, steps: int) -> None:
    for every, live in ((None, False), (None, True), (1, True)):
        r = run_load(work / f"load-{every}", steps, every=every, checkpoints=10, live_reader=live)
        print(f"load soak: {r.summary()}", flush=True)
        check_complete(work / f"load-{every}", steps, every)  # every step readable, as the unit test asks
        print("  RSS (step, MB): " + ", ".join(f"({s}, {m:.0f})" for s, m in r.rss))
        if r.rss_growth_mb >= RSS_LIMIT_MB:
            raise SystemExit(f"FAIL: RSS grew by {r.rss_growth_mb:.1f} MB over {steps} steps (limit {RSS_LIMIT_MB})")
        for q in r.queries[0]:
            if q != "step" and r.worst(q) >= QUERY_LIMIT_S:
                raise SystemExit(f"FAIL: {q} took {r.worst(q):.2f} s (limit {QUERY_LIMIT_S} s)")
        shutil.rmtree(work / f"load-{every}", ignore_errors=True)
    rss = activation_load(work / "load-activations", steps // 2)  # tests/test_activations.py: 500 steps
    growth = list(rss.values())[-1] - list(rss.values())[0]  # halfway (caches warm), at its end
    print(f"activation soak: {steps // 2} lean steps with activations, peak memory {growth:+.1f} MB", flush=True)
    if growth >= 40:
        raise SystemExit(f"FAIL: peak memory grew by {growth:.1f} MB over {steps // 2} steps with activations (limit 40)")
    shutil.rmtree(work / "load-activations", ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=54, help="SIGKILLs in the crash soak (default 54)")
    ap.add_argument("--load-steps", type=int, default=10_000, help="steps in each load soak (default 10000)")
    ap.add_argument("--loss-kills", type=int, default=5,
                    help="SIGKILLs per mode and durability in the loss soak (default 5)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="stepdump-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"scratch: {work}")
    try:
        if args.kills:
            crash_soak(work / "crash", args.kills, args.seed)
        if args.loss_kills:
            with Zygote() as z:
                kills = losses.soak(z, work / "losses", args.loss_kills, args.seed)
            print(f"loss soak: {losses.summary(kills)}", flush=True)
        if args.load_steps:
            load_soak(work, args.load_steps)
    except AssertionError as e:
        print(f"FAIL: {e}\n(scratch kept: {work})")
        raise SystemExit(1) from None
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print("soak: all checks passed")


if __name__ == "__main__":
    main()
