"""The global gradient norm as backward produced it: before any clipping, when the run tells.

Gradients clipped before ``optimizer.step()`` (the Hugging Face ``Trainer``'s
``max_grad_norm``, a loop calling ``clip_grad_norm_``) are recorded clipped:
their global norm sits at the clip value however large the real gradient was,
so a blow-up cannot be seen in them. The pre-clip norm comes, in this order of
trust, from:

1. ``run.meta["user"]["grad_clip"]``, written by the integrations (or by you,
   through ``Recorder(metadata={"grad_clip": {...}})``): ``max_norm``, whether
   the recorded ``grads`` are ``"clipped"`` or ``"unclipped"``, and the
   ``norm_scalar`` holding the pre-clip norm (HF logs it as ``grad_norm``);
2. a logged ``grad_norm`` scalar that is larger than the recorded grads' norm:
   then the recorded grads were clipped (or cover part of the model) and the
   scalar is the whole truth;
3. the recorded norms themselves, when nothing says they are clipped. When
   they look clipped (the same top value, to 1e-4, at 3 or more steps) but no
   pre-clip norm was logged, :attr:`GradNorm.hidden` says so, and the rule
   tells the user what to log.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from stepdump.analysis.rules._frames import global_grad_norm

CLIP_META_KEY = "grad_clip"
# Recorded norms within this relative distance of their maximum count as "at the clip value".
AT_CAP_RTOL = 1e-4
# Steps at the clip value needed to call recorded grads clipped without being told.
AT_CAP_MIN_STEPS = 3


@dataclass(frozen=True)
class GradNorm:
    """The global grad norm the rules judge, and where it came from.

    Attributes:
        norms: Global grad norm per step, before clipping when known (finite, no skipped steps).
        recorded: Global norm of the recorded grads per step.
        source: Where ``norms`` come from, for messages ("" for the recorded grads, unclipped).
        clip: The clip value (``max_norm``), known or inferred; None when there is none.
        hidden: The recorded grads look clipped but no pre-clip norm was logged.
        at_clip: Steps whose recorded norm is at the clip value.
    """

    norms: pd.Series
    recorded: pd.Series
    source: str = ""
    clip: float | None = None
    hidden: bool = False
    at_clip: int = 0

    def scale(self) -> pd.Series:
        """Per step: pre-clip norm / recorded norm (1 where unclipped), to undo clipping per tensor."""
        r = self.recorded.reindex(self.norms.index)
        s = (self.norms / r.where(r > 0)).replace([np.inf, -np.inf], np.nan)
        return s.fillna(1.0)


def clip_meta(run: Any) -> dict[str, Any]:
    """``run.meta["user"]["grad_clip"]`` when it is a dict, else {}."""
    meta = run.meta if isinstance(getattr(run, "meta", None), dict) else {}
    user = meta.get("user")
    clip = user.get(CLIP_META_KEY) if isinstance(user, dict) else None
    return dict(clip) if isinstance(clip, dict) else {}


def _positive(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) and f > 0 else None


def _scalar(run: Any, name: str | None, skipped: set[int]) -> pd.Series:
    sc = run.scalars()
    if not name or name not in sc.columns:
        return pd.Series(dtype=float)
    v = pd.to_numeric(sc[name], errors="coerce").astype(float)
    v = v[np.isfinite(v) & (v >= 0) & ~v.index.isin(list(skipped))]
    v.index = v.index.astype(int)
    return v


def grad_norms(run: Any, grads: pd.DataFrame | pd.Series, skipped: set[int], scalar: str | None = "grad_norm") -> GradNorm:
    """The global grad norm per step, before clipping when the run shows clipping (module docstring).

    ``grads``: the grads' stats frame, or their global norm per step already summed
    (:func:`~._frames.windowed_grad_norm`)."""
    recorded = grads if isinstance(grads, pd.Series) else global_grad_norm(grads, skipped)
    meta = clip_meta(run)
    name = meta.get("norm_scalar", scalar) if scalar is not None else None
    logged = _scalar(run, name if isinstance(name, str) else scalar, skipped)
    clip = _positive(meta.get("max_norm"))
    said = meta.get("grads")
    if said == "unclipped":  # Lightning: recorded before its gradient_clip_val
        return GradNorm(recorded, recorded, f"before clipping at {clip:g}" if clip else "", clip)
    both = logged.index.intersection(recorded.index)
    larger = bool((logged[both] > recorded[both] * (1 + 1e-3)).any()) if len(both) else False
    if not logged.empty and (said == "clipped" or larger):
        cap = clip if clip is not None else (float(recorded.max()) if not recorded.empty else None)
        at = int((recorded >= cap * (1 - AT_CAP_RTOL)).sum()) if cap else 0
        return GradNorm(logged, recorded, f"before clipping, from the logged {logged.name!r}", cap, False, at)
    if recorded.empty:
        return GradNorm(recorded, recorded)
    cap = clip if said == "clipped" and clip is not None else float(recorded.max())
    at = int((recorded >= cap * (1 - AT_CAP_RTOL)).sum()) if cap > 0 else 0
    hidden = said == "clipped" or (at >= AT_CAP_MIN_STEPS and len(recorded) > AT_CAP_MIN_STEPS)
    return GradNorm(recorded, recorded, "", cap if hidden else clip, hidden, at if hidden else 0)
