"""Export a run to TensorBoard event files: scalars, per-tensor stats and histograms.

TensorBoard is optional: this module imports ``torch.utils.tensorboard`` (which
needs the ``tensorboard`` package) only when :func:`export_tensorboard` runs.
TensorBoard keeps scalars as 32-bit floats, so exported values are the run's
values rounded to float32.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stepdump.analysis.report_groups import tensor_groups
from stepdump.errors import ConfigError
from stepdump.read.reader import RunReader
from stepdump.read.rows import check_kind
from stepdump.read.run import Run

log = logging.getLogger(__name__)

#: Stats exported per tensor; ``inf`` is the count of +Inf and -Inf together.
DEFAULT_STATS: tuple[str, ...] = ("norm", "mean", "std", "min", "max", "nan", "inf")
_STAT_CHOICES = ("norm", "mean", "std", "min", "max", "nan", "posinf", "neginf", "inf", "zero_frac", "numel")


@dataclass(frozen=True)
class TensorBoardExport:
    """What :func:`export_tensorboard` wrote."""

    logdir: Path
    scalars: int  #: scalar points (logged scalars)
    stats: int  #: scalar points from per-tensor stats
    histograms: int  #: histograms
    histogram_steps: tuple[int, ...]  #: the full steps that got histograms
    group_histograms: int = 0  #: histograms of blocks (``<kind>_by_block/<block>``)


def export_tensorboard(
    run: RunReader | str | os.PathLike[str],
    logdir: str | os.PathLike[str],
    *,
    scalars: bool = True,
    stats: Sequence[str] | None = DEFAULT_STATS,
    stat_kinds: Iterable[str] | None = None,
    histograms: Iterable[str] | None = ("params", "grads"),
    max_histogram_steps: int = 20,
    profile: bool = False,
    histogram_groups: bool = True,
) -> TensorBoardExport:
    """Write a run's scalars, per-tensor stats and histograms as TensorBoard event files.

    Tags: a scalar keeps its name (``loss``, ``lr``); a stat is
    ``<kind>/<tensor>/<stat>`` (``grads/fc1.weight/norm``); a histogram is
    ``<kind>/<tensor>`` (``params/fc1.weight``), and with ``histogram_groups`` one per block
    of the report's grouping, ``<kind>_by_block/<block>`` (``grads_by_block/transformer.h.3``:
    every finite value of the block's tensors at that step; blocks of one tensor are left
    out, their tensor's histogram is the same). Steps are the run's optimizer
    steps, wall times the moments the steps were committed. Steps the GradScaler
    skipped get the scalar ``skipped`` = 1 (only if the run has any).

    A multi-rank run is written one rank per subdirectory (``logdir/rank0``,
    ``logdir/rank1``, ...), which TensorBoard shows as runs side by side; the
    returned counts are over every rank.

    Args:
        run: An opened run (``stepdump.open``) or the path of one.
        logdir: Directory for the event files (created; point ``tensorboard --logdir`` at it).
        scalars: Export the logged scalars.
        stats: Stats to export per tensor and stats step (``None`` or empty: none); any of
            norm, mean, std, min, max, nan, posinf, neginf, inf, zero_frac, numel.
        stat_kinds: Kinds whose stats are exported (default all in the run).
        histograms: Kinds to draw histograms of, at steps stored in full (``None``: none).
            Only finite values go into a histogram.
        max_histogram_steps: At most this many full steps get histograms, spread evenly
            from the first to the last.
        profile: Also export the recorder's ``sys/*`` timings and memory.
        histogram_groups: Also a histogram per block (see tags above), so a model with
            hundreds of tensors reads as its layers (:mod:`stepdump.analysis.report_groups`).

    Returns:
        What was written.
    """
    args = (scalars, stats, stat_kinds, histograms, max_histogram_steps, profile, histogram_groups)
    if isinstance(run, (str, os.PathLike)):
        from stepdump.read.opener import open_run

        with open_run(run) as opened:
            return _export_all(opened, Path(logdir), *args)
    return _export_all(run, Path(logdir), *args)


def _export_all(run: RunReader, logdir: Path, *args: Any) -> TensorBoardExport:
    """Every store of ``run``: one logdir, or one subdirectory per rank."""
    stores = list(run.stores())
    if stores[0][0] is None:
        return _export(stores[0][1], logdir, *args)
    parts = [_export(store, logdir / f"rank{r}", *args) for r, store in stores]
    return TensorBoardExport(logdir, sum(p.scalars for p in parts), sum(p.stats for p in parts),
                             sum(p.histograms for p in parts),
                             tuple(sorted({s for p in parts for s in p.histogram_steps})),
                             sum(p.group_histograms for p in parts))


def _export(run: Run, logdir: Path, scalars: bool, stats: Sequence[str] | None, stat_kinds: Iterable[str] | None,
            histograms: Iterable[str] | None, max_histogram_steps: int, profile: bool,
            histogram_groups: bool) -> TensorBoardExport:
    stats = tuple(stats or ())
    bad = [s for s in stats if s not in _STAT_CHOICES]
    if bad:
        raise ConfigError(f"unknown stat(s) {', '.join(map(repr, bad))}; choose from {', '.join(_STAT_CHOICES)}")
    if isinstance(max_histogram_steps, bool) or not isinstance(max_histogram_steps, int) or max_histogram_steps < 0:
        raise ConfigError(f"max_histogram_steps={max_histogram_steps!r}: give a number of steps (0 for none)")
    hist_kinds = list(histograms or ())
    kinds_present = run.kinds()
    for k in [*hist_kinds, *(stat_kinds or ())]:
        check_kind(k)
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch raises this when the tensorboard package is missing
        raise ConfigError("exporting to TensorBoard needs the tensorboard package: pip install tensorboard") from e

    logdir.mkdir(parents=True, exist_ok=True)
    walltime = _step_times(run)
    n_scalars = n_stats = n_hist = n_groups = 0
    hist_steps: list[int] = []
    writer = SummaryWriter(log_dir=str(logdir), max_queue=1000, flush_secs=3600)
    try:
        if scalars:
            for step, name, value in _scalar_rows(run, profile):
                writer.add_scalar(name, value, step, walltime=walltime.get(step))
                n_scalars += 1
            skipped = set(run.skipped_steps)
            if skipped:
                for step in run.all_steps:
                    writer.add_scalar("skipped", float(step in skipped), step, walltime=walltime.get(step))
                    n_scalars += 1

        if stats:
            wanted = kinds_present if stat_kinds is None else [k for k in stat_kinds if k in kinds_present]
            for kind in wanted:
                df = run.stats(kind=kind)
                if df.empty:
                    continue
                df = df.assign(inf=df["posinf"] + df["neginf"])
                for row_step, name, *values in df[["step", "name", *stats]].itertuples(index=False):
                    step = int(row_step)
                    for stat, value in zip(stats, values, strict=True):
                        if value is None or math.isnan(value):
                            continue  # e.g. min/max/mean of a tensor with no finite value
                        writer.add_scalar(f"{kind}/{name}/{stat}", float(value), step, walltime=walltime.get(step))
                        n_stats += 1

        if hist_kinds and max_histogram_steps:
            picks = {k: _spread(_steps_with(run, k), max_histogram_steps) for k in hist_kinds if k in kinds_present}
            hist_steps = sorted({s for steps in picks.values() for s in steps})
            block_of = {k: _blocks(run, k) if histogram_groups else {} for k in picks}
            for step in hist_steps:
                for kind, steps in picks.items():
                    if step not in steps:
                        continue
                    in_block: dict[str, list[Any]] = {}
                    for name, tensor in run.tensors(step, kind).items():
                        values = _finite_values(tensor)
                        if values is None:
                            continue
                        writer.add_histogram(f"{kind}/{name}", values, step, walltime=walltime.get(step))
                        n_hist += 1
                        if name in block_of[kind]:
                            in_block.setdefault(block_of[kind][name], []).append(values)
                    for block, parts in in_block.items():
                        writer.add_histogram(f"{kind}_by_block/{block}", np.concatenate(parts), step,
                                             walltime=walltime.get(step))
                        n_groups += 1
    finally:
        writer.close()
    log.info("stepdump: wrote %d scalars, %d stats, %d histograms to %s", n_scalars, n_stats, n_hist, logdir)
    return TensorBoardExport(logdir, n_scalars, n_stats, n_hist, tuple(hist_steps), n_groups)


def _blocks(run: Run, kind: str) -> dict[str, str]:
    """Tensor name -> its block (the report's grouping), for blocks of more than one tensor."""
    names = run.names(kind)
    block = tensor_groups(names)["block"]
    sizes: dict[str, int] = {}
    for n in names:
        sizes[block[n]] = sizes.get(block[n], 0) + 1
    return {n: block[n] for n in names if sizes[block[n]] > 1}


def _steps_with(run: Run, kind: str) -> list[int]:
    """The full steps that can hold ``kind``: the final record (FORMAT.md ``final_step``) only
    where it has that kind (it has no grads, activations or inputs: no update ran there)."""
    steps = run.steps
    final = run.meta.get("final_step")
    if isinstance(final, int) and steps and steps[-1] == final:
        if not run.fingerprints(final, (kind,)):
            return steps[:-1]
    return steps


def _spread(steps: Sequence[int], n: int) -> list[int]:
    """At most ``n`` of ``steps``, evenly spread, first and last included."""
    if len(steps) <= n:
        return list(steps)
    if n == 1:
        return [steps[-1]]
    picks = {round(i * (len(steps) - 1) / (n - 1)) for i in range(n)}
    return [steps[i] for i in sorted(picks)]


def _finite_values(t: torch.Tensor) -> Any:
    """The finite values of a real tensor as a float numpy array (None if there are none)."""
    if t.is_complex() or t.dtype == torch.bool or t.numel() == 0:
        return None
    if t.layout != torch.strided:  # a sparse grad: the histogram of the dense tensor it stands for
        t = t.to_dense()
    v = t.detach().reshape(-1).to(torch.float64 if t.dtype == torch.float64 else torch.float32)
    v = v[torch.isfinite(v)]
    return v.numpy() if v.numel() else None


def _scalar_rows(run: Run, profile: bool) -> list[tuple[int, str, float]]:
    """(step, name, value) of every logged scalar. Read from the catalog rather than
    ``run.scalars()``, whose frame cannot tell a logged NaN (kept: a NaN loss matters)
    from a name not logged at that step (left out)."""
    return [
        (step, name, math.nan if value is None else float(value))
        for step, name, value in run.scalar_rows()  # checked: integer steps, text names, numbers
        if profile or not name.startswith("sys/")
    ]


def _step_times(run: Run) -> dict[int, float]:
    """When each step was committed (the catalog's ``steps.time``), as TensorBoard wall times."""
    try:
        rows = run.catalog.step_times()
    except Exception:  # noqa: BLE001 - wall times are cosmetic; fall back to now
        return {}
    # A time that is not a number (a damaged catalog) is left out like a missing one.
    return {s: float(t) for s, t in rows
            if isinstance(s, int) and isinstance(t, (int, float)) and not isinstance(t, bool)}
