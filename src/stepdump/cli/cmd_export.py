"""stepdump export: write one step as a checkpoint (plain, or one a trainer resumes from)."""

from __future__ import annotations

import argparse
from typing import Any

from stepdump.cli.common import add_run_arg, console, int_arg, open_run, step_arg
from stepdump.cli.exitcodes import Exit
from stepdump.errors import ConfigError

EXAMPLES = """examples:
  stepdump export demo-run --step 10 -o step10.pt
  stepdump export demo-run --step 10 -o step10.safetensors --format safetensors --grads
  stepdump export demo-run --step 10 --format hf-trainer -o ckpt/checkpoint-10 --trainer train_batch_size=64
      then: trainer.train(resume_from_checkpoint="ckpt/checkpoint-10")
  stepdump export demo-run --step 10 --format lightning -o step10.ckpt --trainer num_training_batches=4
      then: trainer.fit(model, datamodule, ckpt_path="step10.ckpt")

step N is the state after N optimizer steps (global_step == N). With no -o the
checkpoint is written in the current folder: step-N.pt, step-N.safetensors,
checkpoint-N (a folder, as the HF Trainer names it) or step=N.ckpt.
"""

FORMATS = ("torch", "safetensors", "hf-trainer", "lightning")
_DEFAULT_NAMES = {"torch": "step-{}.pt", "safetensors": "step-{}.safetensors", "hf-trainer": "checkpoint-{}",
                  "lightning": "step={}.ckpt"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    p.add_argument("--step", type=step_arg, required=True, help="step to export (stored in full, or rebuildable)")
    p.add_argument("-o", "--out", help="file (folder for hf-trainer) to write; default: named after the step")
    p.add_argument("--format", choices=FORMATS, default="torch",
                   help="torch (default), safetensors, hf-trainer (a folder for resume_from_checkpoint=) or "
                        "lightning (a .ckpt for ckpt_path=)")
    p.add_argument("--grads", action="store_true", help="safetensors: include grads as grads/<name>")
    p.add_argument("--trainer", action="append", default=[], metavar="KEY=VALUE",
                   help="hf-trainer / lightning: training setup the run did not record (train_batch_size, "
                        "num_training_batches, accumulate_grad_batches, ...); repeatable")
    p.add_argument("--rank", type=int_arg(0, 2**31 - 1, "--rank"), default=None,
                   help="a run recorded on several ranks: export this rank's store as recorded (default: the "
                        "consolidated full tensors)")


def run(args: argparse.Namespace) -> int:
    output = args.out or _DEFAULT_NAMES[args.format].format(args.step)
    trainer = _parse_trainer(args.trainer)
    with open_run(args.run) as r:  # every reader's export is stepdump.export.export_checkpoint
        out = r.export(args.step, output, format=args.format, grads=args.grads, trainer=trainer, rank=args.rank)
    console.print(f"wrote {out}")
    return Exit.OK


def _parse_trainer(items: list[str]) -> dict[str, Any] | None:
    if not items:
        return None
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--trainer takes KEY=VALUE, got {item!r}")
        value: Any
        try:
            value = int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                value = text  # scheduler_interval=step
        out[key.strip()] = value
    return out
