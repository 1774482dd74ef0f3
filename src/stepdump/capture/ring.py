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
    """The held steps, and when to write them: ``trigger`` fires, then ``after`` more steps in full."""

    def __init__(self, size: int, pool: StagingPool, trigger: Trigger, after: int | None = None) -> None:
        self.size = size
        self._pool = pool
        self._held: deque[Held] = deque()
        self.trigger = trigger
        self.after = size if after is None else after
        self.after_left = 0
        self.history: dict[str, deque[float]] = {}  # recent scalar values, for the trigger

    def push(self, held: Held) -> None:
        self._held.append(held)
        if len(self._held) > self.size:
            old = self._held.popleft()
            # The writer may still be computing that step's stats from the slot.
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


def remember(history: dict[str, deque[float]], scalars: list[tuple[int, str, Any]]) -> None:
    """Keep recent scalar values for triggers."""
    for _, name, v in scalars:
        hist = history.setdefault(name, deque(maxlen=HISTORY))
        hist.append(float(v.item() if isinstance(v, torch.Tensor) else v))


def ring_step(rec: Any, msg: StepMessage, captured: list[tuple[str, str, torch.Tensor]]) -> None:
    """Stats now; the full copy into the ring, or everything to disk if the trigger fires."""
    t = msg.step
    ring: Ring = rec._ring
    if ring.after_left > 0:
        ring.after_left -= 1
        fired = False
        msg.level = LEVEL_FULL
    else:
        latest = {n: h[-1] for n, h in ring.history.items() if h}
        grads = [p.grad for p in rec._layout.params.values() if p.grad is not None]
        fired = bool(ring.trigger(TriggerInfo(t, latest, grads, ring.history)))
    msg.slot = rec._pool.acquire(lambda: rec._writer.error)
    entries = rec._entries(True)
    msg.state_json = rec._state_json(t, entries, True)
    full_items = rec._stager.stage(msg.slot, entries)
    full_items.extend(Item(kind, name, tensor, True) for kind, name, tensor in captured)
    if fired or msg.level == LEVEL_FULL:
        held = ring.drain()
        for h in held:
            rec._put(StepMessage(step=h.step, level=LEVEL_FULL, skipped=h.skipped, items=h.items,
                                  state_json=h.state_json, slot=h.slot))
        msg.level, msg.items = LEVEL_FULL, full_items
        if fired:
            ring.after_left = ring.after
            log.warning("stepdump: trigger fired at step %d; writing it and the %d steps before it", t, len(held))
        return
    msg.items = [dataclasses.replace(i, full=False) for i in full_items if i.kind != "state"]
    msg.hold_slot = True
    ring.push(Held(t, msg.skipped, msg.slot, full_items, msg.state_json))
    msg.state_json = None
