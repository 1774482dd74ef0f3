"""What :func:`stepdump.diff` can leave out of the comparison (``ignore=``, ``--ignore``).

The vocabulary names the parts the diff compares, one word each, and a finer word where a part
has pieces a user may want to keep apart:

==========================  =====================================================================
``hyperparameters``         the param groups' hyperparameters (``lr``, ``betas``, ...), optimizer
                            extras, and the ``lr`` scalars the Recorder logs
``scheduler``               the LR scheduler's state
``scaler``                  the GradScaler's state, its ``grad_scale`` scalar and the steps it skipped
``rng``                     every RNG stream; ``rng.torch``, ``rng.cuda``, ``rng.numpy``,
                            ``rng.python``: one stream
``batch``                   the recorded batch (its structure and the ``inputs`` tensors)
``scalars``                 every scalar logged with ``rec.log`` (loss, metrics); ``scalars.NAME``:
                            one of them
``params``, ``grads``, ...  a tensor kind (``inputs``, ``params``, ``buffers``, ``activations``,
                            ``activation_grads``, ``grads``, ``optimizer``): as leaving it out of
                            ``kinds=``
==========================  =====================================================================

What is left out is neither compared nor counted as compared: the result lists it
(``DiffResult.ignored``) and its summary says so.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from stepdump.analysis.diff_state import KIND_STAGE
from stepdump.errors import ConfigError

#: The RNG streams a record holds (core/rng.py: torch CPU, every CUDA device, numpy, python ``random``).
RNG_STREAMS = ("torch", "cuda", "numpy", "python")

#: The words ``ignore=`` takes (``scalars.NAME`` is any logged scalar's name after the dot).
PARTS = ("hyperparameters", "scheduler", "scaler", "rng", *(f"rng.{s}" for s in RNG_STREAMS), "batch",
         "scalars", "scalars.<name>", *KIND_STAGE)

# The recorded state's sections and the word that leaves each out (other sections are always compared).
_SECTIONS = {"groups": "hyperparameters", "optimizer_extra": "hyperparameters", "scheduler": "scheduler",
             "scaler": "scaler", "rng": "rng", "batch": "batch"}


@dataclass(frozen=True)
class Ignore:
    """The parts of a diff left out, parsed from ``ignore=`` (see the module docstring)."""

    parts: frozenset[str] = frozenset()

    @property
    def listed(self) -> list[str]:
        """The words given, sorted (what a result reports as ignored)."""
        return sorted(self.parts)

    def kinds(self, wanted: Iterable[str]) -> tuple[str, ...]:
        """The tensor kinds of ``wanted`` still compared (``batch`` leaves out ``inputs`` too)."""
        return tuple(k for k in wanted if k not in self.parts and not (k == "inputs" and "batch" in self.parts))

    def scalar(self, name: str) -> bool:
        """Whether the logged scalar ``name`` is left out."""
        if name == "lr" or (name.startswith("lr/") and name[3:].isdigit()):
            return "hyperparameters" in self.parts
        if name == "grad_scale":
            return "scaler" in self.parts
        return "scalars" in self.parts or f"scalars.{name}" in self.parts

    def state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A recorded step state without the sections (and RNG streams) left out."""
        if not self.parts:
            return state
        out = {k: v for k, v in state.items() if _SECTIONS.get(k) not in self.parts}
        rng = out.get("rng")
        if isinstance(rng, dict):
            kept = {s: v for s, v in rng.items() if f"rng.{s}" not in self.parts}
            if kept:
                out["rng"] = kept
            else:
                del out["rng"]
        return out


def parse_ignore(ignore: str | Iterable[str] | None) -> Ignore:
    """``ignore=`` as given (one word, or several) -> :class:`Ignore`.

    Raises:
        ConfigError: A word that names no part (the message lists the valid ones).
    """
    if ignore is None:
        return Ignore()
    words = [ignore] if isinstance(ignore, str) else list(ignore)
    for w in words:
        if not isinstance(w, str) or not _valid(w):
            raise ConfigError(f"cannot ignore {w!r}: it names no part of a diff. Valid parts: {', '.join(PARTS)} "
                              "(scalars.<name> is a logged scalar, e.g. scalars.loss)")
    return Ignore(frozenset(words))


def _valid(word: str) -> bool:
    if word in PARTS and word != "scalars.<name>":
        return True
    return word.startswith("scalars.") and len(word) > len("scalars.")
