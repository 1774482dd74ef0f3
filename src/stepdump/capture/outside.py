"""Params changed outside the optimizer, seen while recording a gradient log.

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
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from operator import attrgetter
from typing import Any

import numpy as np
import torch
import xxhash

from stepdump.core.dtensor import local_part
from stepdump.core.hashing import LiveHasher, fingerprint, raw_bytes
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


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_ptr = torch.Tensor.data_ptr
_stride = torch.Tensor.stride
_META = attrgetter("dtype", "shape")


class _Views:
    """Byte views of a set of plain, contiguous CPU params, made once, and the key that proves they
    still cover each param's bytes: its data pointer, dtype, shape and strides now (a view holds the
    memory it was made from, so no other tensor gets that address while it is kept; LiveHasher's
    reasoning, for the whole set in a few C-level calls instead of several Python calls a param)."""

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        ts = list(params.values())
        self.names = list(params)
        self.key = self.key_of(ts)
        self.views = [raw_bytes(t.detach()) for t in ts]

    @staticmethod
    def key_of(ts: list[torch.Tensor]) -> tuple[list[int], list[Any], list[Any]]:
        return list(map(_ptr, ts)), list(map(_META, ts)), list(map(_stride, ts))

    @staticmethod
    def fits(params: Mapping[str, torch.Tensor]) -> bool:
        return all(type(t) in _PLAIN and t.layout == torch.strided and t.is_cpu and not t.is_quantized
                   and t.is_contiguous() and t.numel() > 0 for t in params.values())

    def fingerprints(self) -> dict[str, int]:
        fps = np.fromiter(map(xxhash.xxh3_64_intdigest, self.views), dtype=np.uint64, count=len(self.views))
        return dict(zip(self.names, fps.view(np.int64).tolist(), strict=True))


class ParamWatch:
    """Fingerprints of the recorded params after each update, compared at the next pre-hook."""

    def __init__(self) -> None:
        self._after: dict[str, int] | None = None  # right after the latest update; None: none seen yet
        self._warned = False
        self._hasher = LiveHasher()  # both moments hash the same params: their byte views are made once
        self._views: _Views | None = None  # the same, for a whole set of plain params

    def _fingerprints(self, params: Mapping[str, torch.Tensor]) -> dict[str, int]:
        """:func:`fingerprints` of ``params`` (the same numbers), by the kept views where they still
        cover the params (the same names, memory, dtypes, shapes and strides as when made)."""
        v = self._views
        if v is not None and v.names == list(params) and v.key == v.key_of(list(params.values())):
            return v.fingerprints()
        if not _Views.fits(params):
            self._views = None
            return fingerprints(params, self._hasher)
        self._views = _Views(params)
        return self._views.fingerprints()

    def after_update(self, params: Mapping[str, torch.Tensor]) -> None:
        """The optimizer's post-hook (or a skipped step's end): what the update left."""
        self._after = self._fingerprints(params)

    def before_update(self, step: int, params: Mapping[str, torch.Tensor]) -> tuple[dict[str, int], list[str]]:
        """The pre-hook of update ``step``: the params' fingerprints now, and the names of those
        that are not what the previous update left (all of them when this Recorder saw no
        update yet: resumed at a step that is not a keyframe, nothing proves them derivable)."""
        now = self._fingerprints(params)
        if self._after is None:
            return now, list(now)
        changed = [n for n, fp in now.items() if self._after.get(n) != fp]
        if changed and not self._warned:
            self._warned = True
            shown = ", ".join(repr(n) for n in changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
            log.warning("stepdump: params changed outside the optimizer between steps %d and %d (e.g. clamping, "
                        "pruning, a write through .data): %s. A gradient log cannot derive them from the recorded "
                        "update, so each param changed so is stored in full at the step it changed, from now on "
                        "(every step stays exact; the run grows by those params' size)", step - 1, step, shown)
        return now, changed
