"""What a SIGKILL loses in each recording mode and durability: docs/reliability.md's crash promise, measured.

Two kills for each of ``full``, ``lean`` (stats-only steps) and ``gradient_log`` under
``durability="flush"`` and ``"fsync"`` (tests/reliability/losses.py; ``make soak`` runs more).
With ``fsync`` at most ``queue_depth`` (2) steps whose ``step()`` returned may be lost, in
every mode. Before this was kept, stats-only and gradient-log steps (which hold no staging
slot) piled up in the writer's mailbox behind its per-step fsyncs: 6 to 13 steps lost at
every gradient-log kill here, up to 58 on a loaded machine. With ``flush`` the steps lost are
the last ``queue_depth`` and those of the group commit's last 0.2 s.

The runs go to a directory on a disk where there is one (``/var/tmp``): on the tmpfs the
rest of the suite uses, an fsync costs nothing and the writer always keeps up.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from reliability import losses

pytestmark = pytest.mark.timeout(240)


def _on_disk(fallback: Path) -> Path:
    for base in ("/var/tmp", tempfile.gettempdir()):
        if os.access(base, os.W_OK) and not base.startswith("/dev/shm"):
            return Path(tempfile.mkdtemp(prefix="stepdump-kills-", dir=base))
    return fallback


@pytest.mark.parametrize("durability", ["fsync", "flush"])
def test_a_kill_loses_no_more_than_the_documented_steps(zygote, tmp_path, durability):
    work = _on_disk(tmp_path)
    try:
        kills = losses.soak(zygote, work, kills=2, seed=38, durabilities=(durability,), min_steps=10,
                            max_delay=0.3)
    finally:
        if work != tmp_path:
            shutil.rmtree(work, ignore_errors=True)
    assert len(kills) == 6  # every (mode, kill) checked inside soak()
    print(f"\n{losses.summary(kills)}")
