"""The appender thread: appends in order, the first error surfaces in wait(), nothing after it lands."""

from __future__ import annotations

import pytest

from stepdump.capture.appender import Appender
from stepdump.store.storage import LocalStorage


def test_appends_land_in_order(tmp_path):
    storage = LocalStorage(tmp_path)
    app = Appender(storage)
    app.start()
    chunks = [bytes([i]) * (1000 + i) for i in range(200)]
    for c in chunks:
        app.append("segments/000001.seg", memoryview(c))
    app.wait()
    app.stop()
    storage.close()
    assert (tmp_path / "segments" / "000001.seg").read_bytes() == b"".join(chunks)


def test_first_error_is_raised_by_wait_and_later_appends_are_dropped(tmp_path):
    (tmp_path / "blocker").write_text("a file where a directory should be")
    storage = LocalStorage(tmp_path)
    app = Appender(storage)
    app.start()
    app.append("segments/000001.seg", b"first")
    app.append("blocker/000002.seg", b"cannot be written")
    app.append("segments/000001.seg", b"after the failure")
    with pytest.raises(OSError):
        app.wait()
    with pytest.raises(OSError):  # and it stays failed
        app.append("segments/000001.seg", b"more")
    app.stop()
    storage.close()
    # bytes after a failed append would sit at offsets the writer did not expect: none land
    assert (tmp_path / "segments" / "000001.seg").read_bytes() == b"first"
    assert isinstance(app.error, OSError)
