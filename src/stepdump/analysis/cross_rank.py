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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pandas as pd

from stepdump.analysis.findings import Finding, Severity
from stepdump.analysis.rules.base import Rule, check_int, check_kinds, register_rule

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
        keys = ["step", "kind", "name", "group"]
        acc: pd.DataFrame | None = None  # keys + version -> n (ranks holding that version)
        for r, rr in run.stores():
            if r is None:
                continue
            df = self._rank_rows(run, r, rr, common)
            part = df[[*keys, "version"]].assign(n=1)
            acc = part if acc is None else (pd.concat([acc, part], ignore_index=True)
                                            .groupby([*keys, "version"], sort=False, as_index=False)["n"].sum())
        if acc is None or acc.empty:
            return findings, -1, [], _EMPTY.copy(), ranks
        per = acc.groupby(keys, sort=False).agg(versions=("version", "nunique"), members=("n", "sum"))
        # A plain (replicated) tensor must be on every rank that stats-recorded the step.
        want = len(ranks)
        bad = per[(per["versions"] > 1) | ((per.index.get_level_values("group") == "replica") & (per["members"] != want))]
        if bad.empty:
            return findings, -1, [], _EMPTY.copy(), ranks
        first = int(bad.index.get_level_values("step").min())
        at = bad[bad.index.get_level_values("step") == first]
        order = {k: i for i, k in enumerate(_KINDS)}
        series = {(k, n): i for i, (k, n) in enumerate(
            (k, n) for k in self.kinds if k in run.kinds() for n in run.names(k))}
        items = sorted({(k, n) for _, k, n, _ in at.index},
                       key=lambda kn: (order.get(kn[0], 99), series.get(kn, 1 << 30), kn[1]))
        # The rows the findings describe: those tensors at that step, read again rank by rank.
        wanted = set(items)
        rows = []
        for r, rr in run.stores():
            if r is None:
                continue
            df = self._rank_rows(run, r, rr, [first])
            rows.append(df[[(k, n) in wanted for k, n in zip(df["kind"], df["name"], strict=True)]])
        return findings, first, items, pd.concat(rows, ignore_index=True), ranks

    def _rank_rows(self, run: Any, r: int, rr: Any, steps: list[int]) -> pd.DataFrame:
        """Rank ``r``'s rows (store ``rr``) of the compared kinds at ``steps``, with group and version."""
        # One step: asked of SQLite; many: filtered here (a long IN list would pass SQLite's limit).
        df = rr.stats(steps=steps[0]) if len(steps) == 1 else rr.stats()
        df = df[df["kind"].isin(list(self.kinds)) & df["step"].isin(steps)]
        params: dict[str, str | None] = {}  # optimizer-state name -> its parameter, on this rank
        df = df.assign(rank=r, group=[_group(run, rr, r, k, n, s, params) for k, n, s in
                                      zip(df["kind"], df["name"], df["shape"], strict=True)])
        df = df[["step", "rank", "kind", "name", "group", "dtype", "shape", "fingerprint", "norm"]]
        return df.assign(version=df["dtype"].astype(str) + "|" + df["shape"].astype(str) + "|"
                         + df["fingerprint"].astype(str))

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


def _versions(rows: pd.DataFrame) -> dict[str, list[int]]:
    """The ranks holding each version (dtype, shape, fingerprint) among one tensor's ``rows``."""
    versions: dict[str, list[int]] = {}
    for r, v in zip(rows["rank"], rows["version"], strict=True):
        versions.setdefault(v, []).append(int(r))
    return versions


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

