"""stepdump reexecute: re-execute one recorded step with the user's code and print the verdict."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from stepdump.cli.common import add_run_arg, console, glob_arg, int_arg, open_run, step_arg
from stepdump.cli.exitcodes import Exit
from stepdump.cli.output import print_json
from stepdump.errors import ConfigError

EXAMPLES = """examples:
  stepdump reexecute demo-run --step 10 --entry stepdump.demo:make_step
  stepdump reexecute demo-run --step 10 --entry stepdump.demo:make_step --find-nan
  stepdump reexecute demo-run --step 10 --entry stepdump.demo:make_step --repeat 3 --json
  stepdump reexecute demo-run --step 10 --entry stepdump.demo:make_step --repeat 2 --trace
  stepdump reexecute demo-run --step 10 --entry stepdump.demo:make_step --activations '4' --write-back

--entry pkg.module:factory names a function of yours (importable from the current directory, e.g.
train:make_step for make_step in ./train.py; stepdump.demo:make_step is the demo's) that
takes no arguments and returns (model, optimizer, train_step[, scheduler[, scaler]]) or a dict
with those keys, freshly built as the recorded loop built them; train_step(model, optimizer,
batch) runs one iteration. For a run recorded by the Lightning callback it may return the
LightningModule alone (the iteration is built from it); by the HF Trainer callback, the Trainer
alone (built as for the run, with its train_dataset: the Trainer runs the step). A run that logged
no batch (a lean run): train_step(model, optimizer, None) draws its own, as the loop did; the step is
reached by a verified replay from the nearest step stored in full. Exit 0: the step reproduces; 1:
it does not (the verdict says how, naming a cause only with its evidence); 4: the record is damaged.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("--step", type=step_arg, required=True, help="the recorded step to re-execute")
    p.add_argument("--entry", required=True, metavar="MODULE:FACTORY",
                   help="your factory returning model, optimizer, train_step (and scheduler, scaler)")
    p.add_argument("--repeat", type=int_arg(1, 1000, "--repeat"), default=2, help="re-executions (2 or more tells nondeterminism apart)")
    p.add_argument("--find-nan", action="store_true",
                   help="trace op by op and name the first op whose output holds a NaN/Inf")
    p.add_argument("--trace", action=argparse.BooleanOptionalAction, default=None,
                   help="run every re-execution under the op tracer and, when they disagree, name the first op "
                        "whose output differs while its inputs are equal (module, source line); needs --repeat 2 "
                        "or more. Default: two extra traced re-executions only when they disagree; --no-trace: none")
    p.add_argument("--loss", default="loss", help="the logged scalar train_step's return value is compared with")
    p.add_argument("--activations", type=glob_arg, action="append", metavar="GLOB",
                   help="capture the outputs of the modules matching GLOB (repeatable; as Recorder(modules=))")
    p.add_argument("--activation-grads", type=glob_arg, action="append", metavar="GLOB",
                   help="capture the grads flowing into the outputs of the modules matching GLOB (repeatable)")
    p.add_argument("--write-back", action="store_true",
                   help="store what was captured, the verdict and the --find-nan origin into the run, marked as "
                        "re-executed (run.activations, stepdump check and the report show them)")
    p.add_argument("--json", action="store_true", help="write the result as JSON")


def load_entry(spec: str) -> dict[str, Any]:
    """Call the factory ``pkg.module:function`` and name what it returned. It is the user's own code,
    named on the command line: never anything read from a run."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--entry {spec!r}: write it as pkg.module:factory")
    if "" not in sys.path:
        sys.path.insert(0, "")  # the current directory, as `python -m` has it
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"--entry {spec!r}: cannot load it ({e})") from e
    if not callable(factory):
        raise ConfigError(f"--entry {spec!r} is a {type(factory).__name__}, not a function: name the factory")
    made = factory()
    keys = ("model", "optimizer", "train_step", "scheduler", "scaler")
    if isinstance(made, dict):
        out = {k: made.get(k) for k in keys}
    elif isinstance(made, (tuple, list)) and 3 <= len(made) <= 5:
        out = dict(zip(keys, made))
    elif callable(getattr(made, "training_step", None)) or hasattr(made, "state_dict"):
        out = {"model": made}  # a module alone: a Lightning recording's iteration comes from it (or it is refused)
    else:
        raise ConfigError(f"--entry {spec!r} returned {type(made).__name__}: return (model, optimizer, train_step"
                          "[, scheduler[, scaler]]) or a dict with those keys")
    if out.get("model") is not None and out.get("train_step") is None:
        return out  # reexecute builds the iteration from a LightningModule, or says what is missing
    if out.get("model") is None or out.get("optimizer") is None or not callable(out.get("train_step")):
        raise ConfigError(f"--entry {spec!r}: the factory must give a model, an optimizer and a callable train_step")
    return out


def run(args: argparse.Namespace) -> int:
    from stepdump.reexec.verdict import DAMAGED, reexecute

    if args.trace and args.repeat < 2:
        raise ConfigError("--trace compares re-executions op by op: give --repeat 2 or more")
    parts = load_entry(args.entry)
    with open_run(args.run) as r:
        result = reexecute(r, args.step, parts["model"], parts.get("optimizer"), parts.get("train_step"),
                           parts.get("scheduler"), parts.get("scaler"), repeat=args.repeat, find_nan=args.find_nan,
                           loss=args.loss, activations=args.activations, activation_grads=args.activation_grads,
                           write_back=args.write_back, trace=args.trace)
    if args.json:
        print_json({"step": result.step, "verdict": result.verdict, "cause": result.cause,
                    "first": list(result.first) if result.first else None,
                    "differing": [list(k) for k in result.differing], "environment": result.environment,
                    "op": result.op.where() if result.op else None, "op_reason": result.op_reason or None,
                    "nan_op": result.nan_op.where() if result.nan_op else None,
                    "nan_inputs": result.nan_op.input_stats if result.nan_op else None,
                    "repeats": result.repeats, "compared": result.compared, "how": result.how,
                    "notes": result.notes, "activations": sorted(result.activations),
                    "activation_grads": sorted(result.activation_grads), "written_back": result.written_back,
                    "edited": result.edited, "unexcluded": result.unexcluded, "damaged": result.damaged,
                    "forwards": result.forwards, "forward_rng": result.forward_rng})
    else:
        console.print(result.summary(), soft_wrap=True, markup=False, highlight=False)
    if result.verdict == DAMAGED:
        return Exit.CORRUPT
    return Exit.OK if result.reproduces else Exit.FOUND
