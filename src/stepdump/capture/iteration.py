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
  loop's first optimizer, learned at its first step; :meth:`Loop.update_starting`) freezes
  every Recorder's start state for that iteration. A Recorder left open but idle (no update
  since this one was created: an earlier loop, a notebook cell) is never taken for the loop's
  first. One Recorder alone: its own update end, as before. A log made after the last update,
  before the model's next training forward, goes to the iteration that just ended
  (``Recorder.log``), whichever Recorder it is given to.
* **An evaluation between updates** (sampling, a validation pass with its own shuffled
  loader): a forward of a recorded model with grad disabled. At its end the start RNG of
  every Recorder not yet frozen is taken again, so record *t* holds the RNG after the
  evaluation drew; the buffers are taken again before the model's next training forward
  (an evaluation in train mode moves BatchNorm stats). A sampler that draws *after* its
  last forward cannot be seen ending: call ``Recorder.begin_iteration()`` after it.

``Recorder.begin_iteration()`` called by the user (or an integration) pins the start
state of that step: nothing here takes it again.

Two classes carry it: :class:`IterationStart`, one per Recorder, owns that Recorder's start
state and is told by the Recorder when its own update begins and ends; :class:`Loop`, one per
process (:data:`LOOP`), knows every recording Recorder's :class:`IterationStart` and tells the
others when one update moves their iteration's start.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from stepdump.core.rng import get_rng_state, raw_of, raw_rng, same_rng_state
from stepdump.store.format import STATE_FORWARD_RNG

if TYPE_CHECKING:
    from stepdump.capture.guard import Guard

StartState = dict[str, Any]  # step_state.begin_state's dict: "rng", module "buffers", STATE_FORWARD_RNG


class Participant(Protocol):
    """What a Recorder's start state does when another part of the loop moves its iteration's start."""

    def loop_freeze(self) -> None: ...
    def loop_update_ended(self) -> None: ...
    def loop_eval_ended(self, rng: dict[str, Any]) -> None: ...


class Loop:
    """The recording Recorders of this process, seen as the updates of one training loop.

    Its rules are the module docstring's. One instance, :data:`LOOP`, lives as long as the
    process: a Recorder's :class:`IterationStart` joins it when the Recorder starts recording
    and leaves it when the Recorder closes or steps aside; it holds them weakly, so a Recorder
    dropped without ``close()`` leaves it too.
    """

    def __init__(self) -> None:
        self._live: weakref.WeakSet[Any] = weakref.WeakSet()  # the recording participants
        self._first: weakref.ref[Any] | None = None  # the participant whose update opens a loop iteration
        # A clock of joins and updates: a participant that has not updated since another one joined is
        # idle for it (left open by an earlier loop, a notebook cell, a test) and cannot be its loop's first.
        self._clock = 0
        self._joined: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._updated: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def join(self, rec: Participant) -> None:
        """``rec`` records from now on (its start state follows the others' updates)."""
        self._live.add(rec)
        self._joined[rec] = self._tick()

    def leave(self, rec: Participant) -> None:
        """``rec``'s Recorder is closed or stepped aside."""
        self._live.discard(rec)
        if self._first is not None and self._first() is rec:
            self._first = None

    def update_starting(self, rec: Participant) -> None:
        """``rec``'s Recorder takes its record (its optimizer's update begins). The update of the loop's
        first optimizer opens a loop iteration: every Recorder's start state for it is final now."""
        first = self._first() if self._first is not None else None
        live = self._live
        if first is rec and len(live) == 1:  # one Recorder alone (the usual loop): the same, without the WeakSet walks
            self._updated[rec] = self._tick()
            rec.loop_freeze()
            return
        if first is None or first not in live or self._updated.get(first, 0) < self._joined.get(rec, 0):
            self._first, first = weakref.ref(rec), rec  # none yet, or one idle since rec joined: not rec's loop
        self._updated[rec] = self._tick()
        for r in list(live) if first is rec else (rec,):
            r.loop_freeze()

    def update_ended(self, rec: Participant) -> None:
        """``rec``'s update is over (it took its own next start state): the others take theirs again."""
        if len(self._live) == 1 and self._first is not None and self._first() is rec:  # rec alone: no others
            return
        for r in list(self._live):
            if r is not rec:
                r.loop_update_ended()

    def eval_ended(self) -> None:
        """A recorded model finished a forward with grad disabled: the RNG after it is the start RNG."""
        if not self._live:
            return
        rng = get_rng_state()
        for r in list(self._live):
            r.loop_eval_ended(rng)


LOOP = Loop()  # this process's loop: every Recorder's start state joins this one


class IterationStart:
    """One Recorder's start-of-iteration state (RNG, module buffers, the RNG each training forward
    starts from), and when it is taken again.

    The Recorder tells it where its own iterations begin (:meth:`open`, :meth:`pin`) and when
    its model runs a training forward (:meth:`training_forward`); :data:`LOOP` tells it when
    another Recorder's update or an evaluation moves the start (the :class:`Participant` methods).

    Args:
        take: The start state of step ``t`` as it is now (None: record ``t`` needs none).
        step: The Recorder's current step.
        closed: Whether the Recorder is closed.
        guard: The Recorder's guard (``stopped``: it stepped aside after a failure).
        final_rng: Take the RNG a final record holds (the RNG after the loop's last update).
        fail: The Recorder's failure handling (``on_error``), with where it happened.
    """

    def __init__(self, take: Callable[[int], StartState | None], step: Callable[[], int],
                 closed: Callable[[], bool], guard: Guard, final_rng: Callable[[], None],
                 fail: Callable[[BaseException, str], None]) -> None:
        self._take, self._step, self._closed, self._guard = take, step, closed, guard
        self._final_rng, self._fail = final_rng, fail
        self.begin: StartState | None = None  # the current step's start state (None: none kept)
        # begin's RNG and its raw reading (core.rng.raw_of), made at the first training forward that
        # compares with it: a forward that starts from that same RNG (nothing drew since) is told cheaply
        self._raw: tuple[dict[str, Any], tuple[Any, ...] | None] | None = None
        self.forward_seen = False  # a training forward ran since the update that opened this iteration
        # Frozen once its loop iteration opened, pinned by an explicit begin_iteration(), buffers to
        # take again before the next training forward after an evaluation.
        self._frozen = self._pinned = self._stale_buffers = False

    def open(self, t: int) -> None:
        """Iteration ``t`` starts now (the end of update ``t-1``, or the Recorder's start)."""
        self.forward_seen = False
        self._frozen = self._pinned = self._stale_buffers = False
        self.begin = self._take(t)

    def pin(self, t: int, rng: dict[str, Any] | None) -> None:
        """The caller says iteration ``t`` starts now (``rng``: with this RNG state); nothing retakes it."""
        self.begin = self._take(t)
        if rng is not None and self.begin is not None:
            self.begin["rng"] = rng
        self._pinned, self._stale_buffers = True, False

    def drop(self) -> None:
        """The Recorder stepped aside: nothing is kept."""
        self.begin, self._raw = None, None

    def _raw_of(self, rng: dict[str, Any]) -> tuple[Any, ...] | None:
        """:func:`~stepdump.core.rng.raw_of` ``rng``, made once per RNG dict (kept by identity)."""
        if self._raw is None or self._raw[0] is not rng:
            self._raw = (rng, raw_of(rng))
        return self._raw[1]

    def training_forward(self) -> bool:
        """A forward with grad enabled begins; return whether one already ran in this iteration.

        Buffers an evaluation moved since the start state are taken as they are now, and the RNG
        this forward starts from is kept: a draw between the iteration's start and a forward
        (nanoGPT's get_batch, an augmentation) is not redone by a re-execution or a replay that is
        handed the recorded batch, so they set it here (FORMAT.md, forward_rng).
        """
        if self._stale_buffers:  # an evaluation ran since the start state: its buffers as they are now
            self._retake(rng=False)
        again, self.forward_seen = self.forward_seen, True
        begin = self.begin
        if begin is not None and not self._guard.stopped:
            try:  # None: the iteration's start state (nothing drew before this forward; no copy stored)
                now = raw_rng()
                if now is not None and now == self._raw_of(begin["rng"]):  # the same bytes: the same state
                    begin.setdefault(STATE_FORWARD_RNG, []).append(None)
                else:
                    rng = get_rng_state()
                    begin.setdefault(STATE_FORWARD_RNG, []).append(None if same_rng_state(rng, begin["rng"]) else rng)
            except Exception as e:  # noqa: BLE001 - do no harm: on_error decides
                self._fail(e, "forward pre-hook")
        return again

    # -- Participant: what LOOP tells it ---------------------------------------
    def loop_freeze(self) -> None:
        """The loop's iteration opened: this start state is final."""
        if self._stale_buffers:
            self._retake(rng=False)
        self._frozen = True

    def loop_update_ended(self) -> None:
        """Another Recorder's update ended: the loop iteration starts later."""
        if not (self._frozen or self._pinned):
            self.forward_seen = False
            self._final_rng()  # the final record: the RNG after the loop's last update
            self._retake(rng=True)

    def loop_eval_ended(self, rng: dict[str, Any]) -> None:
        """An evaluation's forward ended with the RNG ``rng``: the start RNG is that one."""
        if not (self._frozen or self._pinned):
            if self.begin is not None:
                forwards = self.begin.get(STATE_FORWARD_RNG)
                if forwards:  # None meant the start RNG that is being replaced: keep it
                    self.begin[STATE_FORWARD_RNG] = [self.begin["rng"] if f is None else f for f in forwards]
                self.begin["rng"] = rng
            self._stale_buffers = True

    def _retake(self, rng: bool) -> None:
        """Take the start state of the current step again (``rng`` False: the buffers only)."""
        self._stale_buffers = False
        if self.begin is None or self._closed() or self._guard.stopped:
            return
        try:
            kept, forwards = self.begin["rng"], self.begin.get(STATE_FORWARD_RNG)
            self.begin = self._take(self._step())
            if self.begin is not None:
                if not rng:
                    self.begin["rng"] = kept
                if forwards:  # the iteration's forwards so far keep their RNG states (None: the old start's)
                    self.begin[STATE_FORWARD_RNG] = [kept if f is None else f for f in forwards] if rng else forwards
        except Exception as e:  # noqa: BLE001 - do no harm: on_error decides
            self._fail(e, "start of an iteration")
