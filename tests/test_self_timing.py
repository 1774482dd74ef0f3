"""sys/recorder_ms and sys/recorder_bg_ms say what recording costs (issues 25.2, 40).

``sys/recorder_ms`` is what the recorder costs the training thread in an iteration: the wall
time of its hooks there, the optimizer's pre- and post-hooks *and* the model's forward hooks
(``sys/recorder_hooks_ms``), plus the larger of the waits seen outside them
(``sys/recorder_wait_ms``) and the CPU time of the recorder's own threads that the hooks did not
wait for already (the GIL their work holds, a core it takes). ``sys/recorder_bg_ms`` is the CPU
time of all the recorder's own threads in the iteration. No test here measures speed (benchmarks/leave_on_tiny.py compares the
reported figures with the measured added time): the clocks are injected, so every figure
is exact.
"""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import stepdump
from stepdump.capture import activations, iteration, profiling
from stepdump.capture import hooks as hooks_module
from stepdump.capture import recorder as recorder_module
from stepdump.capture import user_log as user_log_module
from stepdump.capture.profiling import BackgroundClock, timed

MODES = {"lean": {"every": None, "stats_every": 1}, "full": {"every": 1}, "tiered": {"every": 2, "stats_every": 1},
         "gradient log": {"gradient_log": 3}}


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def encode(self, x: torch.Tensor) -> torch.Tensor:  # another entry point: the top module's hooks never fire
        return self.b(torch.tanh(self.a(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encode(x)


class _Ticks:
    """A clock that moves one second at every reading."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def _still_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorder's threads' CPU clocks stand still: recorder_ms is the hooks' time alone (their
    CPU, which it also counts, is tested below)."""
    monkeypatch.setattr(profiling._ThreadClocks, "__call__", lambda _clocks, _thread: 0.0)


@pytest.mark.parametrize("entry", ["forward", "encode"])
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_recorder_ms_counts_the_forward_hooks(tmp_path, monkeypatch, mode, entry) -> None:
    # The recorder's own clock stands still; the forward hooks' clock moves 1 s per reading, so
    # each hook call costs exactly 1 s: recorder_ms is 1000 x (timed hook calls per iteration).
    monkeypatch.setattr(recorder_module, "time", types.SimpleNamespace(perf_counter=lambda: 0.0))
    monkeypatch.setattr(user_log_module, "time", types.SimpleNamespace(perf_counter=lambda: 0.0))
    monkeypatch.setattr(profiling, "_wall", _Ticks())
    _still_threads(monkeypatch)
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    call = model if entry == "forward" else model.encode
    forwards = 2  # gradient accumulation: two forwards per update
    with stepdump.Recorder(tmp_path / "run", model, opt, profile=True, on_error="raise", **MODES[mode]):
        for t in range(5):
            for _ in range(forwards):
                call(torch.randn(3, 4)).sum().backward()
            with torch.no_grad():  # an evaluation forward: its hooks run too
                call(torch.randn(3, 4))
            opt.step()
            opt.zero_grad()
    prof = stepdump.open(tmp_path / "run").profile().loc[0:4]  # step 5: the final record, no iteration
    hook_calls = 2 * (forwards + 1) if entry == "forward" else 0  # pre- and post-hook of each forward
    hook_calls += 2  # and the optimizer hooks' frame walk (pre and post), timed by the same clock
    assert list(prof["sys/recorder_ms"]) == [1000.0 * hook_calls] * 5
    assert (prof["sys/recorder_bg_ms"] >= 0).all() and len(prof["sys/recorder_bg_ms"]) == 5


def test_timed_hands_the_time_of_each_call_even_when_it_raises(monkeypatch) -> None:
    monkeypatch.setattr(profiling, "_wall", _Ticks())
    spent: list[float] = []

    def boom() -> None:
        raise ValueError("x")

    assert timed(lambda a, b=0: a + b, spent.append)(1, b=2) == 3
    with pytest.raises(ValueError):
        timed(boom, spent.append)()
    assert spent == [1.0, 1.0]


@pytest.mark.parametrize("case", ["steady", "a thread starts", "a thread ends", "unreadable", "none"])
def test_background_clock_counts_each_thread_from_its_last_reading(case) -> None:
    a, b = threading.Thread(), threading.Thread()
    cpu = {id(a): 1.0, id(b): 10.0}
    threads: list[threading.Thread | None] = [a]
    clock = BackgroundClock(lambda: threads, cpu=lambda th: cpu.get(id(th)))
    cpu[id(a)] = 1.5
    if case == "a thread starts":
        threads.append(b)  # counted from its own start: all its 10 s are new
        want = 0.5 + 10.0
    elif case == "a thread ends":
        cpu.pop(id(a))  # unreadable now: nothing of its last stretch is counted
        want = 0.0
    elif case == "unreadable":
        threads.append(b)
        cpu.pop(id(b))
        want = 0.5
    elif case == "none":
        threads.append(None)  # a thread not created (a writer with no appender)
        want = 0.5
    else:
        want = 0.5
    assert clock.take() == pytest.approx(want, abs=0) and clock.take() == 0.0


def _lean_profile(tmp_path, steps: int, between: Callable[[], None] = lambda: None) -> Any:
    """``Run.profile()`` of ``steps`` lean iterations of ``_Net`` (AdamW, ``profile=True``), with
    ``between()`` run after each backward, before the update (a test moves its clocks there)."""
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with stepdump.Recorder(tmp_path / "run", model, opt, profile=True, on_error="raise", every=None, stats_every=1):
        for _ in range(steps):
            model(torch.randn(3, 4)).sum().backward()
            between()
            opt.step()
            opt.zero_grad()
    return stepdump.open(tmp_path / "run").profile()


class _Clock:
    """A clock that stands still until a test moves it."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


# Recorder work on the training thread outside the pre-hook's record and the post-hook: each is
# made to take exactly 1 s of the injected clock; recorder_ms must count it in its iteration.
TRAINING_THREAD_WORK = {
    "pre-hook, before the record is taken": (iteration.Loop, "update_starting", 1),
    "log()": (user_log_module, "checked_scalar", 1),
    "log_batch()": (activations.ModuleCapture, "log_batch", 1),
    # the frame walk telling the step's own hook call from an inner super().step(): pre and post
    "the optimizer hooks' frame walk": (hooks_module, "nested_step", 2),
}


@pytest.mark.parametrize("work", list(TRAINING_THREAD_WORK))
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_recorder_ms_counts_all_recorder_work_on_the_training_thread(tmp_path, monkeypatch, mode, work) -> None:
    clock = _Clock()
    monkeypatch.setattr(recorder_module, "time", types.SimpleNamespace(perf_counter=clock))
    monkeypatch.setattr(user_log_module, "time", types.SimpleNamespace(perf_counter=clock))  # log(), log_batch()
    monkeypatch.setattr(profiling, "_wall", clock)
    _still_threads(monkeypatch)
    owner, name, calls = TRAINING_THREAD_WORK[work]
    real = getattr(owner, name)

    def slow(*args, **kwargs):
        clock.t += 1.0
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, slow)
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with stepdump.Recorder(tmp_path / "run", model, opt, profile=True, on_error="raise", **MODES[mode]) as rec:
        for _ in range(5):
            x = torch.randn(3, 4)
            rec.log_batch(x)
            loss = model(x).sum()
            loss.backward()
            rec.log(loss=loss)
            opt.step()
            opt.zero_grad()
    prof = stepdump.open(tmp_path / "run").profile().loc[0:4]
    assert list(prof["sys/recorder_ms"]) == [1000.0 * calls] * 5, work


def test_thread_waits_are_the_gap_outside_the_hooks_capped_by_the_recorder_threads_cpu(monkeypatch) -> None:
    cpu = _Clock()
    monkeypatch.setattr(profiling, "_cpu", cpu)
    waits = profiling.ThreadWaits()  # the iteration begins at CPU 0
    began = waits.begin()
    cpu.t = 2.0  # a hook that ran 2 s of CPU
    waits.end(began)
    cpu.t = 6.0  # the iteration: 10 s of wall time, 2.5 of them in the hooks; the thread ran 6 s
    # Outside the hooks: 7.5 s of wall time, 4 s of CPU: off its CPU for 3.5 s.
    assert waits.waited(10.0, 2.5, 2.0, now=6.0) == 2.0  # no more than the recorder's threads ran
    cpu.t = 16.0  # the next iteration: 10 s of wall, 10 of CPU, no hooks: it never waited
    assert waits.waited(10.0, 0.0, 5.0, now=16.0) == 0.0
    cpu.t = 20.0  # 10 s of wall, 4 of CPU, recorder threads ran 9 s: the whole 6 s gap
    assert waits.waited(10.0, 0.0, 9.0, now=20.0) == 6.0
    assert waits.waited(10.0, 0.0, None, now=24.0) == 0.0  # their CPU unknown: nothing is claimed
    assert waits.waited(1.0, 3.0, 9.0, now=30.0) == 0.0  # more CPU than wall time: no negative wait


def test_recorder_ms_adds_the_waits_and_says_them_apart(tmp_path, monkeypatch) -> None:
    """Injected clocks: each iteration takes 10 s of wall time outside the hooks and 4 s of the
    training thread's CPU, and the recorder's threads 1.5 s of theirs: 1.5 s waited, in
    sys/recorder_wait_ms and in sys/recorder_ms, whose hooks took no time."""
    wall, cpu = _Clock(), _Clock()
    monkeypatch.setattr(recorder_module, "time", types.SimpleNamespace(perf_counter=wall))
    monkeypatch.setattr(user_log_module, "time", types.SimpleNamespace(perf_counter=wall))
    monkeypatch.setattr(profiling, "_wall", wall)
    monkeypatch.setattr(profiling, "_cpu", cpu)
    monkeypatch.setattr(profiling.BackgroundClock, "take", lambda self: 1.5)

    def tick() -> None:
        wall.t += 10.0
        cpu.t += 4.0

    prof = _lean_profile(tmp_path, 5, tick).loc[1:4]  # step 0's iteration began at the Recorder's start
    assert list(prof["sys/recorder_wait_ms"]) == [1500.0] * 4
    assert list(prof["sys/recorder_ms"]) == [1500.0] * 4
    assert list(prof["sys/iter_ms"]) == [10000.0] * 4


class _ThreadCpu:
    """Injected thread CPU clocks: every reading of the writer's own thread moves it ``writer`` s, of
    any other recorder thread ``other`` s (one reading per thread per iteration: BackgroundClock)."""

    def __init__(self, writer: float, other: float) -> None:
        self.writer, self.other = writer, other
        self.t: dict[int, float] = {}

    def __call__(self, thread: threading.Thread) -> float:
        step = self.writer if thread.name == "stepdump-writer" else self.other
        self.t[id(thread)] = self.t.get(id(thread), 0.0) + step
        return self.t[id(thread)]


@pytest.mark.parametrize("outside", ["no waits", "waits seen outside the hooks"])
def test_recorder_ms_counts_the_recorder_threads_cpu_not_added_to_the_waits(tmp_path, monkeypatch, outside) -> None:
    """The recorder's threads' CPU is the training's cost even where the training thread is never
    seen off its CPU: their work holds the GIL the training thread takes back after every torch op
    (the writer's), or takes a core. Injected clocks: the writer's thread takes 2 s of CPU an
    iteration, every other recorder thread 1 s; the hooks take none. With no waits recorder_ms is
    their CPU; with the training thread off its CPU 6 s outside the hooks, the waits (capped by
    that CPU) are what it waited for, and are not added to it."""
    wall, cpu = _Clock(), _Clock()
    monkeypatch.setattr(recorder_module, "time", types.SimpleNamespace(perf_counter=wall))
    monkeypatch.setattr(user_log_module, "time", types.SimpleNamespace(perf_counter=wall))
    monkeypatch.setattr(profiling, "_wall", wall)
    monkeypatch.setattr(profiling, "_cpu", cpu)
    thread_cpu = _ThreadCpu(writer=2.0, other=1.0)
    monkeypatch.setattr(profiling._ThreadClocks, "__call__", lambda _clocks, thread: thread_cpu(thread))

    def tick() -> None:
        wall.t += 10.0
        cpu.t += 10.0 if outside == "no waits" else 4.0

    prof = _lean_profile(tmp_path, 5, tick).loc[1:4]  # step 0's iteration began at the Recorder's start
    assert list(prof["sys/recorder_hooks_ms"]) == [0.0] * 4
    bg = list(prof["sys/recorder_bg_ms"])
    assert all(b >= 3000.0 for b in bg)  # the writer's 2 s and at least its appender's 1 s
    waits = [0.0] * 4 if outside == "no waits" else [min(6000.0, b) for b in bg]
    assert list(prof["sys/recorder_wait_ms"]) == waits
    assert list(prof["sys/recorder_ms"]) == bg  # their CPU, never their CPU plus the waits on it


def test_unseen_thread_cpu_is_what_the_hooks_did_not_wait_for_already(monkeypatch) -> None:
    """A hook that waited for a recorder thread (a full step's staging slot) has that wait in its wall
    time: their CPU counts beside the hooks only for what is left of it. What counts as such a wait
    is the time the hooks were blocked on the recorder's own threads (profiling.blocked), not all
    their time off the CPU: on a machine with no idle core the scheduler takes the training thread
    off its CPU inside the hooks too, for the neighbours' sake, and the recorder's threads' CPU is
    then not held in the hooks' time (it failed before: 2 s of the hook's 3 s off its CPU were taken
    as waited for, and the threads' 5 s counted as 3)."""
    cpu, wall = _Clock(), _Clock()
    monkeypatch.setattr(profiling, "_cpu", cpu)
    monkeypatch.setattr(profiling, "_wall", wall)
    waits = profiling.ThreadWaits()
    began = waits.begin()
    cpu.t = 1.0  # the hook ran 1 s of CPU in its 3 s of wall time: 2 s off its CPU, none of it blocked
    waits.end(began)
    cpu.t = 8.0
    waits.waited(10.0, 3.0, 4.0, now=8.0)
    assert waits.in_hooks == 0.0
    assert waits.unseen(5.0) == 5.0
    began = waits.begin()
    with profiling.blocked():  # a hook blocked 2 s on a recorder thread (a future, a slot)
        wall.t += 2.0
    waits.end(began)
    waits.waited(10.0, 3.0, 4.0, now=18.0)
    assert waits.in_hooks == 2.0
    assert waits.unseen(5.0) == 3.0 and waits.unseen(1.5) == 0.0
    waits.waited(10.0, 0.0, 4.0, now=28.0)  # the next iteration: no hooks, nothing held back
    assert waits.unseen(5.0) == 5.0


def test_blocked_counts_only_the_calling_threads_waits(monkeypatch) -> None:
    """The training thread's waits, not another thread's (a second training thread, the writer)."""
    wall = _Clock()
    monkeypatch.setattr(profiling, "_wall", wall)
    before = profiling.blocked_s()
    with profiling.blocked():
        wall.t += 1.5

    def other() -> None:
        with profiling.blocked():
            wall.t += 7.0

    th = threading.Thread(target=other)
    th.start()
    th.join()
    assert profiling.blocked_s() - before == 1.5


@pytest.mark.parametrize("site", ["future", "slot", "live", "deferred"])
def test_each_wait_on_a_recorder_thread_is_counted_as_blocked(site) -> None:
    """The places a hook waits for the recorder's own threads count that wait as blocked, and a
    wait that never blocks counts nothing (real threads, a wait of 0.2 s)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from stepdump.capture.lean import LeanJob
    from stepdump.capture.staging import StagingPool, Stager

    def slow(_entries: list) -> list:
        time.sleep(0.2)
        return []

    pool = StagingPool(slots=1, budget=1 << 20)
    slot = pool.acquire(lambda: None)
    waiter = threading.Timer(0.2, lambda: None)
    if site == "slot":
        waiter = threading.Timer(0.2, pool.release, (slot,))
    elif site in ("live", "deferred"):
        slot.has_live = True
        slot.live_done.clear()
        waiter = threading.Timer(0.2, slot.live_done.set)
    with ThreadPoolExecutor(1) as worker:
        job = LeanJob([], worker, slow) if site == "future" else None
        before = profiling.blocked_s()
        waiter.start()
        if job is not None:
            job.rows_for([], set())
        elif site == "slot":
            pool.acquire(lambda: None)
        elif site == "live":
            pool.wait_live(slot, lambda: True)
        else:
            stager = Stager.__new__(Stager)
            stager._waiting, stager.defer_ok = slot, True
            stager.wait_deferred(lambda: True, pool.gpu_waits)
        waiter.join()
        took = profiling.blocked_s() - before
        assert 0.1 < took < 5.0, took
        before = profiling.blocked_s()
        if job is not None:
            job.rows_for([], set())  # done already: no wait
        elif site == "live":
            pool.wait_live(slot, lambda: True)  # set already: no wait
        assert profiling.blocked_s() - before < 0.01


class _SlowEvent:
    """Stands for a CUDA event the GPU reaches ``seconds`` after the writer starts waiting on it:
    GpuWaits times whatever ``synchronize()`` takes (CUDA's own needs a GPU: tests_gpu)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def synchronize(self) -> None:
        time.sleep(self.seconds)


@pytest.mark.parametrize("site", ["slot", "live"])
def test_a_wait_for_a_writer_that_waits_for_the_gpu_is_the_gpus_not_the_recorders(site: str) -> None:
    """A hook that waits for a slot (or a live append) while the writer waits for the GPU to reach
    the step's event: that part of the wait is the GPU's (gpu_blocked_s, sys/recorder_gpu_wait_ms),
    the writer's own work after it stays the recorder's (blocked_s). Real threads: the writer
    waits 0.4 s for the "GPU", then works 0.3 s, then hands the slot back."""
    from stepdump.capture.staging import StagingPool

    pool = StagingPool(slots=1, budget=1 << 20)
    slot = pool.acquire(lambda: None)
    if site == "live":
        slot.has_live = True
        slot.live_done.clear()
    started = threading.Event()
    failed: list[BaseException] = []

    def writer() -> None:
        started.set()
        try:
            pool.gpu_waits.wait(_SlowEvent(0.4))
            time.sleep(0.3)  # the writer's own work: describing, the catalog
        except BaseException as e:  # noqa: BLE001 - the wait below ends with it, not hangs
            failed.append(e)
            raise
        if site == "live":
            slot.live_done.set()
        else:
            pool.release(slot)

    b0, g0 = profiling.blocked_s(), profiling.gpu_blocked_s()
    th = threading.Thread(target=writer)
    th.start()
    started.wait()
    if site == "slot":  # (a writer that failed ends the wait with its error, not hang the suite)
        pool.acquire(lambda: failed[0] if failed else None)
    else:
        pool.wait_live(slot, th.is_alive)
    th.join()
    on_gpu, own = profiling.gpu_blocked_s() - g0, profiling.blocked_s() - b0
    assert 0.3 < on_gpu < 0.6, on_gpu
    assert 0.2 < own < 0.6, own
    assert pool.gpu_waits.at(time.perf_counter()) >= 0.4  # the writer's clock: its ended wait


def test_gpu_waits_reads_a_wait_in_progress() -> None:
    """GpuWaits.at counts the current wait up to the moment asked (a hook that stops waiting while
    the writer still waits for the GPU), and nothing before the writer's first wait."""
    clock = profiling.GpuWaits()
    assert clock.at(time.perf_counter()) == 0.0
    th = threading.Thread(target=clock.wait, args=(_SlowEvent(1.0),))
    th.start()
    time.sleep(0.2)
    mid = clock.at(time.perf_counter())
    th.join()
    assert 0.1 < mid < 1.0, mid  # (the wait's second: room for a loaded machine's late wake-up)
    assert clock.at(time.perf_counter() + 100.0) == clock.at(time.perf_counter()) >= 1.0  # ended: no longer grows


def test_the_rss_of_a_cpu_step_is_read_by_the_writer_not_on_the_training_thread(tmp_path, monkeypatch) -> None:
    """``sys/peak_mem_mb`` on the CPU is the process's RSS, read where the writer turns the step's
    scalars into floats (a /proc read right after a training step is cold on the training thread)."""
    readers: list[str] = []

    def rss(device: torch.device) -> float:
        readers.append(threading.current_thread().name)
        return 123.0

    monkeypatch.setattr(profiling, "peak_memory_mb", rss)
    prof = _lean_profile(tmp_path, 4)
    assert list(prof["sys/peak_mem_mb"].loc[0:3]) == [123.0] * 4
    assert readers and threading.main_thread().name not in readers, readers
