"""The appender thread: appends in order, the first error surfaces in wait(), nothing after it lands."""

from __future__ import annotations

import pytest

from stepdump.capture.appender import Appender
from stepdump.errors import WriterError
from stepdump.store.storage import LocalStorage


def test_appends_land_in_order(tmp_path):
    storage = LocalStorage(tmp_path)
    app = Appender(storage)
    app.start()
    chunks = [bytes([i]) * (1000 + i) for i in range(200)]
    offset = 0
    for c in chunks:
        app.append("segments/000001.seg", memoryview(c), offset)
        offset += len(c)
    app.wait()
    app.stop()
    storage.close()
    assert (tmp_path / "segments" / "000001.seg").read_bytes() == b"".join(chunks)


def test_first_error_is_raised_by_wait_and_later_appends_are_dropped(tmp_path):
    (tmp_path / "blocker").write_text("a file where a directory should be")
    storage = LocalStorage(tmp_path)
    app = Appender(storage)
    app.start()
    app.append("segments/000001.seg", b"first", 0)
    app.append("blocker/000002.seg", b"cannot be written", 0)
    app.append("segments/000001.seg", b"after the failure", 5)
    with pytest.raises(OSError):
        app.wait()
    with pytest.raises(OSError):  # and it stays failed
        app.append("segments/000001.seg", b"more", 22)
    app.stop()
    storage.close()
    # bytes after a failed append would sit at offsets the writer did not expect: none land
    assert (tmp_path / "segments" / "000001.seg").read_bytes() == b"first"
    assert isinstance(app.error, OSError)


def test_bytes_landing_elsewhere_than_the_catalog_says_are_an_error(tmp_path):
    """Another process appended to the segment: the offset storage reports is not the one the
    writer put in the catalog, so the step fails instead of pointing at the wrong bytes."""
    (tmp_path / "segments").mkdir()
    (tmp_path / "segments" / "000001.seg").write_bytes(b"someone else's bytes")
    storage = LocalStorage(tmp_path)
    app = Appender(storage)
    app.start()
    app.append("segments/000001.seg", b"ours", 0)
    with pytest.raises(WriterError, match="landed at offset 20, where stepdump wrote 0"):
        app.wait()
    app.stop()
    storage.close()
