"""The lean path's fused kernel on a GPT-2-small-sized step (docs/cuda.md, "The fused kernel").

Run on a machine with CUDA and Triton (not part of ``make bench``: this machine has no GPU)::

    .venv/bin/python benchmarks/device_lean_bench.py            # ~30 s on an H100

It builds what a lean step of GPT-2 small (124M parameters) with AdamW reads: the 148
parameter tensors and, of the same shapes, their grads, exp_avg and exp_avg_sq (592 fp32
tensors, ~2 GB), and times, CUDA-event timed, medians of ``--reps`` calls after warm-up:

* ``fused_pack`` (stepdump.core.device_lean_triton): stats + dmix64 of every tensor;
* ``reference_pack`` (stepdump.core.device_lean): the same by plain torch ops, tensor by tensor;
* ``torch._foreach_norm``: one fused read of the same bytes, the floor;

with the bandwidth each reaches (recorded bytes / time), the host time of one call (what the
training thread spends launching: fused_pack's steady call has no per-tile Python), and two
checks printed with the numbers: the fused rows equal the reference (counts, min, max, zero
fraction, fingerprint bitwise; sums within 1e-12 relative) and two fused calls give the same
bits. Exit status 1 when a check fails. ``--scale 0.001`` shrinks every tensor (a dry run; on a
CPU with ``TRITON_INTERPRET=1`` it runs the kernels in Triton's interpreter, wall-clock timed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from stepdump.core import device_lean_triton as dlt  # noqa: E402
from stepdump.core.device_lean import reference_pack  # noqa: E402
from stepdump.core.stats import STATS_LEN  # noqa: E402

EXACT = (0, 1, 2, 3, 4, 5, 9, STATS_LEN)  # counts, min, max, zero fraction, fingerprint


def gpt2_small_shapes(vocab: int = 50257, ctx: int = 1024, d: int = 768, layers: int = 12) -> list[tuple[int, ...]]:
    """GPT-2 small's 148 parameter shapes (the LM head tied to the token embedding)."""
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return [(vocab, d), (ctx, d), *[s for _ in range(layers) for s in block], (d,), (d,)]


def build(device: torch.device, scale: float) -> list[torch.Tensor]:
    """params, grads, exp_avg, exp_avg_sq: fp32, of GPT-2 small's shapes (sizes times ``scale``)."""
    g = torch.Generator(device=device).manual_seed(0)
    out: list[torch.Tensor] = []
    for role in ("param", "grad", "exp_avg", "exp_avg_sq"):
        for shape in gpt2_small_shapes():
            n = max(1, int(torch.Size(shape).numel() * scale))
            t = torch.randn(n, generator=g, device=device) * (0.02 if role != "exp_avg_sq" else 1e-4)
            out.append(t.abs_() if role == "exp_avg_sq" else t)
    return out


def timed(fn: Callable[[], object], reps: int, device: torch.device) -> tuple[float, float]:
    """(median device ms, median host ms of the call itself) over ``reps`` calls, after one warm-up."""
    fn()
    dev_ms: list[float] = []
    host_ms: list[float] = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn()
            host_ms.append((time.perf_counter() - t0) * 1e3)
            end.record()
            end.synchronize()
            dev_ms.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            host_ms.append((time.perf_counter() - t0) * 1e3)
            dev_ms.append(host_ms[-1])
    return statistics.median(dev_ms), statistics.median(host_ms)


def check(fused: torch.Tensor, ref: torch.Tensor) -> list[str]:
    """What differs between the fused rows and the reference's (empty: they agree)."""
    bad: list[str] = []
    f, r = fused.cpu(), ref.cpu()
    for col in EXACT:
        fc, rc = f[:, col], r[:, col]
        if col < STATS_LEN:  # any NaN stands for "no value"
            both_nan = torch.isnan(fc.view(torch.float64)) & torch.isnan(rc.view(torch.float64))
            diff = (fc != rc) & ~both_nan
        else:
            diff = fc != rc
        if bool(diff.any()):
            bad.append(f"column {col}: {int(diff.sum())} rows differ")
    for col in (6, 7, 8):
        fv, rv = f[:, col].view(torch.float64), r[:, col].view(torch.float64)
        err = ((fv - rv).abs() / rv.abs().clamp(min=1.0)).nan_to_num(0.0)
        if float(err.max()) > 1e-12:
            bad.append(f"column {col}: relative error {float(err.max()):.3g}")
    return bad


# (block, warps, chunk): the kernel's tunables; the first is the module's default.
SWEEP: tuple[tuple[int, int, int], ...] = (
    (dlt._BLOCK, dlt._NUM_WARPS, dlt._CHUNK),
    (512, 8, 65536), (512, 4, 65536), (1024, 4, 65536), (1024, 8, 65536), (2048, 8, 65536),
    (2048, 16, 65536), (4096, 16, 65536), (1024, 8, 131072), (2048, 8, 131072), (1024, 8, 32768),
)


def sweep(ts: list[torch.Tensor], nbytes: int, device: torch.device, reps: int) -> int:
    """Each SWEEP configuration: device ms, GB/s, and whether its rows agree with the reference."""
    ref = reference_pack(ts)
    floor, _ = timed(lambda: torch._foreach_norm(ts), reps, device)
    allow_cpu = device.type == "cpu"
    saved = (dlt._BLOCK, dlt._NUM_WARPS, dlt._CHUNK)
    print(f"floor (_foreach_norm) {floor:.3f} ms")
    print(f"{'block':>6s} {'warps':>5s} {'chunk':>7s} {'device ms':>10s} {'GB/s':>7s} {'x floor':>7s}  check")
    bad = 0
    try:
        for cfg in dict.fromkeys(SWEEP):
            dlt._BLOCK, dlt._NUM_WARPS, dlt._CHUNK = cfg
            dlt._structures.clear()
            try:
                got = dlt.fused_pack(ts, _allow_cpu=allow_cpu)
                assert got is not None
                problems = check(got, ref)
                ms, _ = timed(lambda: dlt.fused_pack(ts, _allow_cpu=allow_cpu), reps, device)
            except Exception as e:  # a configuration that does not compile or run: said, the sweep goes on
                print(f"{cfg}: {type(e).__name__}: {str(e)[:200]}")
                bad += 1
                continue
            bad += bool(problems)
            print(f"{cfg[0]:6d} {cfg[1]:5d} {cfg[2]:7d} {ms:10.3f} {nbytes / ms / 1e6:7.0f} "
                  f"{ms / floor:7.2f}  {'ok' if not problems else 'FAIL: ' + '; '.join(problems)}")
    finally:
        dlt._BLOCK, dlt._NUM_WARPS, dlt._CHUNK = saved
        dlt._structures.clear()
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20, help="timed calls of fused_pack and _foreach_norm (median)")
    ap.add_argument("--ref-reps", type=int, default=3, help="timed calls of the torch-ops reference (slow)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every tensor's size (a dry run: 0.001)")
    ap.add_argument("--sweep", action="store_true", help="time the kernel's tunables (block, warps, chunk) "
                    "instead, each checked against the reference")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    allow_cpu = device.type == "cpu"  # only meaningful under TRITON_INTERPRET=1
    ts = build(device, args.scale)
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"torch {torch.__version__}, triton {getattr(dlt.triton, '__version__', None)}, {name}")
    print(f"{len(ts)} fp32 tensors (GPT-2 small x{args.scale:g}: params, grads, exp_avg, exp_avg_sq), "
          f"{nbytes / 1e9:.3f} GB")
    if args.sweep:
        return sweep(ts, nbytes, device, args.reps)
    first = dlt.fused_pack(ts, _allow_cpu=allow_cpu)
    if first is None:
        print("fused_pack refused the list (Triton not importable, or no CUDA): nothing to measure")
        return 1
    failures = check(first, reference_pack(ts))
    again = dlt.fused_pack(ts, _allow_cpu=allow_cpu)
    if again is None or not torch.equal(again, first):
        failures.append("two fused calls gave different bits")
    rows = [
        ("fused_pack (stats + dmix64)", *timed(lambda: dlt.fused_pack(ts, _allow_cpu=allow_cpu), args.reps, device)),
        ("reference_pack (torch ops)", *timed(lambda: reference_pack(ts), args.ref_reps, device)),
        ("torch._foreach_norm (floor)", *timed(lambda: torch._foreach_norm(ts), args.reps, device)),
    ]
    floor = rows[2][1]
    print(f"{'':30s} {'device ms':>10s} {'GB/s':>8s} {'x floor':>8s} {'host ms':>8s}")
    for label, dev_ms, host_ms in rows:
        print(f"{label:30s} {dev_ms:10.3f} {nbytes / dev_ms / 1e6:8.0f} {dev_ms / floor:8.2f} {host_ms:8.3f}")
    print("fused vs reference, twice the same bits:", "ok" if not failures else "FAIL: " + "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
