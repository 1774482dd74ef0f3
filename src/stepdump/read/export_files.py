"""Writing an exported checkpoint file in one piece (read/export.py, read/export_trainers.py).

Both exporters use it, so it sits below them (neither imports the other for it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from stepdump.errors import ConfigError


def save_atomically(out: Path, write: Callable[[Path], object]) -> Path:
    """Write the file ``out`` with ``write(tmp)`` and a rename, so a failed export never leaves
    half a checkpoint at ``out`` (nor a ``.partial`` file beside it)."""
    if out.is_dir():
        raise ConfigError(f"{out} is a directory; give a file path for the checkpoint")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    try:
        write(tmp)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out
