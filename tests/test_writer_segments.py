"""Which segment file the writer appends to, through the storage the Recorder is given."""

from __future__ import annotations

import torch
from helpers import (
    MLP,
    assert_final_record,
    assert_run_matches,
    catalog_sql,
    train_recorded,
)
from reliability.faults import HookedStorage

import stepdump


def test_a_resumed_session_never_appends_after_bytes_no_catalog_row_points_at(tmp_path):
    """A session killed mid-step leaves bytes at the end of a segment, or a whole segment that
    no committed row names. The next session starts a segment of its own, offsets from 0."""
    path = tmp_path / "run"
    torch.manual_seed(0)
    model = MLP(8, 16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    snaps = train_recorded(path, model, opt, 2)
    seg = path / "segments"
    assert sorted(p.name for p in seg.iterdir()) == ["000001.seg"]
    leftover = b"half a step, never committed" * 100
    (seg / "000002.seg").write_bytes(leftover)
    (seg / "000003.seg").write_bytes(b"")  # created, then the first write failed
    appended: list[str] = []
    snaps += train_recorded(path, model, opt, 2, start=2,
                            storage=lambda root: HookedStorage(root, lambda key, n: appended.append(key)))
    (new,) = set(appended)  # one new segment (000003, empty, may be it), neither of the others
    assert new not in ("segments/000001.seg", "segments/000002.seg")
    assert (seg / "000002.seg").read_bytes() == leftover
    keys = {k for (k,) in catalog_sql(path, "SELECT key FROM segments")}
    assert keys == {"segments/000001.seg", new}
    assert catalog_sql(path, "SELECT min(b.offset) FROM blobs b JOIN segments s ON s.id = b.segment "
                             "WHERE s.key = ?", (new,)) == [(0,)]
    with stepdump.open(path) as run:
        # the second session resumed at the first one's final record 2 (replacing it) and closed with 4
        assert run.steps == [0, 1, 2, 3, 4]
        assert_final_record(run, model, opt, step=4)
        assert [h["resumed_at"] for h in run.meta["history"]] == [2]
        for t in range(4):
            assert_run_matches(run, t, snaps[t])
