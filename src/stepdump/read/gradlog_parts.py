"""The pieces of the gradient-log engine (read/gradlog.py) that need no engine: its chain and
snapshot records, the read of the next update's grads on a worker thread, what a verification
of the segments found, and why a run cannot be re-run."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from stepdump.core.classes import described, torch_optimizer
from stepdump.core.hashing import fingerprint
from stepdump.errors import RebuildError, StepdumpError
from stepdump.read.blobs import check_layout
from stepdump.read.rows import Recorded
from stepdump.store.format import SPARSE_COO_PREFIX, Key

if TYPE_CHECKING:
    from stepdump.read.blobs import BlobReader
    from stepdump.read.run import Run
    from stepdump.store.schema import BlobRow

T = TypeVar("T")
Buffers = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]  # a chain's two sets of grad buffers
#: data pointer -> (fingerprint, bytes): memory read verified against that fingerprint (see trust)
Trusted = dict[int, tuple[int, int]]
#: The kinds a gradient log rebuilds; grads (and module buffers) are stored at every step.
REBUILT_KINDS = ("params", "optimizer")
# Optimizers that take sparse gradients only (SparseAdam refuses dense ones): a run recorded
# before stepdump stored sparse grads as sparse (FORMAT.md, "Sparse tensors") cannot drive them.
_NEEDS_SPARSE_GRADS = ("SparseAdam",)
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


@dataclass
class Snapshot:
    """The verified state of one step, handed out as clones. While ``chain`` is set the tensors
    are that chain's own (no copy for a read that ends there); ``GradientLog._release``
    copies them before the chain moves on."""

    step: int
    tensors: dict[Key, torch.Tensor]
    per_param: dict[str, dict[str, torch.Tensor]]
    verified: set[str]  # the kinds checked against fingerprints (at this step or, run on, a later one)
    chain: Chain | None = None


class GroupsChanged(RebuildError):
    """``add_param_group`` between keyframes: a limit of the rebuild, not a difference."""


@dataclass
class SegmentReport:
    """What :meth:`GradientLog.verify_segments` found (``stepdump verify``)."""

    checked: int = 0  # segments whose updates reproduced every recorded fingerprint up to the next keyframe
    problems: list[tuple[int, str]] = field(default_factory=list)  # (first step that differs, why)
    unchecked: list[str] = field(default_factory=list)  # what could not be re-run here, and why


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


def take(chain: Chain) -> Snapshot:
    """The chain's state as a snapshot of its own tensors (no copy; see :meth:`_release`)."""
    tensors: dict[Key, torch.Tensor] = {}
    per_param: dict[str, dict[str, torch.Tensor]] = {}
    for n, p in chain.params.items():
        tensors[("params", n)] = p.detach()
    for n, p in chain.params.items():
        for k, v in chain.optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and v.layout == torch.strided:
                tensors[("optimizer", f"{n}.{k}")] = per_param.setdefault(n, {})[k] = v.detach()
            elif isinstance(v, torch.Tensor):  # sparse state (SGD momentum of sparse grads): its series is
                tensors[("optimizer", f"{n}.{k}")] = v.detach().to_dense()  # dense; the state JSON has it exact
    return Snapshot(chain.step, tensors, per_param, set(chain.checked), chain)

def copied(snap: Snapshot) -> Snapshot:
    """``snap`` in private copies (a tensor in both maps stays one tensor)."""
    copies = {id(t): t.clone() for t in snap.tensors.values()}
    for st in snap.per_param.values():
        copies.update({id(t): t.clone() for t in st.values() if id(t) not in copies})
    return Snapshot(snap.step, {key: copies[id(t)] for key, t in snap.tensors.items()},
                    {n: {k: copies[id(t)] for k, t in st.items()} for n, st in snap.per_param.items()},
                    set(snap.verified))


def refusal_of(run: Run) -> RebuildError | None:
    """Why ``run``'s optimizer cannot be re-run at all (None: it can)."""
    cls = torch_optimizer(run.meta)  # by module and qualified name (core/classes.py), never imported
    where = f"{run.path} (a gradient log)"
    if cls is None:
        return RebuildError(f"{where} was recorded with optimizer {described(run.meta, 'optimizer')}, which is not "
                            "a torch.optim class, so its updates cannot be re-applied here; only keyframes are "
                            "readable")
    name = cls.__name__
    closure = inspect.signature(cls.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        return RebuildError(f"{where} was recorded with {name}, which re-evaluates the loss inside step() (a "
                            "closure), so its updates cannot be re-applied from recorded gradients; only "
                            "keyframes are readable (record with keyframe_every=K and use stepdump.replay, or "
                            "record every step in full)")
    if name in _NEEDS_SPARSE_GRADS and not run.catalog.has_dtype_prefix("grads", SPARSE_COO_PREFIX):
        return RebuildError(f"{where} was recorded with {name}, which needs sparse gradients, and its gradients "
                            "are stored dense (recorded by a stepdump from before sparse gradients were stored "
                            "sparse), so its updates cannot be re-applied; only keyframes are readable")
    device = run.meta.get("device")
    if isinstance(device, str) and device.startswith("cuda") and not torch.cuda.is_available():
        return RebuildError(f"{where} was recorded on {device}; its updates must be re-applied by the same "
                            "kernels, and this machine has no CUDA device; only keyframes are readable here")
    return None
