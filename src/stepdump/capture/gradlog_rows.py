"""A step's small staged tensors described together on the writer thread.

A gradient log stores every grad at every step; on a small model most of them are biases and
norm weights of a few hundred elements. Describing each on its own
(:func:`stepdump.core.stats.compute_stats` and a fingerprint) would take a dozen calls per tensor,
each numpy or torch call a chance to hand the GIL to the training thread and back. Here the small
float tensors a step staged are packed into one buffer (one C call) and described by
:func:`stepdump.capture.packed.packed_rows`: a few passes over the whole buffer, the same stats
bit for bit as ``compute_stats`` gives each (tests/test_lean_packed.py, and
tests/test_gradlog_handoffs.py on the writer's rows), and the same fingerprint (xxh3 of each
tensor's bytes). Larger tensors keep ``compute_stats``: its torch path (fp32 sums) is what every
other record of them holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stepdump.capture.packed import FUSED_DTYPES, SMALL, packed_rows
from stepdump.capture.staging import Item
from stepdump.core.stats import StatsTuple

_flatten = torch._C._nn.flatten_dense_tensors  # one C call: each tensor viewed flat, concatenated
# Fewer small tensors than this in a step: described one by one (packing buys nothing).
_MIN_PACKED = 2


def small_rows(items: Sequence[Item], no_stats: frozenset[str]) -> dict[int, tuple[StatsTuple, int]]:
    """``{index: (stats, fingerprint)}`` for the staged small fp32/fp64 CPU tensors of ``items``
    (kinds in ``no_stats`` left out: they get a fingerprint only); the others are not in it."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, item in enumerate(items):
        t = item.tensor
        # Staged copies only (``raw``: the slot's buffer, contiguous): a live tensor is read once, by the writer.
        if item.raw is None or item.live or item.device_stats is not None or item.kind in no_stats:
            continue
        if t.dtype in FUSED_DTYPES and 0 < t.numel() <= SMALL and t.layout == torch.strided and t.is_cpu:
            by_dtype.setdefault(t.dtype, []).append(i)
    out: dict[int, tuple[StatsTuple, int]] = {}
    for idx in by_dtype.values():
        if len(idx) < _MIN_PACKED:
            continue
        ts = [items[i].tensor for i in idx]
        with torch.no_grad():
            buf = _flatten(ts)
        stats, fps = packed_rows([items[i].kind for i in idx], buf, [t.numel() for t in ts])
        out.update(zip(idx, zip(stats, fps, strict=True), strict=True))
    return out
