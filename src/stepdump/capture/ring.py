"""The flight-recorder ring: full copies of the last N steps, kept in memory.

Each held step owns a staging slot. Stats of the step go to the writer at once
(so always-on stats continue); the full copy waits here until a trigger fires,
when it is written as an ordinary full step, or until it falls out of the ring.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from stepdump.capture.staging import Item, Slot, StagingPool


@dataclass
class Held:
    step: int
    skipped: bool
    slot: Slot
    items: list[Item]
    state_json: str | None


class Ring:
    def __init__(self, size: int, pool: StagingPool) -> None:
        self.size = size
        self._pool = pool
        self._held: deque[Held] = deque()

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
