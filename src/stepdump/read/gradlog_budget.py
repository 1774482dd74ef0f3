"""What a gradient-log rebuild may cost, checked before the work (docs/reliability.md, "Resource
bounds per read").

Rebuilding step *s* decodes the recorded grads of every update from its keyframe on and re-runs
the update over them; the catalog says what those grads are. A few KB of catalog rows can point
the grads of many steps at one big blob of zeros (or at blobs that compress 1000:1), and then
one ``run.tensor()`` decodes and re-applies gigabytes from a store of megabytes (a crafted store:
139 updates, 8.7 GiB decoded from 14.7 MB). Bounding the work by what the call returns, as a delta
chain is, would refuse honest logs: a read of one small tensor honestly re-applies up to *K*-1
updates of the whole model. What an honest log never does is decode much more than it stores:
grads are float noise, each stored once. So the bound is on that:

    bytes the call's updates decode (their grads and states) + 64 KiB per update
        <= DECODE_FACTOR (16) x the distinct bytes the store holds for them + the allowance

(the allowance is the decode budget's, 1 GiB or ``$STEPDUMP_DECODE_BUDGET``; the 64 KiB stand
for what an update costs besides decoding, catalog reads and ``step()`` itself, so a store of
steps with nothing in them is bounded too, while an honest step holds more than 4 KiB: its
state with the RNG's). It is checked from catalog sums before any of the updates it covers is
run or any of their grads read, and refused with :class:`ReadBudgetError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepdump.errors import ReadBudgetError
from stepdump.read.blobs import BUDGET_ENV, DECODE_FACTOR, decode_allowance

if TYPE_CHECKING:
    from stepdump.read.run import Run

#: What one re-applied update counts for besides its grads (see the module docstring).
UPDATE_BYTES = 64 << 10


def _num(v: object) -> int:
    """A catalog sum as a number of bytes (a hostile row's text sums as 0; its read is refused)."""
    try:
        return max(int(v), 0)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        return 0


def _human(n: int) -> str:
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"


class RebuildBudget:
    """The rebuild work of one read call (``GradientLog.read_call``), summed over its reservations."""

    def __init__(self) -> None:
        self.allowance = decode_allowance()
        self.decoded = 0  # grads (and per-update bytes) the reserved updates decode
        self.held = 0  # the distinct stored bytes of those grads

    def reserve(self, run: Run, first: int, last: int, target: int) -> None:
        """Before re-applying updates ``first`` .. ``last`` (to read ``target``): count them, or
        raise :class:`ReadBudgetError` (nothing of them done) if the call would go over budget."""
        if last < first:
            return
        decoded, held, text = (_num(v) for v in run.catalog.stored_work(("grads", "state"), first, last))
        updates = last - first + 1
        decoded += text + updates * UPDATE_BYTES
        held += text
        limit = DECODE_FACTOR * (self.held + held) + self.allowance
        if self.decoded + decoded > limit:
            raise ReadBudgetError(
                f"reading step {target} of {run.path} means re-applying {updates} recorded updates (steps {first}.."
                f"{last}) whose grads and states decode to {_human(self.decoded + decoded)} from {_human(self.held + held)} "
                f"stored: over the read budget of {_human(limit)} ({DECODE_FACTOR} x the stored bytes + "
                f"{_human(self.allowance)}). An honest gradient log stores its grads about as large as they "
                f"decode; this one claims far more work than it holds (grads of many steps naming one blob, or "
                f"compressing far beyond float data). Nothing was decoded. Read a step stored in full, or, if you "
                f"trust the store, raise the allowance: {BUDGET_ENV}=<bytes> (now {self.allowance})")
        self.decoded += decoded
        self.held += held
