"""Cheap per-step resource readings for the ``sys/*`` scalars."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# /proc/self/statm kept open and read again with pread: an open() + close() per step cost
# more than the reading (~70 us of the ~5 us here, measured on the benchmark machine).
# (pid, fd): /proc/self is resolved at open(), so a forked child opens its own.
_statm: tuple[int, int] | None = None
_statm_lock = threading.Lock()


def _rss_pages() -> int | None:
    """Resident pages of this process from /proc/self/statm, or None where there is none."""
    global _statm
    with _statm_lock:
        try:
            pid = os.getpid()
            if _statm is None or _statm[0] != pid:
                _statm = (pid, os.open("/proc/self/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
            return int(os.pread(_statm[1], 128, 0).split()[1])
        except (OSError, AttributeError, IndexError, ValueError):  # not Linux (no pread, no /proc)
            return None


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: peak allocated since the last call (then reset). CPU: current process RSS."""
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        # = torch.cuda.max_memory_allocated(device), without flattening every allocator statistic
        # into a sorted dict first (~160 Python calls a step there)
        peak = torch.cuda.memory_stats_as_nested_dict(device).get("allocated_bytes", {}).get("all", {}).get("peak", 0)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**20
    pages = _rss_pages()
    if pages is not None:
        return pages * _PAGE / 2**20
    import resource  # not Linux: the lifetime peak is the best cheap number

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class RssLater:
    """The process's resident memory in MB (:func:`peak_memory_mb` on the CPU), read when the value is
    turned into a float: by the writer thread, as it takes the step's scalars (within a commit window of
    the step), not on the training thread, where the /proc read right after a training step cost 15-35 us
    (cold; ~2 us warm). A step's ``sys/peak_mem_mb`` on the CPU is the current RSS, not a peak: a few
    milliseconds later it is the same figure of a loop in its steady state."""

    __slots__ = ()

    def __float__(self) -> float:
        return peak_memory_mb(torch.device("cpu"))

    def __repr__(self) -> str:
        return "<the process's RSS in MB, read when converted>"


RSS_LATER = RssLater()

_NO_SPAN = contextlib.nullcontext()


def span(name: str) -> contextlib.AbstractContextManager[Any]:
    """``torch.profiler.record_function(name)`` while a torch profiler is on, else a no-op: the
    record_function op costs ~15-40 us per enter/exit (a dispatcher call each way, and a
    hand-off of the GIL when another thread holds it), every step, for a profile nobody takes."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return _NO_SPAN


# The clock of the timed hooks (tests replace it); perf_counter itself: a Python function around it
# was two calls more per timed hook, four hooks a step.
_wall: Callable[[], float] = time.perf_counter


def timed(fn: Callable[..., Any], add: Callable[[float], None]) -> Callable[..., Any]:
    """``fn``, with the wall time each call takes handed to ``add`` (a hook's share of
    ``sys/recorder_ms``: the forward hooks run on the training thread too)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = _wall()
        try:
            return fn(*args, **kwargs)
        finally:
            add(_wall() - t0)

    call.__qualname__ = getattr(fn, "__qualname__", "timed")
    return call


# The training thread's CPU clock (tests replace it).
_cpu: Callable[[], float] = time.thread_time

# Seconds each thread has spent blocked on the recorder's own threads (blocked()): per thread, as
# the training thread's hooks are what waits, and a second training thread's waits are its own.
_blocked = threading.local()


def blocked_s() -> float:
    """Seconds the calling thread has spent in :func:`blocked` so far, less what of it was the
    GPU's (:func:`gpu_blocked_s`)."""
    return getattr(_blocked, "s", 0.0)


def gpu_blocked_s() -> float:
    """Seconds the calling thread has spent in :func:`blocked` so far while the thread it waited
    for waited for the GPU (:class:`GpuWaits`): ``sys/recorder_gpu_wait_ms``."""
    return getattr(_blocked, "gpu", 0.0)


class GpuWaits:
    """The seconds a writer has spent waiting for the GPU to reach a step's event, as a clock
    another thread can read at any moment (:meth:`at`).

    On a GPU-bound loop the host runs ahead of the GPU; the writer waits on each step's event
    for the GPU to get there, and once every staging slot is in its hands the training thread
    waits for a slot (:func:`blocked`). That wait is the GPU being behind, which the loop would
    have waited for at its next sync without a recorder (its wall time is the GPU's): counted in
    ``sys/recorder_ms`` it made a 31 ms GPU-bound step report 28 ms of recording on an H200
    (docs/cuda.md). :func:`blocked` takes the part of a wait during which the writer waited for
    the GPU out of the hooks' time and says it apart. One writer thread per clock: its state is
    one tuple, replaced whole, so a reader needs no lock."""

    def __init__(self) -> None:
        self._state: tuple[float, float | None] = (0.0, None)  # (seconds of ended waits, start of the current one)

    def wait(self, event: Any) -> None:
        """``event.synchronize()``, timed."""
        t0 = _wall()
        self._state = (self._state[0], t0)
        try:
            event.synchronize()
        finally:
            self._state = (self._state[0] + (_wall() - t0), None)

    def at(self, now: float) -> float:
        """Seconds of waiting up to ``now`` (a :func:`time.perf_counter` reading), the current wait's included."""
        done, since = self._state
        return done if since is None else done + max(0.0, now - since)


@contextlib.contextmanager
def blocked(gpu: GpuWaits | None = None) -> Iterator[None]:
    """Time a wait of the calling thread (a hook on the training thread) on one of the recorder's own
    threads: a staging slot, a worker's rows, the writer's append of live tensors. Only such waits
    hold the recorder's threads' CPU in a hook's wall time (``ThreadWaits.unseen``); the rest of a
    hook's time off its CPU is the scheduler's, for anyone. Used only where the wait is known to
    block (a ready future or a set event costs no clock reading). ``gpu``: the waited-for writer's
    waits for the GPU; the part of this wait they cover counts as :func:`gpu_blocked_s`, not here."""
    t0 = _wall()
    g0 = gpu.at(t0) if gpu is not None else 0.0
    try:
        yield
    finally:
        t1 = _wall()
        on_gpu = min(t1 - t0, gpu.at(t1) - g0) if gpu is not None else 0.0
        _blocked.s = getattr(_blocked, "s", 0.0) + (t1 - t0 - on_gpu)
        if on_gpu > 0.0:
            _blocked.gpu = getattr(_blocked, "gpu", 0.0) + on_gpu


class ThreadWaits:
    """The time the training thread spent *off* its CPU in an iteration outside the recorder's
    hooks, as far as the recorder's own threads can have caused it: what ``sys/recorder_ms``
    adds to the hooks' time (``sys/recorder_wait_ms``).

    A recorder thread that holds the GIL (Python work: describing rows, building catalog
    statements) stops the training thread at its next torch call, which lets the GIL go and must
    take it back; on a machine without an idle core, any CPU a recorder thread uses is a core the
    training thread waits for. Neither shows in the hooks' wall time, and both show as the
    iteration's wall time minus the training thread's CPU time. That gap also holds waits the
    recorder has no part in (a data loader, I/O, another process on the core), so it is capped
    by the CPU time the recorder's threads used in the iteration (``sys/recorder_bg_ms``): the
    figure is ``min(gap outside the hooks, recorder threads' CPU)``. Not counted, because no
    clock sees it: the training's own kernels running slower on caches the recorder left cold.
    The forward hooks' CPU time is not read (two syscalls per hook): their time counts as CPU
    outside the hooks, which makes the gap smaller by that much, never larger.

    What no clock of the training thread sees is the GIL it loses to the recorder's threads while
    it runs (a torch op done, the GIL to take back), and a core they take: :meth:`unseen` gives the
    part of their CPU time (``BackgroundClock``) the hooks' own waits on them (:func:`blocked`) do
    not already hold, which ``sys/recorder_ms`` counts where it is larger than the waits outside
    the hooks."""

    def __init__(self) -> None:
        self.iteration = _cpu()  # the training thread's CPU clock when the iteration began
        self.hooks = 0.0  # CPU seconds of the optimizer hooks in the iteration
        self.in_hooks = 0.0  # of the last iteration waited() closed: its hooks' waits on the recorder's threads
        self._blocked = blocked_s()  # blocked_s() when the iteration began
        self._gpu = gpu_blocked_s()  # gpu_blocked_s() at the last on_gpu()

    def begin(self) -> float:
        """The CPU clock now (at a hook's start)."""
        return _cpu()

    def end(self, began: float) -> None:
        """A hook that began at ``began`` (:meth:`begin`) is over."""
        self.hooks += _cpu() - began

    def waited(self, iter_s: float, hooks_s: float, background_s: float | None, now: float) -> float:
        """Seconds the iteration (``iter_s`` of wall time, ``hooks_s`` of them in the recorder's
        hooks, ended at CPU clock ``now``) waited on the recorder's threads, and start the next."""
        off_cpu = (iter_s - hooks_s) - ((now - self.iteration) - self.hooks)
        # Not the hooks' whole time off the CPU: on a machine with no idle core most of it is the
        # scheduler serving other processes, and counting it here left the recorder's threads' CPU
        # out of sys/recorder_ms (a PPO update on a busy machine reported 72% of its measured cost).
        b = blocked_s()
        self.in_hooks, self._blocked = max(0.0, b - self._blocked), b
        self.iteration, self.hooks = now, 0.0
        return min(max(0.0, off_cpu), background_s or 0.0)

    def on_gpu(self) -> float:
        """Seconds the hooks waited for a writer that waited for the GPU (:class:`GpuWaits`) since
        the last call: ``sys/recorder_gpu_wait_ms``, out of the hooks' time."""
        g = gpu_blocked_s()
        waited, self._gpu = g - self._gpu, g
        return waited

    def unseen(self, background_s: float) -> float:
        """Of ``background_s`` (the recorder's threads' CPU seconds in the iteration :meth:`waited`
        closed), what the hooks' time does not hold already: a hook that waited for a recorder
        thread (a full step's staging slot, a future: :func:`blocked`) has that wait in its wall time."""
        return max(0.0, background_s - self.in_hooks)


def _thread_cpu_s(thread: threading.Thread) -> float | None:
    """CPU seconds ``thread`` has used (its POSIX CPU clock), or None where it cannot be read."""
    ident = thread.ident
    if ident is None or not hasattr(time, "pthread_getcpuclockid"):
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (OSError, OverflowError, ValueError):  # the thread has ended
        return None


class _ThreadClocks:
    """:func:`_thread_cpu_s` with each thread's clock id looked up once (two Python calls less per
    thread and step; a thread that ended reads as None, as there). Keeps the threads it saw, so
    that ``id(thread)`` is not reused for another one."""

    def __init__(self) -> None:
        self._ids: dict[int, tuple[threading.Thread, int]] = {}

    def __call__(self, thread: threading.Thread) -> float | None:
        got = self._ids.get(id(thread))
        if got is None:
            ident = thread.ident
            if ident is None or not hasattr(time, "pthread_getcpuclockid"):
                return None
            try:
                got = self._ids[id(thread)] = (thread, time.pthread_getcpuclockid(ident))
            except (OSError, OverflowError, ValueError):
                return None
        try:
            return time.clock_gettime(got[1])
        except (OSError, OverflowError, ValueError):  # the thread has ended
            return None


class BackgroundClock:
    """CPU time of the recorder's background threads (writer, appender, stats worker) between
    two readings: ``sys/recorder_bg_ms``, and what ``sys/recorder_ms`` counts beside the hooks
    (``ThreadWaits.unseen``).

    Their CPU is training time wherever no core is idle for them, and where their work holds the
    GIL (describing rows, building catalog statements), which the training thread must take back
    after every torch op; measured on the shared 2-core machine it came out of the training's wall
    time about one for one even with the second core nominally free (docs/design-measurements.md).
    Where a core is truly idle for GIL-free work (torch reductions, xxh3, file writes on a large
    model) it runs beside training, and counting it overstates the cost."""

    def __init__(self, threads: Callable[[], Iterable[threading.Thread | None]],
                 cpu: Callable[[threading.Thread], float | None] | None = None) -> None:
        self._threads, self._cpu = threads, cpu if cpu is not None else _ThreadClocks()
        self._last: dict[int, float] = {}  # id(thread) -> its CPU seconds at the last reading
        self.take()

    def take(self) -> float:
        """CPU seconds the threads used since the last call (a thread that ended since is not
        counted for its last stretch; a new one from its start)."""
        total, now = 0.0, {}
        for th in self._threads():
            if th is None:
                continue
            s = self._cpu(th)
            if s is None:
                continue
            now[id(th)] = s
            total += max(0.0, s - self._last.get(id(th), 0.0))
        self._last = now
        return total
