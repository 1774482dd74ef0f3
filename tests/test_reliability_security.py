"""Security: opening and reading an untrusted store never runs code, never reaches outside
the run directory, and refuses absurd sizes before allocating them.

(Exported checkpoints loading with ``torch.load(weights_only=True)`` is tested
in tests/test_export_verify.py.)
"""

from __future__ import annotations

import ast
import os
import stat
import threading
from pathlib import Path

import pytest
import torch
import zstandard
from helpers import catalog_sql, one_step_run, peak_traced_bytes, weight_blob
from torch import nn

import stepdump
from stepdump.core.hashing import fingerprint_bytes
from stepdump.store import storage as storage_mod

SRC = Path(stepdump.__file__).parent

# -- no code execution -----------------------------------------------------------------------------

_BANNED_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib", "yaml"}
_BANNED_CALLS = {"eval", "exec", "__import__", "compile", "execfile"}
# Dynamic imports that are fine: the name comes from a constant tuple in the source, never from a store.
_ALLOWED_IMPORT_MODULE = {("cli/main.py", "COMMANDS"), ("__init__.py", "_LAZY"),  # tests/test_public_api.py checks _LAZY
                          ("cli/cmd_reexecute.py", "--entry")}  # the user's own factory, named on the command line


def _findings(path: Path) -> list[str]:
    rel = path.relative_to(SRC).as_posix()
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [f"{rel}:{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] in _BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _BANNED_MODULES:
            out.append(f"{rel}:{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
            kw = {k.arg: k.value for k in node.keywords}
            if isinstance(f, ast.Name) and name in _BANNED_CALLS:
                out.append(f"{rel}:{node.lineno}: {name}()")
            elif name == "load" and owner == "torch":
                w = kw.get("weights_only")
                if not (isinstance(w, ast.Constant) and w.value is True):
                    out.append(f"{rel}:{node.lineno}: torch.load without weights_only=True")
            elif name == "load" and owner in ("np", "numpy"):
                a = kw.get("allow_pickle")
                if a is not None and not (isinstance(a, ast.Constant) and a.value is False):
                    out.append(f"{rel}:{node.lineno}: numpy.load with allow_pickle")
            elif name in ("read_pickle", "from_pickle") or (name == "loads" and owner in _BANNED_MODULES):
                out.append(f"{rel}:{node.lineno}: {name}()")
            elif name == "import_module":
                src = ast.get_source_segment(path.read_text(), node) or ""
                if not any(rel == r and "name" in src for r, _ in _ALLOWED_IMPORT_MODULE):
                    out.append(f"{rel}:{node.lineno}: importlib.import_module({src})")
    return out


def test_the_package_has_no_way_to_execute_stored_data():
    """No pickle (or marshal, shelve, yaml...), eval/exec/compile, torch.load without
    weights_only=True, numpy pickles, or dynamic imports of computed names anywhere in src/."""
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 30
    findings = [f for p in files for f in _findings(p)]
    assert findings == []


def test_the_scan_would_catch_them(tmp_path, monkeypatch):
    bad = SRC / "_scan_probe_never_committed.py"
    text = "import pickle\nx = eval('1')\nimport torch\ntorch.load('f')\ntorch.load('f', weights_only=False)\n"
    try:
        bad.write_text(text)
        found = _findings(bad)
    finally:
        bad.unlink()
    assert len(found) == 4, found


def test_the_allowed_dynamic_import_takes_names_from_a_constant():
    main = (SRC / "cli" / "main.py").read_text()
    tree = ast.parse(main)
    consts = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "COMMANDS" for t in n.targets)]
    assert consts and isinstance(consts[0].value, ast.Tuple)
    assert all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in consts[0].value.elts)


# -- odd names on the writer side --------------------------------------------------------------------

ODD_NAMES = ["模块", "emoji😀", "/etc/passwd", "a\x00b", "\u2024\u2024\u2215\u2024\u2024", "%s%n",
             "'; DROP TABLE series; --", " ", "\\back\\slash", "segments", "\u202eevil", "LOCK"]


class OddNames(nn.Module):
    def __init__(self):
        super().__init__()
        for i, name in enumerate(ODD_NAMES):
            self.add_module(name, nn.Linear(3, 2, bias=i % 2 == 0))
        self.register_buffer("buf\x00/\u2025", torch.arange(3.0))

    def forward(self, x):
        return sum(m(x).sum() for m in self.children()) + self.get_buffer("buf\x00/\u2025").sum()


def _listing(root: Path) -> dict[str, tuple[int, float]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime) for p in root.rglob("*")}


def test_odd_parameter_names_round_trip_and_never_become_paths(tmp_path):
    torch.manual_seed(0)
    model = OddNames()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("untouched")
    before = _listing(outside)
    run_dir = tmp_path / "deep" / "run"
    snaps = {}
    scalar_names = {"../../loss": 1.0, "名前": 2.0, "a/b\\c": 3.0}
    with stepdump.Recorder(run_dir, model, opt) as rec:
        for t in range(3):
            opt.zero_grad()
            model(torch.randn(4, 3)).backward()
            snaps[t] = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.step()
            rec.log(**scalar_names)
    names = [n for n, _ in model.named_parameters()]
    assert any("\x00" in n for n in names) and any("/etc/passwd" in n for n in names)
    with stepdump.open(run_dir) as run:
        assert run.names("params") == names
        assert run.names("grads") == names
        assert {f"{n}.exp_avg" for n in names} <= set(run.names("optimizer"))
        for t, snap in snaps.items():
            for n, want in snap.items():
                assert torch.equal(run.tensor(n, t), want), n
            assert set(run.stats(name=names[0], steps=t)["kind"]) == {"params", "grads"}
        fresh = OddNames()
        fresh.load_state_dict(run.state_dict(2))
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
        fresh_opt.load_state_dict(run.optimizer_state_dict(2))
        for (n, p), want in zip(fresh.named_parameters(), snaps[2].values()):
            assert torch.equal(p, want), n
        assert set(scalar_names) <= set(run.scalars().columns)
        assert stepdump.verify(run).ok
    # Names never became paths: the run holds only its own files, nothing appeared elsewhere.
    files = {p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*")}
    assert files - {"catalog.sqlite-wal", "catalog.sqlite-shm"} == {"LOCK", "catalog.sqlite", "segments",
                                                                    "segments/000001.seg", "stats.parquet"}
    assert {p.name for p in tmp_path.iterdir()} == {"outside", "deep"}
    assert [p.name for p in (tmp_path / "deep").iterdir()] == ["run"]
    assert _listing(outside) == before


# -- hostile catalogs on the reader side -----------------------------------------------------------------


@pytest.fixture
def small_run(tmp_path):
    return one_step_run(tmp_path / "run")


@pytest.fixture
def opened_paths(monkeypatch):
    """Every path the storage layer hands to os.open while the test runs."""
    seen = []
    real_open = os.open

    def spy(path, *args, **kwargs):
        seen.append(os.fspath(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(storage_mod.os, "open", spy)
    return seen


@pytest.mark.parametrize("key", ["../../etc/passwd", "/etc/passwd", "segments/../../../etc/passwd",
                                 "segments\\..\\..\\x", "segments/000001.seg\x00.txt", "", ".", "segments/./x",
                                 "segments//x"])
def test_segment_keys_that_leave_the_run_are_refused_before_anything_is_opened(small_run, key, opened_paths):
    catalog_sql(small_run, "UPDATE segments SET key = ?", (key,))
    with stepdump.open(small_run) as run:
        with pytest.raises(stepdump.CorruptDataError, match="refusing storage key"):
            run.tensor("weight", 0)
        report = stepdump.verify(run)
    assert not report.ok and all("refusing storage key" in p.detail for p in report.problems)
    assert opened_paths == []


def test_a_segment_linking_outside_the_run_is_not_read_even_with_matching_checksums(small_run, tmp_path):
    """The exfiltration case: the catalog describes exactly the bytes of a file outside the
    run (checksum, fingerprint, sizes all match). The reader still refuses the link."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"private key material, 48 bytes long!!!!!!!!!!!!")
    data = secret.read_bytes()
    fp = fingerprint_bytes(data)
    seg = next((small_run / "segments").glob("*.seg"))
    seg.unlink()
    seg.symlink_to(secret)
    blob = weight_blob(small_run)
    catalog_sql(small_run, "UPDATE blobs SET offset = 0, length = ?, raw_length = ?, checksum = ? WHERE id = ?",
         (len(data), len(data), fp, blob))
    catalog_sql(small_run, "UPDATE tensors SET dtype = 'uint8', shape = ?, fingerprint = ? WHERE blob = ?",
         (str(len(data)), fp, blob))
    with stepdump.open(small_run) as run:
        with pytest.raises(stepdump.CorruptDataError, match="outside the run directory"):
            run.tensor("weight", 0)


@pytest.mark.parametrize("what", ["fifo", "directory", "device"])
def test_a_segment_that_is_not_a_regular_file_is_refused_without_blocking(small_run, what):
    seg = next((small_run / "segments").glob("*.seg"))
    seg.unlink()
    if what == "fifo":
        os.mkfifo(seg)
    elif what == "directory":
        seg.mkdir()
    else:  # a character device, like /dev/zero (endless bytes)
        os.mknod(seg, 0o600 | stat.S_IFCHR, os.makedev(1, 5))
    result = {}

    def read():
        with stepdump.open(small_run) as run:
            try:
                run.tensor("weight", 0)
            except stepdump.StepdumpError as e:
                result["error"] = e

    th = threading.Thread(target=read, daemon=True)
    th.start()
    th.join(10)
    assert not th.is_alive(), f"reading a {what} segment blocked"
    assert isinstance(result.get("error"), stepdump.CorruptDataError)
    assert "not a regular file" in str(result["error"]) or "cannot be opened" in str(result["error"])


# -- absurd sizes: refused before allocating ------------------------------------------------------------


ABSURD = [
    # shape claims 10**15 float32 elements; sizes claimed to match
    ("1000000000,1000000", 4 * 10**15, 4 * 10**15, "raw", "implausibly large"),
    # 40 GB claimed by a raw blob: more than the segment holds, refused before pread allocates it
    ("100000,100000", 4 * 10**10, 4 * 10**10, "raw", "truncated"),
    # 40 GB claimed from a few stored bytes: no codec expands that much
    ("100000,100000", 4 * 10**10, None, "zstd", "more than zstd can expand"),
    ("100000,100000", 4 * 10**10, None, "blosc-lz4", "more than blosc-lz4 can expand"),
    # zero-sized dims that would still make absurd strides
    ("0,1099511627776,1099511627776", 0, None, "raw", "implausibly large"),
    ("1," * 2000 + "1", 4, None, "raw", None),  # many dims of 1: fine, nothing big
    ("99999999999999999999", 4, None, "raw", "bad shape"),
    ("-4,3", 48, None, "raw", "bad shape"),
]


@pytest.mark.parametrize("shape,raw_length,length,codec,match", ABSURD)
def test_absurd_shapes_and_sizes_are_refused_before_allocating(small_run, shape, raw_length, length, codec, match):
    blob = weight_blob(small_run)
    if length is None:
        (length,) = catalog_sql(small_run, "SELECT length FROM blobs WHERE id = ?", (blob,))[0]
    catalog_sql(small_run, "UPDATE tensors SET shape = ? WHERE blob = ?", (shape, blob))
    catalog_sql(small_run, "UPDATE blobs SET raw_length = ?, length = ?, codec = ? WHERE id = ?",
         (raw_length, length, codec, blob))
    with stepdump.open(small_run) as run:
        outcome = {}

        def read():
            try:
                outcome["value"] = run.tensor("weight", 0)
            except stepdump.StepdumpError as e:
                outcome["error"] = e

        peak = peak_traced_bytes(read)
        report = stepdump.verify(run)
    assert peak < 32 << 20, f"the reader allocated {peak} bytes for a damaged row"
    assert "error" in outcome, outcome
    assert isinstance(outcome["error"], stepdump.CorruptDataError)
    if match:
        assert match in str(outcome["error"])
    assert not report.ok


def test_a_zstd_frame_that_lies_about_its_size_is_refused_before_decoding(small_run):
    """A frame whose header claims 64 MiB (it would decode to that: zeros), where the catalog says 48 bytes."""
    bomb = zstandard.ZstdCompressor(level=3).compress(bytes(1 << 26))
    blob = weight_blob(small_run)
    seg = next((small_run / "segments").glob("*.seg"))
    offset = seg.stat().st_size
    with open(seg, "ab") as f:
        f.write(bomb)
    catalog_sql(small_run, "UPDATE blobs SET offset = ?, length = ?, codec = 'zstd', checksum = ? WHERE id = ?",
         (offset, len(bomb), fingerprint_bytes(bomb), blob))
    with stepdump.open(small_run) as run:
        def read():
            with pytest.raises(stepdump.CorruptDataError, match="zstd frame says it holds 67108864 bytes"):
                run.tensor("weight", 0)

        assert peak_traced_bytes(read) < 32 << 20


def test_a_zstd_frame_without_a_size_decodes_only_what_it_holds(small_run):
    """No content size in the header: decoding is bounded by what the catalog expects (+1),
    not by a claim, and a frame that decodes to more is refused."""
    bomb = zstandard.ZstdCompressor(level=3, write_content_size=False).compress(bytes(1 << 26))
    blob = weight_blob(small_run)
    seg = next((small_run / "segments").glob("*.seg"))
    offset = seg.stat().st_size
    with open(seg, "ab") as f:
        f.write(bomb)
    catalog_sql(small_run, "UPDATE blobs SET offset = ?, length = ?, codec = 'zstd', checksum = ? WHERE id = ?",
         (offset, len(bomb), fingerprint_bytes(bomb), blob))
    with stepdump.open(small_run) as run:
        def read():
            with pytest.raises(stepdump.CorruptDataError, match="decodes to 49 bytes, expected 48"):
                run.tensor("weight", 0)

        assert peak_traced_bytes(read) < 64 << 20


def test_a_catalog_whose_tables_are_views_is_refused_before_they_run(small_run):
    """An endless recursive view in place of ``steps`` would hang every query that reads it."""
    catalog_sql(small_run, "DROP TABLE steps")
    catalog_sql(small_run, "CREATE VIEW steps AS WITH RECURSIVE c(x) AS (SELECT 0 UNION ALL SELECT x + 1 FROM c) "
                    "SELECT x AS step, 2 AS level, 0 AS skipped, 0.0 AS time, NULL AS state FROM c")
    # Had the view run, open() would never return (pytest-timeout ends the test as a failure).
    with pytest.raises(stepdump.CorruptDataError, match="'steps' is a view, not a table"):
        stepdump.open(small_run)
