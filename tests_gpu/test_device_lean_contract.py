"""The device-side lean path's contract (docs/cuda.md), on a real GPU: the device fingerprint
(``stepdump.core.device_lean``), fingerprint kinds and the comparisons between them
(``same_fingerprint``, ``Recorder(fingerprint=)``, ``RunReader.fingerprint_kinds``), and what a
recorded stats step costs the host and the training stream (bytes copied, no sync, the writer's
wait, the overhead on GPT-2 small). They were written against the designed interface before the
path existed, which is why some names are imported inside the tests; the module collects on CPU
(``tests/test_gpu_suite.py`` checks that). ``tests_gpu/test_cuda_paths.py`` holds the pinned
staging, side-stream and fidelity checks.
"""

from __future__ import annotations

import importlib
import json
import statistics
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from cuda_workloads import DEV, gpt2_step_times
from dmix_reference import CHANGES, COMPARE_ROWS, changed_pair, reference_dmix64, sprinkle_nonfinite
from helpers import assert_same
from torch import nn

import stepdump
from stepdump.core.hashing import fingerprint, raw_bytes
from stepdump.core.stats import STATS_LEN, device_stats

def _same_or_both_nan(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bitwise equal, except that a missing value (NaN) may be any NaN."""
    if bool(torch.isnan(b)):
        assert bool(torch.isnan(a)), f"{what}: {float(a)} is not NaN"
    else:
        assert_same(a, b, what)


def _lean() -> ModuleType:
    return importlib.import_module("stepdump.core.device_lean")


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-100, 100, shape, generator=g).to(dtype)
    return (torch.randn(shape, generator=g) * 5).to(dtype)


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]
SHAPES = [(0,), (1,), (3,), (7,), (8,), (9,), (33, 17), (4, 256, 3)]  # byte lengths on and off a word


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_device_fingerprint_is_dmix64_of_the_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """On the GPU and on the CPU, equal to the integer definition of the recorded bytes."""
    lean = _lean()
    t = _tensor(dtype, shape)
    want = reference_dmix64(bytes(raw_bytes(t)))
    on_gpu = lean.device_fingerprint(t.to(DEV))
    assert on_gpu.device.type == "cuda" and on_gpu.dtype == torch.int64 and on_gpu.dim() == 0
    assert int(on_gpu) == want
    assert int(lean.device_fingerprint(t)) == want  # the reader computes it from a stored blob


@pytest.mark.parametrize("layout", ["transposed", "sliced", "expanded"])
def test_device_fingerprint_of_a_view_is_that_of_its_contiguous_bytes(layout: str) -> None:
    lean = _lean()
    base = _tensor(torch.float32, (64, 48)).to(DEV)
    view = {"transposed": base.T, "sliced": base[3:50:2, 5:], "expanded": base[:1].expand(5, 48)}[layout]
    assert int(lean.device_fingerprint(view)) == reference_dmix64(bytes(raw_bytes(view.cpu())))


@pytest.mark.parametrize("change", CHANGES)
def test_device_fingerprint_sees_every_change(change: str) -> None:
    """Every change of the bytes or their length changes the fingerprint (each row once, bitwise)."""
    lean = _lean()
    a, b = changed_pair(bytes(raw_bytes(_tensor(torch.float32, (1001,)))), change)
    assert a != b  # the control: the change is one
    fa, fb = (int(lean.device_fingerprint(torch.frombuffer(bytearray(x), dtype=torch.uint8).to(DEV)))
              for x in (a, b))
    assert fa == reference_dmix64(bytes(a)) and fb == reference_dmix64(bytes(b))
    assert fa != fb


MIXES = {
    "fp32 params": [torch.float32] * 6,
    "bf16 + fp32 master": [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32],
    "fp16 grads + int step": [torch.float16, torch.float16, torch.int64, torch.float32],
    "one tensor": [torch.float32],
}


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("nonfinite", [False, True])
def test_fused_stats_agree_with_device_stats(mix: str, nonfinite: bool) -> None:
    """Row i of fused_stats is device_stats(tensors[i]): counts, min, max exactly; sums to 1e-12.

    Sums (mean, std, norm) are the one place an order of reduction shows: the fused pass may
    add in another order than the per-tensor one, so they are held to 1e-12 relative (health
    indicators, not identity: identity is the fingerprint's, which is exact).
    """
    lean = _lean()
    ts = [_tensor(d, (1 + 977 * i, 3), seed=i).to(DEV) for i, d in enumerate(MIXES[mix])]
    ts.append(torch.empty(0, device=DEV))  # an empty tensor: NaN for what has no value
    if nonfinite:
        sprinkle_nonfinite(ts)
    got = lean.fused_stats(ts)
    assert got.shape == (len(ts), STATS_LEN) and got.dtype == torch.float64 and got.device.type == "cuda"
    for i, t in enumerate(ts):
        want = device_stats(t)
        for col in (0, 1, 2, 3, 4, 5, 9):  # numel, nan, +inf, -inf, min, max, zero fraction: exact
            _same_or_both_nan(got[i, col], want[col], f"{mix} tensor {i} column {col}")
        for col in (6, 7, 8):
            w, g = float(want[col]), float(got[i, col])
            assert (w != w and g != g) or abs(g - w) <= 1e-12 * max(1.0, abs(w)), (mix, i, col, g, w)


def test_lean_pack_is_stats_bits_then_fingerprint() -> None:
    lean = _lean()
    ts = [_tensor(d, (500 + i,), seed=i).to(DEV) for i, d in enumerate((torch.float32, torch.bfloat16, torch.int64))]
    pack = lean.lean_pack(ts)
    assert pack.shape == (len(ts), STATS_LEN + 1) and pack.dtype == torch.int64 and pack.device.type == "cuda"
    assert_same(pack[:, :STATS_LEN].view(torch.float64), lean.fused_stats(ts), "stats columns")
    for i, t in enumerate(ts):
        assert int(pack[i, STATS_LEN]) == int(lean.device_fingerprint(t)), i


# -- comparisons across fingerprint kinds: equal only when same kind and same value --------------


@pytest.mark.parametrize(("ka", "fa", "kb", "fb", "want"), COMPARE_ROWS)
def test_same_fingerprint_rules(ka: str, fa: int, kb: str, fb: int, want: bool | None) -> None:
    from stepdump.core.hashing import same_fingerprint

    assert same_fingerprint(ka, fa, kb, fb) is want


# -- what a recorded stats step costs the host and the training stream -------------------------
def _mlp(width: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.LayerNorm(width)).to(DEV)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), torch.randn(32, width, device=DEV)


def _train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, n: int) -> None:
    for _ in range(n):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _dtoh_bytes(root: Path, width: int, steps: int) -> tuple[int, int]:
    """(D2H bytes, D2H copies) of ``steps`` lean steps, from the profiler's trace."""
    model, opt, x = _mlp(width)
    with stepdump.Recorder(root / f"w{width}", model, opt, every=None, stats_every=1, on_error="raise"):
        _train(model, opt, x, 2)  # first steps: buffers, optimizer state
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            _train(model, opt, x, steps)
            torch.cuda.synchronize()  # every copy enqueued by these steps has run
    trace = root / f"trace{width}.json"
    prof.export_chrome_trace(str(trace))
    events: list[dict[str, Any]] = json.loads(trace.read_text())["traceEvents"]
    dtoh = [e for e in events if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")]
    return sum(int(e.get("args", {}).get("bytes", 0)) for e in dtoh), len(dtoh)


def test_stats_step_copies_a_few_numbers_whatever_the_model_size(tmp_path: Path) -> None:
    """A lean step moves n_tensors x (STATS_LEN + 1) x 8 bytes to the host in one copy: the same
    bytes for a model 64x bigger with the same tensors (today: the whole record, every step)."""
    steps = 5
    small, n_small = _dtoh_bytes(tmp_path, 64, steps)
    big, n_big = _dtoh_bytes(tmp_path, 512, steps)
    model, opt, _ = _mlp(64)
    n_tensors = 5 * len(list(model.parameters()))  # params, grads, exp_avg, exp_avg_sq, step (a CUDA tensor when fused)
    assert small > 0, "the control: the profiler saw the step's copy"
    assert big == small, f"D2H bytes per {steps} lean steps: {big} at width 512 vs {small} at width 64"
    assert small <= steps * (n_tensors + 1) * (STATS_LEN + 1) * 8, small  # (+1: the step counter)
    assert n_small <= steps, f"{n_small} D2H copies for {steps} steps: one per step"


def test_lean_steps_never_sync_the_training_thread(tmp_path: Path) -> None:
    """Under sync debug mode "error", lean steps run: no .item(), no pageable copy, no stream sync;
    the worker waits on an event (cudaEventSynchronize, which the mode does not flag)."""
    plain = _mlp(128)
    model, opt, x = _mlp(128)
    _train(*plain, 2)
    with stepdump.Recorder(tmp_path / "run", model, opt, every=None, stats_every=1, on_error="raise"):
        _train(model, opt, x, 2)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with pytest.raises(RuntimeError):  # the controls: the mode is on,
                torch.ones(1, device=DEV).item()
            ev = torch.cuda.Event()
            ev.record()
            ev.synchronize()  # what the worker waits with is allowed,
            _train(*plain, 2)  # and the training loop itself does not sync
            _train(model, opt, x, 5)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    with stepdump.open(tmp_path / "run") as run:
        # updates 0..6 (the last five under the mode), then the final record that close() writes
        assert run.stats_steps == list(range(8)) and run.meta.get("final_step") == 7, run.stats_steps
        assert "recording_stopped" not in run.meta


def test_the_writer_sleeps_while_the_gpu_is_behind(tmp_path: Path) -> None:
    """On a GPU-bound step the host runs ahead and the writer waits for each step's event: that
    wait sleeps (a blocking event), it does not spin a core for the whole step. A default event's
    wait spun: the writer's CPU (``sys/recorder_bg_ms``) was 96% of the step on GPT-2 small,
    counted as the recorder's cost. And the training thread's wait for a staging slot while the
    writer waits for the GPU is the GPU's, not the recorder's: counted as the recorder's, this
    31 ms step reported 28 ms of ``sys/recorder_ms``. The control: the steps are GPU-bound (the
    training thread's own CPU is a small part of their wall time), so the writer did wait."""
    torch.manual_seed(0)
    width = 4096
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(4))).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(4096, width, device=DEV)
    with stepdump.Recorder(tmp_path / "run", model, opt, every=None, stats_every=1, on_error="raise"):
        _train(model, opt, x, 3)
        torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.thread_time()
        _train(model, opt, x, 12)
        torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    assert cpu < 0.5 * wall, f"the control: the steps are GPU-bound (training thread CPU {cpu:.3f} s of {wall:.3f} s)"
    with stepdump.open(tmp_path / "run") as run:
        prof = run.profile().iloc[3:15]
    bg, it = float(prof["sys/recorder_bg_ms"].median()), float(prof["sys/recorder_ms"].median())
    step = float(prof["sys/iter_ms"].median())
    on_gpu = float(prof["sys/recorder_gpu_wait_ms"].median())
    print(f"step {step:.2f} ms, sys/recorder_bg_ms {bg:.2f}, sys/recorder_ms {it:.2f}, "
          f"hooks {float(prof['sys/recorder_hooks_ms'].median()):.2f}, wait {float(prof['sys/recorder_wait_ms'].median()):.2f}, "
          f"gpu wait {on_gpu:.2f}")
    assert bg < 0.25 * step, f"the writer's CPU {bg:.2f} ms of a {step:.2f} ms step: its wait for the GPU spins"
    # The host ran ahead until every staging slot was in the writer's hands, waiting for the GPU:
    # the hooks' wait for a slot is the GPU's (sys/recorder_gpu_wait_ms), not the recorder's.
    assert on_gpu > 0.5 * step, f"the hooks waited {on_gpu:.2f} ms of a {step:.2f} ms step for the GPU"
    assert it < 0.25 * step, f"sys/recorder_ms {it:.2f} of a {step:.2f} ms GPU-bound step"


# -- rows carry their kind; readers never call two kinds equal ---------------------------------
def _record(root: Path, option: str, every: int | None) -> Path:
    model, opt, x = _mlp(96)
    with stepdump.Recorder(root, model, opt, every=every, stats_every=1, fingerprint=option, on_error="raise"):
        _train(model, opt, x, 4)
    return root


@pytest.mark.parametrize(("option", "kind"), [("auto", "dmix64"), ("dmix64", "dmix64"), ("xxh3", "xxh3")])
@pytest.mark.parametrize("every", [None, 2])
def test_rows_carry_their_fingerprint_kind(tmp_path: Path, option: str, kind: str, every: int | None) -> None:
    """Every row of a CUDA run says its kind; a stored blob's bytes give the row's fingerprint
    again under that kind; verify passes."""
    lean = _lean()
    path = _record(tmp_path / "run", option, every)
    with stepdump.open(path) as run:
        for step in run.stats_steps:
            kinds = run.fingerprint_kinds(step)
            assert kinds and set(kinds.values()) == {kind}, (step, kinds)
        for step in run.steps:
            fps = run.fingerprints(step, ["params", "grads"])
            for (k, name), fp in fps.items():
                t = run.tensors(step, k)[name]
                again = int(lean.device_fingerprint(t)) if kind == "dmix64" else fingerprint(t)
                assert again == fp, (step, k, name)
        assert stepdump.verify(run).ok


@pytest.mark.parametrize("every", [None, 2])
def test_diff_across_kinds_is_never_identical(tmp_path: Path, every: int | None) -> None:
    """The same training recorded twice, host and device fingerprints: stats-only steps are not
    comparable (never "identical"); where both stored bytes, the bytes decide. A twin of the same
    kind is identical (the control)."""
    a = _record(tmp_path / "a", "xxh3", every)
    b = _record(tmp_path / "b", "dmix64", every)
    twin = _record(tmp_path / "twin", "dmix64", every)
    with stepdump.open(a) as ra, stepdump.open(b) as rb, stepdump.open(twin) as rt:
        assert stepdump.diff(rb, rt).identical  # the control
        res = stepdump.diff(ra, rb)
        assert not res.identical
        # Bytes where either run stored them (every=2: steps 0 and 2; both: the final record that
        # close() writes in full): equal there; the stats-only steps named as not compared.
        assert res.first_step is None and not res.complete, res.summary()
        assert "fingerprint kind" in res.summary(), res.summary()
        if every is None:  # grads are never in the final record: nothing of them is comparable
            grads = stepdump.diff(ra, rb, kinds=("grads",))
            assert not grads.comparable and not grads.identical, grads.summary()


# -- the target ------------------------------------------------------------------------------
def test_lean_overhead_on_gpt2_small(tmp_path: Path) -> None:
    """Lean recording (stats + fingerprints every step) ≤ 1.02x an unrecorded GPT-2-small step,
    medians of 6 interleaved rounds in one process (arm order rotated); the floor (one fused read)
    and sys/recorder_ms printed beside."""
    times = gpt2_step_times(tmp_path)
    plain, lean, floor = (statistics.median(times[k]) for k in ("plain", "lean", "floor"))
    own = statistics.median(times["recorder_ms"])
    msg = (f"plain {plain:.2f} ms, lean {lean:.2f} ms ({lean / plain:.3f}x), floor {floor:.2f} ms ({floor / plain:.3f}x), "
           f"sys/recorder_ms {own:.2f} (host time in the hooks)")
    print(msg)
    assert lean / plain <= 1.02, msg
