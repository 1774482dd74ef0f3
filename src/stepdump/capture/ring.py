"""The flight-recorder ring: full copies of the last N steps, kept in memory.

Each held step owns a staging slot. Stats of the step go to the writer at once
(so always-on stats continue); the full copy waits here until a trigger fires,
when it is written as an ordinary full step, or until it falls out of the ring.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from stepdump.capture.profiling import blocked
from stepdump.capture.staging import Item, Slot, StagingPool
from stepdump.capture.triggers import Trigger, TriggerInfo
from stepdump.capture.writer import StepMessage
from stepdump.store.format import LEVEL_FULL

log = logging.getLogger(__name__)
HISTORY = 200  # scalar values kept for triggers


@dataclass
class Held:
    step: int
    skipped: bool
    slot: Slot
    items: list[Item]
    state_json: str | None


class Ring:
    """The held steps, and when to write them: ``trigger`` fires, then ``after`` more steps in full.

    One episode per condition: the trigger is asked at every step, but once it has
    fired it fires again only after a step where it was false (re-armed). While the
    condition lasts past the ``after`` steps, steps are held as when nothing
    happened (a NaN that stays would otherwise write every step in full), and that
    is logged once. A trigger step inside the ``after`` window of the previous one
    (the condition cleared, then came back) starts the ``after`` count again.

    The Recorder stages every step in full while a ring is on and hands the
    staged step to :meth:`take`, which decides; the ring never reaches into the
    Recorder (its only inputs are the step's message, the grads and the scalars).
    """

    def __init__(self, size: int, pool: StagingPool, trigger: Trigger, after: int) -> None:
        self.size = size
        self._pool = pool
        self._held: deque[Held] = deque()
        self.trigger = trigger
        self.after = after
        self.after_left = 0
        self.episode: int | None = None  # the trigger step of the condition going on; None: armed
        self._persist_logged = False
        self.history: dict[str, deque[float]] = {}  # recent scalar values, for the trigger

    def remember(self, scalars: list[tuple[int, str, Any]]) -> None:
        """Keep recent scalar values (``(step, name, value)`` rows) for the trigger."""
        for _, name, v in scalars:
            hist = self.history.setdefault(name, deque(maxlen=HISTORY))
            hist.append(float(v.item() if isinstance(v, torch.Tensor) else v))

    def take(self, msg: StepMessage, t: int, slot: Slot, grads: list[torch.Tensor]) -> list[StepMessage]:
        """Decide for a step staged in full (``msg``: level stats, items and state of the full copy).

        ``t`` and ``slot`` are the step's number and the slot it was staged into.
        Either the trigger fires (or steps after it are due): ``msg`` becomes a full
        step and the held steps before it are returned, to be written first. Or the
        full copy is held here: ``msg`` keeps only stats (its slot stays held) and
        nothing is returned.
        """
        latest = {n: h[-1] for n, h in self.history.items() if h}
        on = bool(self.trigger(TriggerInfo(t, latest, grads, self.history)))
        fired = on and self.episode is None
        full_after = not fired and self.after_left > 0
        if full_after:
            self.after_left -= 1
        if fired:
            self.episode, self._persist_logged = t, False
        elif not on and self.episode is not None:
            log.info("stepdump: the trigger condition of step %d is gone at step %d; the trigger is armed again",
                     self.episode, t)
            self.episode = None
        elif on and not full_after and not self._persist_logged:
            self._persist_logged = True
            log.warning("stepdump: the trigger condition persists since step %d; its episode is written "
                        "(ring, trigger step, %d after), later steps are held as usual until a healthy step "
                        "re-arms the trigger", self.episode, self.after)
        if fired or full_after:
            held = self.drain()
            msg.level = LEVEL_FULL
            if fired:
                self.after_left = self.after
                log.warning("stepdump: trigger fired at step %d; writing it and the %d steps before it", t, len(held))
            return [StepMessage(step=h.step, level=LEVEL_FULL, skipped=h.skipped, items=h.items,
                                state_json=h.state_json, slot=h.slot) for h in held]
        full_items = msg.items
        msg.items = [dataclasses.replace(i, full=False) for i in full_items if i.kind != "state"]
        msg.hold_slot = True
        self._push(Held(t, msg.skipped, slot, full_items, msg.state_json))
        msg.state_json = None
        return []

    def _push(self, held: Held) -> None:
        self._held.append(held)
        if len(self._held) > self.size:
            old = self._held.popleft()
            # The writer may still be computing that step's stats from the slot.
            if not old.slot.written.is_set():
                with blocked(self._pool.gpu_waits):
                    old.slot.written.wait()
            self._pool.release(old.slot)

    def drain(self) -> list[Held]:
        out = list(self._held)
        self._held.clear()
        return out

    def release_all(self) -> None:
        for held in self.drain():
            held.slot.written.wait(timeout=10)
            self._pool.release(held.slot)

    def __len__(self) -> int:
        return len(self._held)
