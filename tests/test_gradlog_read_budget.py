"""Gradient-log rebuilds are inside the read budget (docs/reliability.md, "Resource bounds per read";
issue 22, item 11).

A rebuild decodes the grads of every update from the keyframe on; a store may claim far more of
them than it holds (a few KB of catalog rows pointing the grads of many steps at one big blob of
zeros). The bound: the grads a read call's updates decode (+ 64 KiB per update) are at most 16 x
the distinct bytes the store holds for them + the decode allowance (``STEPDUMP_DECODE_BUDGET``,
1 GiB). Over it, the read is refused before any of the work, with ``ReadBudgetError`` naming the
knob; honest logs, whose grads are stored about as large as they decode, read as before.

The row: a crafted store, and honest logs whose grads compress well or not at all, each under
the default, a zero and a raised allowance. A refusal decodes nothing (no blob read, no update
re-applied); a read within the budget equals the live training bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard
from helpers import assert_same_tree, catalog_sql, record_run, tiny_model
from torch import nn

import stepdump
from stepdump.core.hashing import fingerprint_bytes
from stepdump.read.blobs import BlobReader

K = 8
STEPS = 8
READ_AT = K - 1  # the farthest step from keyframe 0: K - 1 updates


class _Rows(nn.Module):
    """An embedding used densely: each batch touches 4 of 4096 rows, so each (dense) 1 MiB grad is
    almost all zeros and zstd stores it in a few KB: honest grads that compress ~100:1."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4096, 64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb(idx).sum()


def _compressible(path: Path) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = _Rows()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    states: list[dict[str, torch.Tensor]] = []
    record_run(path, steps=STEPS, model=model, opt=opt, codec="zstd", gradient_log=K,
               batch=lambda t: torch.arange(4) * 97 + t, loss_fn=lambda t, m, b: m(b),
               before_step=lambda t, m, o: states.append({k: v.clone() for k, v in m.state_dict().items()}))
    return states


def _incompressible(path: Path) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Linear(128, 128)  # 64 KiB of float noise per grad, stored raw
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    states: list[dict[str, torch.Tensor]] = []
    record_run(path, steps=STEPS, model=model, opt=opt, gradient_log=K,
               batch=lambda t: torch.randn(16, 128, generator=torch.Generator().manual_seed(t)),
               loss_fn=lambda t, m, x: m(x).square().mean(),
               before_step=lambda t, m, o: states.append({k: v.clone() for k, v in m.state_dict().items()}))
    return states


def _tiny(path: Path) -> list[dict[str, torch.Tensor]]:
    """The 8-16-4 MLP: grads of ~1 KB per step, far below the 64 KiB an update counts for; what
    the store holds per step besides them (its state, the RNG's included) keeps it in budget."""
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    states: list[dict[str, torch.Tensor]] = []
    record_run(path, steps=STEPS, model=model, opt=opt, gradient_log=K,
               before_step=lambda t, m, o: states.append({k: v.clone() for k, v in m.state_dict().items()}))
    return states


ZEROS = 128 << 20


def _aliased_zeros(path: Path) -> list[dict[str, torch.Tensor]]:
    """The issue's store, small: an honest log whose grads at steps 0..K-2 all name one zstd blob of
    128 MiB of zeros (a few KB stored), rows consistent with it (dtype, shape, fingerprint): every
    blob check passes, and reading step K-1 would decode 14 x 128 MiB and re-apply 7 updates."""
    states = _incompressible(path)
    zeros = bytes(ZEROS)
    data = zstandard.ZstdCompressor().compress(zeros)
    seg_id, key = catalog_sql(path, "SELECT id, key FROM segments ORDER BY id DESC LIMIT 1")[0]
    offset = (path / key).stat().st_size
    with open(path / key, "ab") as f:
        f.write(data)
    (blob,) = catalog_sql(path, "SELECT max(id) + 1 FROM blobs")[0]
    catalog_sql(path, "INSERT INTO blobs VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (blob, seg_id, offset, len(data), "zstd", ZEROS, fingerprint_bytes(data), None))
    catalog_sql(path, "UPDATE tensors SET blob = ?, dtype = 'float32', shape = ?, fingerprint = ? WHERE step < ? "
                      "AND series IN (SELECT id FROM series WHERE kind = 'grads')",
                (blob, str(ZEROS // 4), fingerprint_bytes(zeros), K - 1))
    return states


# (store, $STEPDUMP_DECODE_BUDGET or None for the default, refused?)
CASES: dict[str, tuple[Callable[[Path], list[dict[str, torch.Tensor]]], str | None, bool]] = {
    "crafted-aliased-zeros-default-budget": (_aliased_zeros, None, True),
    "crafted-aliased-zeros-raised-budget": (_aliased_zeros, str(1 << 40), False),  # then the grads' shape is wrong
    "honest-compressible-grads-default-budget": (_compressible, None, False),
    "honest-compressible-grads-no-allowance": (_compressible, "0", True),
    "honest-compressible-grads-raised-allowance": (_compressible, str(16 << 20), False),
    "honest-float-grads-no-allowance": (_incompressible, "0", False),
    "honest-tiny-grads-no-allowance": (_tiny, "0", False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_rebuild_over_the_budget_is_refused_before_the_work_and_one_within_it_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    make, allowance, refused = CASES[case]
    states = make(tmp_path / "run")
    if allowance is not None:
        monkeypatch.setenv("STEPDUMP_DECODE_BUDGET", allowance)
    reads: list[str] = []
    for method in ("read_into", "read_ahead", "_decode", "tensor"):  # every way a blob's bytes are read
        original = getattr(BlobReader, method)

        def counted(self: Any, *a: Any, _name: str = method, _original: Any = original, **kw: Any) -> Any:
            reads.append(_name)
            return _original(self, *a, **kw)

        monkeypatch.setattr(BlobReader, method, counted)
    with stepdump.open(tmp_path / "run") as run:
        engine = run.gradient_log
        assert engine is not None and engine.rebuilds(READ_AT, "params")
        if refused:
            with pytest.raises(stepdump.ReadBudgetError) as e:
                run.tensor("weight" if "weight" in states[0] else "emb.weight", READ_AT)
            assert reads == [] and engine.updates_applied == 0, (reads, engine.updates_applied)
            text = str(e.value)
            assert "STEPDUMP_DECODE_BUDGET" in text and f"{READ_AT} recorded updates" in text, text
            assert "Nothing was decoded" in text
            report = stepdump.verify(run)  # the same bound: the segment is not re-applied, and says why
            assert any("STEPDUMP_DECODE_BUDGET" in u for u in report.unchecked), report.unchecked
            assert report.segments_checked == 1  # the final record's segment, which decodes nothing claimed
        elif case.startswith("crafted"):  # within a raised budget the work is done, and the lie is found
            with pytest.raises(stepdump.RebuildError, match="gradient of 'weight' at step 0 is torch.float32"):
                run.tensor("weight", READ_AT)
        else:
            assert_same_tree(dict(run.state_dict(READ_AT)), states[READ_AT], f"state_dict({READ_AT})")
            assert engine.updates_applied == READ_AT
            assert stepdump.verify(run).ok
