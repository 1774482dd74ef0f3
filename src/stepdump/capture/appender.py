"""Segment appends on their own thread, so a step's writes overlap its stats and encoding.

The writer thread spends a step computing stats, fingerprints and codec output
for each tensor and appending the bytes to a segment. ``write()`` into the page
cache is mostly waiting on the kernel's writeback throttling (it releases the
GIL), so doing it on a second thread lets the next tensor's stats and encoding
run meanwhile. Measured on benchmark workload A (134 MB per record, 2 cores):
see docs/performance.md.

Order and visibility are unchanged: appends run in the order they were queued,
on one thread, and the writer calls :meth:`Appender.wait` before a step's
catalog commit, so a step is still committed only after all its bytes were
handed to the OS. Queued buffers are not copied: the writer keeps the staging
slot they point into until ``wait`` returned.

Buffers the writer made itself (codec output, batched small blobs) are *owned*:
they exist only for the append, and while the disk is slower than encoding they
would pile up, up to a whole step's encoded bytes. So owned bytes waiting in
the queue are capped (``max_pending``): an append that would go over waits for
earlier ones to land, and memory stays bounded whatever the model's size (one
buffer bigger than the cap is let through alone).

A step's last batch of small blobs may be written *inline* (``append(..., inline=True)``) when
nothing is queued: on the writer's thread, one write, the order unchanged (the queue is empty). A
small model's step is a few kilobytes, and handing them to this thread and waiting for it costs a
GIL hand-off each way, each a context switch of the training thread; there is nothing
for the hand-off to overlap with at the end of a step, as the commit waits for the bytes anyway.

Each append carries the offset the writer has already put in the catalog rows;
storage returns where the bytes really landed, and a mismatch (another process
writing into the segment, a storage that does not append) is an error, not a
blob pointed at wrong bytes.
"""

from __future__ import annotations

import queue
import threading
from typing import NamedTuple

from stepdump.errors import WriterError
from stepdump.store.storage import Storage


class _Job(NamedTuple):
    """One queued append."""

    key: str
    data: bytes | bytearray | memoryview
    offset: int
    owned: int  # bytes counted against max_pending (0: the caller's memory)


DEFAULT_MAX_PENDING = 64 << 20


class Appender(threading.Thread):
    """Appends ``(key, bytes)`` to storage in FIFO order; the first error stops it.

    ``max_pending``: owned bytes (see :meth:`append`) that may wait in the queue.
    """

    def __init__(self, storage: Storage, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        super().__init__(name="stepdump-appender", daemon=True)
        self.storage = storage
        self.error: BaseException | None = None
        self.max_pending = max_pending
        self.pending = 0  # owned bytes queued and not yet appended
        self._room = threading.Condition()
        self._queue: queue.Queue[_Job | None] = queue.Queue()

    def run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if self.error is None:  # after a failure, later bytes would land at wrong offsets
                    self._land(job.key, job.data, job.offset)
            except BaseException as e:  # noqa: BLE001 - handed to the writer in wait()
                self.error = e
            finally:
                if job is not None and job.owned:
                    with self._room:
                        self.pending -= job.owned
                        self._room.notify_all()
                self._queue.task_done()

    def append(self, key: str, data: bytes | bytearray | memoryview, offset: int, owned: bool = False,
               inline: bool = False) -> None:
        """Queue an append of ``data`` that must land at ``offset`` of ``key``; ``data`` must
        stay unchanged until :meth:`wait` returns. ``owned``: ``data`` was made for this append
        (it counts against ``max_pending``, and the call waits while the queue is full of such).
        ``inline``: when no append is queued or running, write it now, on this thread (module
        docstring); an error is kept for :meth:`wait` as a queued append's would be."""
        self._check()
        if inline and not self._queue.unfinished_tasks:  # only this thread queues: it stays empty
            try:
                self._land(key, data, offset)
            except BaseException as e:  # noqa: BLE001 - raised by wait(), as for a queued append
                self.error = e
            return
        n = memoryview(data).nbytes if owned else 0
        if n:
            with self._room:
                while self.pending and self.pending + n > self.max_pending and self.error is None:
                    self._room.wait()
                self.pending += n
        self._queue.put(_Job(key, data, offset, n))

    def _land(self, key: str, data: bytes | bytearray | memoryview, offset: int) -> None:
        landed = self.storage.append(key, data)
        if landed != offset:
            raise WriterError(
                f"bytes for segment {key!r} landed at offset {landed}, where stepdump wrote {offset} "
                "into the catalog: something else writes into this run's segment files"
            )

    def wait(self) -> None:
        """Block until every queued append is done; raise the first error any of them hit."""
        self._queue.join()
        self._check()

    def stop(self) -> None:
        """Finish the queued appends and end the thread (errors stay in ``error``)."""
        self._queue.put(None)
        self.join()

    def _check(self) -> None:
        if self.error is not None:
            raise self.error
