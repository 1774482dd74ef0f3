"""The stored form of a sparse COO tensor (FORMAT.md, "Sparse tensors"), pinned byte for byte,
what a reader refuses, its stats, and every consumer of a run that meets one (verify, show,
export, TensorBoard, diff of two tensors).

Hand-made tensors only: nothing here depends on this CPU's kernels.
"""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from test_sparse_grads import build, iteration

import stepdump
from stepdump.analysis.diff_values import compare_tensors
from stepdump.analysis.verify import verify
from stepdump.core.hashing import fingerprint, raw_bytes
from stepdump.core.sparse import from_raw_bytes
from stepdump.core.stats import compute_stats
from stepdump.render.tensorboard import export_tensorboard
from stepdump.store.format import sparse_values_dtype


def _coo(indices: list[list[int]], values: list, size: tuple[int, ...], coalesced: bool = False) -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor(indices), torch.tensor(values, dtype=torch.float32), size,
                                   is_coalesced=coalesced, check_invariants=True)


# Indices [[3, 1, 3]] (row 3 twice, uncoalesced) of a (5, 2) tensor, values [[1, 2], [3, 4], [0.5, 0]].
PINNED = (
    "434f4f3100000000" "0100000000000000" "0300000000000000" "0000000000000000"  # COO1, flags 0, dim 1, nnz 3, 0
    "0300000000000000" "0100000000000000" "0300000000000000"  # int64 indices
    "0000803f00000040" "0000404000008040" "0000003f00000000"  # float32 values
)


def test_the_raw_bytes_and_fingerprint_of_a_sparse_tensor_are_pinned():
    t = _coo([[3, 1, 3]], [[1.0, 2.0], [3.0, 4.0], [0.5, 0.0]], (5, 2))
    assert bytes(raw_bytes(t)).hex() == PINNED
    assert fingerprint(t) == fingerprint(torch.frombuffer(bytearray.fromhex(PINNED), dtype=torch.uint8))
    back = from_raw_bytes(bytes.fromhex(PINNED), torch.float32, (5, 2))
    assert back.layout == torch.sparse_coo and not back.is_coalesced() and back.shape == (5, 2)
    assert torch.equal(back._indices(), t._indices()) and torch.equal(back._values(), t._values())
    coalesced = t.coalesce()
    head = bytes(raw_bytes(coalesced))[:8]
    assert head == b"COO1" + struct.pack("<I", 1), "bit 0 of the flags: coalesced"
    assert sparse_values_dtype("sparse_coo:float32") == "float32" and sparse_values_dtype("float32") is None


def _pinned(**change: object) -> bytes:
    data = bytearray.fromhex(PINNED)
    for field, value in change.items():
        at, fmt = {"magic": (0, "<4s"), "flags": (4, "<I"), "sparse_dim": (8, "<Q"), "nnz": (16, "<Q"),
                   "reserved": (24, "<Q"), "index0": (32, "<q")}[field]
        struct.pack_into(fmt, data, at, value)
    return bytes(data)


@pytest.mark.parametrize("raw,why", [
    (_pinned(magic=b"COO2"), "header is malformed"),
    (_pinned(flags=2), "header is malformed"),
    (_pinned(reserved=7), "header is malformed"),
    (_pinned(sparse_dim=3), "sparse dims"),
    (_pinned(nnz=4), "holds"),
    (_pinned(nnz=1 << 62), "holds"),
    (_pinned(index0=5), "malformed"),  # outside the size
    (_pinned(index0=-1), "malformed"),
    (_pinned(flags=1), "malformed"),  # claims coalesced, but row 3 is there twice
    (bytes.fromhex(PINNED)[:-1], "holds"),
    (bytes.fromhex(PINNED)[:20], "shorter than its header"),
], ids=["magic", "flags", "reserved", "sparse-dim", "nnz", "huge-nnz", "index-past-size", "negative-index",
        "coalesced-lie", "truncated", "no-header"])
def test_a_malformed_sparse_blob_is_refused_never_read(raw, why):
    with pytest.raises(stepdump.CorruptDataError, match=why):
        from_raw_bytes(raw, torch.float32, (5, 2))


def test_stats_of_a_sparse_tensor_are_those_of_the_dense_tensor_it_stands_for():
    """Duplicates summed, elements no index names counted as zeros (values chosen so that every
    sum below is exact in floating point)."""
    t = _coo([[3, 1, 3, 0]], [[1.0, 2.0], [3.0, 4.0], [1.0, 0.0], [-8.0, 0.0]], (5, 2))
    dense = torch.tensor([[-8.0, 0.0], [3.0, 4.0], [0.0, 0.0], [2.0, 2.0], [0.0, 0.0]])
    got, want = compute_stats(t), compute_stats(dense)
    assert got[:6] == want[:6], (got, want)  # numel, nan, +inf, -inf, min, max
    assert got[6] == want[6] == 3.0 / 10  # mean over all ten elements
    assert got[8] == want[8] == 97.0 ** 0.5  # norm
    assert got[9] == want[9] == 5 / 10  # zero fraction, implicit zeros included
    assert abs(got[7] - want[7]) <= 1e-12 * want[7]  # std: the same quantity by another formula
    nan = _coo([[2]], [[float("nan"), 1.0]], (5, 2))
    assert compute_stats(nan)[:6] == (10, 1, 0, 0, 0.0, 1.0)
    empty = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.int64), torch.zeros(0, 2), (5, 2),
                                    check_invariants=True)
    assert compute_stats(empty) == (10, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0)


def test_compare_tensors_tells_sparse_structure_from_values():
    a = _coo([[3, 1, 3]], [[1.0, 2.0], [3.0, 4.0], [0.5, 0.0]], (5, 2))
    assert compare_tensors("grads", "e", a, a.clone()) is None
    structure = compare_tensors("grads", "e", a, a.coalesce())
    assert structure is not None and structure.reason == "structure", structure
    assert "sparse structure differs" in structure.describe()
    other = _coo([[3, 1, 3]], [[1.0, 2.0], [3.0, 4.5], [0.5, 0.0]], (5, 2))
    d = compare_tensors("grads", "e", a, other)
    assert d is not None and d.reason == "values" and d.n_diff == 1 and d.at == (1, 1), d
    dense = compare_tensors("grads", "e", a, a.to_dense())
    assert dense is not None and dense.reason == "structure"
    assert compare_tensors("grads", "e", a, a.coalesce(), atol=1e-9) is None  # equal values, within a tolerance


@pytest.fixture(scope="module")
def sparse_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("sparse") / "run"
    model, opt = build("SGD")
    with stepdump.Recorder(path, model, opt, on_error="raise"):
        for t in range(3):
            iteration(model, opt, t, "duplicates")
    return path


def test_verify_checks_a_sparse_grad_and_finds_it_damaged(sparse_run, tmp_path):
    with stepdump.open(sparse_run) as run:
        report = verify(run)
        assert not report.problems and report.blobs_checked > 0, report
        row = run.catalog.tensor_row(run.catalog.series_id("grads", "emb.weight"), 1)
        assert row is not None and str(row[1]).startswith("sparse_coo:")
        blob = row[0]
        seg, offset = run.catalog.blob_location(blob)
    damaged = tmp_path / "run"
    shutil.copytree(sparse_run, damaged)
    with open(damaged / seg, "r+b") as f:
        f.seek(offset + 40)  # an index byte
        b = f.read(1)
        f.seek(offset + 40)
        f.write(bytes([b[0] ^ 1]))
    with stepdump.open(damaged) as run:
        report = verify(run)
        assert any(f"blob {blob}" in p.where for p in report.problems), report.problems
        with pytest.raises(stepdump.CorruptDataError):
            run.tensor("emb.weight", 1, kind="grads")


def test_show_prints_a_sparse_grad_with_its_structure(sparse_run, cli):
    out = json.loads(cli("show", sparse_run, "emb.weight", "--step", "1", "--kind", "grads", "--json").stdout)
    with stepdump.open(sparse_run) as run:
        g = run.tensor("emb.weight", 1, kind="grads")
    assert out["layout"] == f"sparse COO, {g._nnz()} stored elements, not coalesced", out["layout"]
    shown = out["values"]
    assert out["shape"] == [30, 6] and shown and shown == g.to_dense().reshape(-1).tolist()[:len(shown)]


def test_export_and_tensorboard_take_a_sparse_grad_as_the_dense_tensor_it_stands_for(sparse_run, tmp_path):
    from safetensors.torch import load_file

    with stepdump.open(sparse_run) as run:
        g = run.tensor("emb.weight", 1, kind="grads")
        run.export(1, tmp_path / "step1.safetensors", format="safetensors", grads=True)
        got = load_file(str(tmp_path / "step1.safetensors"))["grads/emb.weight"]
        assert torch.equal(got, g.to_dense())
        written = export_tensorboard(run, tmp_path / "tb", histograms=("grads",))
        # emb.weight (sparse), head.weight, head.bias at steps 0-2 (the final record has no grads)
        assert written.histogram_steps == (0, 1, 2) and written.histograms == 9, written
