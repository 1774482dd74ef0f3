"""Checking a gradient-log chain's state against the fingerprints recorded at its step, hashing
each byte once (the comparison itself: ``GradientLog._check``).

A keyframe's tensors are read verified against the very fingerprints the chain's first check
compares them with, so that check takes them without hashing again (``Trusted``: memory, by
address and size, whose bytes hashed to a fingerprint and that nothing has written since); the
rest is hashed half on this thread, half on the read call's worker.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from stepdump.core.hashing import fingerprint
from stepdump.read.gradlog_chain import halves
from stepdump.store.format import Key

if TYPE_CHECKING:
    from stepdump.read.gradlog_chain import Chain

#: data pointer -> (fingerprint, bytes): memory read verified against that fingerprint (see trust)
Trusted = dict[int, tuple[int, int]]


def trust(trusted: Trusted, t: torch.Tensor, fp: int) -> None:
    """Note that ``t``'s bytes were just read and verified against fingerprint ``fp`` (a keyframe's
    tensors: its check then compares them without hashing them again, :func:`trusted_fingerprint`)."""
    if t.layout == torch.strided and t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0:
        trusted[t.data_ptr()] = (fp, t.numel() * t.element_size())


def trusted_fingerprint(trusted: Trusted, t: torch.Tensor) -> int | None:
    """The fingerprint of ``t`` if it is memory :func:`trust` noted, whole (None: hash it). Only
    before anything has written to the tensors read (a keyframe, before its first update)."""
    if t.layout != torch.strided or t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return None
    got = trusted.get(t.data_ptr())
    return got[0] if got is not None and got[1] == t.numel() * t.element_size() else None


def fingerprints(pool: ThreadPoolExecutor | None, tensors: dict[Key, torch.Tensor],
                 trusted: Trusted) -> dict[Key, int]:
    """Fingerprints of ``tensors`` (those ``trusted`` has, without hashing), the larger half of
    the bytes hashed on the read call's worker while this thread hashes the rest."""
    out: dict[Key, int] = {}
    todo: dict[Key, int] = {}
    for key, t in tensors.items():
        fp = trusted_fingerprint(trusted, t)
        if fp is not None:
            out[key] = fp
        elif t.layout == torch.strided and t.device.type == "cpu":
            todo[key] = t.numel() * t.element_size()
    if pool is None or len(todo) < 2:
        return out  # hashed by differs_from_row
    mine, theirs = halves(todo)
    job = pool.submit(lambda: {key: fingerprint(tensors[key]) for key in theirs})
    out.update({key: fingerprint(tensors[key]) for key in mine})
    out.update(job.result())
    return out


def live(chain: Chain) -> dict[Key, torch.Tensor]:
    """The chain's params and strided optimizer tensors, as ``_check`` compares them with a record."""
    out: dict[Key, torch.Tensor] = {}
    for n, p in chain.params.items():
        out[("params", n)] = p.detach()
    for n, p in chain.params.items():
        for k, v in chain.optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):  # sparse state: its record is the dense series
                out[("optimizer", f"{n}.{k}")] = v.detach() if v.layout == torch.strided else v.to_dense()
    return out
