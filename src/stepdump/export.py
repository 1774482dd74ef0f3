"""Public API for exporting a recorded run to other tools' formats.

* :func:`export_checkpoint` writes one step as an ordinary checkpoint
  (``format=``, one of :data:`CHECKPOINT_FORMATS`): a ``torch.save`` dict
  (``model``, ``optimizer``, ``scheduler``, ``scaler``, ``step``) that
  ``torch.load(path, weights_only=True)`` reads; a ``safetensors`` file of the
  step's params (and grads); an ``hf-trainer`` folder that
  ``transformers.Trainer.train(resume_from_checkpoint=folder)`` resumes from; or a
  ``lightning`` ``.ckpt`` that ``Trainer.fit(model, ckpt_path=...)`` resumes from.
  Record *t* is the state after *t* optimizer steps (``global_step == t``).
  ``run.export(step, path, ...)`` and ``stepdump export RUN --step N`` are the same function
  with the same arguments (``format``, ``grads``, ``trainer`` settings, ``rank``);
  docs/recipes/resume-from-step-n.md says what resumes bit for bit.
* :func:`export_tensorboard` writes scalars, per-tensor stats and histograms as
  TensorBoard event files (:class:`TensorBoardExport` says what was written).
  Also ``stepdump export-tb``.
* :func:`export_tensorboard_runs` writes several runs side by side with their comparison with
  the first (:class:`TensorBoardRuns`). Also ``stepdump export-tb A LOGDIR --compare B``.
* :func:`write_report` writes the HTML report of one run or of several runs
  overlaid (``labels=``). Also ``stepdump report``; docs/report.md.
* :func:`bundle` writes one step as a small self-contained store, for a bug report
  (:class:`BundleResult`). Also ``stepdump bundle``; docs/reexecute.md.

The implementations live in the internal packages ``stepdump.read``, ``stepdump.render`` and
``stepdump.reexec``; import from here, whose names are kept stable.
"""

from __future__ import annotations

from stepdump.read.export import FORMATS as CHECKPOINT_FORMATS
from stepdump.read.export import export as export_checkpoint
from stepdump.reexec.bundle import BundleResult, bundle
from stepdump.render.html import write_report
from stepdump.render.tensorboard import DEFAULT_STATS as TENSORBOARD_STATS
from stepdump.render.tensorboard import TensorBoardExport, export_tensorboard
from stepdump.render.tensorboard_compare import TensorBoardRuns, export_tensorboard_runs

__all__ = [
    "CHECKPOINT_FORMATS",
    "TENSORBOARD_STATS",
    "BundleResult",
    "TensorBoardExport",
    "TensorBoardRuns",
    "bundle",
    "export_checkpoint",
    "export_tensorboard",
    "export_tensorboard_runs",
    "write_report",
]
