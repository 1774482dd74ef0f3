"""The report's scalar charts: one chart per quantity, on the scale that shows it.

Two things a user found in the report are decided here, as pure functions of
the logged series:

* **Duplicates.** The same values often arrive under several names: the
  Recorder logs ``lr`` (and ``lr/1`` ... per param group), a Hugging Face
  ``Trainer`` logs ``learning_rate``, a user logs ``lr`` again. A chart each
  says the same thing three times. :func:`group_scalars` folds a series into
  another when its values equal the other's at every step it was logged
  (shift 0), or equal the other's at the *next* step (shift 1: a Trainer logs
  the rate after its scheduler stepped, so its ``learning_rate`` at step t is
  the rate update t+1 uses). Only exact equality counts: nothing is merged
  because it looks alike.
* **Scale.** :func:`wants_log` picks a log axis when a linear one would
  flatten most of the curve: positive values spanning about two decades, or a
  spike ten times the median (a loss spike squashes the rest of the loss curve
  into the floor on a linear axis). The page has a toggle either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

Series = tuple[np.ndarray, np.ndarray]  # (steps int64, values float64; NaN for a logged NaN)

#: hi/lo ratio from which positive values are drawn on a log axis by default.
LOG_SPAN = 50.0
#: max/median ratio (a spike) from which positive values are drawn on a log axis by default.
LOG_SPIKE = 10.0


def wants_log(values: np.ndarray) -> bool:
    """True when ``values`` (NaN/Inf ignored) are all positive and span decades or hold a spike."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size < 2 or bool(np.any(v <= 0)):
        return False
    lo, hi, med = float(v.min()), float(v.max()), float(np.median(v))
    return hi / lo >= LOG_SPAN or hi / med >= LOG_SPIKE


@dataclass
class ScalarGroup:
    """One chart: the series drawn (``name``) and the names whose values it also is."""

    name: str
    aliases: list[str] = field(default_factory=list)  # equal at every step they were logged
    shifted: list[str] = field(default_factory=list)  # equal to ``name`` one step later

    @property
    def names(self) -> list[str]:
        return [self.name, *self.aliases, *self.shifted]

    def title(self, prefix: str = "") -> str:
        """The chart title, naming every series it stands for: ``lr = lr/1 = learning_rate``."""
        return " = ".join([prefix + self.name, *(prefix + n for n in self.aliases),
                           *(f"{prefix}{n} (one step later)" for n in self.shifted)])

    @property
    def note(self) -> str:
        """Why names share the chart ('' when they do not)."""
        parts = []
        if self.aliases:
            parts.append(f"{', '.join(self.aliases)}: the same values as {self.name} at every step logged")
        for n in self.shifted:
            parts.append(f"{n} at step t equals {self.name} at step t+1 (logged after the scheduler "
                         "stepped, as a Hugging Face Trainer logs learning_rate)")
        return "; ".join(parts)


def scalar_order(name: str) -> tuple[bool, bool, str]:
    """Sort key of scalar charts: loss first, then learning rates, then alphabetical."""
    return (name != "loss", not name.startswith("lr"), name)


def _same_at(a: Series, b: Series, shift: int) -> bool:
    """b's value at each of its steps s equals a's at s + shift (NaN equals NaN); b's steps
    past a's last step are allowed for shift 1 (the last log of a shifted series has no partner)."""
    (sa, va), (sb, vb) = a, b
    if sb.size == 0:
        return False
    want = sb + shift
    if shift:
        keep = want <= sa[-1] if sa.size else np.zeros(sb.size, dtype=bool)
        want, vb = want[keep], vb[keep]
        if want.size < 2:  # one coincidence is not evidence of a shifted copy
            return False
    idx = np.searchsorted(sa, want)
    if bool(np.any(idx >= sa.size)) or not np.array_equal(sa[np.minimum(idx, sa.size - 1)], want):
        return False
    return bool(np.array_equal(va[idx], vb, equal_nan=True))


def group_scalars(series: dict[str, Series]) -> list[ScalarGroup]:
    """Fold duplicate series into groups (see the module docstring), in chart order.

    The series with the most points of a group is drawn (ties: :func:`scalar_order`); a name
    joins the first group whose drawn series it repeats.
    """
    return fold_groups({n: int(v[0].size) for n, v in series.items()},
                       lambda a, b, shift: _same_at(series[a], series[b], shift))


def fold_groups(sizes: dict[str, int], same_at: Callable[[str, str, int], bool]) -> list[ScalarGroup]:
    """:func:`group_scalars` over names with ``sizes`` points, ``same_at(a, b, shift)`` saying
    whether ``b`` repeats ``a`` (read ``shift`` steps later): the catalog can answer it in SQL."""
    by_priority = sorted(sizes, key=lambda n: (-sizes[n], scalar_order(n)))
    groups: list[ScalarGroup] = []
    for name in by_priority:
        home = None
        for g in groups:
            if same_at(g.name, name, 0):
                g.aliases.append(name)
                home = g
                break
            if same_at(g.name, name, 1):
                g.shifted.append(name)
                home = g
                break
        if home is None:
            groups.append(ScalarGroup(name))
    return sorted(groups, key=lambda g: scalar_order(g.name))
