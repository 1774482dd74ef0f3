"""Catalog stat rows as one Arrow table: the columns of the stats frame, typed once.

Built from ``CatalogReader.stat_arrays`` (numpy columns, the stat chunks' and the ``tensors``
table's rows alike: :func:`arrays_table`, no Python object per value). Shared by the readers
(``run.stats(dtype_backend="pyarrow")``, ``export-stats``: :mod:`stepdump.read.columnar`) and by
the copy of a run's stats that ``Recorder.close()`` writes (:mod:`stepdump.core.stats_file`), so
both hold exactly the same columns and values. Values come
from the catalog rows as they are, with no float round trip: a stat SQLite holds as NULL (nothing
to describe: an empty tensor, a tensor with no finite element) is an Arrow null.

pyarrow is imported here only, lazily: it is an optional dependency (``pip install pyarrow``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Sized
from types import ModuleType
from typing import Any

import numpy as np

from stepdump.errors import ConfigError, CorruptDataError
from stepdump.store.queries import STAT_ROW_COLUMNS
from stepdump.store.schema import DEFAULT_FP_KIND, STAT_COLUMNS

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
    if not other:  # a frame's column has a length: no Python step per row to count them
        return [DEFAULT_FP_KIND] * (len(kinds) if isinstance(kinds, Sized) else sum(1 for _ in kinds))
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


def arrays_table(rows: Any, series: Sequence[Sequence[Any]], fp_kinds: dict[int, str], *, rank: int | None,
                 where: object) -> Any:
    """Stat rows as ``CatalogReader.stat_arrays`` gives them (by step then series; a count of -1
    and a float NaN are NULL) as a table of :func:`schema`: the rows of ``CatalogReader.stat_rows``,
    value for value.

    Args:
        rows: The ``StatArrays`` of every column in ``STAT_COLUMNS``.
        series: ``(id, kind, name)`` of every series the rows name (``CatalogReader.matching_series``).
        fp_kinds: Series id -> fingerprint kind, for the series that are not xxh3 (``CatalogReader.fp_kinds``).
        rank: The ``rank`` column's value, or None for none.
        where: The store, for the error a value of the wrong type raises.
    """
    pa = pyarrow()
    import pyarrow.compute as pc

    sch = schema(rank is not None)
    n = len(rows)
    ids = np.asarray([s[0] for s in series], dtype=np.int64)
    by_id = np.argsort(ids, kind="stable")
    at = np.searchsorted(ids[by_id], rows.series) if len(ids) else np.zeros(n, np.int64)
    known = len(ids) > 0 and bool((at < len(ids)).all()) and bool(
        (ids[by_id][np.minimum(at, len(ids) - 1)] == rows.series).all())
    if n and not known:
        raise CorruptDataError(f"the catalog of {where} has stats of a series it does not list")
    take = pa.array(by_id[at] if n else np.zeros(0, np.int64), type=pa.int64())
    try:
        per_series = {"kind": pa.array([s[1] for s in series], type=pa.string()),
                      "name": pa.array([s[2] for s in series], type=pa.string()),
                      "fp_kind": pa.array([fp_kinds.get(s[0], DEFAULT_FP_KIND) for s in series], type=pa.string())}
        columns: dict[str, Any] = {c: pc.take(v, take) for c, v in per_series.items()}
        columns["step"] = pa.array(rows.step, type=pa.int64())
        if rank is not None:
            columns["rank"] = pa.array(np.full(n, rank, np.int64), type=pa.int64())
        columns["dtype"] = pa.array(rows.dtype, type=pa.string())
        columns["shape"] = pa.array(rows.shape, type=pa.string())
        for c in STAT_COLUMNS:
            v = rows.stats[c]
            columns[c] = (pa.array(v, type=pa.int64(), mask=v < 0) if c in _INT else
                          pa.array(v, type=pa.float64(), mask=np.isnan(v)))
        columns["fingerprint"] = pa.array(rows.fingerprint, type=pa.int64())
        columns["stored"] = pa.array(rows.blob >= 0, type=pa.bool_())
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError) as e:
        raise CorruptDataError(f"the catalog of {where} holds stats of the wrong type ({e})") from e
    return pa.Table.from_arrays([columns[f.name] for f in sch], schema=sch)
