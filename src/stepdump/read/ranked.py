"""``DistributedRun``: one view of a run recorded by several ranks (DDP, FSDP2 / DTensor).

The run is a directory (or URL) with ``ranks.json`` and one ordinary store per
recorded rank (:mod:`stepdump.store.ranks`). :meth:`DistributedRun.rank` opens
one rank's store as a plain :class:`~stepdump.read.run.Run`. The methods a Run
has answer for the whole job:

* step lists, names, scalars, non-tensor state: those of the *primary* rank
  (the lowest recorded one, normally 0) -- under DDP every rank steps alike;
* :meth:`~DistributedRun.stats`: every rank's rows, with a ``rank`` column;
* :meth:`~DistributedRun.tensor`, ``state_dict``, ``optimizer_state_dict``:
  full tensors. A tensor sharded by FSDP2 / DTensor is put together from each
  rank's shard at the offset its rank recorded (``meta.distributed.sharding``);
  a replicated one is the primary rank's. ``local=True`` / ``rank=r`` give a
  rank's tensor as recorded (its shard);
* :meth:`~DistributedRun.restore`: each rank loads its own record (its shard
  into DTensor parameters, see :func:`stepdump.read.restore.restore`).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stepdump.errors import (
    ConfigError,
    StepNotFoundError,
    TensorNotFoundError,
)
from stepdump.read.run import Run, StepRange, _as_step
from stepdump.read.state import layout_entries, param_indices
from stepdump.store import ranks as ranks_file
from stepdump.store.fsspec_storage import FsspecStorage, default_cache_dir, is_url

if TYPE_CHECKING:  # pandas loads in stats(), the one method that builds a frame here
    import pandas as pd


#: Rank stores a DistributedRun keeps open at once (``run.max_open``).
MAX_OPEN_RANKS = 32


class DistributedRun:
    """A run recorded by several ranks of one ``torch.distributed`` job; open with :func:`stepdump.open`.

    Attributes:
        path: The run directory (or URL).
        world_size: Number of ranks in the job that recorded it.
        ranks: The ranks that recorded (each has a store).
        primary: The rank whose steps, names and scalars stand for the run.
    """

    def __init__(self, path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> None:
        self._url = str(path).rstrip("/") if is_url(path) else None
        if self._url is not None:
            self.path: Path | str = self._url
            self._cache = Path(cache_dir) if cache_dir is not None else default_cache_dir(self._url)
            self._remote: FsspecStorage | None = FsspecStorage(self._url, storage_options)
            data = self._remote.get_bytes(ranks_file.RANKS_FILE)
            if data is None:
                from stepdump.errors import NotARunError

                raise NotARunError(f"{self._url} has no {ranks_file.RANKS_FILE}; it is not a multi-rank run")
            self.layout = ranks_file.parse(data, f"{self._url}/{ranks_file.RANKS_FILE}")
        else:
            self.path = Path(path)
            self._remote = None
            self.layout = ranks_file.read_local(self.path)
        self.world_size: int = int(self.layout["world_size"])
        self.ranks: list[int] = list(self.layout["ranks"])
        self.primary: int = min(self.ranks)
        # Rank stores opened so far, least recently used first; at most max_open are kept open
        # here (each holds a SQLite connection, its page cache and segment files): an analysis
        # that walks 1,000 ranks one by one holds ~max_open, not 1,000 (tests/test_ranks_bounded.py).
        self._runs: OrderedDict[int, Run] = OrderedDict()
        # Every rank store opened here that is still alive (held by the LRU above or a caller).
        self._held: weakref.WeakValueDictionary[int, Run] = weakref.WeakValueDictionary()
        self.max_open: int = MAX_OPEN_RANKS
        self._lock = threading.Lock()
        self._sharding: dict[int, dict[str, Any]] = {}

    # -- ranks -----------------------------------------------------------------
    def rank(self, r: int) -> Run:
        """Rank ``r``'s store as a plain Run (its own tensors: shards under FSDP2)."""
        r = _as_step(r)
        if r not in self.ranks:
            raise TensorNotFoundError(
                f"rank {r} was not recorded in {self.path} (recorded ranks: {self.ranks}, world_size "
                f"{self.world_size}); record it with Recorder(..., ranks=...) including {r}"
            )
        with self._lock:  # the columnar export opens ranks from a thread pool
            return self._rank_locked(r)

    def _rank_locked(self, r: int) -> Run:
        run = self._runs.get(r)
        if run is not None:
            self._runs.move_to_end(r)
            return run
        while len(self._runs) >= max(1, self.max_open):  # room first: never max_open + 1 open here
            # Dropped, not closed: a caller may still hold it (it closes when no one does).
            self._runs.popitem(last=False)
        # One a caller still holds (a list of every rank's store, walked again): that one, not a
        # second catalog of the same rank opened beside it (a report walks 256 ranks ~7 times).
        run = self._held.get(r)
        if run is None:
            name = ranks_file.rank_dir(r)
            if self._remote is not None:
                from stepdump.read.remote import RemoteRun

                cache = self._cache / name
                run = RemoteRun(f"{self._url}/{name}", cache_dir=cache, storage=self._remote.child(name, cache))
            else:
                run = Run(ranks_file.local_rank_dir(Path(self.path), r))
            self._held[r] = run
        self._runs[r] = run
        return run

    @property
    def _primary(self) -> Run:
        return self.rank(self.primary)

    def sharding(self, name: str, rank: int | None = None) -> dict[str, Any] | None:
        """Where parameter ``name``'s shard on ``rank`` sits in the full tensor (None: not sharded)."""
        r = self.primary if rank is None else rank
        if r not in self._sharding:
            self._sharding[r] = self.rank(r).meta.get("distributed", {}).get("sharding", {}) or {}
        return self._sharding[r].get(name)

    # -- lifecycle -------------------------------------------------------------
    def close(self) -> None:
        for run in self._runs.values():
            run.close()
        self._runs.clear()
        self._held = weakref.WeakValueDictionary()  # closed or left to their holders: not handed out again

    def __enter__(self) -> DistributedRun:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<stepdump.types.DistributedRun {str(self.path)!r}: world_size {self.world_size}, "
                f"ranks {self.ranks}, {len(self.all_steps)} steps>")

    @property
    def remote(self) -> bool:
        """True for a run read from a URL (its rank stores are fetched into a local cache)."""
        return self._remote is not None

    @property
    def meta(self) -> dict[str, Any]:
        """The primary rank's catalog meta (``meta["distributed"]`` says which rank it is)."""
        return self._primary.meta

    @property
    def format_version(self) -> int:
        return self._primary.format_version

    @property
    def live(self) -> bool:
        """True while any rank's Recorder is still writing."""
        return any(self.rank(r).live for r in self.ranks)

    def stores(self) -> Iterator[tuple[int | None, Run]]:
        """``(rank, rank's store)`` for every recorded rank, in rank order: what analyses
        about one store (``verify``, the ``check`` rules, ``diff``) run on, rank by rank."""
        for r in self.ranks:
            yield r, self.rank(r)

    def blob_bytes(self) -> tuple[int, int]:
        """(stored, raw) bytes of tensor data, summed over every rank's store."""
        sizes = [self.rank(r).blob_bytes() for r in self.ranks]
        return sum(s for s, _ in sizes), sum(r for _, r in sizes)

    # -- steps, names, scalars: the primary rank's -------------------------------
    @property
    def steps(self) -> list[int]:
        return self._primary.steps

    @property
    def stats_steps(self) -> list[int]:
        return self._primary.stats_steps

    @property
    def all_steps(self) -> list[int]:
        return self._primary.all_steps

    @property
    def skipped_steps(self) -> list[int]:
        return self._primary.skipped_steps

    def kinds(self) -> list[str]:
        return self._primary.kinds()

    def names(self, kind: str = "params") -> list[str]:
        return self._primary.names(kind)

    def fingerprints(self, step: int, kinds: Iterable[str] | None = None, *,
                     rank: int | None = None) -> dict[tuple[str, str], int]:
        return self.rank(self.primary if rank is None else rank).fingerprints(step, kinds)

    def fingerprint_kinds(self, step: int, kinds: Iterable[str] | None = None, *,
                          rank: int | None = None) -> dict[tuple[str, str], str]:
        """:meth:`Run.fingerprint_kinds` of ``rank`` (default the primary rank)."""
        return self.rank(self.primary if rank is None else rank).fingerprint_kinds(step, kinds)

    def scalars(self, names: str | Iterable[str] | None = None, steps: StepRange = None, *,
                rank: int | None = None) -> pd.DataFrame:
        """Scalars logged on ``rank`` (default the primary rank)."""
        return self.rank(self.primary if rank is None else rank).scalars(names, steps)

    def scalar_rows(self, steps: StepRange = None, *, nan_only: bool = False,
                    rank: int | None = None) -> list[tuple[int, str, float | None]]:
        """:meth:`Run.scalar_rows` of ``rank`` (default the primary rank)."""
        return self.rank(self.primary if rank is None else rank).scalar_rows(steps, nan_only=nan_only)

    def profile(self, steps: StepRange = None, *, rank: int | None = None) -> pd.DataFrame:
        return self.rank(self.primary if rank is None else rank).profile(steps)

    def stats(self, kind: str | None = None, name: str | None = None, steps: StepRange = None, *,
              ranks: Iterable[int] | None = None, dtype_backend: str = "numpy") -> pd.DataFrame:
        """Every recorded rank's stats (:meth:`Run.stats`) in one frame, with a ``rank`` column.

        Under FSDP2 a rank's row describes its shard; under DDP the rows of one
        (step, kind, name) should agree (:func:`stepdump.analysis.cross_rank.cross_rank` checks that).
        ``dtype_backend="pyarrow"``: Arrow-backed columns, ranks read a few at a time on a thread
        pool (:mod:`stepdump.read.columnar`; ``stepdump export-stats`` writes it as Parquet).
        """
        import pandas as pd

        if dtype_backend == "pyarrow":
            from stepdump.read import columnar

            return columnar.frame(self, kind, name, steps, ranks=ranks)
        if dtype_backend != "numpy":
            raise ConfigError(f"dtype_backend={dtype_backend!r}: choose 'numpy' or 'pyarrow'")

        frames = []
        for r in (self.ranks if ranks is None else list(ranks)):
            df = self.rank(r).stats(kind, name, steps)
            df.insert(1, "rank", r)
            frames.append(df)
        out = pd.concat(frames, ignore_index=True)
        return out.sort_values(["step", "rank"], kind="stable").reset_index(drop=True)

    def step_state(self, step: int, *, rank: int | None = None) -> dict[str, Any]:
        return self.rank(self.primary if rank is None else rank).step_state(step)

    def rng_state(self, step: int, *, rank: int | None = None) -> dict[str, Any]:
        """RNG state of ``rank`` (default the primary) at the start of iteration ``step``."""
        return self.rank(self.primary if rank is None else rank).rng_state(step)

    def scheduler_state_dict(self, step: int) -> dict[str, Any] | None:
        return self._primary.scheduler_state_dict(step)

    def scaler_state_dict(self, step: int) -> dict[str, Any] | None:
        return self._primary.scaler_state_dict(step)

    # -- tensors -----------------------------------------------------------------
    def tensor(self, name: str, step: int, kind: str = "params", *, rank: int | None = None,
               local: bool = False) -> torch.Tensor:
        """The full tensor ``name`` of ``kind`` at ``step``.

        Args:
            rank: Return this rank's tensor as it recorded it (its shard, for a
                sharded tensor) instead of the full one.
            local: Return the primary rank's tensor as recorded (same as
                ``rank=run.primary``).
        """
        if rank is not None or local:
            return self.rank(self.primary if rank is None else rank).tensor(name, step, kind)
        param = self._sharded_param(kind, name)
        if param is None:
            return self._primary.tensor(name, step, kind)
        return self._assemble(name, step, kind, param)

    def tensors(self, step: int, kind: str = "params", *, rank: int | None = None,
                local: bool = False) -> dict[str, torch.Tensor]:
        """Every stored tensor of ``kind`` at ``step``, by name (full tensors unless ``rank``/``local``)."""
        if rank is not None or local:
            return self.rank(self.primary if rank is None else rank).tensors(step, kind)
        step = _as_step(step)
        return {n: self.tensor(n, step, kind) for n in self._primary.stored_names(step, kind)}

    def state_dict(self, step: int) -> OrderedDict[str, torch.Tensor]:
        """``model.state_dict()`` at the start of iteration ``step``, with full (unsharded) tensors."""
        step = _as_step(step)
        self._primary._require_full(step)  # a gradient log's primary also reads rebuilt steps
        entries = layout_entries(self._primary)
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        loaded: dict[tuple[str, str], torch.Tensor] = {}
        for key, kind, name in entries:
            if (kind, name) not in loaded:
                loaded[(kind, name)] = self.tensor(name, step, kind)
            out[key] = loaded[(kind, name)]
        return out

    def optimizer_state_dict(self, step: int) -> dict[str, Any]:
        """``optimizer.state_dict()`` before update ``step``, with full (unsharded) state tensors."""
        osd = self._primary.optimizer_state_dict(step)
        groups = self._primary.step_state(step)["groups"]  # optimizer_state_dict checked them
        index = {i: n for n, i in param_indices(g["params"] for g in groups).items()}
        for i, st in osd["state"].items():
            param = index.get(i)
            if param is None or self.sharding(param) is None:
                continue
            for k, v in list(st.items()):
                if isinstance(v, torch.Tensor):
                    st[k] = self.tensor(f"{param}.{k}", step, "optimizer")
        return osd

    def restore(self, step: int, model: Any, optimizer: Any = None, scheduler: Any = None, scaler: Any = None,
                *, rng: bool = True, rank: int | None = None, extra_state: Any = None) -> None:
        """Restore this process's rank (``torch.distributed.get_rank()``; ``rank=`` to choose) at ``step``.

        Call it on every rank with that rank's model and optimizer: each loads
        its own record, DTensor parameters their own shard (same world size
        and sharding as the recording job).
        """
        if rank is None:
            dist = torch.distributed
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else self.primary
        self.rank(rank).restore(step, model, optimizer, scheduler, scaler, rng=rng, extra_state=extra_state)

    def export(self, step: int, path: str | os.PathLike[str], format: str = "torch", grads: bool = False,
               trainer: Mapping[str, Any] | None = None, rank: int | None = None) -> Path:
        """Write step ``step`` as one consolidated checkpoint (full tensors), or rank ``rank``'s
        store as recorded; see :meth:`Run.export`."""
        from stepdump.read.export import export

        return export(self, step, path, format=format, grads=grads, trainer=trainer,  # type: ignore[arg-type]
                      rank=rank)

    # -- assembling shards -------------------------------------------------------
    def _sharded_param(self, kind: str, name: str) -> str | None:
        """The parameter whose sharding ``kind``/``name`` follows, or None if it is not sharded."""
        if kind in ("params", "grads"):
            param: str | None = name
        elif kind == "optimizer":
            param = self._primary.catalog.optimizer_param(name)
        else:
            return None
        return param if param is not None and self.sharding(param) is not None else None

    def _assemble(self, name: str, step: int, kind: str, param: str) -> torch.Tensor:
        spec = self.sharding(param)
        if spec is None:  # _sharded_param checked it; a catalog changed under us
            raise TensorNotFoundError(f"{param!r} has no sharding information in {self.path}")
        shard = self._primary.tensor(name, step, kind)
        if tuple(shard.shape) != tuple(spec["local_shape"]):
            # Not shaped like the parameter's shard (Adam's 0-d `step`): replicated, take it as is.
            return shard
        full_shape = tuple(int(d) for d in spec["global_shape"])
        out = torch.empty(full_shape, dtype=shard.dtype)
        covered = torch.zeros(full_shape, dtype=torch.bool)
        # Replicated blocks (HSDP) are on several ranks: the primary's copy is written last and wins.
        for r in sorted(self.ranks, key=lambda r: r == self.primary):
            rspec = self.sharding(param, r)
            if rspec is None or rspec.get("offset") is None:
                raise ConfigError(
                    f"{kind} {name!r} is sharded with placements {spec.get('placements')} on a mesh of shape "
                    f"{spec.get('mesh_shape')}, which is not a plain block split, so stepdump cannot put it "
                    f"together; read the shards with run.tensor(..., rank=r)"
                )
            t = shard if r == self.primary else self.rank(r).tensor(name, step, kind)
            if tuple(t.shape) != tuple(rspec["local_shape"]):
                raise StepNotFoundError(
                    f"rank {r} recorded {kind} {name!r} at step {step} with shape {tuple(t.shape)}, not its shard "
                    f"shape {tuple(rspec['local_shape'])}"
                )
            region = tuple(slice(o, o + n) for o, n in zip(rspec["offset"], rspec["local_shape"], strict=True))
            out[region] = t
            covered[region] = True
        if not bool(covered.all()):
            missing = sorted(set(range(self.world_size)) - set(self.ranks))
            raise StepNotFoundError(
                f"{kind} {name!r} at step {step}: the recorded ranks {self.ranks} do not hold every shard (ranks "
                f"{missing} were not recorded); read a shard with run.tensor(..., rank=r) or record all ranks"
            )
        return out
