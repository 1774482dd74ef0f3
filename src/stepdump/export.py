"""Public API for exporting a recorded run to other tools' formats.

* :func:`export_checkpoint` writes one step as an ordinary checkpoint: a
  ``torch.save`` dict (``model``, ``optimizer``, ``scheduler``, ``scaler``,
  ``step``) that ``torch.load(path, weights_only=True)`` reads, or a
  ``safetensors`` file of the step's params (and grads). Also ``run.export(...)``
  and ``stepdump export``.
* :func:`export_tensorboard` writes scalars, per-tensor stats and histograms as
  TensorBoard event files (:class:`TensorBoardExport` says what was written).
  Also ``stepdump export-tb``.

The implementations live in the internal packages ``stepdump.read`` and
``stepdump.render``; import from here, whose names are kept stable.
"""

from __future__ import annotations

from stepdump.read.export import FORMATS as CHECKPOINT_FORMATS
from stepdump.read.export import export as export_checkpoint
from stepdump.render.tensorboard import DEFAULT_STATS as TENSORBOARD_STATS
from stepdump.render.tensorboard import TensorBoardExport, export_tensorboard

__all__ = [
    "CHECKPOINT_FORMATS",
    "TENSORBOARD_STATS",
    "TensorBoardExport",
    "export_checkpoint",
    "export_tensorboard",
]
