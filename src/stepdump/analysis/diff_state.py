"""What differs at a step besides tensors: hyperparameters, scheduler/scaler, RNG, batch, scalars.

Every difference is a :class:`Difference` with a *stage*: where in one iteration it acts. Stages
run in causal order (:data:`STAGES`), so the first difference of a step is its earliest cause:
the hyperparameters and the RNG and batch an iteration starts from come before the params the
forward pass reads, whose outputs (activations, the loss) come before the grads, which come
before the optimizer state.

The state of a step is compared as the catalog stores it (typed JSON whose tensors are
references to blobs): references are compared by fingerprint, so equal states are never
decoded and no tensor is read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from stepdump.analysis.diff_values import TensorDiff
from stepdump.core import tjson
from stepdump.errors import CorruptDataError
from stepdump.store.format import STATE_AFTER_UPDATE, STATE_FORWARD_RNG, STATE_OUTSIDE_OPTIMIZER

#: The stages of one iteration, earliest cause first.
STAGES = ("hyperparameters", "rng", "batch", "params", "forward", "grads", "optimizer")

#: The stage of each tensor kind.
KIND_STAGE = {"inputs": "batch", "params": "params", "buffers": "params", "activations": "forward",
              "activation_grads": "grads", "grads": "grads", "optimizer": "optimizer"}

#: Scalars the Recorder logs by itself that are hyperparameters, not measurements.
_SCALER_SCALAR = "grad_scale"

#: Recorded meta compared between runs (run-wide settings that change the numbers).
CONFIG_KEYS = ("model_class", "optimizer_class", "scheduler_class", "scaler", "torch_version", "device",
               "num_threads")

#: (dtype, shape, fingerprint) of each ``state`` tensor of a step, by ref.
StateFingerprints = dict[str, tuple[Any, Any, Any]]


@dataclass(frozen=True)
class Difference:
    """One thing that differs between two runs at one step.

    ``stage`` is one of :data:`STAGES`; ``what`` names it (``lr``, ``scheduler last_epoch``,
    ``rng torch``, ``loss``, ``grads 0.weight``); ``a`` and ``b`` are the two values where
    they are plain values (None for tensors, or a side that does not have it); ``tensor``
    is the element-wise comparison for a tensor.
    """

    step: int
    stage: str
    what: str
    a: Any = None
    b: Any = None
    tensor: TensorDiff | None = None

    def describe(self) -> str:
        """One line, ``what``: how it differs."""
        if self.tensor is not None:
            return self.tensor.describe()
        if self.a is None and self.b is None:
            return f"{self.what} differs"
        return f"{self.what}: A {_show(self.a)}, B {_show(self.b)}"

    def sort_key(self) -> tuple[int, int]:
        return self.step, STAGES.index(self.stage) if self.stage in STAGES else len(STAGES)


@dataclass(frozen=True)
class RngDiff:
    """An RNG stream whose state differs between two runs at the start of some steps.

    ``stream`` is a key of the recorded RNG state (``torch``, ``cuda``, ``numpy``, ``python``);
    it differs at ``steps`` of the steps whose RNG both runs recorded, the first at
    ``first_step`` and the last at ``last_step``. By itself it is not a divergence: only what
    is computed from it (the batch, the loss, the grads) can be.
    """

    stream: str
    first_step: int
    last_step: int
    steps: int


def config_differences(meta_a: dict[str, Any], meta_b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, A's value, B's value) of the recorded settings that differ between two runs."""
    return [(k, meta_a.get(k), meta_b.get(k)) for k in CONFIG_KEYS if meta_a.get(k) != meta_b.get(k)]


# -- scalars -------------------------------------------------------------------------------------


def scalar_stage(name: str) -> str:
    """The stage of a logged scalar: the lr and AMP scale are hyperparameters, the rest (the
    loss, metrics) are outputs of the forward pass."""
    if name == "lr" or name.startswith("lr/") or name == _SCALER_SCALAR:
        return "hyperparameters"
    return "forward"


def scalar_label(name: str) -> str:
    """``lr/1`` -> ``lr (group 1)`` (the label the param-group comparison uses)."""
    if name.startswith("lr/") and name[3:].isdigit():
        return f"lr (group {name[3:]})"
    return "scaler scale" if name == _SCALER_SCALAR else name


def scalar_table(rows: list[tuple[int, str, float | None]]) -> dict[str, dict[int, float | None]]:
    """name -> step -> value of a run's scalar rows, without the recorder's ``sys/*`` readings
    (wall time and memory differ between any two runs)."""
    out: dict[str, dict[int, float | None]] = {}
    for step, name, value in rows:
        if not name.startswith("sys/"):
            out.setdefault(name, {})[step] = value
    return out


def scalars_equal(a: float | None, b: float | None, atol: float, rtol: float) -> bool:
    """Bitwise by default (None is a logged NaN: equal to a NaN), else within the tolerance."""
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return (a is None or math.isnan(a)) and (b is None or math.isnan(b))
    if atol == 0 and rtol == 0:
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return abs(a - b) <= atol + rtol * abs(b)


def scalar_differences(ta: dict[str, dict[int, float | None]], tb: dict[str, dict[int, float | None]],
                       atol: float, rtol: float) -> dict[int, list[Difference]]:
    """step -> the scalars logged in both runs that differ there."""
    out: dict[int, list[Difference]] = {}
    for name in sorted(ta.keys() & tb.keys()):
        va, vb = ta[name], tb[name]
        for step in va.keys() & vb.keys():
            if not scalars_equal(va[step], vb[step], atol, rtol):
                out.setdefault(step, []).append(
                    Difference(step, scalar_stage(name), scalar_label(name), va[step], vb[step]))
    return out


# -- step state ----------------------------------------------------------------------------------


def parse_state(text: str | None, where: str) -> dict[str, Any] | None:
    """The stored state JSON of a step, parsed but not decoded (None: the step has no state)."""
    if text is None:
        return None
    try:
        tree = tjson.loads(text, f"the recorded state of {where}")
    except (ValueError, TypeError, RecursionError) as e:
        raise CorruptDataError(f"the recorded state of {where} is malformed ({e}): `stepdump verify` "
                               "checks a run") from None
    if not isinstance(tree, dict):
        raise CorruptDataError(f"the recorded state of {where} is not an object: `stepdump verify` checks a run")
    return tree


def state_differences(step: int, sa: dict[str, Any], sb: dict[str, Any], fa: StateFingerprints,
                      fb: StateFingerprints) -> tuple[list[Difference], set[str]]:
    """The differences between two recorded states of ``step``, and the sections both had
    (``hyperparameters``, ``scheduler``, ``scaler``, ``rng``, ``batch``)."""
    found: list[Difference] = []
    both: set[str] = set()
    for key in sorted(sa.keys() | sb.keys()):
        # Where params changed outside the optimizer were stored, and what replay needs (each forward's
        # RNG, what the update left in edited params): storage, not the training; what they change shows
        # in the loss, grads and params.
        if key in (STATE_OUTSIDE_OPTIMIZER, STATE_AFTER_UPDATE, STATE_FORWARD_RNG):
            continue
        stage = "rng" if key == "rng" else "batch" if key == "batch" else "hyperparameters"
        if key not in sa or key not in sb:
            if key in ("rng", "batch"):  # recorded on one side only: not comparable, not a difference
                continue
            found.append(Difference(step, stage, _section_label(key), _presence(sa, key), _presence(sb, key)))
            continue
        both.add("hyperparameters" if key in ("groups", "optimizer_extra") else key)
        if key == "groups":
            found += _group_differences(step, sa[key], sb[key], fa, fb)
            continue
        if key in ("rng", "batch"):  # one difference per generator: their inner fields mean nothing alone
            parts = sorted({p[:1] for p, _, _ in _walk(sa[key], sb[key], fa, fb, ())})
            found += [Difference(step, stage, " ".join([_section_label(key), *p])) for p in parts]
            continue
        for path, x, y in _walk(sa[key], sb[key], fa, fb, ()):
            found.append(Difference(step, stage, " ".join([_section_label(key), *path]).strip(),
                                    _plain(x), _plain(y)))
    return found, both


def _group_differences(step: int, ga: Any, gb: Any, fa: StateFingerprints,
                       fb: StateFingerprints) -> list[Difference]:
    if not (isinstance(ga, list) and isinstance(gb, list)):
        return [Difference(step, "hyperparameters", "param groups", _plain(ga), _plain(gb))]
    if len(ga) != len(gb):
        return [Difference(step, "hyperparameters", "number of param groups", len(ga), len(gb))]
    found = []
    for i, (a, b) in enumerate(zip(ga, gb)):
        ha = a.get("hyper", {}) if isinstance(a, dict) else a
        hb = b.get("hyper", {}) if isinstance(b, dict) else b
        for path, x, y in _walk(ha, hb, fa, fb, ()):
            label = " ".join(path) or "hyperparameters"
            found.append(Difference(step, "hyperparameters", label if len(ga) == 1 else f"{label} (group {i})",
                                    _plain(x), _plain(y)))
        if isinstance(a, dict) and isinstance(b, dict) and len(a.get("params", ())) != len(b.get("params", ())):
            found.append(Difference(step, "hyperparameters", f"number of params in group {i}",
                                    len(a.get("params", ())), len(b.get("params", ()))))
    return found


def _walk(a: Any, b: Any, fa: StateFingerprints, fb: StateFingerprints,
          path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any, Any]]:
    """(path, a, b) of each place two stored trees differ; tensor refs compare by fingerprint.

    Dicts are walked key by key (so a difference is named by its key); a list or tagged
    value is one value unless it holds tensor refs, which are walked to reach them."""
    ra, rb = _ref(a), _ref(b)
    if ra is not None or rb is not None:
        # A ref with no state fingerprint points elsewhere (the batch skeleton's refs name the
        # inputs, which are compared as tensors): the refs themselves are what is compared here.
        if ra is None or rb is None or fa.get(ra) != fb.get(rb) or (fa.get(ra) is None and ra != rb):
            yield path, a, b
        return
    if isinstance(a, dict) and isinstance(b, dict) and not _tagged(a) and not _tagged(b):
        for k in sorted(a.keys() | b.keys()):
            if k not in a or k not in b:
                yield (*path, k), a.get(k), b.get(k)
            else:
                yield from _walk(a[k], b[k], fa, fb, (*path, k))
        return
    if _has_ref(a) and _has_ref(b):
        if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
            for k in a:
                yield from _walk(a[k], b[k], fa, fb, path)
            return
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for x, y in zip(a, b):
                yield from _walk(x, y, fa, fb, path)
            return
    if not _same(a, b):
        yield path, a, b


def _has_ref(x: Any) -> bool:
    if _ref(x) is not None:
        return True
    if isinstance(x, dict):
        return any(_has_ref(v) for v in x.values())
    if isinstance(x, list):
        return any(_has_ref(v) for v in x)
    return False


def _same(a: Any, b: Any) -> bool:
    """Exact equality of two JSON trees (1 and 1.0 differ in type; NaN is stored tagged)."""
    return type(a) is type(b) and json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _ref(x: Any) -> str | None:
    if isinstance(x, dict) and "$tensor" in x and set(x) <= {"$tensor", "$device"}:
        return str(x["$tensor"])
    return None


def _tagged(x: dict[str, Any]) -> bool:
    return len(x) == 1 and next(iter(x)).startswith("$")


def _section_label(key: str) -> str:
    return {"groups": "", "optimizer_extra": "optimizer", "batch": "batch structure"}.get(key, key)


def _presence(state: dict[str, Any], key: str) -> str:
    return "recorded" if key in state else "not recorded"


def _plain(x: Any) -> Any:
    """A stored value for display: tuples and floats untagged, tensors as ``<tensor>``."""
    if _ref(x) is not None:
        return "<tensor>"
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        if _tagged(x):
            (tag, val), = x.items()
            if tag == "$tuple" and isinstance(val, list):
                return tuple(_plain(v) for v in val)
            if tag == "$float":
                try:
                    return float(val)
                except (TypeError, ValueError):
                    return val
            if tag == "$repr":
                return str(val)
            return x
        return {k: _plain(v) for k, v in x.items()}
    return x


def _show(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    text = repr(v) if not isinstance(v, str) else v
    return text if len(text) <= 80 else text[:77] + "..."
