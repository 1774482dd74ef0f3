"""Export several runs to TensorBoard together, with the report's comparison.

:func:`export_tensorboard_runs` writes each run with :func:`~stepdump.render.tensorboard.export_tensorboard`
into its own subdirectory (``logdir/<label>``: TensorBoard shows them as runs side by side, their
``loss`` curves on one chart), and into the directory of every run after the first, what the HTML
report's comparison shows against the first run (A: the first run, B: this one):

* ``compare/<scalar>/a_minus_b`` and ``compare/<scalar>/rel_diff``: A − B and
  |A − B| / max(|A|, |B|) of every scalar both runs logged, at every step both logged (the full
  series, computed as the report does: :func:`stepdump.analysis.report_compare.scalar_difference`);
* ``compare/diverged``: 0 before the first divergent step ``stepdump diff`` names, 1 from it on,
  at every step both runs recorded (all 0 when the runs are identical; absent when they could not
  be compared): a step function that lines up with every other chart, TensorBoard having no
  vertical marker;
* ``compare/first_divergent_step``: one point, at that step, whose value is the step;
* ``compare/divergence`` (Text tab): the diff's headline, reading and earliest cause.

The comparison's events go to a file of their own in B's directory (suffix ``.compare``).
Everything here only reads the runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stepdump.analysis.matrices import scalar_series
from stepdump.analysis.report import stores_of
from stepdump.analysis.report_compare import divergence, scalar_difference
from stepdump.errors import ConfigError
from stepdump.read.reader import RunReader
from stepdump.render.tensorboard import TensorBoardExport, _step_times, export_tensorboard

log = logging.getLogger(__name__)

RunArg = RunReader | str | os.PathLike[str]


@dataclass(frozen=True)
class TensorBoardRuns:
    """What :func:`export_tensorboard_runs` wrote."""

    logdir: Path
    runs: tuple[TensorBoardExport, ...]  #: each run's own export, in order (``logdir/<label>``)
    #: (label of A, label of B, the first divergent step or None) for each run compared
    compared: tuple[tuple[str, str, int | None], ...]
    compare_scalars: int  #: points written under ``compare/``


def export_tensorboard_runs(runs: Sequence[RunArg], logdir: str | os.PathLike[str],
                            labels: Sequence[str] | None = None, *, compare: bool = True,
                            **kwargs: Any) -> TensorBoardRuns:
    """Write several runs as TensorBoard runs side by side, with the comparison (module docstring).

    Args:
        runs: Two or more runs (opened, or their paths); the first is A, the base of the comparison.
        logdir: Directory of the event files; each run goes to ``logdir/<label>``.
        labels: One directory name per run (default: the runs' directory names, numbered where
            two are the same).
        compare: Write the comparison into every run after the first; False: only the runs.
        **kwargs: Passed on to :func:`~stepdump.render.tensorboard.export_tensorboard` for each run
            (``profile=True`` also compares the ``sys/*`` scalars).

    Returns:
        What was written.
    """
    if len(runs) < 1:
        raise ConfigError("export_tensorboard_runs needs at least one run")
    root = Path(logdir)
    with contextlib.ExitStack() as stack:
        opened = [_opened(r, stack) for r in runs]
        names = _labels(opened, labels)
        exports = tuple(export_tensorboard(r, root / n, **kwargs) for r, n in zip(opened, names, strict=True))
        compared: list[tuple[str, str, int | None]] = []
        points = 0
        if compare:
            for i in range(1, len(opened)):
                first, n = _write_comparison(opened[0], opened[i], names[0], names[i], root / names[i],
                                             bool(kwargs.get("profile", False)))
                compared.append((names[0], names[i], first))
                points += n
    return TensorBoardRuns(root, exports, tuple(compared), points)


def _opened(run: RunArg, stack: contextlib.ExitStack) -> RunReader:
    if isinstance(run, (str, os.PathLike)):
        from stepdump.read.opener import open_run

        return stack.enter_context(open_run(run))
    return run


def _labels(runs: Sequence[RunReader], labels: Sequence[str] | None) -> list[str]:
    """Directory names for the runs: ``labels`` checked, or the runs' own names made unique."""
    if labels is None:
        names = [Path(str(r.path)).name or f"run{i}" for i, r in enumerate(runs)]
        seen: dict[str, int] = {}
        out = []
        for n in names:
            seen[n] = seen.get(n, 0) + 1
            out.append(n if names.count(n) == 1 else f"{n}_{seen[n]}")
        return out
    if len(labels) != len(runs):
        raise ConfigError(f"{len(labels)} labels for {len(runs)} runs: give one label per run, or none")
    for lab in labels:
        if not lab or lab in (".", "..") or "/" in lab or "\\" in lab or "\0" in lab:
            raise ConfigError(f"label {lab!r} cannot be a directory name under the logdir: use a plain name")
    if len(set(labels)) != len(labels):
        raise ConfigError(f"labels {list(labels)} repeat a name: each run needs a directory of its own")
    return list(labels)


def _write_comparison(a: RunReader, b: RunReader, label_a: str, label_b: str, logdir: Path,
                      profile: bool) -> tuple[int | None, int]:
    """Write B's comparison against A into ``logdir``; returns (first divergent step, points written)."""
    from torch.utils.tensorboard import SummaryWriter  # the export checked it is installed

    raw_a, raw_b = _scalars(a), _scalars(b)
    walltime = _step_times(next(iter(b.stores()))[1])
    div = divergence(a, b, 1)
    first = div.get("step")
    first = int(first) if isinstance(first, int) else None
    n = 0
    logdir.mkdir(parents=True, exist_ok=True)
    writer = SummaryWriter(log_dir=str(logdir), max_queue=1000, flush_secs=3600, filename_suffix=".compare")
    try:
        for name in sorted(set(raw_a) & set(raw_b)):
            if name.split("/", 1)[-1].startswith("sys/") and not profile:
                continue  # as the runs' own export: the recorder's timings only with profile
            got = scalar_difference(*raw_a[name], *raw_b[name])
            if got is None:
                continue
            steps, d, rel, _ = got
            for tag, values in ((f"compare/{name}/a_minus_b", d), (f"compare/{name}/rel_diff", rel)):
                for step, value in zip(steps.tolist(), values.tolist(), strict=True):
                    writer.add_scalar(tag, float(value), int(step), walltime=walltime.get(int(step)))
                    n += 1
        common = sorted(set(a.all_steps) & set(b.all_steps))
        if first is not None or div.get("identical"):
            for step in common:  # identical runs: 0 everywhere
                writer.add_scalar("compare/diverged", float(first is not None and step >= first), step,
                                  walltime=walltime.get(step))
                n += 1
        if first is not None:
            writer.add_scalar("compare/first_divergent_step", float(first), first, walltime=walltime.get(first))
            n += 1
        lines = [f"{label_a} (A) vs {label_b} (B): {div.get('headline', '')}"]
        lines += [f"{k}: {div[k]}" for k in ("reading", "cause") if div.get(k)]
        step_of_text = first if first is not None else 0
        writer.add_text("compare/divergence", "\n\n".join(lines), step_of_text, walltime=walltime.get(step_of_text))
    finally:
        writer.close()
    log.info("stepdump: compared %s with %s in %s (first divergent step %s, %d points)",
             label_b, label_a, logdir, first, n)
    return first, n


def _scalars(run: RunReader) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """name -> (steps, values) of every logged scalar of ``run`` (names prefixed ``rank<r>/`` per rank)."""
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for prefix, store in stores_of(run):
        out.update({prefix + k: v for k, v in scalar_series(store).items()})
    return out
