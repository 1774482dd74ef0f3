"""What :func:`stepdump.diff` returns: :class:`DiffResult` and its :class:`Coverage`.

The result types sit below the modules that build them (:mod:`~stepdump.analysis.diff`, the
pair-by-pair :mod:`~stepdump.analysis.diff_joint` and the noise-aware
:mod:`~stepdump.analysis.diff_noise`), so those import them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stepdump.analysis.diff_reading import headline, summary_lines
from stepdump.analysis.diff_state import Difference, RngDiff
from stepdump.analysis.diff_values import TensorDiff
from stepdump.store.format import Key

if TYPE_CHECKING:  # an annotation only: diff_noise builds DiffResults, so it imports this module
    from stepdump.analysis.diff_noise import NoiseDiff



@dataclass
class Coverage:
    """What a diff compared, and what it could not.

    Counts are over the steps the comparison went through: the recorded state is compared up
    to the first divergent step, tensors up to the first step where tensors differ, scalars
    at every common step.
    """

    #: Common steps with fingerprints (the same as ``DiffResult.steps_compared``).
    steps: int = 0
    #: (kind, name) compared at one step or more, and (step, tensor) pairs compared.
    tensors: int = 0
    tensor_checks: int = 0
    #: Tensor kinds compared; kinds recorded by one run only.
    kinds: list[str] = field(default_factory=list)
    kinds_only_in_a: list[str] = field(default_factory=list)
    kinds_only_in_b: list[str] = field(default_factory=list)
    #: Steps whose recorded state (param groups, scheduler, scaler, RNG) was compared, and
    #: which of its parts both runs had (``hyperparameters``, ``scheduler``, ``scaler``, ``rng``, ``batch``).
    state_steps: int = 0
    state_parts: list[str] = field(default_factory=list)
    #: Steps (as far as the state was compared) where one run or both had no recorded state:
    #: their hyperparameters other than the lr, scheduler, scaler and RNG state are unknown.
    state_missing: int = 0
    #: Steps whose RNG state both runs recorded and the diff compared (see ``DiffResult.rng``).
    rng_steps: int = 0
    #: Scalars compared (logged by both; the recorder's ``sys/*`` timings are never compared),
    #: steps at which the ``lr`` scalars were, and scalars logged by one run only.
    scalars: list[str] = field(default_factory=list)
    lr_steps: int = 0
    scalars_only_in_a: list[str] = field(default_factory=list)
    scalars_only_in_b: list[str] = field(default_factory=list)
    #: Step-tensor checks not made because the runs fingerprint that tensor in two kinds (xxh3 in
    #: one, dmix64 in the other: docs/cuda.md) and neither stored its bytes at that step, and the
    #: first of them as (step, kind, name, fingerprint kind in A, in B). A diff with any is never
    #: ``identical`` nor ``complete``.
    fp_kinds_differ: int = 0
    fp_kinds_differ_first: tuple[int, str, str, str, str] | None = None


@dataclass
class DiffResult:
    """What :func:`diff` found.

    ``identical`` means something was compared (``comparable``) and nothing compared differs:
    no tensor at a common step, no hyperparameter, scheduler, scaler state or batch, no logged
    scalar. An RNG state that differs while none of these does is a note (``notes``), not a
    difference. What was not compared (names, steps, scalars in one run only, tensors whose
    fingerprints are of two kinds with no bytes stored) is listed, and ``complete`` says whether
    there was any. A tensor left uncompared for its fingerprint kinds makes a result not
    ``identical``: nothing says it is equal.
    """

    #: The first step where anything compared differs (None: none does).
    first_step: int | None
    #: How each tensor differs at ``first_tensor_step``, earliest cause first.
    tensors: list[TensorDiff]
    steps_compared: int
    steps_only_in_a: list[int] = field(default_factory=list)
    steps_only_in_b: list[int] = field(default_factory=list)
    names_only_in_a: list[Key] = field(default_factory=list)
    names_only_in_b: list[Key] = field(default_factory=list)
    #: (step, name) of the first logged scalar that differs.
    first_scalar_diff: tuple[int, str] | None = None
    #: For multi-rank runs: the rank ``first_step`` and ``tensors`` are about (None: single stores).
    rank: int | None = None
    #: For multi-rank runs: each rank's own result (empty for single stores).
    per_rank: dict[int, DiffResult] = field(default_factory=dict)
    #: Everything that differs at ``first_step``, earliest cause first (``differences[0]`` is the cause).
    differences: list[Difference] = field(default_factory=list)
    #: The first step where tensors differ (``tensors`` are about it); may be later than ``first_step``.
    first_tensor_step: int | None = None
    #: What was compared and what could not be.
    coverage: Coverage = field(default_factory=Coverage)
    #: Recorded settings that differ between the runs: (meta key, A's value, B's value).
    config: list[tuple[str, Any, Any]] = field(default_factory=list)
    #: One line: what the first differences point at ("" when nothing differs).
    reading: str = ""
    #: RNG streams that differ where they were compared (up to ``first_step``): not divergences.
    rng: list[RngDiff] = field(default_factory=list)
    #: What is worth knowing but is no divergence ("numpy and python RNG differ at every step
    #: compared (0-99); nothing computed differs").
    notes: list[str] = field(default_factory=list)
    #: The parts left out with ``ignore=``, sorted.
    ignored: list[str] = field(default_factory=list)
    #: For joint runs (several model/optimizer pairs): the pair ``differences[0]`` is about, and
    #: each pair's own result (analysis/diff_joint.py).
    pair: str | None = None
    per_pair: dict[str, DiffResult] = field(default_factory=dict)
    #: With ``noise=``: the test against A and its repeats, with its run-level false-alarm rate
    #: (:mod:`~stepdump.analysis.diff_noise`); ``first_step`` is then where a quantity first counts.
    noise: NoiseDiff | None = None

    @property
    def comparable(self) -> bool:
        """Whether the runs had anything to compare: a tensor recorded by both at a common step."""
        return self.coverage.tensor_checks > 0

    @property
    def identical(self) -> bool:
        """Something was compared, nothing compared differs, and no tensor was left uncompared
        for its fingerprint kinds (see the class docstring)."""
        return self.comparable and self.first_step is None and not self.coverage.fp_kinds_differ

    @property
    def complete(self) -> bool:
        """Whether everything either run recorded had a counterpart in the other."""
        c = self.coverage
        return not (self.steps_only_in_a or self.steps_only_in_b or self.names_only_in_a or self.names_only_in_b
                    or c.scalars_only_in_a or c.scalars_only_in_b or c.fp_kinds_differ)

    @property
    def first_tensor(self) -> TensorDiff | None:
        return self.tensors[0] if self.tensors else None

    @property
    def cause(self) -> Difference | None:
        """The earliest difference at ``first_step`` (None when nothing differs)."""
        return self.differences[0] if self.differences else None

    def headline(self) -> str:
        """The first line of :meth:`summary`: identical, nothing comparable, or where and why they part."""
        return headline(self)

    def summary(self) -> str:
        """A few lines: the headline, the reading, what was compared and what could not be."""
        return "\n".join(summary_lines(self))
