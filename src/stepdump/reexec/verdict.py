"""``stepdump.reexecute``: re-run one recorded step N times and say whether it reproduces.

Four verdicts (docs/reexecute.md, "Causes and their evidence"), each with its evidence:

* ``reproduces``: every re-execution equals every other and the record, bit for bit (the loss,
  every grad the update used, every param and optimizer tensor the update left);
* ``nondeterministic``: the re-executions disagree with each other; the first quantity that
  differs is named and, from two more re-executions under the op tracer, the first op whose
  output differs while its inputs are equal;
* ``differs from the record``: the re-executions agree with each other but not with the record.
  Either this host computes differently (the run's meta names another torch, CPU capability,
  BLAS, thread count or device), or, only when every other explanation was checked and excluded
  (:func:`evidence`), a suspected silent data corruption at record time; otherwise the causes that
  could not be excluded are listed, most likely first, and none is named;
* ``the record is damaged``: a blob the verdict would rest on fails its checksum (the step's and
  the next record's): nothing is re-executed against bytes that are not what was written.

Params the loop changed between update *k* and record *k+1* (a clamp, an evaluation swap, a
Lookahead sync) are compared with what update *k* left in them, and named as the loop's edit.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from stepdump.core.host import kernels_meta
from stepdump.core.optrace import OpRecord, first_op_difference
from stepdump.errors import CorruptDataError, ConfigError, StepNotFoundError, nearest_steps
from stepdump.reexec import frameworks, ranks
from stepdump.reexec.capture import module_globs
from stepdump.reexec.engine import (
    GRADS,
    edits_watched,
    float_bits,
    LOSS,
    PARAMS_AFTER,
    recorded_inputs,
    TrainStep,
    check_batch,
    differing,
    execute,
    prepare,
    recorded,
    stored_batch,
)
from stepdump.reexec.writeback import check_writable
from stepdump.reexec.writeback import write_back as write_back_into
from stepdump.store.format import Key

REPRODUCES, NONDETERMINISTIC, DIFFERS = "reproduces", "nondeterministic", "differs from the record"
DAMAGED = "the record is damaged"
CORRUPTION, UNDETERMINED = "suspected corruption at record time", "not determined"


@dataclass
class ReexecResult:
    """The verdict on one step and what it rests on.

    Attributes:
        step: The step re-executed.
        verdict: ``"reproduces"``, ``"nondeterministic"`` or ``"differs from the record"``.
        cause: For a difference from the record: ``"environment"`` (``environment`` lists what
            differs), ``"suspected corruption at record time"`` (every other cause excluded, with
            evidence) or ``"not determined"`` (``unexcluded`` lists what could not be excluded,
            most likely first); else ``""``.
        first: ``(quantity, name)`` of the first tensor that differs (quantity: ``loss``,
            ``grads``, ``params after the update``, ``optimizer after the update``), or None.
        differing: Every quantity that differs (between re-executions, or from the record).
        op: The first op whose output differs while its inputs are equal (nondeterministic),
            when the tracer caught it; ``op_reason`` says how it was told.
        nan_op: With ``find_nan``: the first op whose output held a NaN or Inf, with its
            inputs' stats (``nan_op.input_stats``); None if none did.
        environment: How this process differs from the recording's meta, one line each.
        repeats: Re-executions compared. compared: quantities compared with the record.
        how: How the step's state was reached. notes: anything that limits the verdict.
        activations, activation_grads: What the modules matching ``activations=`` /
            ``activation_grads=`` computed in the first re-execution, by the Recorder's names.
        written_back: The capture and the verdict were stored into the run (``write_back=True``).
        edited: Params the loop changed between this step's update and the next record (compared
            with what the update left in them; the loop's edit is not a difference).
        unexcluded: For a difference from the record whose cause is not determined: the causes
            the evidence could not exclude, most likely first.
        damaged: ``the record is damaged``: each blob that fails its checksum, as ``kind name at
            step k: why``.
        forwards: Training forwards of the first re-execution, and whether each one's recorded
            RNG state was set (``forward_rng``).
    """

    step: int
    verdict: str
    cause: str = ""
    first: Key | None = None
    differing: list[Key] = field(default_factory=list)
    op: OpRecord | None = None
    op_reason: str = ""
    nan_op: OpRecord | None = None
    environment: list[str] = field(default_factory=list)
    repeats: int = 0
    compared: int = 0
    how: str = ""
    notes: list[str] = field(default_factory=list)
    activations: dict[str, torch.Tensor] = field(default_factory=dict)
    activation_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    written_back: bool = False
    rank: int | None = None  # a multi-rank run: the rank this process re-executed (reexec/ranks.py)
    ranks_agree: list[int] = field(default_factory=list)  # ranks whose recorded reduced grads equal it
    ranks_differ: dict[int, Key] = field(default_factory=dict)  # the others: their first differing grad
    edited: list[str] = field(default_factory=list)
    unexcluded: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    forwards: int = 0
    forward_rng: bool = False

    @property
    def reproduces(self) -> bool:
        return self.verdict == REPRODUCES

    def summary(self) -> str:
        """The verdict in a few lines of plain text (what the CLI prints)."""
        lines = [f"step {self.step}: {self.verdict}"]
        first = f"{self.first[0]} {self.first[1]!r}" if self.first else ""
        if self.verdict == REPRODUCES:
            lines[0] += (f" ({self.repeats} re-execution(s) equal to each other and to the record, bit for bit, "
                         f"{self.compared} quantities)")
        elif self.verdict == NONDETERMINISTIC:
            lines[0] += f" here: re-executions disagree, first at {first} ({len(self.differing)} quantities in all)"
            if self.op is not None:
                lines.append(f"  first op that differs: {self.op.where()} ({self.op_reason})")
            elif self.op_reason:
                lines.append(f"  {self.op_reason}")
        elif self.verdict == DAMAGED:
            lines[0] = (f"step {self.step}: the record is damaged ({len(self.damaged)} blob(s) fail their checksum); "
                        "nothing was compared with it")
            lines.extend(f"  damaged: {d}" for d in self.damaged[:5])
            lines.append("  run `stepdump verify` on the run for every damaged blob, and restore the run from a copy")
        else:
            stable = f" while re-execution is stable ({self.repeats} re-executions agree)" if self.repeats > 1 \
                else " (re-executed once)"
            lines[0] = f"step {self.step}: differs from the record{stable}, first at {first} ({len(self.differing)} in all)"
            if self.cause == "environment":
                lines.append("  this host computes differently: " + "; ".join(self.environment))
            elif self.cause == CORRUPTION:
                lines.append("  every other cause was checked and excluded (the step's blobs pass their checksums, "
                             "the state was verified, the batch matches its fingerprint, the RNG of every forward "
                             "was replayed, no edit between steps, the same torch, CPU capability, BLAS, threads "
                             "and device, re-executions stable): suspected silent data corruption at record time "
                             "(the recorded value was not what this code computes from the recorded state and "
                             "batch)")
            else:
                lines.append("  cause not determined; not excluded, most likely first:")
                lines.extend(f"    - {u}" for u in self.unexcluded)
        if self.nan_op is not None:
            lines.append(f"  first NaN/Inf: {self.nan_op.where()}")
            for i, s in enumerate(self.nan_op.input_stats):
                lines.append(f"    input {i}: {s}")
        if self.edited:
            shown = ", ".join(repr(n) for n in self.edited[:3]) + (" ..." if len(self.edited) > 3 else "")
            lines.append(f"  the loop changed {len(self.edited)} param(s) between update {self.step} and step "
                         f"{self.step + 1} ({shown}): compared with what the update left in them")
        if self.rank is not None:
            lines.append(ranks.summary_line(self.step, self.rank, self.ranks_agree, self.ranks_differ))
        lines.append(f"  state: {self.how}")
        lines.extend(f"  note: {n}" for n in self.notes)
        if self.activations or self.activation_grads:
            lines.append(f"  captured: {len(self.activations)} activations, {len(self.activation_grads)} "
                         "activation grads")
        if self.written_back:
            lines.append(f"  written back into the run at step {self.step} (marked as re-executed: "
                         "run.activations(step), stepdump check, the report)")
        return "\n".join(lines)


def environment_difference(meta: dict[str, Any], model: torch.nn.Module) -> list[str]:
    """What differs between the recording's meta and this process, one line per key."""
    first = next(iter(model.parameters()), None)
    here = {"torch_version": torch.__version__, **kernels_meta(), "num_threads": torch.get_num_threads(),
            "device": str(first.device) if first is not None else "cpu"}
    labels = {"torch_version": "torch", "cpu_capability": "CPU capability", "blas": "BLAS",
              "num_threads": "threads", "device": "device"}
    out = []
    for key, label in labels.items():
        then = meta.get(key)
        if then is not None and then != here[key]:
            out.append(f"{label} {then} when recorded, {here[key]} here")
    return out


def reexecute(run: Any, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
              train_step: TrainStep | None = None, scheduler: Any = None, scaler: Any = None, *, repeat: int = 2,
              batch: Any = None, find_nan: bool = False, trace: bool | None = None,
              loss: str | None = "loss", activations: str | Iterable[str] | None = None,
              activation_grads: str | Iterable[str] | None = None, write_back: bool = False,
              replay_forward_rng: bool = True) -> ReexecResult:
    """Re-execute step ``step`` of ``run`` ``repeat`` times and compare with the record, bitwise.

    Args:
        run: A :class:`stepdump.types.Run`, a run directory or a one-step bundle (``stepdump bundle``).
        step: The recorded step to re-execute.
        model, optimizer, scheduler, scaler: Objects of the kind the run recorded; they are put in
            the state of record ``step`` (restore, gradient-log rebuild, replay from a keyframe,
            or as given when they already hold it) and end after the last re-execution's update.
        train_step: ``train_step(model, optimizer, batch)`` runs one iteration as the recorded loop
            did (zero_grad, forward, backward, ``optimizer.step()``); it may return the loss,
            compared with the scalar ``loss`` logged at the step. A batch logged in several
            ``log_batch`` calls (micro-batches) is handed over as a list, one item per call.
            None for a run recorded by the Lightning callback: the iteration is built from the
            LightningModule ``model`` (``training_step``, the Trainer's accumulation and clipping
            from the run's meta; ``optimizer`` None: from ``configure_optimizers``). For a run
            recorded by the HF Trainer callback, pass the ``transformers.Trainer`` as ``model``:
            its ``training_step``, clipping, optimizer and scheduler run the step
            (reexec/hf_trainer.py).
        repeat: Re-executions (2 or more tells nondeterminism from a difference with the record).
        batch: The step's batch, when the run holds only its fingerprint; checked against it
            (:class:`stepdump.errors.BatchMismatchError`: "this is not the batch of step k").
        find_nan: Trace the first re-execution op by op and name the first op whose output holds a
            NaN/Inf (module, source line, its inputs' stats).
        trace: Name the op that differs between re-executions: None traces two extra
            re-executions only when they disagree; True traces every one; False never.
        loss: The logged scalar train_step's return value is compared with (None: not compared).
        activations, activation_grads: Module-name globs (as ``Recorder(modules=)`` takes them):
            the outputs, and the grads flowing into them, of the matching modules in the first
            re-execution, on the result by the Recorder's names (``fc1``, ``block/0``, ``block#1``).
        replay_forward_rng: Set the RNG recorded at each training forward there (the default; a
            draw between the iteration's start and a forward then cannot change the verdict).
            False: only the iteration's start RNG is set (what ``train_step`` draws in between is
            redrawn), and the verdict cannot exclude the RNG as a cause.
        write_back: Store the captured tensors and the verdict (with ``find_nan``'s op) into the
            run, marked as re-executed: ``run.activations(step)``, ``stepdump check`` (rule
            ``reexecution``) and the report show them. A later write-back for the same step
            replaces it. Refused for a bundle, a remote or multi-rank run, a run being recorded.

    Returns:
        A :class:`ReexecResult` (``.verdict``, ``.summary()``).
    """
    from stepdump.read.opener import open_run

    if isinstance(run, (str, os.PathLike)):
        run = open_run(run)
    refuse_joint(run, "re-executed")
    whole, rank = run, None
    if ranks.is_multi_rank(run):  # each rank re-executes its own step, inside the process group
        run, rank = ranks.select(run)
    supplied: list[str] = []
    if train_step is None:  # a framework's recording: its module gives the iteration (reexec/frameworks.py)
        model, optimizer, train_step, scheduler, supplied = frameworks.supply(run, model, optimizer, scheduler)
    elif optimizer is None:
        raise ConfigError("optimizer= is needed with a train_step of your own (only a Lightning recording's module "
                          "or an HF recording's Trainer supplies both)")
    globs = (module_globs(activations, "activations"), module_globs(activation_grads, "activation_grads"))
    if write_back:
        check_writable(run)  # before any work: a bundle, a remote run, a run being recorded
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ConfigError(f"repeat={repeat!r}: give the number of re-executions, 1 or more (2 tells "
                          "nondeterminism apart)")
    if step not in set(run.stats_steps):
        raise StepNotFoundError(f"step {step} of {run.path} has no record to compare a re-execution with; "
                                f"{nearest_steps(step, run.stats_steps)}")
    batch_checked = batch is not None and bool(recorded_inputs(run, step))
    if batch_checked:
        check_batch(run, step, batch)
    damaged = damaged_blobs(run, step)
    if damaged:  # judged before anything is restored from it
        return ReexecResult(step=step, verdict=DAMAGED, damaged=damaged, how="not re-executed")
    prep = prepare(run, step, model, optimizer, train_step, scheduler, scaler)
    batch, batch_checked = _batch_to_feed(run, step, prep, batch, batch_checked)
    runs = [_execute_or_explain(run, step, i, prep, batch, model, optimizer, train_step, scheduler, scaler,
                                trace=bool(trace) or (find_nan and i == 0), capture=globs if i == 0 else None,
                                forward_rng=replay_forward_rng)
            for i in range(repeat)]
    result = _judge(run, step, prep, runs, batch, model, optimizer, train_step, scheduler, scaler, trace, find_nan,
                    loss, repeat)
    result.edited = sorted(prep.edited)
    result.forwards, result.forward_rng = runs[0].forwards, runs[0].forward_rng
    if result.verdict == DIFFERS and not result.environment:
        result.unexcluded = unexcluded(run, step, prep, runs, result, batch_checked, replay_forward_rng,
                                       batch is not None)
        result.cause = UNDETERMINED if result.unexcluded else CORRUPTION
    result.notes += supplied
    captured = runs[0].captured or {}
    result.activations = dict(captured.get("activations", {}))
    result.activation_grads = dict(captured.get("activation_grads", {}))
    if rank is not None:
        result.rank = rank
        result.ranks_agree, result.ranks_differ, notes = ranks.compare(whole, step, runs[0].fps, prep.fp_kinds)
        result.notes += notes
    if write_back:
        write_back_into(run, result, captured)
        result.written_back = True
    return result


def _batch_to_feed(run: Any, step: int, prep: Any, batch: Any, checked: bool) -> tuple[Any, bool]:
    """The batch each re-execution is handed (the one given, the stored one, or None where the loop
    logged none and train_step draws its own), and whether it matches the recorded fingerprint."""
    if batch is not None:
        if not checked:
            prep.notes.append(f"the batch given could not be checked: step {step} holds no batch fingerprint (the "
                              "loop did not call rec.log_batch)")
        return batch, checked
    st = run.step_state(step) if run.catalog.has_state(step) else {}
    if st.get("batch") is None and not recorded_inputs(run, step):
        # The loop logged no batch: train_step(model, optimizer, None) draws its own, as the recorded
        # loop did (a verified replay up to here drew the same ones).
        prep.notes.append(f"no batch was logged at step {step}: train_step was given None and drew its own")
        return None, False
    batch = stored_batch(run, step, st)
    if not recorded_inputs(run, step):
        return batch, False
    check_batch(run, step, batch)  # the stored batch is the one fingerprinted at record time
    return batch, True


def _execute_or_explain(run: Any, step: int, i: int, prep: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """:func:`execute`; a first one handed no batch that fails is a ConfigError saying why."""
    try:
        return execute(prep, batch, *args, **kwargs)
    except Exception as e:
        if batch is not None or i > 0:
            raise
        raise ConfigError(
            f"step {step} of {run.path} holds no batch (the loop never called rec.log_batch), so train_step was "
            f"given None and failed ({type(e).__name__}: {e}); log the batch in the loop (rec.log_batch(batch)), "
            "pass batch=, or let train_step draw its own batch when it is given None, as the recorded loop drew "
            "it") from e


def _judge(run: Any, step: int, prep: Any, runs: list[Any], batch: Any, model: torch.nn.Module,
           optimizer: torch.optim.Optimizer, train_step: TrainStep, scheduler: Any, scaler: Any,
           trace: bool | None, find_nan: bool, loss: str | None, repeat: int) -> ReexecResult:
    """The verdict from the re-executions ``runs`` (two more under the tracer if they disagree)."""
    record = recorded(run, step, loss)
    result = ReexecResult(step=step, verdict=REPRODUCES, repeats=repeat, how=prep.how, notes=list(prep.notes),
                          compared=len(set(record) & set(runs[0].fps)))
    if find_nan and runs[0].ops is not None:
        result.nan_op = runs[0].ops.first_nonfinite
    among = next((d for d in (differing(runs[0].fps, r.fps, both=False) for r in runs[1:]) if d), [])
    if among:
        result.verdict, result.differing, result.first = NONDETERMINISTIC, among, among[0]
        traced = [r for r in runs if r.ops is not None]
        if len(traced) < 2 and trace is not False:
            traced = [execute(prep, batch, model, optimizer, train_step, scheduler, scaler, trace=True)
                      for _ in range(2)]
        if len(traced) >= 2:
            found = first_op_difference(traced[0].ops.records, traced[1].ops.records)  # type: ignore[union-attr]
            if found is not None:
                result.op, _, result.op_reason = found
            else:
                result.op_reason = "the two traced re-executions happened to agree op for op; run again"
        else:
            result.op_reason = "op not traced (--no-trace / trace=False): re-execute with tracing to name it"
        return result
    against = differing(runs[0].fps, record)
    missing = [(kind, name) for kind, name in record if (kind, name) not in runs[0].fps and kind != "loss"]
    if step + 1 not in set(run.stats_steps):
        result.notes.append(f"step {step + 1} has no record: the params and optimizer state the update left were "
                            "not compared")
    if missing:
        first_kind, first_name = missing[0]
        result.notes.append(f"{len(missing)} recorded quantities were not computed by the re-execution "
                            f"(first: {first_kind} {first_name!r})")
    if against:
        result.verdict, result.differing, result.first = DIFFERS, against, against[0]
        result.environment = environment_difference(run.meta, model)
        result.cause = "environment" if result.environment else UNDETERMINED  # reexecute() weighs the evidence
        if repeat < 2:
            result.notes.append("re-executed once: with repeat=2 or more, nondeterminism here would be told apart")
    if loss is not None and not any(kind == "loss" for kind, _ in record):
        logged = [v for _, name, v in run.scalar_rows(step) if name == loss]
        if logged:  # a logged NaN is stored as NULL (Run.scalar_rows)
            result.notes.append(f"the loss logged at step {step} was NaN: it was not compared bit for bit (the "
                                "re-execution's loss is " + ("NaN too" if runs[0].fps.get((LOSS, "loss")) == NAN_BITS
                                                              else "not NaN") + ")")
        else:
            result.notes.append(f"no scalar {loss!r} logged at step {step}, or train_step returned no number: "
                                "the loss was not compared with the record")
    return result


def refuse_joint(run: Any, what: str) -> None:
    """A joint run (``Recorder(path, models=, optimizers=)``): its iteration spans every pair's
    update, which one pair's record cannot give; say so, with what can be done instead."""
    from stepdump.read.joint import is_joint

    if is_joint(run):
        pairs = ", ".join(run.pair_names)
        raise ConfigError(
            f"{run.path} is a joint run (pairs {pairs}): one of its iterations updates every pair, and a step "
            f"cannot be {what} as one iteration of several optimizers yet. Restore the step into all pairs with "
            "run.restore(step, models={...}, optimizers={...}) and continue from there, or, where one pair's update "
            f"reads no other pair's params, use that pair's own store: stepdump.open('{run.path}/<pair>')")


def damaged_blobs(run: Any, step: int) -> list[str]:
    """Every blob of record ``step`` and of the next record that fails its checksum, as ``kind name
    at step k: why`` (what a re-execution compares and restores from; ``stepdump verify`` checks all)."""
    out: list[str] = []
    stats = set(run.stats_steps)
    for s in (step, step + 1):
        if s not in stats:
            continue
        for kind, name, _param, _key, blob, *_ in run.catalog.stored_tensors(s, (*run.kinds(), "state")):
            try:
                run.read_blob(blob)
            except CorruptDataError as e:
                out.append(f"{kind} {name!r} at step {s}: {e}")
    return out


NAN_BITS = float_bits(float("nan"))


def unexcluded(run: Any, step: int, prep: Any, runs: list[Any], result: ReexecResult, batch_checked: bool,
               forward_rng: bool, batch_given: bool = True) -> list[str]:
    """The causes of a stable difference from the record that the evidence does not exclude, most
    likely first (empty: every one excluded, so the record itself is suspect). Each cause is
    excluded only by its evidence (docs/reexecute.md, "Causes and their evidence"). ``batch_given``:
    train_step was handed a batch (else it drew its own, redoing every draw of the iteration)."""
    kinds = {kind for kind, _ in result.differing}
    first_kind, _ = result.first if result.first is not None else (None, None)
    loss_first = first_kind == LOSS
    only_update = not kinds & {LOSS, GRADS}  # the loss and every grad reproduce; only what the update left differs
    found: list[tuple[int, str]] = []  # (rank: lower is more likely, cause)
    ex = runs[0]
    rng_why = ""
    if prep.rng is None or any("RNG state of step" in n for n in prep.notes):
        rng_why = "the step's RNG state was not recorded"
    elif not forward_rng:
        rng_why = "the RNG recorded at each forward was not set (replay_forward_rng=False)"
    elif not prep.forward_rng and ex.forwards and batch_given:
        rng_why = "the RNG state at each forward was not recorded (a run recorded before stepdump took it)"
    elif prep.forward_rng and not ex.forward_rng:
        rng_why = (f"the re-execution made {ex.forwards} training forward(s), the recording "
                   f"{len(prep.forward_rng)}: the RNG of each was not replayed")
    if rng_why:
        found.append((0 if loss_first else 1 if not only_update else 3,
                      f"the RNG or the data: a draw between the iteration's start and a forward ({rng_why})"))
    if not batch_checked:
        found.append((0 if loss_first else 2, "the RNG or the data: the batch could not be checked against a "
                                              "recorded fingerprint"))
    if PARAMS_AFTER in kinds and not edits_watched(run, step):
        found.append((0 if only_update else 2, f"an edit of the params by the loop between update {step} and step "
                                               f"{step + 1} (record {step + 1} was not compared with what update "
                                               f"{step} left: a step not stored in full, or a run recorded before "
                                               "stepdump watched)"))
    if not prep.verified:
        found.append((2, "the state: taken from the objects given (their params and optimizer state match the "
                         "record's fingerprints, their buffers were not checked)"))
    if result.repeats < 2:
        found.append((3, "nondeterminism here: re-executed once (repeat=2 or more tells it apart)"))
    if found:
        grads = [name for kind, name in result.differing if kind == GRADS]
        if LOSS not in kinds and len(grads) == 1:  # the loss and every other grad reproduce: one recorded grad is off
            found.append((-1, f"silent data corruption at record time: only grads {grads[0]!r} differs, while the "
                              "loss and every other grad reproduce"))
        else:
            found.append((9, "silent data corruption at record time"))
    return [c for _, c in sorted(found, key=lambda f: f[0])]
