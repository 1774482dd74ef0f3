"""Received runs are data, never a path elsewhere: joint runs, multi-rank runs and their JSON.

A run directory may come from someone else (a shared file system, a tarball). A symbolic link
planted in it must never aim a Recorder's writes, or a reader's reads, at a store outside it:

* a joint run's pair directory (``RUN/G``) that is a link: a new joint Recorder must not build
  G's store in the link's target, a resumed one must not append to it, ``stepdump.open`` must
  not read it (``run.tensor("G/weight", 0)`` used to return the other run's weight);
* a multi-rank run's rank directory (``RUN/rank00000``) that is a link, likewise;
* the temporary file ``joint.json`` / ``ranks.json`` is written under: a planted link there
  used to have its target overwritten (``Path.write_bytes`` follows it);
* ``joint.json`` / ``ranks.json`` themselves being links out of the run.

And every JSON a store holds is parsed with depth and size bounds: one nested 100,000 deep is
a corrupt store (exit 4), never a ``RecursionError`` traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import catalog_sql, record_run
from torch import nn

import stepdump
from stepdump.errors import StepdumpError
from stepdump.store import joint as joint_file
from stepdump.store import ranks as ranks_file

pytestmark = pytest.mark.timeout(120)


def _pair_objects(seed: int = 0) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer]]:
    torch.manual_seed(seed)
    g, d = nn.Linear(4, 4), nn.Linear(4, 1)
    return {"G": g, "D": d}, {"G": torch.optim.SGD(g.parameters(), lr=0.1), "D": torch.optim.SGD(d.parameters(), lr=0.1)}


def _record_joint(path: Path, iterations: int = 2, **opts) -> Path:
    models, opts_ = _pair_objects()
    with stepdump.Recorder(path, models=models, optimizers=opts_, on_error="raise", **opts) as rec:
        for i in range(iterations):
            x = torch.full((2, 4), float(i))
            for name in ("D", "G"):
                opts_[name].zero_grad()
                models[name](x).sum().backward()
                opts_[name].step()
    return path


def _tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` and its bytes: what must stay untouched."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def other_run(tmp_path: Path) -> Path:
    """A store outside the run under test (someone else's), with a weight of its own."""
    torch.manual_seed(7)
    return record_run(tmp_path / "elsewhere" / "other", steps=2)


# -- 1. a joint Recorder writes through no planted link ------------------------------------------

def test_a_new_joint_run_does_not_build_a_pair_store_through_a_planted_link(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "G").symlink_to(target, target_is_directory=True)
    with pytest.raises(StepdumpError, match="symbolic link"):
        _record_joint(run)
    assert list(target.iterdir()) == []  # nothing built in the link's target


def test_resuming_a_joint_run_whose_pair_is_a_link_does_not_append_to_the_linked_store(tmp_path: Path) -> None:
    run = _record_joint(tmp_path / "run")
    linked = tmp_path / "linked"
    shutil.move(run / "G", linked)
    (run / "G").symlink_to(linked, target_is_directory=True)
    before = _tree(linked)
    with pytest.raises(StepdumpError, match="symbolic link"):
        _record_joint(run, resume=True)
    assert _tree(linked) == before


def test_a_planted_temporary_joint_json_link_is_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious, outside the run\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / f".{joint_file.JOINT_FILE}.{os.getpid()}.tmp").symlink_to(victim)
    (run / f".{joint_file.JOINT_FILE}.tmp").symlink_to(victim)
    _record_joint(run)
    assert victim.read_text() == "precious, outside the run\n"
    assert stepdump.open(run).pair_names == ["G", "D"]


def test_a_planted_temporary_ranks_json_link_is_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    root = tmp_path / "run"
    root.mkdir()
    (root / f".{ranks_file.RANKS_FILE}.{os.getpid()}.tmp").symlink_to(victim)
    ranks_file.write_local(root, ranks_file.ranks_document(1, [0], "gloo"))
    assert victim.read_text() == "precious\n"
    assert ranks_file.read_local(root)["ranks"] == [0]


# -- 2. readers read no store outside the run ------------------------------------------------------

def test_a_received_joint_run_does_not_read_a_pair_store_outside_itself(tmp_path: Path, other_run: Path) -> None:
    run = _record_joint(tmp_path / "run")
    shutil.rmtree(run / "G")
    (run / "G").symlink_to(other_run, target_is_directory=True)
    with pytest.raises(stepdump.CorruptDataError, match="symbolic link"):
        with stepdump.open(run) as j:
            j.tensor("G/0.weight", 0)


def test_a_joint_json_that_is_a_link_out_of_the_run_is_refused(tmp_path: Path) -> None:
    run = _record_joint(tmp_path / "run")
    outside = tmp_path / "outside.json"
    shutil.move(run / joint_file.JOINT_FILE, outside)
    (run / joint_file.JOINT_FILE).symlink_to(outside)
    with pytest.raises(stepdump.CorruptDataError, match="symbolic link"):
        stepdump.open(run)


def _ranks_run(tmp_path: Path, store: Path, link: bool) -> Path:
    root = tmp_path / "ranked"
    root.mkdir(parents=True)
    ranks_file.write_local(root, ranks_file.ranks_document(1, [0], "gloo"))
    if link:
        (root / ranks_file.rank_dir(0)).symlink_to(store, target_is_directory=True)
    else:
        shutil.copytree(store, root / ranks_file.rank_dir(0))
    return root


def test_a_multi_rank_run_does_not_read_a_rank_store_outside_itself(tmp_path: Path, other_run: Path) -> None:
    ok = _ranks_run(tmp_path / "a", other_run, link=False)  # the same run, copied in: read as ever
    with stepdump.open(ok) as run:
        assert torch.equal(run.tensor("0.weight", 0), stepdump.open(other_run).tensor("0.weight", 0))
    bad = _ranks_run(tmp_path / "b", other_run, link=True)
    with pytest.raises(stepdump.CorruptDataError, match="symbolic link"):
        with stepdump.open(bad) as run:
            run.tensor("0.weight", 0)


# -- 3. JSON parsed with bounds ---------------------------------------------------------------------

DEEP = b"[" * 100_000 + b"]" * 100_000


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stepdump.cli.main", *args], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("which", ["joint", "ranks"])
def test_a_deeply_nested_layout_file_is_a_corrupt_store(tmp_path: Path, which: str) -> None:
    root = tmp_path / "run"
    if which == "joint":
        _record_joint(root)
        name = joint_file.JOINT_FILE
    else:
        root.mkdir()
        name = ranks_file.RANKS_FILE
    (root / name).write_bytes(DEEP)
    with pytest.raises(stepdump.CorruptDataError, match="nested"):
        stepdump.open(root)
    done = _cli("info", str(root))
    assert done.returncode == 4, done.stderr
    assert "Traceback" not in done.stderr and "nested" in done.stderr


def test_a_deeply_nested_step_state_is_a_corrupt_store(tmp_path: Path) -> None:
    run_dir = record_run(tmp_path / "run", steps=2)
    deep = '{"extra_state": {"ema": ' + "[" * 100_000 + "]" * 100_000 + "}}"
    catalog_sql(run_dir, "UPDATE steps SET state = ? WHERE step = 0", (deep,))
    with stepdump.open(run_dir) as run:
        with pytest.raises(stepdump.CorruptDataError, match="nested"):
            run.extra_state_dict(0, "ema")
        with pytest.raises(stepdump.CorruptDataError, match="nested"):
            run.step_state(0)
