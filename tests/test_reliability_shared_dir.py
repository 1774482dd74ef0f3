"""A shared run directory (issue 16): what someone else planted there is refused, never followed.

A ``LOCK`` that is a symbolic link or a hard link used to have the Recorder
truncate its target and write ``pid N on HOST`` into it; a ``LOCK`` that is a
FIFO hung ``Recorder(path)``, ``Run.live`` and ``stepdump info``. Here each of
them, and links or FIFOs among the catalog's side files, ``segments/`` and the
segment files, must give a stepdump error naming the file, within a timeout,
with the target untouched.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import copy_run, record_run, tiny_model

import stepdump
from stepdump.errors import StepdumpError
from stepdump.store.storage import LocalStorage

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """A finished run, as its Recorder left it."""
    return record_run(tmp_path_factory.mktemp("clean") / "run", steps=2)


@pytest.fixture(autouse=True)
def _no_writer_left():
    """A refused Recorder must not leave its writer thread behind."""
    yield
    assert not [t for t in threading.enumerate() if t.name == "stepdump-writer" and t.is_alive()]


def _recorder(path: Path, **kwargs) -> stepdump.Recorder:
    model = tiny_model()
    return stepdump.Recorder(path, model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def _live(path: Path) -> bool:
    with stepdump.open(path) as run:
        return run.live


def _within(seconds: float, fn: Callable[[], object], fifo: Path | None = None) -> object:
    """``fn()``'s result or exception, failing (instead of hanging) if it takes longer."""
    box: dict = {}

    def call():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    th = threading.Thread(target=call, daemon=True)
    th.start()
    th.join(seconds)
    if th.is_alive():
        if fifo is not None:  # a reader blocked in open(FIFO): a writer end lets it go
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"the call blocked for more than {seconds} s")
    return box.get("error", box.get("value"))


@pytest.fixture
def victim(tmp_path):
    v = tmp_path / "victim.txt"
    v.write_text("precious, outside the run\n")
    return v


@pytest.mark.parametrize("resume", [False, True])
@pytest.mark.parametrize("with_run", [False, True])
@pytest.mark.parametrize("link", ["symlink", "dangling", "hardlink"])
def test_a_lock_that_links_elsewhere_is_refused_and_the_target_untouched(clean, tmp_path, victim, link,
                                                                         with_run, resume):
    path = copy_run(clean, tmp_path / "run") if with_run else tmp_path / "run"
    path.mkdir(exist_ok=True)
    (path / "LOCK").unlink(missing_ok=True)
    target = victim if link != "dangling" else tmp_path / "created-by-the-recorder"
    if link == "hardlink":
        os.link(victim, path / "LOCK")
    else:
        (path / "LOCK").symlink_to(target)
    err = _within(30, lambda: _recorder(path, resume=resume).close())
    assert isinstance(err, StepdumpError), err
    if resume or not with_run:  # (an existing run without resume=True: RunExistsError, before the lock)
        assert isinstance(err, stepdump.CorruptDataError) and "LOCK" in str(err) and "refusing" in str(err), err
    assert victim.read_text() == "precious, outside the run\n"
    assert not (tmp_path / "created-by-the-recorder").exists()


@pytest.mark.parametrize("resume", [False, True])
def test_a_lock_that_is_a_fifo_is_refused_without_hanging(clean, tmp_path, resume, cli):
    path = copy_run(clean, tmp_path / "run")
    (path / "LOCK").unlink()
    os.mkfifo(path / "LOCK")
    err = _within(30, lambda: _recorder(path, resume=resume).close(), fifo=path / "LOCK")
    assert isinstance(err, stepdump.CorruptDataError) and "LOCK" in str(err), err
    err = _within(30, lambda: _live(path), fifo=path / "LOCK")
    assert isinstance(err, stepdump.CorruptDataError) and "not a regular file" in str(err), err
    out = _within(30, lambda: cli("info", path, ok=None), fifo=path / "LOCK")
    assert out.code != 0 and "LOCK" in out.stdout + out.stderr


def test_a_fifo_lock_in_an_empty_directory_is_refused(tmp_path):
    path = tmp_path / "run"
    path.mkdir()
    os.mkfifo(path / "LOCK")
    err = _within(30, lambda: _recorder(path).close(), fifo=path / "LOCK")
    assert isinstance(err, stepdump.CorruptDataError) and "LOCK" in str(err), err


@pytest.mark.parametrize("side", ["catalog.sqlite-wal", "catalog.sqlite-shm", "catalog.sqlite-journal"])
def test_a_catalog_side_file_that_links_elsewhere_is_refused(clean, tmp_path, victim, side):
    path = copy_run(clean, tmp_path / "run")
    (path / side).symlink_to(victim)
    err = _within(30, lambda: _recorder(path, resume=True).close())
    assert isinstance(err, StepdumpError) and side in str(err), err
    with pytest.raises(stepdump.CorruptDataError, match=side):
        stepdump.open(path)
    assert victim.read_text() == "precious, outside the run\n"


def test_a_segments_directory_that_links_elsewhere_is_refused(clean, tmp_path):
    path = copy_run(clean, tmp_path / "run")
    outside = tmp_path / "outside"
    (path / "segments").rename(outside)
    (path / "segments").symlink_to(outside)
    before = sorted(p.name for p in outside.iterdir())
    err = _within(30, lambda: _recorder(path, resume=True).close())
    assert isinstance(err, StepdumpError) and "segments" in str(err), err
    assert sorted(p.name for p in outside.iterdir()) == before


@pytest.mark.parametrize("what", ["symlink", "hardlink", "fifo", "parent"])
def test_storage_never_appends_through_a_link_or_to_a_fifo(tmp_path, victim, what):
    root = tmp_path / "run"
    (root / "segments").mkdir(parents=True)
    seg = root / "segments" / "000001.seg"
    if what == "symlink":
        seg.symlink_to(victim)
    elif what == "hardlink":
        os.link(victim, seg)
    elif what == "fifo":
        os.mkfifo(seg)
    else:
        (root / "segments").rmdir()
        (root / "segments").symlink_to(victim.parent)
        seg = victim.parent / "000001.seg"
    storage = LocalStorage(root)
    try:
        err = _within(30, lambda: storage.append("segments/000001.seg", b"bytes"))
    finally:
        storage.close()
    assert isinstance(err, stepdump.CorruptDataError), err
    assert "refusing" in str(err)
    assert victim.read_text() == "precious, outside the run\n"
    assert what != "parent" or not seg.exists()
