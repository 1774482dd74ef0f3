"""Optional integrations with training frameworks and viewers.

Nothing here is imported by ``import stepdump``; each module imports its
framework only when it is itself imported:

* :mod:`stepdump.integrations.lightning` — ``StepdumpCallback`` for PyTorch Lightning.
* :mod:`stepdump.integrations.transformers` — ``StepdumpTrainerCallback`` for the
  Hugging Face ``Trainer``.

TensorBoard export is :func:`stepdump.export.export_tensorboard` (``stepdump export-tb``).
See docs/integrations.md for the step semantics of each.
"""
