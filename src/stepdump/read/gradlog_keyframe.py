"""A gradient-log chain's start: stand-in params and a fresh optimizer loaded with a keyframe
(read/gradlog.py, the engine).

The keyframe is read once into the tensors the optimizer then updates in place. Its params
(and the first update's grads) are read on the read call's worker thread while this thread
reads the optimizer state (for Adam twice the params' bytes), so the two halves of the read
run side by side. Every tensor is read verified against the fingerprint recorded at the
keyframe; the chain's first check compares with those same fingerprints, so what was read
verified is not hashed a second time (``trusted``: memory, by address and size, whose bytes
hashed to a fingerprint and that nothing has written since).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from stepdump.core.classes import torch_optimizer
from stepdump.core.hashing import XXH3
from stepdump.errors import RebuildError, StepdumpError
from stepdump.read.blobs import check_layout
from stepdump.read.gradlog_chain import Buffers, Chain, read_ahead, read_grads
from stepdump.read.gradlog_check import Trusted, trust
from stepdump.read.rows import Recorded
from stepdump.read.state import optimizer_state_dict, param_indices, recorded_groups
from stepdump.store.format import Key

if TYPE_CHECKING:
    from stepdump.read.blobs import BlobReader
    from stepdump.read.gradlog_window import Window
    from stepdump.read.run import Run

log = logging.getLogger(__name__)

# glibc's DEFAULT_MMAP_THRESHOLD_MAX (64-bit): the highest its malloc raises the mmap threshold to.
_MMAP_THRESHOLD_MAX = 32 << 20


def warm_allocator(largest: int) -> None:
    """Free one mapped block of a few times ``largest`` bytes (never touched, so it costs no page faults).

    glibc's malloc hands the top of its heap back to the system once more than its trim threshold
    is free there, and starts with low thresholds (128 KiB mmap / 256 KiB trim) that rise to a
    mapped block's size (trim: twice that) when one is freed. A training loop raises them early
    (activations); a chain of optimizer steps alone may not, and then every temporary of every
    update (Adam: two per param, ``sqrt`` and the division) is trimmed away when freed and comes
    back as fresh pages, page faults that made a rebuilt ``Adam.step()`` twice as slow as the same
    step in training. Freeing this block raises the thresholds as training does. Elsewhere than
    glibc (or with thresholds set by the user) it is a plain allocation and nothing else.
    """
    size = min(_MMAP_THRESHOLD_MAX, 4 * largest)
    if size > 0:
        torch.empty(size, dtype=torch.uint8)  # allocated and freed at once


def read_tensor(blobs: BlobReader, blob: Any, dtype: Any, shape: Any, fp: int,
                trusted: Trusted | None = None, fp_kind: str = XXH3) -> torch.Tensor:
    """A stored tensor in memory of its own: the chain updates it in place for many steps
    (``BlobReader.tensor`` hands out a buffer the read call keeps until it ends). With
    ``trusted``: noted there as verified against ``fp`` (see :func:`trust`)."""
    tdtype, dims, _ = check_layout(dtype, shape)
    t = blobs.read_into(torch.empty(dims, dtype=tdtype), blob, dtype, shape, fp, fp_kind)
    if trusted is not None:
        trust(trusted, t, fp)
    return t


def _read_params(blobs: BlobReader, pool: ThreadPoolExecutor | None, rows: dict[Key, Recorded], names: list[str],
                 trusted: Trusted) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    """The keyframe's params ``names``, read on the read call's worker (while this thread reads
    the optimizer state, twice their size for Adam): their buffers, and a function that waits
    for the worker and reads here whatever it could not read and verify, raising the error a
    read without a worker raises."""
    bufs: dict[str, torch.Tensor] = {}
    jobs = []
    for n in names:
        row = rows[("params", n)]
        try:
            tdtype, dims, _ = check_layout(row.dtype, row.shape)
            b = blobs.blob_row(row.blob) if pool is not None else None
        except StepdumpError:
            continue  # left to ``finish``, which raises it
        bufs[n] = torch.empty(dims, dtype=tdtype)
        if b is not None:
            jobs.append((n, bufs[n], b, row.fingerprint, row.fp_kind))
    done = pool.submit(read_grads, blobs, jobs) if pool is not None and jobs else None

    def finish() -> None:
        ok = done.result() if done is not None else set()  # read_grads never raises
        for n in names:
            row = rows[("params", n)]
            if n in ok:
                with blobs.call() as scope:
                    scope.returned += check_layout(row.dtype, row.shape)[2]  # what read_into counts
                if row.fingerprint is not None:
                    trust(trusted, bufs[n], row.fingerprint)
            else:
                bufs[n] = read_tensor(blobs, row.blob, row.dtype, row.shape, row.fingerprint, trusted, row.fp_kind)

    return bufs, finish


def start_chain(run: Run, blobs: BlobReader, window: Window, pool: ThreadPoolExecutor | None, k: int,
                device: torch.device, check: Callable[[Chain, Trusted], None]) -> Chain:
    """Stand-in params and a fresh optimizer loaded with keyframe ``k`` of ``run``.

    Args:
        run: The run read from.
        blobs: Its blob reader.
        window: The catalog facts of its steps (the keyframe's rows, its grads' blob rows).
        pool: The read call's worker (None: everything is read on this thread).
        k: The keyframe.
        device: Where the stand-in params live (the recording's device).
        check: Compares the loaded chain with the keyframe's fingerprints (raises on a
            difference); given the memory read verified, which it need not hash again.
    """
    cls = torch_optimizer(run.meta)
    if cls is None:  # refusal_of() refuses it before
        raise RebuildError(f"{run.path}: the optimizer it recorded is not a torch.optim class; only keyframes "
                           "are readable")
    state = run.step_state(k)
    groups = [list(g["params"]) for g in recorded_groups(run, k, state)]
    hyper = [dict(g["hyper"]) for g in recorded_groups(run, k, state)]
    rows = window.rows(k)
    stored = [n for (kind, n), row in rows.items() if kind == "params" and row.blob is not None]
    # Every param stored at the keyframe: those the optimizer steps, and the model's others
    # (not optimized: they keep their keyframe value, which each step's fingerprints confirm).
    order = {n: i for i, n in enumerate([*param_indices(groups), *stored])}
    names = sorted(stored, key=order.__getitem__)
    if not any(n in names for g in groups for n in g):
        raise RebuildError(f"keyframe {k} of {run.path} stores no optimized params, so nothing can be rebuilt "
                           "from it; record with capture including 'params'")
    # The keyframe's tensors, read verified against the fingerprints its check compares them
    # with: that check does not hash them again (``trusted``).
    trusted: Trusted = {}
    bufs, finish = _read_params(blobs, pool, rows, names, trusted)
    optimized = {n for g in groups for n in g if n in bufs}
    grads: Buffers = ({}, {})
    # The first update's grads, on the worker too, after the params (nothing else waits for it).
    ahead = (read_ahead(pool, blobs, bufs, optimized, grads, k, rows, window.blob_row)
             if pool is not None else None)
    # The constructor's own flags (fused, foreach, capturable, differentiable, ...) decide
    # which kernel runs: give it group 0's recorded values; each group keeps its own too.
    accepted = set(inspect.signature(cls).parameters)
    kwargs = {key: v for key, v in hyper[0].items() if key in accepted and key != "params"}
    # Read into tensors of their own, which load_state_dict keeps as they are (already of the
    # param's dtype and device) and the optimizer then updates in place.
    osd = optimizer_state_dict(run, blobs, k, read=functools.partial(read_tensor, blobs, trusted=trusted))
    finish()
    params: dict[str, torch.Tensor] = {}
    for n, t in bufs.items():
        t = t.to(device)
        params[n] = torch.nn.Parameter(t, requires_grad=t.is_floating_point() or t.is_complex())
    warm_allocator(max((p.numel() * p.element_size() for p in params.values()), default=0))
    arg = [{**h, "params": [params[n] for n in g if n in params]} for g, h in zip(groups, hyper, strict=True)]
    # Renumber the recorded state for the params rebuilt (a subset under include=/exclude=).
    old = param_indices(groups)
    new = param_indices([[n for n in g if n in params] for g in groups])
    osd = {"state": {new[n]: osd["state"][old[n]] for n in new if old[n] in osd["state"]},
           "param_groups": [{**pg, "params": [new[n] for n in g if n in params]}
                            for pg, g in zip(osd["param_groups"], groups, strict=True)]}
    try:
        opt = cls(arg, **kwargs)
        opt.load_state_dict(osd)
    except Exception as e:  # torch refuses this configuration here (fused on this device, ...)
        raise RebuildError(f"cannot rebuild from keyframe {k} of {run.path}: building a {cls.__name__} with the "
                           f"recorded hyperparameters and state failed on {device} ({type(e).__name__}: {e})") from e
    chain = Chain(keyframe=k, step=k, params=params, groups=groups, optimized=optimized, optimizer=opt,
                  grads=grads, ahead=ahead)
    check(chain, trusted)
    if "params" not in chain.checked:
        log.debug("stepdump: keyframe %s of %s has no fingerprints to check its loaded state against", k, run.path)
    return chain
