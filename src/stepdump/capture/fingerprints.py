"""Which fingerprint kind a Recorder gives the tensors it records (``Recorder(fingerprint=)``).

A series keeps one kind at all its steps (FORMAT.md, "Fingerprint kinds"). A new run takes the
option as given. A resumed run already has kinds: the option must agree with them, or the lean
rows of a stats-only step (no bytes to fingerprint again) would be of the other kind and left
out. :func:`resumed` decides, before the Recorder starts writing.
"""

from __future__ import annotations

from pathlib import Path

from stepdump.errors import ConfigError
from stepdump.store.format import FP_KIND_DMIX64, FP_KIND_XXH3
from stepdump.store.queries import CatalogReader
from stepdump.store.schema import catalog_path

AUTO = "auto"


def resumed(path: Path, option: str) -> str:
    """The fingerprint option to resume the run at ``path`` with, given ``option``.

    ``"auto"`` on a run whose series are all dmix64 (recorded with ``fingerprint="dmix64"``)
    goes on as ``"dmix64"``: a CPU tensor's lean rows are then dmix64 like its earlier rows.
    An explicit option that contradicts the run's kinds is a :class:`~stepdump.ConfigError`.
    No catalog at ``path`` yet (a resume that starts a run): ``option``."""
    if not catalog_path(path).exists():
        return option
    reader = CatalogReader(path)
    try:
        series = len(reader.series_keys())
        other = len(reader.fp_kinds())  # the dmix64 series (the only other kind)
    finally:
        reader.close()
    xxh3 = series - other
    if option == AUTO:
        return FP_KIND_DMIX64 if other and not xxh3 else AUTO
    clash = other if option == FP_KIND_XXH3 else xxh3
    if clash:
        have = FP_KIND_DMIX64 if option == FP_KIND_XXH3 else FP_KIND_XXH3
        raise ConfigError(f"cannot resume {path} with fingerprint={option!r}: {clash} of its tensors have {have} "
                          f"fingerprints, and a tensor keeps one kind at every step; resume with "
                          f"fingerprint={have!r} or 'auto', or record into a new directory")
    return option
