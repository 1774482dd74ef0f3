"""``stepdump.check`` calibrated on a corpus of healthy loops (tests/corpus), recorded in full and lean mode.

* Every rule runs on every healthy corpus run: nothing worse than INFO (a check that cries wolf
  is a false verdict).
* The six false verdicts of issue 27, each on the loop that showed it.
* Faults planted in the same loops are named at their step, on their tensor, with their cause.
* The table in docs/checks.md ("How the rules were calibrated") is what this run produced:
  ``STEPDUMP_UPDATE_DOCS=1 pytest tests/test_checks_corpus.py`` rewrites it.

Each corpus run is recorded once per mode per session (``corpus`` fixture) and shared by the
tests and the table.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from corpus import LOOPS, MODES
from corpus.nanogpt import EXPLODING

import stepdump
from stepdump.checks import DEFAULT_RULES, Finding, Severity

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")

DOCS = Path(__file__).resolve().parent.parent / "docs" / "checks.md"
BEGIN, END = "<!-- corpus-table:begin -->", "<!-- corpus-table:end -->"
RULES = [cls.name for cls in DEFAULT_RULES]


@dataclass(frozen=True)
class Fault:
    """A fault planted in a corpus loop, and what must name it."""

    loop: str
    fault: str
    rule: str
    step: int | None
    tensor: str
    cause: str  # a phrase of the message that names the cause
    severity: Severity

    @property
    def id(self) -> str:
        return f"{self.loop}-{self.fault}"


FAULTS = [
    Fault("classification", "nan_batch", "nan_inf", 13, "batch/0", "the batch itself holds it", Severity.ERROR),
    Fault("classification", "lr_x1000", "lr_jump", 14, "lr", "1000x its neighbours", Severity.WARNING),
    Fault("lora", "lr_x1000", "lr_jump", 17, "lr", "1000x its neighbours", Severity.WARNING),
    Fault("classification", "dead_relu", "dead_units", 10, "fc1.weight", "dead ReLUs", Severity.WARNING),
    # A param frozen by mistake inside the optimizer looks exactly like a frozen base (LoRA): INFO, never silent.
    Fault("classification", "frozen_in_optimizer", "unchanged_tensor", 0, "fc1.weight", "never had a gradient",
          Severity.INFO),
    Fault("classification", "forgotten_in_optimizer", "unchanged_tensor", 0, "fc1.bias", "in no param group",
          Severity.WARNING),
    Fault("nanogpt", "exploding_grad", "exploding_gradient", 16, EXPLODING, "before clipping", Severity.WARNING),
    Fault("nanogpt", "nan_forward", "nan_inf", 15, "loss", "the forward pass produced it", Severity.ERROR),
    Fault("classification", "loss_flat", "loss_not_decreasing", None, "loss", "did not decrease", Severity.WARNING),
]


class Corpus:
    """Records each (loop, fault, mode) once and keeps its findings: ``{run label: [Finding]}``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[tuple[str, str | None, str], dict[str, list[Finding]]] = {}

    def findings(self, loop: str, mode: str, fault: str | None = None) -> dict[str, list[Finding]]:
        key = (loop, fault, mode)
        if key not in self._done:
            module = importlib.import_module(f"corpus.{loop}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                runs = module.record(self.root / f"{loop}-{fault or 'healthy'}-{mode}", mode, fault)
            self._done[key] = {label: stepdump.check(path) for label, path in runs.items()}
        return self._done[key]

    def run_path(self, loop: str, mode: str, label: str = "") -> Path:
        self.findings(loop, mode)
        return self.root / f"{loop}-healthy-{mode}" / label


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Corpus]:
    yield Corpus(tmp_path_factory.mktemp("corpus"))


def serious(findings: list[Finding]) -> list[str]:
    return [f"{f.severity.name} {f.rule} @{f.step} {f.tensor}: {f.message}" for f in findings
            if f.severity >= Severity.WARNING]


def of(findings: list[Finding], rule: str) -> list[Finding]:
    return [f for f in findings if f.rule == rule]


# -- no false alarm on a healthy loop ---------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("loop", LOOPS)
def test_healthy_loop_has_no_warning(corpus: Corpus, loop: str, mode: str) -> None:
    for label, found in corpus.findings(loop, mode).items():
        assert serious(found) == [], f"{loop}{'/' + label if label else ''} ({mode})"


# -- the six false verdicts of issue 27 --------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("loop", ["classification", "timm_warmup"])
def test_warmup_from_a_small_lr_is_not_an_lr_jump(corpus: Corpus, loop: str, mode: str) -> None:
    # torchvision: LinearLR(start_factor=0.01) per epoch (stairs, 34x at step 4); timm: warmup_lr_init=1e-6 (1001x).
    with stepdump.open(corpus.run_path(loop, mode)) as run:
        lr = run.scalars()["lr"].dropna()
        assert lr.iloc[1:8].max() > 30 * lr.iloc[0]  # the planted shape: a rise over 10x from a nonzero lr
    assert of(corpus.findings(loop, mode)[""], "lr_jump") == []


@pytest.mark.parametrize("mode", list(MODES))
def test_lora_growth_from_zero_init_is_not_a_blow_up(corpus: Corpus, mode: str) -> None:
    with stepdump.open(corpus.run_path("lora", mode)) as run:
        b = run.stats("params", name="layers.0.lora_B.default.weight").set_index("step")["norm"]
        assert b.loc[0] == 0.0 and b.loc[1] == 0.0 and b.loc[2] > 0  # zero init, lr 0 at step 0
    assert of(corpus.findings("lora", mode)[""], "update_ratio") == []


def test_embedding_grads_are_not_dead_units(corpus: Corpus) -> None:
    with stepdump.open(corpus.run_path("diffusion", "full")) as run:
        zf = run.stats("grads", name="time_proj.weight")["zero_frac"]
        assert (zf > 0.9).all()  # 16 timesteps of 1000 rows: most rows get no gradient, by construction
        assert "time_proj.weight" in run.meta["layout"]["embeddings"]
    assert of(corpus.findings("diffusion", "full")[""], "dead_units") == []


@pytest.mark.parametrize("mode", list(MODES))
def test_frozen_params_in_the_optimizer_are_one_info_naming_no_gradient(corpus: Corpus, mode: str) -> None:
    found = of(corpus.findings("lora", mode)[""], "unchanged_tensor")
    frozen = ("layers.0.base_layer.weight", "layers.0.base_layer.bias", "layers.2.base_layer.weight",
              "layers.2.base_layer.bias")
    assert [(f.severity, f.step, sorted(f.tensors)) for f in found] == [(Severity.INFO, 0, sorted(frozen))]
    assert "never had a gradient" in found[0].message and "lr=0" not in found[0].message


@pytest.mark.parametrize("mode", list(MODES))
def test_nan_origin_is_the_loss_not_the_grad_norm_logged_after_it(corpus: Corpus, mode: str) -> None:
    found = of(corpus.findings("nanogpt", mode, "nan_forward")[""], "nan_inf")
    assert [(f.step, f.kind, f.tensor, f.severity) for f in found] == [(15, None, "loss", Severity.ERROR)]
    assert "also logged non-finite at step 15: 'grad_norm'" in found[0].message
    assert "the objective first" in found[0].message


@pytest.mark.parametrize("mode", list(MODES))
def test_rl_and_gan_losses_are_not_judged_as_objectives(corpus: Corpus, mode: str) -> None:
    for loop, label in (("ppo", ""), ("dcgan", "D"), ("dcgan", "G")):
        found = of(corpus.findings(loop, mode)[label], "loss_not_decreasing")
        assert [(f.severity, f.step) for f in found] == [(Severity.INFO, None)], (loop, label)
        assert "not judged" in found[0].message and "objective=" in found[0].message


def test_a_declared_objective_is_judged(corpus: Corpus) -> None:
    path = corpus.run_path("ppo", "full")
    # PPO's summed loss rises over this run (new rollouts, new targets): declared the objective, it is judged.
    found = of(stepdump.check(path, rules=["loss_not_decreasing"], objective="loss"), "loss_not_decreasing")
    assert [(f.severity, f.tensor) for f in found] == [(Severity.WARNING, "loss")]
    assert stepdump.check(path, rules=["loss_not_decreasing"], objective=False) == []  # declared: none, silent


# -- faults planted in the same loops are found --------------------------------------------------------


def fault_finding(corpus: Corpus, fault: Fault, mode: str) -> Finding | None:
    """The finding that names the fault as the table counts it: its rule, step, tensor and cause."""
    for f in of(corpus.findings(fault.loop, mode, fault.fault)[""], fault.rule):
        if (f.step == fault.step and fault.tensor in (f.tensor, *f.tensors) and fault.cause in f.message
                and f.severity >= fault.severity):
            return f
    return None


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.id)
def test_planted_fault_is_named(corpus: Corpus, fault: Fault, mode: str) -> None:
    found = fault_finding(corpus, fault, mode)
    assert found is not None, [f"{f.rule} @{f.step} {f.tensor} {f.tensors}: {f.message}"
                               for f in corpus.findings(fault.loop, mode, fault.fault)[""]]


# -- the table in docs/checks.md ------------------------------------------------------------------


def _cell(counts: list[tuple[int, int]]) -> str:
    """Per mode (warnings+errors, infos) -> 'full/lean' count of warnings, infos in brackets."""
    bad = "/".join(str(b) for b, _ in counts)
    info = "/".join(str(i) for _, i in counts)
    return bad + (f" ({info} info)" if any(i for _, i in counts) else "")


def corpus_table(corpus: Corpus) -> str:
    """The markdown the docs hold between the markers: counts and found/missed only (no floats)."""
    runs = [(loop, label) for loop in LOOPS for label in corpus.findings(loop, "full")]
    head = [f"{loop}/{label}" if label else loop for loop, label in runs]
    lines = ["False alarms on the healthy corpus: warnings and errors per rule, full/lean mode (INFO in brackets).",
             "", "| rule | " + " | ".join(head) + " |", "|---|" + "---|" * len(runs)]
    for rule in RULES:
        cells = []
        for loop, label in runs:
            counts = []
            for mode in MODES:
                fs = of(corpus.findings(loop, mode)[label], rule)
                counts.append((sum(f.severity >= Severity.WARNING for f in fs),
                               sum(f.severity == Severity.INFO for f in fs)))
            cells.append(_cell(counts))
        lines.append(f"| `{rule}` | " + " | ".join(cells) + " |")
    rules = sorted({f.rule for f in FAULTS}, key=RULES.index)
    lines += ["", "Planted faults: the rule that must name it (step, tensor, cause), found in full/lean mode "
              "(in brackets: the least severity it must have).", "",
              "| loop | fault | step | tensor | " + " | ".join(f"`{r}`" for r in rules) + " |",
              "|---|---|---|---|" + "---|" * len(rules)]
    for fault in FAULTS:
        marks = "/".join("found" if fault_finding(corpus, fault, m) else "MISSED" for m in MODES)
        cells = [f"{marks} ({fault.severity.name.lower()})" if r == fault.rule else "" for r in rules]
        step = "run" if fault.step is None else str(fault.step)
        lines.append(f"| {fault.loop} | {fault.fault} | {step} | `{fault.tensor}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def replace_region(text: str, body: str) -> str:
    """``text`` with what lies between the corpus-table markers replaced by ``body``."""
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{body}\n{END}{tail}"


def test_docs_table_is_what_the_corpus_gives(corpus: Corpus) -> None:
    text = DOCS.read_text()
    assert BEGIN in text and END in text, f"{DOCS} has lost its {BEGIN} ... {END} markers"
    want = replace_region(text, corpus_table(corpus))
    if os.environ.get("STEPDUMP_UPDATE_DOCS") == "1" and text != want:
        DOCS.write_text(want)  # regenerating: the file now holds what this run produced
        text = DOCS.read_text()
    assert text == want, ("docs/checks.md's corpus table differs from what this run produced; regenerate it with "
                          "STEPDUMP_UPDATE_DOCS=1 pytest tests/test_checks_corpus.py")
