"""Params changed outside the optimizer between two updates, seen while recording.

A gradient log stores params only at keyframes; a read derives them at the other steps by
re-applying the recorded updates, so it derives what update *k* produced. Code that changes a
param between update *k* and update *k+1* (a clamp or projection after ``optimizer.step()``, a
pruning mask through ``.data`` between backward and step, ``vector_to_parameters``, a write
through a numpy view) makes the params entering update *k+1* something no update produced.
Replay cannot derive them; the record of *k+1* must hold them.

Version counters cannot see all of these (``.data`` edits, ``param.data = ...`` and numpy
writes bump none), so the check is by content: the exact fingerprint (xxh3 of the bytes, the
one every record holds) of every recorded param right after update *k* (the optimizer's
post-hook) and again at the pre-hook of *k+1*, on the training thread, where nothing else
writes them. A param whose fingerprints differ is stored in full at *k+1* and named in that
record's state (``outside_optimizer``, FORMAT.md); the reader takes its stored value instead
of the update's output there. The pre-hook fingerprints are also the record's: a lean row
computed earlier (at the iteration's first forward) that describes other bytes is computed
again.

The other modes watch too, for re-execution (docs/reexecute.md), where the next record is stored
in full (and at every step of a keyframe run, whose replay must redo the edit): the two hashes
are on the training thread, so a lean step is not watched (a re-execution then lists an edit
among the causes it cannot exclude). Re-executing update *k*
compares what it leaves with record *k+1*, which also holds the loop's edit (a clamp, an EMA or
schedule-free evaluation swap that is not a bitwise round trip, a Lookahead sync). Record *k+1*
then names the changed params and holds what update *k* left in them (``after_update``: their
exact fingerprints right after the update), so the optimizer's output is told apart from the
loop's edit, and the edit is its own finding instead of a suspected corruption.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from stepdump.core.dtensor import local_part
from stepdump.core.hashing import LiveHasher, fingerprint
from stepdump.store.format import STATE_OUTSIDE_OPTIMIZER as STATE_KEY

log = logging.getLogger(__name__)

__all__ = ["STATE_KEY", "ParamWatch", "fingerprints"]


def fingerprints(params: Mapping[str, torch.Tensor], hasher: LiveHasher | None = None) -> dict[str, int]:
    """name -> exact fingerprint of each param's bytes (this rank's shard of a DTensor); a param
    with no plain bytes (quantized, meta: not recorded either) is left out. ``hasher``: reuse
    its byte views (the same exact fingerprints, without making a view of each param again)."""
    out = {}
    with torch.no_grad():
        for n, p in params.items():
            t = local_part(p.detach())
            if t.layout == torch.strided and not t.is_quantized and t.device.type != "meta":
                out[n] = hasher(t, n) if hasher is not None else fingerprint(t)
    return out


class ParamWatch:
    """Fingerprints of the recorded params after each update, compared at the next pre-hook."""

    def __init__(self, strict: bool = True) -> None:
        self._after: dict[str, int] | None = None  # right after the latest update; None: none seen yet
        # strict (a gradient log): with no update seen, every param counts as changed (nothing proves
        # it derivable); otherwise nothing is claimed changed and :attr:`watched` says so.
        self._strict = strict
        self.watched = False  # the last before_update compared with what an update left
        self._warned = False
        self._hasher = LiveHasher()  # both moments hash the same params: their byte views are made once

    def _fingerprints(self, params: Mapping[str, torch.Tensor]) -> dict[str, int]:
        """:func:`fingerprints` of ``params`` (the same numbers): by the views kept for the whole
        set where the params are plain CPU tensors, else param by param."""
        fps = self._hasher.fingerprint_all(params)
        return fps if fps is not None else fingerprints(params, self._hasher)

    def after_update(self, params: Mapping[str, torch.Tensor] | None) -> None:
        """The optimizer's post-hook (or a skipped step's end): what the update left. None: the next
        step is not recorded, so nothing will be compared with it (forget the last update's)."""
        self._after = self._fingerprints(params) if params is not None else None

    def left(self, names: list[str]) -> dict[str, int]:
        """What the latest update left in the params ``names`` (their exact fingerprints)."""
        after = self._after or {}
        return {n: after[n] for n in names if n in after}

    def before_update(self, step: int, params: Mapping[str, torch.Tensor]) -> tuple[dict[str, int], list[str]]:
        """The pre-hook of update ``step``: the params' fingerprints now, and the names of those
        that are not what the previous update left (all of them when this Recorder saw no
        update yet: resumed at a step that is not a keyframe, nothing proves them derivable)."""
        self.watched = self._after is not None
        if self._after is None and not self._strict:
            return {}, []  # nothing to compare with (the last update was not watched): no hash at all
        now = self._fingerprints(params)
        if self._after is None:
            return now, list(now)
        # One C-level comparison of the two dicts where nothing changed (the usual case), not a lookup per param.
        changed = [] if now == self._after else [n for n, fp in now.items() if self._after.get(n) != fp]
        if changed and not self._warned:
            self._warned = True
            shown = ", ".join(repr(n) for n in changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
            if self._strict:
                log.warning("stepdump: params changed outside the optimizer between steps %d and %d (e.g. "
                            "clamping, pruning, a write through .data): %s. A gradient log cannot derive them from "
                            "the recorded update, so each param changed so is stored in full at the step it "
                            "changed, from now on (every step stays exact; the run grows by those params' size)",
                            step - 1, step, shown)
            else:
                log.info("stepdump: the loop changed params between update %d and step %d: %s (stored in full "
                         "at the step they changed; re-execution tells them apart from the update)",
                         step - 1, step, shown)
        return now, changed
