"""``cross_rank``: find the first step where replicas that must be identical differ across ranks.

Under DDP every rank holds the same parameters, the same (allreduced)
gradients and the same optimizer state at every step; under FSDP2 with
replication (HSDP) the ranks that hold the same shard do. A rank that drifts
(rank-dependent code between ``backward()`` and ``step()``, a parameter
outside the reducer, a non-deterministic kernel, params never broadcast) does
not fail: it trains a slightly different model, silently. Fingerprints
(xxh3-64 of the exact bytes, recorded at every stats step) make the check
cheap: no tensor is read.

Which ranks must agree on a tensor: those whose recorded piece of it covers
the same block of the full tensor. A plain tensor is one replica on every
rank; a sharded one (``meta.distributed.sharding``) groups ranks by their
shard's offset and shape, so FSDP2 shards are compared only with their
replicas (there are none without HSDP).

Ranks may fingerprint a tensor in two kinds (xxh3 on one, dmix64 on another: docs/cuda.md).
Two kinds are never taken as equal or different: where a dmix64 rank stored the bytes they
are hashed with xxh3 and compared so; where it did not, that tensor at that step is not
compared, and a WARNING says so (never a silent "replicas agree").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pandas as pd

from stepdump.analysis.findings import Finding, Severity
from stepdump.analysis.rules.base import Rule, check_int, check_kinds, register_rule
from stepdump.core.hashing import XXH3, fingerprint
from stepdump.read.rows import fp_kind_map

_KINDS = ("params", "grads", "optimizer", "buffers")
_HINT = {
    "params": "the parameter changed on some rank outside the synchronised update (rank-dependent code between "
              "backward() and step(), an in-place edit on one rank, or replicas never broadcast at the start)",
    "grads": "the gradient differs after the allreduce (a parameter outside DDP's reducer, no_sync() on one rank, "
             "or a gradient edited on one rank after backward())",
    "optimizer": "the optimizer state differs (a rank-dependent optimizer setting, or an earlier divergence of "
                 "params or grads that this step inherited)",
    "buffers": "the module buffers differ (batch-norm running stats are per rank unless synchronised)",
}


@register_rule
@dataclass(frozen=True, kw_only=True)
class CrossRank(Rule):
    """Replicas that must be identical across ranks differ (multi-rank runs only).

    Attributes:
        kinds: Kinds compared (``buffers`` is off by default: batch-norm running
            stats legitimately differ per rank without SyncBatchNorm).
        max_findings: At most this many tensors reported at the first divergent step.
    """

    name: ClassVar[str] = "cross_rank"
    kinds: tuple[str, ...] = ("params", "grads", "optimizer")
    max_findings: int = 20

    def __post_init__(self) -> None:
        check_kinds(self.name, "kinds", self.kinds, _KINDS)
        check_int(self.name, "max_findings", self.max_findings, 1)

    def __call__(self, run: Any) -> list[Finding]:
        split = self.first_split(run)
        if split is None:
            return []
        findings, first, items, rows, ranks = split
        for kind, name in items[: self.max_findings]:
            sub = rows[(rows["kind"] == kind) & (rows["name"] == name)]
            findings.append(self._finding(first, kind, name, sub, ranks, len(items)))
        return findings

    def apart(self, run: Any) -> dict[str, Any] | None:
        """Which ranks hold other bytes than the rest at the first step where replicas disagree:
        ``{"step", "tensors": [(kind, name), ...], "ranks": {rank: number of those tensors where it
        is outside the largest group of agreeing ranks}}``; None when replicas agree (or one rank).
        The same detection as the findings (the report's ranks summary names these outliers)."""
        split = self.first_split(run)
        if split is None or split[1] < 0:
            return None
        _, first, items, rows, ranks = split
        out: dict[int, int] = {}
        for kind, name in items:
            groups = _versions(rows[(rows["kind"] == kind) & (rows["name"] == name)])
            agree = max(groups.values(), key=len)
            for r in sorted(set(ranks) - set(agree)):
                out[r] = out.get(r, 0) + 1
        return {"step": first, "tensors": items, "ranks": out}

    def first_split(self, run: Any) -> tuple[list[Finding], int, list[tuple[str, str]], pd.DataFrame, list[int]] | None:
        """(warnings about step sets, the first step where replicas disagree or -1, the tensors that
        differ there, their stats rows at that step, the ranks); None for fewer than two ranks.

        Streams the ranks (one rank's store and rows at a time, opened lazily by ``run.stores()``):
        what is kept between ranks is each (step, kind, name, group) with its distinct versions and
        how many ranks hold it -- one rank's rows when replicas agree -- so memory does not grow
        with the number of ranks, and the work grows linearly with it."""
        steps: dict[int, set[int]] = {r: set(rr.all_steps) for r, rr in run.stores() if r is not None}
        ranks = sorted(steps)
        if len(ranks) < 2:
            return None
        findings = self._step_sets(steps)
        common = sorted(set.intersection(*steps.values()))
        mixed = _mixed_kinds(run)
        # A plain (replicated) tensor must be on every rank that stats-recorded the step.
        want = len(ranks)
        split = None if mixed else self._split_from_rows(run, common, want)
        if split is None:  # mixed fingerprint kinds, or rows only a frame reads alike
            split = self._split_from_frames(run, common, want, mixed, findings)
        if not split:
            return findings, -1, [], _EMPTY.copy(), ranks
        first = int(min(step for step, _, _, _ in split))
        at = [key for key in split if key[0] == first]
        order = {k: i for i, k in enumerate(_KINDS)}
        series = {(k, n): i for i, (k, n) in enumerate(
            (k, n) for k in self.kinds if k in run.kinds() for n in run.names(k))}
        items = sorted({(k, n) for _, k, n, _ in at},
                       key=lambda kn: (order.get(kn[0], 99), series.get(kn, 1 << 30), kn[1]))
        # The rows the findings describe: those tensors at that step, read again rank by rank.
        wanted = set(items)
        rows = []
        for r, rr in run.stores():
            if r is None:
                continue
            df = self._rank_rows(run, r, rr, [first], mixed)
            rows.append(df[[(k, n) in wanted for k, n in zip(df["kind"], df["name"], strict=True)]])
        return findings, first, items, pd.concat(rows, ignore_index=True), ranks

    def _split_from_frames(self, run: Any, common: list[int], want: int,
                           mixed: dict[tuple[str, str], dict[int, str]],
                           findings: list[Finding]) -> list[tuple[int, str, str, str]]:
        """:meth:`_split_from_rows` from each rank's stats frame (:meth:`_rank_rows`), for any
        rows and for tensors fingerprinted in several kinds (adds the WARNING about those left
        uncompared to ``findings``)."""
        keys = ["step", "kind", "name", "group"]
        acc: pd.DataFrame | None = None  # keys + version -> n (ranks holding that version)
        for r, rr in run.stores():
            if r is None:
                continue
            df = self._rank_rows(run, r, rr, common, mixed)
            part = df[[*keys, "version"]].assign(n=1)
            acc = part if acc is None else (pd.concat([acc, part], ignore_index=True)
                                            .groupby([*keys, "version"], sort=False, as_index=False)["n"].sum())
        if acc is None or acc.empty:
            return []
        per = acc.groupby(keys, sort=False).agg(versions=("version", "nunique"), members=("n", "sum"))
        if mixed:  # one version per fingerprint kind: nothing says whether they are the same bytes
            per = per.join(_unresolved(acc, keys))
            findings += _not_compared(self, per[per["unresolved"]], mixed)
            per = per[~per["unresolved"]]
        bad = per[(per["versions"] > 1) | ((per.index.get_level_values("group") == "replica")
                                           & (per["members"] != want))]
        return list(bad.index)

    def _split_from_rows(self, run: Any, common: list[int], want: int) -> list[tuple[int, str, str, str]] | None:
        """The (step, kind, name, group) keys whose replicas disagree, from each rank's catalog
        rows as plain tuples (one query per rank, no frame): what the frames' way finds (tested
        against it), several times faster per rank. None where a rank's rows are not what that
        equality rests on (a value that is not a plain number or text, a NULL fingerprint: the
        frames read those their own way, or refuse them), to be done the frames' way."""
        wanted = set(common)
        kinds = set(self.kinds)
        # (step, kind, name, group) -> version -> ranks holding it, in the order first seen
        acc: dict[tuple[int, str, str, str], dict[str, int]] = {}
        for r, rr in run.stores():
            if r is None:
                continue
            check = getattr(rr, "_check_series", None)
            if check is not None:  # what Run.stats() checks first: series names and kinds are text
                check()
            rows = _plain_rows(rr.catalog.stat_rows())
            if rows is None:
                return None
            params: dict[str, str | None] = {}
            groups: dict[tuple[str, str, Any], str] = {}
            for step, kind, name, dtype, shape, fp in rows:
                if kind not in kinds or step not in wanted:
                    continue
                g = groups.get((kind, name, shape))
                if g is None:
                    g = groups[(kind, name, shape)] = _group(run, rr, r, kind, name, shape, params)
                versions = acc.setdefault((step, kind, name, g), {})
                v = f"{dtype}|{shape}|{fp}"
                versions[v] = versions.get(v, 0) + 1
        return [key for key, versions in acc.items()
                if len(versions) > 1 or (key[3] == "replica" and sum(versions.values()) != want)]

    def _rank_rows(self, run: Any, r: int, rr: Any, steps: list[int],
                   mixed: dict[tuple[str, str], dict[int, str]] | None = None) -> pd.DataFrame:
        """Rank ``r``'s rows (store ``rr``) of the compared kinds at ``steps``, with group and version.
        ``mixed``: the tensors whose fingerprint kind differs across ranks (:func:`_mixed_kinds`):
        their version names the kind, and a dmix64 row with bytes is hashed with xxh3 from them."""
        # One step: asked of SQLite; many: filtered here (a long IN list would pass SQLite's limit).
        df = rr.stats(steps=steps[0]) if len(steps) == 1 else rr.stats()
        df = df[df["kind"].isin(list(self.kinds)) & df["step"].isin(steps)]
        params: dict[str, str | None] = {}  # optimizer-state name -> its parameter, on this rank
        df = df.assign(rank=r, group=[_group(run, rr, r, k, n, s, params) for k, n, s in
                                      zip(df["kind"], df["name"], df["shape"], strict=True)])
        fps = df["fingerprint"].astype(str)
        if mixed:
            fps = pd.Series([_comparable_fp(rr, r, s, k, n, fp, stored, mixed) for s, k, n, fp, stored in
                             zip(df["step"], df["kind"], df["name"], df["fingerprint"], df["stored"], strict=True)],
                            index=df.index, dtype=object)
        df = df[["step", "rank", "kind", "name", "group", "dtype", "shape", "fingerprint", "norm"]]
        return df.assign(version=df["dtype"].astype(str) + "|" + df["shape"].astype(str) + "|" + fps)

    def _finding(self, step: int, kind: str, name: str, rows: pd.DataFrame, ranks: Sequence[int],
                 total: int) -> Finding:
        versions = _versions(rows)
        norms = {int(r): float(nrm) for r, nrm in zip(rows["rank"], rows["norm"], strict=True)}
        missing = sorted(set(ranks) - set(norms))
        parts = [("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, sorted(rs)))
                 + f" (norm {norms[min(rs)]:.6g})" for rs in sorted(versions.values(), key=min)]
        what = " vs ".join(parts)
        if missing:
            what += f"; missing on rank(s) {', '.join(map(str, missing))}"
        more = f" ({total} tensors differ at this step)" if total > 1 else ""
        return self.finding(
            Severity.ERROR, step,
            f"{kind} {name!r} differs across ranks at step {step}, the first step where replicas disagree{more}: "
            f"{what}. Likely cause: {_HINT.get(kind, 'an earlier divergence')}.",
            kind=kind, tensor=name, value=len(versions) + (1 if missing else 0), threshold=1,
        )

    def _step_sets(self, steps: dict[int, set[int]]) -> list[Finding]:
        if len({frozenset(s) for s in steps.values()}) <= 1:
            return []
        desc = "; ".join(f"rank {r}: {len(s)} steps" + (f" ({min(s)}..{max(s)})" if s else "")
                         for r, s in sorted(steps.items()))
        return [self.finding(
            Severity.WARNING, None,
            f"ranks recorded different steps ({desc}); cross-rank comparison covers the steps all ranks have. "
            "A rank with fewer steps stopped early (crash, hang) or recorded with another schedule.",
        )]


_EMPTY = pd.DataFrame(columns=["step", "rank", "kind", "name", "group", "dtype", "shape", "fingerprint", "norm",
                               "version"])


def _plain_rows(rows: list[tuple[Any, ...]]) -> list[tuple[int, str, str, Any, Any, int]] | None:
    """(step, kind, name, dtype, shape, fingerprint) of catalog stat rows (STAT_ROW_COLUMNS),
    or None unless every row holds what ``Run.stats()`` would keep as is: an integer step and
    fingerprint, text kind and name, numbers or NULL for the stats. Then ``str()`` of each
    value is what the frame's ``astype(str)`` gives."""
    out = []
    for row in rows:
        step, kind, name, dtype, shape = row[:5]
        fp = row[-2]
        if type(step) is not int or type(fp) is not int or type(kind) is not str or type(name) is not str:
            return None
        if not all(v is None or type(v) is int or type(v) is float for v in row[5:-2]):
            return None
        if not (dtype is None or type(dtype) is str) or not (shape is None or type(shape) is str):
            return None
        out.append((step, kind, name, dtype, shape, fp))
    return out


def _versions(rows: pd.DataFrame) -> dict[str, list[int]]:
    """The ranks holding each version (dtype, shape, fingerprint) among one tensor's ``rows``."""
    versions: dict[str, list[int]] = {}
    for r, v in zip(rows["rank"], rows["version"], strict=True):
        versions.setdefault(v, []).append(int(r))
    return versions


def _mixed_kinds(run: Any) -> dict[tuple[str, str], dict[int, str]]:
    """(kind, name) -> {rank: fingerprint kind} of the tensors whose kind is not the same on every
    rank ({} in a run of one kind: the comparison is then exactly by fingerprint)."""
    per_rank = {r: fp_kind_map(rr.catalog) for r, rr in run.stores() if r is not None}
    if not any(per_rank.values()):
        return {}
    keys = {k for m in per_rank.values() for k in m}
    out = {key: {r: m.get(key, XXH3) for r, m in per_rank.items()} for key in keys}
    return {key: by_rank for key, by_rank in out.items() if len(set(by_rank.values())) > 1}


def _comparable_fp(store: Any, rank: int, step: int, kind: str, name: str, fp: Any, stored: Any,
                   mixed: dict[tuple[str, str], dict[int, str]]) -> str:
    """``kind:fingerprint`` of one row of a tensor whose kind differs across ranks: xxh3 where
    this rank's is xxh3 or where its bytes are stored (read, checked, hashed), else its own kind."""
    fk = mixed.get((kind, name), {}).get(rank, XXH3) if (kind, name) in mixed else None
    if fk is None:
        return str(fp)
    if fk != XXH3 and stored:
        return f"{XXH3}:{fingerprint(store.tensor(name, step, kind))}"
    return f"{fk}:{fp}"


def _unresolved(acc: pd.DataFrame, keys: list[str]) -> pd.Series:
    """Per (step, kind, name, group): True where the versions are of two fingerprint kinds and
    each kind has one (nothing says whether the bytes are the same); several versions of one
    kind differ whatever the others are."""
    fk = acc["version"].str.rsplit("|", n=1).str[-1].str.split(":", n=1).str[0]
    tagged = acc.assign(fk=fk.where(acc["version"].str.rsplit("|", n=1).str[-1].str.contains(":"), ""))
    g = tagged.groupby(keys, sort=False)
    kinds = g["fk"].nunique()
    most = tagged.groupby([*keys, "fk"], sort=False)["version"].nunique().groupby(level=keys, sort=False).max()
    return ((kinds > 1) & (most == 1)).rename("unresolved")


def _not_compared(rule: Rule, rows: pd.DataFrame, mixed: dict[tuple[str, str], dict[int, str]]) -> list[Finding]:
    """One WARNING naming the tensors left uncompared across ranks for their fingerprint kinds."""
    if rows.empty:
        return []
    first = min(rows.index, key=lambda i: (i[0], i[1], i[2]))
    step, kind, name, _ = first
    by_kind: dict[str, list[int]] = {}
    for r, fk in sorted(mixed.get((kind, name), {}).items()):
        by_kind.setdefault(fk, []).append(r)
    sides = ", ".join(f"{fk} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
                      for fk, rs in sorted(by_kind.items()))
    return [rule.finding(
        Severity.WARNING, step,
        f"{len(rows)} tensor-step(s) not compared across ranks (first: {kind} {name!r} at step {step}): fingerprint "
        f"kinds differ ({sides}) and no bytes are stored at this step; a difference there would go unseen. "
        "Record every rank with one fingerprint kind (Recorder(fingerprint=...)) or store those steps in full.",
        kind=kind, tensor=name)]


def _group(run: Any, store: Any, rank: int, kind: str, name: str, shape: str,
           params: dict[str, str | None]) -> str:
    """Ranks with the same group must hold identical bytes for (kind, name).

    ``store`` is ``rank``'s store; ``params`` caches its optimizer-state -> parameter lookups."""
    param: str | None = None
    if kind in ("params", "grads"):
        param = name
    elif kind == "optimizer":
        if name not in params:
            params[name] = store.catalog.optimizer_param(name)
        param = params[name]
    spec = run.sharding(param, rank) if param is not None else None
    if spec is None:
        return "replica"
    local = ",".join(str(d) for d in spec.get("local_shape", []))
    if shape != local:  # shaped unlike the shard (Adam's 0-d step): replicated
        return "replica"
    return f"shard@{spec.get('offset')}:{local}"


def cross_rank(run: Any, *, kinds: Iterable[str] = ("params", "grads", "optimizer"),
               max_findings: int = 20) -> list[Finding]:
    """Compare fingerprints across the ranks of a multi-rank run (see the module docstring).

    Args:
        run: A :class:`stepdump.read.ranked.DistributedRun` (``stepdump.open`` of a
            multi-rank run). Any other run has no ranks to compare: no findings.
        kinds: Kinds whose replicas must agree.
        max_findings: Tensors reported at the first divergent step.

    Returns:
        ERROR findings for every tensor that differs at the first step where
        any does (``step``, ``kind``, ``tensor`` say where; the message names
        the ranks on each side), plus a WARNING if ranks recorded different steps.
    """
    return CrossRank(kinds=tuple(kinds), max_findings=max_findings)(run)

