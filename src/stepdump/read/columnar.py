"""The stats of every rank and step as one Arrow table: ``run.stats(dtype_backend="pyarrow")``,
``stepdump export-stats RUN -o stats.parquet``.

One row per (step, rank, kind, name), the columns of :meth:`Run.stats` (a multi-rank run's with
``rank`` second, as :meth:`DistributedRun.stats` has it). Values come from the catalog rows
as they are, with no float round trip: a stat SQLite holds as NULL (nothing to describe: an
empty tensor, a tensor with no finite element) is an Arrow null, the NaN of the numpy frame.

Ranks are read by a small thread pool (SQLite releases the GIL while it reads) a few at a time
and handed on in rank order, so a Parquet export holds at most ``window`` ranks' rows in
memory, however many ranks there are. pyarrow is imported lazily (:mod:`stepdump.core.stats_table`):
it is an optional dependency (``pip install pyarrow``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

# The table's columns and types live in core (the Recorder's stats.parquet holds the same ones);
# fp_kind_column is named here too, for the readers that import it from here (Run).
from stepdump.core.stats_table import fp_kind_column as fp_kind_column
from stepdump.core.stats_table import arrays_table, pyarrow, schema
from stepdump.store.queries import StepRange

if TYPE_CHECKING:
    import pandas as pd

    from stepdump.read.run import Run

#: Ranks read ahead at once (threads of the pool, and ranks' rows held before they are written).
WINDOW = 8


def store_table(store: Run, kind: str | None = None, name: str | None = None, steps: StepRange = None,
                *, rank: int | None = None) -> Any:
    """One store's stat rows as an Arrow table (with a ``rank`` column when ``rank`` is given)."""
    store._check_series()
    if kind is not None:
        store._check_kind(kind)
    cat = store.catalog
    return arrays_table(cat.stat_arrays(kind, name, steps), cat.matching_series(kind, name), cat.fp_kinds(),
                        rank=rank, where=store.path)


def tables(run: Any, kind: str | None = None, name: str | None = None, steps: StepRange = None,
           *, ranks: Iterable[int] | None = None, window: int = WINDOW) -> Iterator[Any]:
    """Arrow tables of ``run``'s stats, one per store, in rank order (see the module docstring).

    ``run`` is a Run, a DistributedRun (a ``rank`` column; ``ranks`` to choose some), or any
    reader whose ``stores()`` yield no ranks (a JointRun: its ``stats()`` frame, pair-prefixed
    names, converted).
    """
    if steps is not None and not isinstance(steps, (slice, range)) and not hasattr(steps, "__index__"):
        steps = list(steps)  # read by every rank's query
    if not getattr(run, "ranks", None):
        # One store (a Run or RemoteRun: the readers with a catalog). Asked of the object, not by
        # isinstance, because run.py imports this module (tests/test_layers.py: no import circles).
        if hasattr(run, "catalog"):
            yield store_table(run, kind, name, steps)
        else:
            yield frame_to_table(run.stats(kind, name, steps), ranked=False)
        return
    chosen = list(run.ranks if ranks is None else ranks)
    for r in chosen:
        if r not in run.ranks:
            run.rank(r)  # raises, naming the recorded ranks
    yield from _in_order(chosen, lambda r: store_table(run.rank(r), kind, name, steps, rank=r), window)


def _in_order(items: list[int], read: Callable[[int], Any], window: int) -> Iterator[Any]:
    """``read(i)`` for each item, at most ``window`` in flight on a thread pool, yielded in order."""
    window = max(1, min(window, len(items)))
    with ThreadPoolExecutor(max_workers=window, thread_name_prefix="stepdump-ranks") as pool:
        pending = [pool.submit(read, i) for i in items[:window]]
        nxt = window
        while pending:
            result = pending.pop(0).result()
            if nxt < len(items):
                pending.append(pool.submit(read, items[nxt]))
                nxt += 1
            yield result


def table(run: Any, kind: str | None = None, name: str | None = None, steps: StepRange = None, *,
          ranks: Iterable[int] | None = None) -> Any:
    """Every store's stats as one Arrow table, in the row order of ``run.stats()`` (by step, then
    rank, then recording order)."""
    pa = pyarrow()
    import pyarrow.compute as pc

    parts = list(tables(run, kind, name, steps, ranks=ranks))
    out = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
    if "rank" in out.column_names:  # Arrow's sort is stable: recording order stays within a (step, rank)
        out = out.take(pc.sort_indices(out, sort_keys=[("step", "ascending"), ("rank", "ascending")]))
    return out


def frame(run: Any, kind: str | None = None, name: str | None = None, steps: StepRange = None, *,
          ranks: Iterable[int] | None = None) -> pd.DataFrame:
    """:func:`table` as a pandas frame with Arrow-backed columns (``pd.ArrowDtype``)."""
    import pandas as pd

    return table(run, kind, name, steps, ranks=ranks).to_pandas(types_mapper=pd.ArrowDtype)


def frame_to_table(df: pd.DataFrame, *, ranked: bool) -> Any:
    """A numpy-backed stats frame (NaN for a NULL stat) as a table of :func:`schema`."""
    pa = pyarrow()
    sch = schema(ranked)
    arrays = []
    for f in sch:
        values = df[f.name]
        arrays.append(pa.array(values.astype(object).where(values.notna(), None).tolist(), type=f.type))
    return pa.Table.from_arrays(arrays, schema=sch)


def write_parquet(run: Any, path: str | os.PathLike[str], kind: str | None = None, name: str | None = None,
                  steps: StepRange = None, *, window: int = WINDOW) -> tuple[int, int]:
    """Write ``run``'s stats to one Parquet file, a store at a time; ``(rows, stores)`` written.

    A multi-rank run's file always has the ``rank`` column; a single store's has none. The file
    is written beside ``path`` and renamed into place, so a failed export leaves no partial file.
    """
    return _write_tables(tables(run, kind, name, steps, window=window), path)


def _write_tables(parts: Iterable[Any], path: str | os.PathLike[str]) -> tuple[int, int]:
    """Write each table of ``parts`` to one Parquet file at ``path`` (atomically); ``(rows, tables)``."""
    pyarrow()
    import pyarrow.parquet as pq

    out = Path(path)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    rows = stores = 0
    writer = None
    try:
        for part in parts:
            if writer is None:
                writer = pq.ParquetWriter(tmp, part.schema)
            writer.write_table(part)
            rows += part.num_rows
            stores += 1
        if writer is not None:
            writer.close()
            writer = None
        os.replace(tmp, out)
    finally:
        if writer is not None:
            writer.close()
        if tmp.exists():
            tmp.unlink()
    return rows, stores


class ParquetExport(NamedTuple):
    """What :func:`export_parquet` wrote: ``rows`` of ``stores`` stores, ``copied`` of them from
    their own ``stats.parquet``; ``rebuilt``: why each other store's could not be used."""

    rows: int
    stores: int
    copied: int
    rebuilt: list[str]


def export_parquet(run: Any, path: str | os.PathLike[str], kind: str | None = None, name: str | None = None,
                   steps: StepRange = None, *, window: int = WINDOW) -> ParquetExport:
    """:func:`write_parquet`, taking each store's ``stats.parquet`` (what ``Recorder.close()`` wrote,
    :mod:`stepdump.core.stats_file`) where nothing is filtered and the file checks out against its
    catalog: a byte copy for one store, a concatenation for a multi-rank run. A store whose file is
    absent, stale, truncated or changed is read from its catalog instead, and the reason given."""
    pyarrow()  # the ConfigError that says how to install it, before any file is looked at
    if kind is not None or name is not None or steps is not None or getattr(run, "url", None) is not None:
        return ParquetExport(*write_parquet(run, path, kind, name, steps, window=window), 0, [])
    if not getattr(run, "ranks", None):
        if not hasattr(run, "catalog"):  # a joint run: no catalog of its own
            return ParquetExport(*write_parquet(run, path, window=window), 0, [])
        data, why = _verified(run, None)
        if data is None:
            return ParquetExport(*write_parquet(run, path, window=window), 0, [why])
        out = Path(path)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
        return ParquetExport(_rows(data), 1, 1, [])
    rebuilt: list[str] = []

    def read(r: int) -> tuple[Any, str]:
        store = run.rank(r)
        data, why = _verified(store, r)
        if data is None:
            return store_table(store, rank=r), why
        import pyarrow.parquet as pq

        return pq.read_table(pyarrow().BufferReader(data)), ""

    def parts() -> Iterator[Any]:
        for table, why in _in_order(list(run.ranks), read, window):
            if why:
                rebuilt.append(why)
            yield table

    rows, stores = _write_tables(parts(), path)
    return ParquetExport(rows, stores, stores - len(rebuilt), rebuilt)


def _verified(store: Any, rank: int | None) -> tuple[bytes | None, str]:
    """``store``'s stats.parquet bytes if they check out and hold the columns of its export (a
    ``rank`` column of ``rank`` for one rank of a multi-rank run, none for a single store); else
    None and why not."""
    from stepdump.core import stats_file

    found = stats_file.check(store.path, store.catalog)
    if found.data is None or found.meta is None:
        return None, found.reason
    if found.meta.rank != rank:
        return None, (f"{store.path / stats_file.STATS_FILE} has the rank column of rank {found.meta.rank}, "
                      f"the export {'none' if rank is None else f'that of rank {rank}'}")
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(pyarrow().BufferReader(found.data)).metadata
        ok = meta.schema.to_arrow_schema().equals(schema(rank is not None)) and meta.num_rows == found.meta.rows
    except (OSError, ValueError) as e:  # ArrowInvalid is a ValueError: bytes that hashed right but do not parse
        return None, f"{store.path / stats_file.STATS_FILE} does not read as Parquet ({e})"
    if not ok:
        return None, f"{store.path / stats_file.STATS_FILE} does not hold the columns and rows its meta names"
    return found.data, ""


def _rows(data: bytes) -> int:
    import pyarrow.parquet as pq

    return int(pq.ParquetFile(pyarrow().BufferReader(data)).metadata.num_rows)
