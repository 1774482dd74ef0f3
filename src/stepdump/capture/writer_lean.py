"""The writer's stats-only rows: a step's lean rows into catalog rows, and held steps' copies described.

A mixin of :class:`stepdump.capture.writer.Writer` (its own idea: rows that carry stats and a
fingerprint but no bytes), as capture/iteration.py is of the Recorder. It uses the writer's
``_held_packed`` (steps' ``StepMessage.packed`` copies not described yet, and their bytes),
``_held_tensors`` and ``_kind_warned``.
"""

from __future__ import annotations

import logging
from typing import Any

from stepdump.capture.packed import LeanRow, Snapshot, describe_all
from stepdump.core.device_lean import HOST_FP_KIND
from stepdump.store.catalog import CatalogWriter

log = logging.getLogger("stepdump.capture.writer")


class LeanRowsMixin:
    """Lean rows into the held tensor rows (module docstring)."""

    _held_packed: list[tuple[int, Snapshot]]
    _held_packed_bytes: int
    _held_tensors: list[tuple[Any, ...]]
    _kind_warned: set[tuple[str, str]]

    def _describe_held(self, cat: CatalogWriter) -> None:
        """The held steps' copies (``StepMessage.packed``) described, into the held tensor rows."""
        held, self._held_packed, self._held_packed_bytes = self._held_packed, [], 0
        if held:
            check = cat.any_fp_kind
            for (step, _), lean in zip(held, describe_all([snap for _, snap in held]), strict=True):
                self._lean_rows(cat, step, lean, check, self._held_tensors)

    def _lean_rows(self, cat: CatalogWriter, step: int | None, lean: list[LeanRow], check: bool,
                   out: list[tuple[Any, ...]]) -> None:
        """The catalog rows of ``lean`` (stats and fingerprint only) at ``step``, appended to ``out``;
        ``check``: whether the store has series of a kind other than xxh3 (then each row's kind is
        checked against its series')."""
        for r in lean:
            sid = cat.series_id(r.kind, r.name, r.param, r.key, r.fp_kind)
            if (check or r.fp_kind is not None) and cat.fp_kind(sid) != (r.fp_kind or HOST_FP_KIND):
                self._other_kind(cat.fp_kind(sid), r)
                continue
            out.append((sid, step, r.dtype, r.shape, None, *r.stats, r.fp))

    def _other_kind(self, have: str, r: LeanRow) -> None:
        """A lean row whose fingerprint is not of its series' kind (a tensor that moved between the
        CPU and a GPU under fingerprint="auto"): no bytes to fingerprint again, so the row is left
        out (a row of the wrong kind would be a wrong answer); said once per tensor."""
        if (r.kind, r.name) not in self._kind_warned:
            self._kind_warned.add((r.kind, r.name))
            log.warning("stepdump: %s %r has %s fingerprints in this run, and a stats-only step gave it a %s one "
                        "(it moved between the CPU and a GPU?); its stats-only rows are left out from here. Record "
                        "with fingerprint='xxh3' or fingerprint='dmix64' to give every tensor one kind",
                        r.kind, r.name, have, r.fp_kind or HOST_FP_KIND)
