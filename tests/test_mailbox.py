"""The writer's mailbox (issue 25, capture/mailbox.py): a stats-only step whose rows are computed
already reaches the writer without waking it. Waking a thread once a step cost a small model's
training thread more than the recorder's own work, so these tests pin: a steady lean loop wakes the
writer about once a ``COMMIT_WINDOW``, not once a step; every step still arrives, once, in order,
mixed with steps that do wake it (full steps, a new layout); a full mailbox wakes it; a loop that
stops leaves nothing unwritten for long; no staging slot is held by a waiting step."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import catalog_sql, tiny_model, train_logging

import stepdump
from stepdump.capture import mailbox as mailbox_mod
from stepdump.capture import writer as writer_mod
from stepdump.capture.step_state import Entry
from stepdump.store.format import LEVEL_FULL, LEVEL_STATS




def _count_wakes(rec: stepdump.Recorder, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The items put in the writer's queue from now on (each one wakes it)."""
    q = rec._link.writer.queue
    put = q.put
    seen: list[Any] = []

    def counting(item: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(item)
        put(item, *args, **kwargs)

    monkeypatch.setattr(q, "put", counting)
    return seen


def _stall_writer(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the writer take no mail until the event returned is set (a slow disk, or a loaded
    machine where the writer thread does not get to run): set it before closing the Recorder."""
    gate = threading.Event()
    real = mailbox_mod.MailReader.take

    def stalled(self: Any, handle: Any) -> bool:
        gate.wait()
        return real(self, handle)

    monkeypatch.setattr(mailbox_mod.MailReader, "take", stalled)
    return gate


def test_a_steady_lean_loop_wakes_the_writer_once_a_window_not_once_a_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_mod, "COMMIT_WINDOW", 3600.0)  # steps as fast as a loaded machine can make them
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    steps = 40
    with stepdump.Recorder(tmp_path / "run", model, opt, every=None, stats_every=1) as rec:
        wakes = _count_wakes(rec, monkeypatch)
        train_logging(rec, model, opt, steps)
        # Before: one put per step (40). Now: the first step, and the step whose message sets catalog
        # meta (the layout once the optimizer state exists); the others wait in the mailbox.
        assert len(wakes) <= 3, len(wakes)
    rows = catalog_sql(tmp_path / "run", "SELECT step, level FROM steps ORDER BY step")
    assert rows == [(t, LEVEL_STATS) for t in range(steps)] + [(steps, LEVEL_FULL)]  # the final record last
    per_step = dict(catalog_sql(tmp_path / "run", "SELECT step, count(*) FROM tensors GROUP BY step"))
    n = len(list(model.parameters()))
    assert all(per_step[t] >= 2 * n for t in range(steps)), per_step  # params and grads of every step
    losses = catalog_sql(tmp_path / "run", "SELECT step, value FROM scalars WHERE name='loss' ORDER BY step")
    assert losses == [(t, float(t)) for t in range(steps)]


def test_steps_that_wake_the_writer_keep_their_place_among_waiting_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Full steps every 4 (bytes to write: they wake the writer) between lean ones (they wait): one
    queue of messages, so the run holds every step once, in order, full where it should be."""
    monkeypatch.setattr(writer_mod, "COMMIT_WINDOW", 3600.0)
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    steps = 13
    with stepdump.Recorder(tmp_path / "run", model, opt, every=4, stats_every=1) as rec:
        wakes = _count_wakes(rec, monkeypatch)
        train_logging(rec, model, opt, steps)
        assert 0 < len(wakes) < steps
    rows = catalog_sql(tmp_path / "run", "SELECT step, level FROM steps ORDER BY step")
    assert rows == [(t, LEVEL_FULL if t % 4 == 0 else LEVEL_STATS) for t in range(steps)] + [(steps, LEVEL_FULL)]
    with stepdump.open(tmp_path / "run") as run:
        assert stepdump.verify(run).ok


def test_a_full_mailbox_wakes_the_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_mod, "COMMIT_WINDOW", 3600.0)
    monkeypatch.setattr(mailbox_mod, "MAILBOX_MAX", 4)
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with stepdump.Recorder(tmp_path / "run", model, opt, every=None, stats_every=1) as rec:
        wakes = _count_wakes(rec, monkeypatch)
        train_logging(rec, model, opt, 20)
        assert len(wakes) >= 4  # about one per 4 steps: the mailbox never holds many more


def test_a_loop_that_stops_has_its_waiting_steps_written_within_the_window(tmp_path: Path) -> None:
    """No close(), no more steps: the writer looks at its mail on its own within COMMIT_WINDOW."""
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    path = tmp_path / "run"
    rec = stepdump.Recorder(path, model, opt, every=None, stats_every=1)
    try:
        train_logging(rec, model, opt, 6)  # fast steps: most of them wait in the mailbox
        deadline = time.monotonic() + writer_mod.COMMIT_WINDOW + 20  # slack for a loaded machine
        seen: list[Any] = []
        while time.monotonic() < deadline and len(seen) < 6:
            seen = catalog_sql(path, "SELECT step FROM steps ORDER BY step")
            time.sleep(0.02)
        assert [s for (s,) in seen] == list(range(6))
        assert len(rec._link.writer.mailbox) == 0
    finally:
        rec.close()


def test_a_waiting_step_holds_no_staging_slot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lean step stages nothing: its slot goes back at once, so steps waiting in the mailbox can
    never leave the next step without one (the pool would block the training thread)."""
    monkeypatch.setattr(writer_mod, "COMMIT_WINDOW", 3600.0)
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gate = _stall_writer(monkeypatch)  # the writer takes nothing: every step waits
    rec = stepdump.Recorder(tmp_path / "run", model, opt, every=None, stats_every=1)
    try:
        pool = rec._pool
        train_logging(rec, model, opt, 3 * len(pool._slots) + 2)  # more steps than slots, all waiting
        assert len(rec._link.writer.mailbox) == 3 * len(pool._slots) + 2
        assert all(m.slot is None for m, _ in list(rec._link.writer.mailbox._box))
        assert pool._free.qsize() == len(pool._slots)
    finally:
        gate.set()
        rec.close()


def test_a_durable_run_wakes_the_writer_every_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """durability="fsync" commits every step on its own: nothing waits in the mailbox."""
    monkeypatch.setattr(writer_mod, "COMMIT_WINDOW", 3600.0)
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with stepdump.Recorder(tmp_path / "run", model, opt, every=None, stats_every=1, durability="fsync") as rec:
        wakes = _count_wakes(rec, monkeypatch)
        train_logging(rec, model, opt, 6)
        assert len(wakes) == 6


@pytest.mark.parametrize("at_close", [True, False], ids=["at close", "while training"])
def test_a_write_that_fails_on_mail_stops_recording_without_a_hang(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, at_close: bool) -> None:
    """A step taken from the mailbox that fails to write: one warning naming it, recording stops,
    training goes on, and close() returns (the end token is not waited for twice)."""
    monkeypatch.setattr(writer_mod, "COMMIT_WINDOW", 3600.0)
    if not at_close:
        monkeypatch.setattr(mailbox_mod, "MAILBOX_MAX", 4)  # the writer takes mail while training goes on
    real = writer_mod.Writer._write

    def failing(self: Any, msg: Any) -> None:
        if msg.step == 3:
            raise OSError(5, "Input/output error")
        real(self, msg)

    monkeypatch.setattr(writer_mod.Writer, "_write", failing)
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rec = stepdump.Recorder(tmp_path / "run", model, opt, every=None, stats_every=1)
    with caplog.at_level("WARNING"):
        train_logging(rec, model, opt, 12)
        rec.close()
    said = [r.getMessage() for r in caplog.records if "Input/output error" in r.getMessage()]
    assert len(said) == 1, said
    # The held steps before it go with it (a group commit fails whole: tests/test_group_commit.py),
    # so the warning names the first step not committed, and the run ends just before it.
    stopped = int(said[0].split("stopped at step ")[1].split()[0])
    steps = [s for (s,) in catalog_sql(tmp_path / "run", "SELECT step FROM steps ORDER BY step")]
    assert 0 < stopped <= 3 and steps == list(range(stopped)), (said, steps)


def test_copies_waiting_in_the_mailbox_stay_under_its_byte_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lean step of a small model carries a copy of its tensors (StepMessage.packed): once more
    than MAILBOX_BYTES of them wait, each post wakes the writer, so a fast loop cannot pile them up."""
    monkeypatch.setattr(writer_mod, "COMMIT_WINDOW", 3600.0)
    sizes: list[int] = []
    real_bytes = mailbox_mod.mail_bytes

    def measured(msg: Any) -> int:
        sizes.append(real_bytes(msg))
        return sizes[-1]

    monkeypatch.setattr(mailbox_mod, "mail_bytes", measured)
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with stepdump.Recorder(tmp_path / "run", model, opt, every=None, stats_every=1) as rec:
        box = rec._link.writer.mailbox
        train_logging(rec, model, opt, 3)
        step_bytes = max(sizes)
        assert step_bytes > 0  # the copies are what this test is about
        monkeypatch.setattr(mailbox_mod, "MAILBOX_BYTES", 3 * step_bytes)
        wakes = _count_wakes(rec, monkeypatch)
        for t in range(24):
            before = len(wakes)
            train_logging(rec, model, opt, 1)
            if box.waiting_bytes > 3 * step_bytes:  # past the cap: this step's post woke the writer
                assert len(wakes) == before + 1, (t, box.waiting_bytes, step_bytes)
        assert len(wakes) >= 24 // 4 - 1  # about one wake per 4 steps' copies


def test_a_writer_that_does_not_keep_up_holds_the_training_thread_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stalled writer (a slow disk) takes no mail: the training thread waits once MAILBOX_STALL x
    MAILBOX_BYTES of copies wait, so memory stays bounded; when the writer goes on, so does
    training, and every step is written."""
    monkeypatch.setattr(writer_mod, "COMMIT_WINDOW", 3600.0)
    monkeypatch.setattr(mailbox_mod, "MAILBOX_BYTES", 1)  # any step's copy is past the stall mark
    gate = _stall_writer(monkeypatch)
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rec = stepdump.Recorder(tmp_path / "run", model, opt, every=None, stats_every=1)
    box = rec._link.writer.mailbox
    done = threading.Event()

    def train() -> None:
        train_logging(rec, model, opt, 40)
        done.set()

    th = threading.Thread(target=train)
    try:
        th.start()
        deadline = time.monotonic() + 30
        while box.waiting_bytes <= mailbox_mod.MAILBOX_STALL and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # the training thread had time to run on, if nothing held it
        assert not done.is_set()
        assert len(box) == 1  # held back at its first step's copy
    finally:
        gate.set()
        th.join(60)
        rec.close()
    assert done.is_set()
    steps = [s for (s,) in catalog_sql(tmp_path / "run", "SELECT step FROM steps ORDER BY step")]
    assert steps == list(range(41))  # 40 trained steps and the final record


@pytest.mark.parametrize("small", [True, False], ids=["copied out, mailed", "kept in its slot"])
def test_gradient_log_steps_through_the_mailbox_rebuild_bit_for_bit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small: bool) -> None:
    """A small gradient-log step's grads and RNG state are copied out of the staging slot, the slot
    goes back and the step waits in the mailbox (keyframes, full steps, still wake the writer);
    a larger one (over lean.INLINE_BYTES) keeps its slot and wakes it as before. Either way every
    step rebuilds bitwise equal to the live model (the grads stored are the ones the update used)."""
    from helpers import train_recorded

    from stepdump.capture import lean

    monkeypatch.setattr(writer_mod, "COMMIT_WINDOW", 3600.0)
    # The one knob, read when a step is taken: a copy of it bound at import would keep whatever value
    # it had then (another test's patch, if the Recorder was first imported under it).
    monkeypatch.setattr(lean, "INLINE_BYTES", 2 << 20 if small else 0)
    wakes: list[Any] = []
    real_put = writer_mod.queue.Queue.put

    def counting(self: Any, item: Any, *args: Any, **kwargs: Any) -> None:
        wakes.append(item)
        real_put(self, item, *args, **kwargs)

    monkeypatch.setattr(writer_mod.queue.Queue, "put", counting)  # the writer's queue (the pool's too)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    steps = 12
    snaps = train_recorded(tmp_path / "run", model, opt, steps, gradient_log=4)
    tokens = sum(w is mailbox_mod.MAIL for w in wakes)
    # Keyframes at 0, 4, 8 (and the final record, the layout's meta) wake it; mailed steps do not.
    assert (tokens <= 6) if small else (tokens >= steps), tokens
    with stepdump.open(tmp_path / "run") as run:
        assert stepdump.verify(run).ok
        for t in range(steps):
            got = run.state_dict(t)
            for name, want in snaps[t]["params"].items():
                assert torch.equal(got[name], want), (t, name)


def test_copied_items_are_the_staged_ones_with_their_bytes() -> None:
    """staging.OwnedCopier: the items the writer makes again hold the staged bytes (tensor and
    ``raw``, so the writer describes the small ones together), in their order, in memory of their
    own; a step over the limit, or with a live item, is not copied."""
    from stepdump.capture import gradlog_rows, staging

    g = torch.Generator().manual_seed(0)
    entries = [Entry("grads", "a", torch.randn(3, 4, generator=g), True),
               Entry("state", "/rng/t", torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8), True),
               Entry("grads", "b", torch.randn(5, generator=g), True)]
    slot = staging.Slot(0)
    staged = staging.Stager().stage(slot, entries)
    copier = staging.OwnedCopier()
    copied = copier(staged, 1 << 20)
    assert copied is not None and copied.nbytes == 12 * 4 + 9 + 5 * 4
    before = [e[2].clone() for e in entries]
    for e in entries:  # the slot's buffers are reused by the next step: the copies must not follow them
        e[2].add_(1) if e[2].is_floating_point() else e[2].zero_()
    staging.Stager().stage(slot, entries)
    items = copied.items()
    assert [(i.kind, i.name, i.full) for i in items] == [(i.kind, i.name, i.full) for i in staged]
    for item, old in zip(items, before, strict=True):
        assert torch.equal(item.tensor, old) and item.tensor.data_ptr() != old.data_ptr()
        assert bytes(item.raw) == old.numpy().tobytes()
    assert set(gradlog_rows.small_rows(items, frozenset({"state"}))) == {0, 2}  # described together
    assert copier(staged, 10) is None  # over the limit: the step keeps its slot
    live = [staging.Item("grads", "a", entries[0][2], True, live=True)]
    assert copier(live, 1 << 20) is None


def test_steps_not_recorded_send_their_scalars_without_waking_the_writer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampled schedule: the steps between two recorded ones send only their step row and
    scalars, and wait in the mailbox like stats-only steps (each woke the writer before)."""
    monkeypatch.setattr(writer_mod, "COMMIT_WINDOW", 3600.0)
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    steps = 20
    with stepdump.Recorder(tmp_path / "run", model, opt, every=5, stats_every=None) as rec:
        wakes = _count_wakes(rec, monkeypatch)
        train_logging(rec, model, opt, steps)
        assert len(wakes) <= steps // 5 + 2, len(wakes)  # the full steps (and the layout's meta)
    levels = dict(catalog_sql(tmp_path / "run", "SELECT step, level FROM steps"))
    assert [levels.get(t) for t in range(steps)] == [LEVEL_FULL if t % 5 == 0 else 0 for t in range(steps)]
    losses = catalog_sql(tmp_path / "run", "SELECT step, value FROM scalars WHERE name='loss' ORDER BY step")
    assert losses == [(t, float(t)) for t in range(steps)]
