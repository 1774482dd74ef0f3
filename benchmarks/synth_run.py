"""A long stats-only run written straight into the catalog: the rows a recording would write.

Recording 100,000 steps of a 500-tensor model step by step takes about an hour; the report's
scale benchmark (``report_scale.py``) and its browser test need the *store*, not the training.
:func:`synth_run` records the first ``template`` steps for real (``stepdump.Recorder``, stats
only, params and grads of ``tensors`` small parameters named like a transformer's blocks), then
appends the remaining steps through the store's own writer (:class:`stepdump.store.catalog.
CatalogWriter`: ``add_tensors`` / ``add_step`` / ``add_scalars`` / ``set_meta``), each step's
rows shaped like the template's last step (same series, dtype, shape, state JSON, scalar names)
with synthetic stats. tests/test_report_scale.py checks the result against a run recorded for
real: same tables, same row shapes.

Planted, so a report can be checked for them: a gradient spike (``spike`` step, the first
tensor's grad max 1e4) and a NaN (``nan_step``: the second tensor's grad holds a NaN, and the
logged loss is NaN).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

import stepdump
from stepdump.store.catalog import CatalogWriter

KINDS = ("attn_w", "attn_b", "mlp_w", "mlp_b", "ln_w", "ln_b")
NUMEL = 16


def tensor_names(tensors: int) -> list[str]:
    """``h_<block>_<kind>`` for ``tensors`` tensors, six to a block."""
    return [f"h_{i // len(KINDS)}_{KINDS[i % len(KINDS)]}" for i in range(tensors)]


def grad_value(step: int | np.ndarray, j: int | np.ndarray) -> np.ndarray:
    """Every element of tensor ``j``'s gradient at ``step`` (what the template records too)."""
    return 0.01 * (1 + (np.asarray(step) + np.asarray(j)) % 7)


def record_template(path: Path, tensors: int, steps: int) -> None:
    """Record ``steps`` steps for real: SGD on ``tensors`` parameters of 16 elements, stats only."""
    torch.manual_seed(0)
    model = nn.ParameterDict({n: nn.Parameter(torch.randn(NUMEL)) for n in tensor_names(tensors)})
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with stepdump.Recorder(path, model, opt, every=None, stats_every=1, capture=("params", "grads")) as rec:
        for s in range(steps):
            for j, p in enumerate(model.values()):
                p.grad = torch.full((NUMEL,), float(grad_value(s, j)))
            opt.step()
            rec.log(loss=1.0 / (1 + s))


def synth_run(path: str | Path, tensors: int, steps: int, *, spike: int | None = None,
              nan_step: int | None = None, template: int = 2, chunk: int = 2000) -> Path:
    """Write a ``tensors`` x ``steps`` stats-only run at ``path`` (see the module docstring).

    Args:
        path: A directory that does not exist yet.
        tensors: Parameters of the model (their params and grads get stats rows: 2 x tensors series).
        steps: Optimizer steps in all (the first ``template`` recorded for real); as in a recording,
            step ``steps`` is the final one (params in full, no grads).
        spike: Step where the first tensor's gradient spikes to 1e4 (None: no spike).
        nan_step: Step where the second tensor's gradient holds a NaN and the loss is NaN.
        template: Steps recorded for real.
        chunk: Steps per catalog transaction.
    """
    path = Path(path)
    if steps <= template:
        raise ValueError(f"steps={steps} must exceed template={template}")
    record_template(path, tensors, template)
    with stepdump.open(path) as run:
        final = run.meta.get("final_step")
        if final != template or run.all_steps[-1] != template:
            raise RuntimeError(f"the template has steps {run.all_steps}, final_step {final}: not what synth_run copies")
        model = template - 1  # an ordinary step: the final one holds params in full, no grads
        rows = [r for r in run.catalog.step_rows(model) if r[0] in ("params", "grads")]
        state = run.catalog.step_state(model)
        level = run.catalog.level(model)
        scalars = {n: v for _, n, v in run.catalog.scalar_rows(model)}
    names = tensor_names(tensors)
    index = {n: j for j, n in enumerate(names)}
    rng = np.random.default_rng(0)
    cat = CatalogWriter(path)
    try:
        cat.renumber_step(template, steps)  # the final step (params in full, state) ends the run
        sids = np.array([cat.series_id(k, n, p, key) for k, n, p, key, *_ in rows], dtype=np.int64)
        dtypes = [r[4] for r in rows]
        shapes = [r[5] for r in rows]
        is_grad = np.array([r[0] == "grads" for r in rows])
        j = np.array([index[r[1]] for r in rows], dtype=np.int64)
        base = np.array([float(r[9]) if r[9] is not None else 0.0 for r in rows])  # the template's min
        width = len(rows)
        for a in range(template, steps, chunk):
            b = min(steps, a + chunk)
            s = np.repeat(np.arange(a, b, dtype=np.int64), width)
            jj, gg = np.tile(j, b - a), np.tile(is_grad, b - a)
            g = grad_value(s, jj)
            p = np.tile(base, b - a) - 1e-3 * 0.04 * (s - template)  # SGD drift, smooth
            v = np.where(gg, g, p)
            vmin, vmax = v.copy(), v.copy()
            nan = np.zeros(s.size, dtype=np.int64)
            if spike is not None and a <= spike < b:
                vmax[(s == spike) & gg & (jj == 0)] = 1e4
            if nan_step is not None and a <= nan_step < b:
                nan[(s == nan_step) & gg & (jj == 1 % max(tensors, 1))] = 1
            norm = np.sqrt((NUMEL - 1) * v * v + vmax * vmax)
            mean = (v * (NUMEL - 1) + vmax) / NUMEL
            std = np.sqrt(np.maximum((v * v * (NUMEL - 1) + vmax * vmax) / NUMEL - mean * mean, 0.0))
            fp = rng.integers(-(2**63), 2**63 - 1, size=s.size, dtype=np.int64)
            n = s.size
            # By series then step: the order of the catalog's primary key, so SQLite appends to each
            # series' run of rows instead of inserting all over the tree (several times faster).
            o = np.lexsort((s, np.tile(sids, b - a)))
            cat.add_tensors(zip(np.tile(sids, b - a)[o].tolist(), s[o].tolist(), [dtypes[i] for i in o % width],
                                [shapes[i] for i in o % width], [None] * n, [NUMEL] * n, nan[o].tolist(), [0] * n,
                                [0] * n, vmin[o].tolist(), vmax[o].tolist(), mean[o].tolist(), std[o].tolist(),
                                norm[o].tolist(), [0.0] * n, fp[o].tolist()))
            for t in range(a, b):
                cat.add_step(t, level, False, state)
            cat.add_scalars((t, name, (None if t == nan_step else 1.0 / (1 + t)) if name == "loss" else v)
                            for t in range(a, b) for name, v in scalars.items())
            cat.commit()
        cat.set_meta("final_step", steps)
        cat.commit()
    finally:
        cat.close()
    return path
