"""``stepdump.reexecute``: re-run one recorded step N times and say whether it reproduces.

Three verdicts (docs/reexecute.md), each with its evidence:

* ``reproduces``: every re-execution equals every other and the record, bit for bit (the loss,
  every grad the update used, every param and optimizer tensor the update left);
* ``nondeterministic``: the re-executions disagree with each other; the first quantity that
  differs is named and, from two more re-executions under the op tracer, the first op whose
  output differs while its inputs are equal;
* ``differs from the record``: the re-executions agree with each other but not with the record.
  Either this host computes differently (the run's meta names another torch, CPU capability,
  BLAS, thread count or device), or, when all of those are the same, the record itself is
  suspect: a suspected silent data corruption at record time, named as such.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from stepdump.core.host import kernels_meta
from stepdump.core.optrace import OpRecord, first_op_difference
from stepdump.errors import ConfigError, StepNotFoundError, nearest_steps
from stepdump.reexec import frameworks, ranks
from stepdump.reexec.capture import module_globs
from stepdump.reexec.engine import (
    Key,
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

REPRODUCES, NONDETERMINISTIC, DIFFERS = "reproduces", "nondeterministic", "differs from the record"


@dataclass
class ReexecResult:
    """The verdict on one step and what it rests on.

    Attributes:
        step: The step re-executed.
        verdict: ``"reproduces"``, ``"nondeterministic"`` or ``"differs from the record"``.
        cause: For a difference from the record: ``"environment"`` (``environment`` lists what
            differs) or ``"suspected corruption at record time"``; else ``""``.
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
        else:
            lines[0] = (f"step {self.step}: differs from the record while re-execution is stable "
                        f"({self.repeats} re-executions agree), first at {first} ({len(self.differing)} in all)")
            if self.cause == "environment":
                lines.append("  this host computes differently: " + "; ".join(self.environment))
            else:
                lines.append("  torch, CPU capability, BLAS, threads and device all match the recording: suspected "
                             "silent data corruption at record time (the recorded value was not what this code "
                             "computes from the recorded state and batch)")
        if self.nan_op is not None:
            lines.append(f"  first NaN/Inf: {self.nan_op.where()}")
            for i, s in enumerate(self.nan_op.input_stats):
                lines.append(f"    input {i}: {s}")
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
              activation_grads: str | Iterable[str] | None = None, write_back: bool = False) -> ReexecResult:
    """Re-execute step ``step`` of ``run`` ``repeat`` times and compare with the record, bitwise.

    Args:
        run: A :class:`stepdump.Run`, a run directory or a one-step bundle (``stepdump bundle``).
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
    if batch is not None:
        check_batch(run, step, batch)
    prep = prepare(run, step, model, optimizer, train_step, scheduler, scaler)
    if batch is None:
        batch = stored_batch(run, step, run.step_state(step) if run.catalog.has_state(step) else {})
    runs = [execute(prep, batch, model, optimizer, train_step, scheduler, scaler,
                    trace=bool(trace) or (find_nan and i == 0), capture=globs if i == 0 else None)
            for i in range(repeat)]
    result = _judge(run, step, prep, runs, batch, model, optimizer, train_step, scheduler, scaler, trace, find_nan,
                    loss, repeat)
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
    missing = [k for k in record if k not in runs[0].fps and k[0] != "loss"]
    if step + 1 not in set(run.stats_steps):
        result.notes.append(f"step {step + 1} has no record: the params and optimizer state the update left were "
                            "not compared")
    if missing:
        result.notes.append(f"{len(missing)} recorded quantities were not computed by the re-execution "
                            f"(first: {missing[0][0]} {missing[0][1]!r})")
    if against:
        result.verdict, result.differing, result.first = DIFFERS, against, against[0]
        result.environment = environment_difference(run.meta, model)
        result.cause = "environment" if result.environment else "suspected corruption at record time"
        if repeat < 2:
            result.notes.append("re-executed once: with repeat=2 or more, nondeterminism here would be told apart")
    if loss is not None and not any(k[0] == "loss" for k in record):
        result.notes.append(f"no scalar {loss!r} logged at step {step}, or train_step returned no number: "
                            "the loss was not compared with the record")
    return result
