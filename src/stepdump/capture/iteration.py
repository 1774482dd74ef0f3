"""Where an iteration starts: the moment a record's RNG state and module buffers are taken.

Record *t* holds the RNG and buffers that iteration *t*'s training work starts with
(docs/concepts.md, "Where each part of a record is taken"). One Recorder alone sees the
end of update *t-1* and takes them there. Two things in ordinary loops move the true
start later, and this module follows both:

* **Several Recorders in one loop** (one per optimizer: dcgan's D and G). D's update
  is followed by G's, which runs netD again (BatchNorm in train mode updates its running
  stats). The loop's iteration starts after the *last* update of the loop body, so every
  Recorder's start state is taken again at the end of *any* live Recorder's update, until
  the loop's next iteration opens: the update of the Recorder that captured first (the
  loop's first optimizer, learned at its first step; :func:`update_starting`) freezes every
  Recorder's start state for that iteration. A Recorder left open but idle (no update since
  this one was created: an earlier loop, a notebook cell) is never taken for the loop's first. One Recorder alone: its own update end, as
  before. A log made after the last update, before the model's next training forward, goes
  to the iteration that just ended (``Recorder.log``), whichever Recorder it is given to.
* **An evaluation between updates** (sampling, a validation pass with its own shuffled
  loader): a forward of a recorded model with grad disabled. At its end the start RNG of
  every Recorder not yet frozen is taken again, so record *t* holds the RNG after the
  evaluation drew; the buffers are taken again before the model's next training forward
  (an evaluation in train mode moves BatchNorm stats). A sampler that draws *after* its
  last forward cannot be seen ending: call ``Recorder.begin_iteration()`` after it.

``Recorder.begin_iteration()`` called by the user (or an integration) pins the start
state of that step: nothing here takes it again.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from stepdump.capture.step_state import begin_state
from stepdump.core.rng import get_rng_state, same_rng_state
from stepdump.store.format import LEVEL_NONE, LEVEL_STATS, STATE_FORWARD_RNG

if TYPE_CHECKING:
    from stepdump.capture.assemble import Assembler
    from stepdump.capture.final import FinalRecord
    from stepdump.capture.guard import Guard
    from stepdump.capture.lean import LeanCapture
    from stepdump.capture.ring import Ring
    from stepdump.capture.selection import Levels, NameFilter


class Participant(Protocol):
    """What a Recorder does when another part of the loop moves its iteration's start."""

    def _loop_freeze(self) -> None: ...
    def _loop_update_ended(self) -> None: ...
    def _loop_eval_ended(self, rng: dict[str, Any]) -> None: ...


_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()  # recording Recorders of this process
_first: weakref.ref[Any] | None = None  # the Recorder whose update opens a loop iteration
# A clock of joins and updates: a Recorder that has not updated since another one joined is
# idle for it (left open by an earlier loop, a notebook cell, a test) and cannot be its loop's first.
_clock = 0
_joined: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_updated: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _tick() -> int:
    global _clock
    _clock += 1
    return _clock


def join(rec: Participant) -> None:
    """``rec`` records from now on (its start state follows the others' updates)."""
    _LIVE.add(rec)
    _joined[rec] = _tick()


def leave(rec: Participant) -> None:
    """``rec`` is closed or stepped aside."""
    global _first
    _LIVE.discard(rec)
    if _first is not None and _first() is rec:
        _first = None


def update_starting(rec: Participant) -> None:
    """``rec`` takes its record (its optimizer's update begins). The update of the loop's first
    optimizer opens a loop iteration: every Recorder's start state for it is final now."""
    global _first
    first = _first() if _first is not None else None
    if first is rec and len(_LIVE) == 1:  # one Recorder alone (the usual loop): the same, without the WeakSet walks
        _updated[rec] = _tick()
        rec._loop_freeze()
        return
    if first is None or first not in _LIVE or _updated.get(first, 0) < _joined.get(rec, 0):
        _first, first = weakref.ref(rec), rec  # none yet, or one idle since rec joined: not rec's loop
    _updated[rec] = _tick()
    for r in list(_LIVE) if first is rec else (rec,):
        r._loop_freeze()


def update_ended(rec: Participant) -> None:
    """``rec``'s update is over (it took its own next start state): the others take theirs again."""
    if len(_LIVE) == 1 and _first is not None and _first() is rec:  # rec alone: no others
        return
    for r in list(_LIVE):
        if r is not rec:
            r._loop_update_ended()


def eval_ended() -> None:
    """A recorded model finished a forward with grad disabled: the RNG after it is the start RNG."""
    if not _LIVE:
        return
    rng = get_rng_state()
    for r in list(_LIVE):
        r._loop_eval_ended(rng)


class IterationStart:
    """The Recorder's side of this module: its forward hooks (a training forward, the end of an
    evaluation's forward) and what it does when the loop moves its iteration's start.

    A mixin of :class:`stepdump.Recorder`, kept here so that the rule of where an iteration
    starts lives in one file; the attributes below are the Recorder's own.
    """

    model: Any
    _step: int
    _closed: bool
    _begin: dict[str, Any] | None
    _captured_at: int | None
    _forward_seen: bool
    _frozen: bool
    _pinned: bool
    _stale_buffers: bool
    _keyframes: bool
    kinds: tuple[str, ...]
    _asm: Assembler
    _final: FinalRecord
    _guard: Guard
    _lean: LeanCapture
    _level: Levels
    _filter: NameFilter
    _ring: Ring | None

    def _fail(self, err: BaseException, where: str) -> None:
        raise NotImplementedError  # the Recorder's

    def _saw_forward(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():  # an evaluation under no_grad
            return
        if self._stale_buffers:  # an evaluation ran since the start state: its buffers as they are now
            self._loop_retake(rng=False)
        again, self._forward_seen = self._forward_seen, True  # a training forward (or one with grad enabled)
        t = self._step
        watch = self._asm.structure  # its flag only (no call): the pre-hook looks at the optimizer's groups
        if watch is not None and watch.dirty and self._captured_at != t and not self._guard.stopped:
            try:  # the model's structure changed since the last look (a layer pruned before this forward)
                self._asm.follow(self.model, t, self._begin)
            except Exception as e:  # noqa: BLE001 - do no harm: on_error decides
                self._fail(e, "forward pre-hook")
        if self._begin is not None and not self._guard.stopped:
            # The RNG each training forward starts from: a draw between the iteration's start and a
            # forward (nanoGPT's get_batch, an augmentation) is not redone by a re-execution or a
            # replay that is handed the recorded batch, so they set it here (FORMAT.md, forward_rng).
            try:  # None: the iteration's start state (nothing drew before this forward; no copy stored)
                rng = get_rng_state()
                self._begin.setdefault(STATE_FORWARD_RNG, []).append(
                    None if same_rng_state(rng, self._begin["rng"]) else rng)
            except Exception as e:  # noqa: BLE001 - do no harm: on_error decides
                self._fail(e, "forward pre-hook")
        if self._lean.enabled and self._captured_at != t and not self._guard.stopped and self._level(t) == LEVEL_STATS:
            try:
                self._lean.forward_started(t, lambda: self._asm.entries(False, step=t), again)
            except Exception as e:  # noqa: BLE001 - do no harm: on_error decides
                self._fail(e, "forward pre-hook")

    def _saw_forward_end(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() and not self._closed and not self._guard.stopped:
            try:  # an evaluation's forward: the iteration's start RNG is after it (module docstring)
                eval_ended()
            except Exception as e:  # noqa: BLE001 - do no harm: on_error decides
                self._fail(e, "forward hook")

    def _loop_freeze(self) -> None:
        if self._stale_buffers:
            self._loop_retake(rng=False)
        self._frozen = True

    def _loop_update_ended(self) -> None:  # another Recorder's update: the loop iteration starts later
        if not (self._frozen or self._pinned):
            self._forward_seen = False
            self._final.rng.take()  # the final record: the RNG after the loop's last update
            self._loop_retake(rng=True)

    def _loop_eval_ended(self, rng: dict[str, Any]) -> None:
        if not (self._frozen or self._pinned):
            if self._begin is not None:
                forwards = self._begin.get(STATE_FORWARD_RNG)
                if forwards:  # None meant the start RNG that is being replaced: keep it
                    self._begin[STATE_FORWARD_RNG] = [self._begin["rng"] if f is None else f for f in forwards]
                self._begin["rng"] = rng
            self._stale_buffers = True

    def _loop_retake(self, rng: bool) -> None:
        """Take the start state of the current step again (``rng`` False: the buffers only)."""
        self._stale_buffers = False
        if self._closed or self._guard.stopped or self._begin is None:
            return
        try:
            kept, forwards = self._begin["rng"], self._begin.get(STATE_FORWARD_RNG)
            self._begin_iteration(self._step)
            if self._begin is not None:
                if not rng:
                    self._begin["rng"] = kept
                if forwards:  # the iteration's forwards so far keep their RNG states (None: the old start's)
                    self._begin[STATE_FORWARD_RNG] = [kept if f is None else f for f in forwards] if rng else forwards
        except Exception as e:  # noqa: BLE001 - do no harm: on_error decides
            self._fail(e, "start of an iteration")

    def _begin_iteration(self, t: int) -> None:
        """Start of iteration t: keep what a full record t needs from this moment."""
        # A callable schedule may say yes only later (a trigger set by the loop): then always taken.
        full = self._level.full(t) or self._ring is not None or self._level.full.dynamic
        every = self._keyframes or self._asm.gradlog  # RNG (a gradient log: buffers too) at every step
        if not full and not (every and self._level(t) != LEVEL_NONE):
            self._begin = None
            return
        with torch.profiler.record_function("stepdump.begin"):
            keep = full or self._asm.gradlog
            self._begin = begin_state(self._asm.layout, self._filter if keep and "params" in self.kinds else None)
