"""stepdump configured the ways the benchmark rows name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workloads import Workload


class StepdumpRecording:
    """A Recorder on the workload's model and optimizer; it captures from the
    optimizer's step pre-hook, so no hook is passed to the training step."""

    hook = None

    def __init__(self, w: Workload, out: Path, **kwargs: Any) -> None:
        import stepdump

        self.rec = stepdump.Recorder(out / "run", w.model, w.optimizer, **kwargs)

    def close(self) -> None:
        self.rec.close()


def full(codec: str) -> dict[str, Any]:
    """Everything in full at every step."""
    return {"every": 1, "stats_every": 1, "codec": codec}


# Stats and fingerprints every step, tensors in full every 100 steps.
TIERED: dict[str, Any] = {"every": 100, "stats_every": 1}
# Stats and fingerprints every step, no tensor bytes.
STATS_ONLY: dict[str, Any] = {"every": None, "stats_every": 1}

# Codecs timed by default; --all-codecs adds the rest of CODEC_NAMES.
DEFAULT_CODECS = ("raw", "zstd", "blosc-lz4", "blosc-zstd", "delta-lz4", "delta-zstd")
