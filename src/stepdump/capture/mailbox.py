"""The writer's mailbox: every message from the training thread, in order, and when to wake the writer.

Why: waking a thread costs the one that wakes it. On a millisecond step, a ``queue.put`` per step
that wakes the writer (which then takes the GIL while the training thread's torch ops let go of it
and take it back) costs the training thread more than the recorder's own work on a lean step
(measured: docs/design-measurements.md, "The writer's mailbox").

So the Recorder's messages go into a deque (an append is atomic under the GIL and wakes no one),
and the writer's queue carries only *tokens*. A message the writer must see now (one with bytes to
write or live tensors it must read before the optimizer goes on, a full step, a new layout, any
step of a ``durability="fsync"`` run) is posted with a token, so the writer wakes at once, as
before. A step below full with nothing left in a staging slot (``mailable``: a lean step whose rows
are computed or copied already, a small gradient-log step whose bytes were copied out of its slot)
is posted without one, unless the last token is ``COMMIT_WINDOW`` seconds old (so a steady loop wakes the writer about once
a window, the first step at once, and its steps commit as soon as the group commit made them
before); the writer also wakes on its own once a window, for a loop that stopped between two
steps, and a full mailbox (``MAILBOX_MAX`` messages, or ``MAILBOX_BYTES`` of copies posted since
the last token) gets a token for every post; past ``MAILBOX_STALL`` times the bytes, the training
thread waits for the writer to take them. A step below full may so wait up to one ``COMMIT_WINDOW``
for the writer's wake-up and then one more for the group commit: what a crash can lose is stated
once, in docs/reliability.md ("After a crash").
One FIFO for everything keeps the steps in the order they were taken; a message put straight
into the queue (no mailbox: reexec's bundles, tests) is written after the mail posted before it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from stepdump.capture.staging import owned
from stepdump.store.format import LEVEL_NONE, LEVEL_STATS

# The queue token that says: there is mail to take now.
MAIL = object()
# Mail that may wait for the writer's own wake-up; past it each post wakes the writer.
MAILBOX_MAX = 256
# Bytes of copies (a lean step's packed snapshot, a gradient-log step's grads) waiting in the
# mailbox past which a post wakes the writer: a fast loop with a record near lean.INLINE_BYTES
# (2 MiB) would otherwise hold up to MAILBOX_MAX of them (the writer's own cap on held copies is
# 8 MiB: writer.HELD_PACKED_BYTES). Past MAILBOX_STALL times that (a writer that does not keep up:
# a slow disk), the training thread waits for it to take them: memory stays bounded.
MAILBOX_BYTES = 8 << 20
MAILBOX_STALL = 4


def mail_bytes(msg: Any) -> int:
    """The bytes of copies ``msg`` holds while it waits (a lean step's packed snapshot, a gradient-log
    step's copied items, private copies such as a logged batch)."""
    return ((msg.packed.nbytes if msg.packed is not None else 0) + (msg.copied.nbytes if msg.copied is not None else 0)
            + sum(i.tensor.numel() * i.tensor.element_size() for i in msg.items))


def mailable(msg: Any, window: float) -> bool:
    """Whether ``msg`` (a StepMessage) may wait in the mailbox for the writer's next wake: a
    step below full (a step not recorded sends its scalars) with nothing in a staging slot (a lean step's rows computed or copied
    already, a small gradient-log step's bytes copied out: staging.owned), no catalog meta, in
    a run that holds such steps for a group commit at all (``window``: how long, 0 for a
    ``durability="fsync"`` run)."""
    return (msg.level in (LEVEL_NONE, LEVEL_STATS) and msg.slot is None and not msg.meta and msg.step is not None
            and window > 0 and owned(msg.items))


class Mailbox:
    """The messages posted and not taken yet, oldest first, and the bytes of copies they hold.

    One thread posts (the training thread), one takes (the writer): each of the two byte
    counters is written by one thread only, so their difference needs no lock."""

    __slots__ = ("_box", "_posted", "_taken")

    def __init__(self) -> None:
        self._box: deque[tuple[Any, int]] = deque()
        self._posted = 0  # bytes of copies ever posted (the training thread's)
        self._taken = 0  # of those, ever taken (the writer's)

    def post(self, msg: Any, wake: bool, nbytes: int = 0) -> bool:
        """Add ``msg`` (holding ``nbytes`` of copies); True when the writer must be woken for it
        (``wake``, or the box is full: MAILBOX_MAX messages or MAILBOX_BYTES of copies)."""
        self._box.append((msg, nbytes))
        self._posted += nbytes
        return wake or len(self._box) >= MAILBOX_MAX or self.waiting_bytes > MAILBOX_BYTES

    @property
    def waiting_bytes(self) -> int:
        """Bytes of copies posted and not taken yet."""
        return self._posted - self._taken

    def take(self) -> Iterator[Any]:
        """The messages waiting, oldest first, each taken out as it is yielded (those posted
        meanwhile too): what is not taken yet stays for the next :meth:`take`."""
        box = self._box
        while box:
            msg, nbytes = box.popleft()
            self._taken += nbytes
            yield msg

    def __len__(self) -> int:
        return len(self._box)


class Written:
    """How many messages taken from the mailbox the writer has written (and, where none is held
    for a group commit, committed), for a training thread that waits for them.

    With ``durability="fsync"`` each step is durable when its ``step()`` returns, but for the
    last ``queue_depth`` records: a step that holds no staging slot (a stats-only step, a small
    gradient-log step copied out of its slot) is bounded by nothing else, and a writer slower
    than the loop (an fsync per commit) would let tens of them pile up in the mailbox, all lost
    at a kill. ``notify``: wake waiters after each message (only a run that waits pays for it)."""

    __slots__ = ("_cv", "_notify", "count")

    def __init__(self, notify: bool) -> None:
        self.count = 0  # written by the writer thread only
        self._notify = notify
        self._cv = threading.Condition()

    def add(self) -> None:
        """The writer wrote one more message."""
        self.count += 1
        if self._notify:
            with self._cv:
                self._cv.notify_all()

    def wait_for(self, n: int, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until ``n`` messages are written; True once they are."""
        with self._cv:
            return self._cv.wait_for(lambda: self.count >= n, timeout)


class MailReader:
    """The writer's side of the mailbox: the queue of tokens, the mailbox and the count of messages
    written, read in order. The writer holds one and gives each call what it needs of the writer's
    own: how to write a message (``handle``), how to hand one back unwritten (``done_with``), when
    its held steps are due and its commit window."""

    __slots__ = ("queue", "mailbox", "written")

    def __init__(self, q: queue.Queue[Any], box: Mailbox, written: Written) -> None:
        self.queue = q  # tokens (MAIL), the end (None), or a message put straight in (no mailbox)
        self.mailbox = box
        self.written = written

    def take(self, handle: Callable[[Any], bool]) -> bool:
        """Write the mail posted so far with ``handle``, oldest first; False once it has failed."""
        for msg in self.mailbox.take():
            if not handle(msg):
                return False
            self.written.add()
        return True

    def next(self, due: float | None, window: float) -> Any:
        """The next queue item; :class:`queue.Empty` once held steps are ``due`` (monotonic time,
        None: none held), and at least once a ``window`` (0: none) while mail may come (it comes
        without waking the writer)."""
        waits = [window] if window > 0 else []
        if due is not None:
            waits.append(due - time.monotonic())
        if not waits:
            return self.queue.get()
        wait = min(waits)
        return self.queue.get(timeout=wait) if wait > 0 else self.queue.get_nowait()

    def drain(self, done_with: Callable[[Any], None]) -> None:
        """After a failure keep taking messages (mail too) and hand each to ``done_with``, so the
        training thread never blocks on a put and no slot stays taken; until the end (None)."""
        while True:
            self.discard(done_with)
            msg = self.queue.get()
            if msg is None:
                self.discard(done_with)
                return
            if msg is not MAIL:
                done_with(msg)

    def discard(self, done_with: Callable[[Any], None]) -> None:
        """The mail posted so far, taken and handed to ``done_with``, not written (after a failure)."""
        for mail in self.mailbox.take():
            done_with(mail)
