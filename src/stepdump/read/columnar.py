"""The stats of every rank and step as one Arrow table: ``run.stats(dtype_backend="pyarrow")``,
``stepdump export-stats RUN -o stats.parquet``.

One row per (step, rank, kind, name), the columns of :meth:`Run.stats` (a multi-rank run's with
``rank`` second, as :meth:`DistributedRun.stats` has it). Values come from the catalog rows
as they are, with no float round trip: a stat SQLite holds as NULL (nothing to describe: an
empty tensor, a tensor with no finite element) is an Arrow null, the NaN of the numpy frame.

Ranks are read by a small thread pool (SQLite releases the GIL while it reads) a few at a time
and handed on in rank order, so a Parquet export holds at most ``window`` ranks' rows in
memory, however many ranks there are. pyarrow is imported here only, lazily: it is an optional
dependency (``pip install pyarrow``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from stepdump.errors import ConfigError, CorruptDataError
from stepdump.store.queries import STAT_ROW_COLUMNS, StepRange
from stepdump.store.schema import DEFAULT_FP_KIND, STAT_COLUMNS

if TYPE_CHECKING:
    import pandas as pd

    from stepdump.read.run import Run

#: Ranks read ahead at once (threads of the pool, and ranks' rows held before they are written).
WINDOW = 8
_INT = ("step", "numel", "nan", "posinf", "neginf", "fingerprint")


def pyarrow() -> ModuleType:
    """The pyarrow module, or a ConfigError saying how to install it."""
    try:
        import pyarrow as pa
    except ImportError as e:
        raise ConfigError("columnar stats (Arrow frames, Parquet export) need pyarrow: pip install pyarrow "
                          "(or pip install 'stepdump[arrow]')") from e
    return pa


def fp_kind_column(other: dict[tuple[str, str], str], kinds: Iterable[Any], names: Iterable[Any]) -> list[str]:
    """The ``fp_kind`` column of stat rows: each row's fingerprint kind, from ``other`` (the
    series that are not xxh3, ``CatalogReader.fp_kinds_by_name``; empty in a format-1 store)."""
    if not other:
        return [DEFAULT_FP_KIND] * sum(1 for _ in kinds)
    return [other.get((k, n), DEFAULT_FP_KIND) for k, n in zip(kinds, names, strict=True)]


def schema(ranked: bool) -> Any:
    """The Arrow schema of the stats table (``ranked``: with the ``rank`` column, second)."""
    pa = pyarrow()
    fields = []
    for c in STAT_ROW_COLUMNS:
        if c in _INT:
            t = pa.int64()
        elif c == "stored":
            t = pa.bool_()
        elif c in STAT_COLUMNS:
            t = pa.float64()
        else:
            t = pa.string()
        fields.append(pa.field(c, t, nullable=c not in ("step", "kind", "name")))
        if ranked and c == "step":
            fields.append(pa.field("rank", pa.int64(), nullable=False))
        if c == "fingerprint":  # its kind, right after it (FORMAT.md "Fingerprint kinds")
            fields.append(pa.field("fp_kind", pa.string(), nullable=False))
    return pa.schema(fields)


def store_table(store: Run, kind: str | None = None, name: str | None = None, steps: StepRange = None,
                *, rank: int | None = None) -> Any:
    """One store's stat rows as an Arrow table (with a ``rank`` column when ``rank`` is given)."""
    pa = pyarrow()
    store._check_series()
    if kind is not None:
        store._check_kind(kind)
    rows = store.catalog.stat_rows(kind, name, steps)
    sch = schema(rank is not None)
    columns = list(zip(*rows, strict=True)) if rows else [() for _ in STAT_ROW_COLUMNS]
    by_name = dict(zip(STAT_ROW_COLUMNS, columns, strict=True))
    if rank is not None:
        by_name["rank"] = (rank,) * len(rows)
    by_name["fp_kind"] = tuple(fp_kind_column(store.catalog.fp_kinds_by_name(), by_name["kind"], by_name["name"]))
    try:
        # "stored" comes out of SQLite as 0/1 ("blob IS NOT NULL").
        arrays = [pa.array(by_name[f.name], type=pa.int8()).cast(f.type) if f.name == "stored"
                  else pa.array(by_name[f.name], type=f.type) for f in sch]
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError) as e:
        raise CorruptDataError(f"the catalog of {store.path} holds stats of the wrong type ({e})") from e
    return pa.Table.from_arrays(arrays, schema=sch)


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
    pyarrow()
    import pyarrow.parquet as pq

    out = Path(path)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    rows = stores = 0
    writer = None
    try:
        for part in tables(run, kind, name, steps, window=window):
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
