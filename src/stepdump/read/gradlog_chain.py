"""A gradient-log chain: stand-in params and a live optimizer that the engine (read/gradlog.py)
steps from a keyframe, and the grads of its next update read ahead on the read call's worker.

An update reads its grads into host buffers the chain keeps, two per param (fresh ones
page-fault more than the update costs): update *t* uses set ``t % 2``, so a worker thread reads
and checks the grads of update *t + 1* into the other set while update *t* runs (pread, xxh3
and torch's kernels let go of the GIL), and an update costs the longer of the two, not their
sum. The worker touches only segment files and buffers; the catalog is read on the reading
thread, and what the worker could not read and verify the reading thread reads itself.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from stepdump.errors import RebuildError, StepdumpError
from stepdump.read.blobs import check_layout
from stepdump.read.rows import Recorded
from stepdump.store.format import Key

if TYPE_CHECKING:
    from stepdump.read.blobs import BlobReader
    from stepdump.store.schema import BlobRow

T = TypeVar("T")
Buffers = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]  # a chain's two sets of grad buffers
#: The kinds a gradient log rebuilds; grads (and module buffers) are stored at every step.
REBUILT_KINDS = ("params", "optimizer")


@dataclass
class Chain:
    """Stand-in params and a live optimizer holding the state before update ``step``."""

    keyframe: int
    step: int
    params: dict[str, torch.Tensor]  # recorded name -> the leaf tensor the optimizer steps
    groups: list[list[str]]  # every group's recorded names (also those not rebuilt: include/exclude)
    optimized: set[str]  # the params of ``params`` the optimizer steps
    optimizer: torch.optim.Optimizer
    checked: frozenset[str] = frozenset()  # kinds whose state at ``step`` matched that step's record
    rows: dict[Key, Recorded] = field(default_factory=dict)  # the step's rows
    # Two host buffers per param, reused every update: update t reads its grads from set t % 2,
    # so those of t + 1 can be read into the other set while update t runs (see Ahead).
    grads: Buffers = field(default_factory=lambda: ({}, {}))
    on_device: dict[str, torch.Tensor] = field(default_factory=dict)  # one per param on another device
    ahead: Ahead | None = None  # the grads of update ``step`` being read on the worker thread


class GroupsChanged(RebuildError):
    """``add_param_group`` between keyframes: a limit of the rebuild, not a difference (a chain
    keeps the param groups of its keyframe)."""


@dataclass
class Ahead:
    """The grads of update ``step`` being read, on the engine's worker thread, into the chain's
    buffers for that update while the update before it runs; ``rows`` are the step's rows the
    jobs were made from. ``done`` gives the names whose buffers then hold grads verified against
    their checksums and fingerprints; the update reads any other grad itself (read_grads)."""

    step: int
    rows: dict[Key, Recorded]
    done: Future[set[str]]


def read_grads(blobs: BlobReader, jobs: list[tuple[str, torch.Tensor, BlobRow, int | None, str]]) -> set[str]:
    """On the worker thread: fill each job's buffer with its blob and verify it (checksum and
    fingerprint, :meth:`BlobReader.read_ahead`); the names of those that are in and verified.
    Never raises: a grad that is not in is read again by the reading thread, whose read raises
    the error that says what is wrong (so an error is reported there, as without a worker)."""
    done: set[str] = set()
    for name, buf, row, fp, fp_kind in jobs:  # fp_kind: the series' fingerprint kind (xxh3, dmix64)
        if blobs.read_ahead(buf, row, fp, fp_kind):
            done.add(name)
    return done


def read_ahead(pool: ThreadPoolExecutor, blobs: BlobReader, params: dict[str, torch.Tensor],
               optimized: set[str], grads: Buffers, s: int, rows: dict[Key, Recorded],
               blob_row: Callable[[Any], BlobRow]) -> Ahead:
    """Start reading the grads of update ``s`` (``rows``: the step's) on ``pool``'s worker, into
    a chain's buffers for ``s`` (``grads``; ``params`` and ``optimized``: its params), the other
    set than the update running meanwhile uses. The catalog is read here, on the reading thread
    (``blob_row``: a grad's checked blob row, :meth:`BlobReader.blob_row`); the worker touches
    only segment files and buffers. A grad whose row is not as the update wants it is left to
    the update, which says what is wrong with it."""
    jobs = []
    for n, p in params.items():
        row = rows.get(("grads", n))
        if n not in optimized or row is None or row.blob is None:
            continue
        try:
            tdtype, dims, _ = check_layout(row.dtype, row.shape)
            b = blob_row(row.blob)
        except StepdumpError:
            continue
        if tdtype == p.dtype and dims == tuple(p.shape):
            jobs.append((n, grad_buffer(grads, s, n, tdtype, dims), b, row.fingerprint, row.fp_kind))
    return Ahead(s, rows, pool.submit(read_grads, blobs, jobs))


def ready_grads(ahead: Ahead | None, t: int) -> dict[str, Recorded]:
    """The grads of update ``t`` the worker read and verified, once it is done with them: name ->
    the row it read (the update takes a grad read ahead only from the row it reads itself)."""
    if ahead is None:
        return {}
    try:
        done = ahead.done.result()  # read_grads never raises; a cancelled job read nothing
    except Exception:  # noqa: BLE001 - then the update reads every grad itself
        return {}
    return {n: ahead.rows[("grads", n)] for n in done} if ahead.step == t else {}


def grad_buffer(grads: Buffers, t: int, n: str, dtype: torch.dtype, dims: tuple[int, ...]) -> torch.Tensor:
    """A chain's host buffer (of its ``grads``) for the grad of ``n`` at update ``t`` (one of two, by ``t % 2``)."""
    bufs = grads[t % 2]
    buf = bufs.get(n)
    if buf is None:
        buf = bufs[n] = torch.empty(dims, dtype=dtype)
    return buf


def halves(sizes: dict[T, int]) -> tuple[list[T], list[T]]:
    """``sizes``' keys in two lists of about the same total size (largest first, each to the lighter
    side): the work of one thread and of the worker beside it."""
    out: tuple[list[T], list[T]] = ([], [])
    total = [0, 0]
    for key in sorted(sizes, key=lambda k: -sizes[k]):
        side = 0 if total[0] <= total[1] else 1
        out[side].append(key)
        total[side] += sizes[key]
    return out
