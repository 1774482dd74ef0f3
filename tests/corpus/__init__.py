"""A corpus of healthy training loops, each a small faithful copy of a loop people run.

``stepdump.check`` is calibrated on it (docs/checks.md, "How the rules were calibrated"):
every rule runs on every loop, recorded in full and in lean mode, and must say nothing worse
than INFO; the same loops with one fault planted must have the fault named at its step, on its
tensor, with its cause (tests/test_checks_corpus.py).

Each module imitates one upstream file (named in its docstring) at toy size on synthetic data
(seconds on a CPU) and exposes ``record(path, mode, fault=None) -> {label: run_dir}``: one run,
or one per optimizer (a GAN records one Recorder per optimizer, as users do). ``mode`` is a
key of :data:`MODES`; ``fault`` one of the module's ``FAULTS`` (None: the healthy loop).
Each loop is seeded, so a fault's step and tensor are known in advance.
"""

from __future__ import annotations

from typing import Any

# Recorder keywords per recording mode: everything at every step, and the lean leave-it-on mode.
MODES: dict[str, dict[str, Any]] = {
    "full": {},
    "lean": {"every": None, "stats_every": 1},
}

# The loops, in the order the docs table lists them (module names in this package).
LOOPS = ("classification", "timm_warmup", "lora", "diffusion", "ppo", "dcgan", "nanogpt", "hf_trainer", "lightning")
