"""One export: ``run.export``, ``stepdump.export.export_checkpoint`` and ``stepdump export`` take the
same arguments (format, grads, trainer settings, rank) and write the same checkpoint, and refuse the
same things with the same error (issue 23, item 3)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import assert_same_tree, record_run
from safetensors import safe_open

import stepdump
from stepdump.export import export_checkpoint
from stepdump.read.joint import JointRun
from stepdump.read.ranked import DistributedRun
from stepdump.read.reader import RunReader
from stepdump.read.remote import RemoteRun
from stepdump.read.run import Run

# (format, grads, trainer) rows; the CLI spells trainer as --trainer KEY=VALUE.
ROWS = [
    ("torch", False, None),
    ("safetensors", False, None),
    ("safetensors", True, None),
    ("hf-trainer", False, {"train_batch_size": 8}),
    ("lightning", False, {"num_training_batches": 4}),
]
ENTRIES = ("method", "function", "cli")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_run(tmp_path_factory.mktemp("exp") / "run", steps=5)


def _export(entry: str, run_dir: Path, out: Path, cli: Any, **kw: Any) -> None:
    if entry == "cli":
        args = ["export", run_dir, "--step", 3, "-o", out, "--format", kw.get("format", "torch")]
        args += ["--grads"] * bool(kw.get("grads"))
        for k, v in (kw.get("trainer") or {}).items():
            args += ["--trainer", f"{k}={v}"]
        if kw.get("rank") is not None:
            args += ["--rank", kw["rank"]]
        res = cli(*args, ok=None)
        if res.code != 0:
            raise stepdump.ConfigError(res.stdout + res.stderr)
        return
    with stepdump.open(run_dir) as run:
        if entry == "method":
            run.export(3, out, **kw)
        else:
            export_checkpoint(run, 3, out, **kw)


def _load(path: Path) -> dict[str, Any]:
    """What a checkpoint holds: every file of it, torch-loaded, safetensors-loaded (the header's
    key order is the writer's hash order) or as bytes; numpy arrays (RNG states) as tensors."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    out: dict[str, Any] = {}
    for f in files:
        key = str(f.relative_to(path)) if path.is_dir() else f.suffix
        if f.suffix in (".pt", ".pth", ".ckpt") or f.read_bytes()[:2] == b"PK":  # torch.save's zip
            out[key] = _tensors(torch.load(f, weights_only=False))
        elif f.suffix == ".safetensors" or not path.is_dir():
            with safe_open(f, "pt") as st:
                out[key] = {"metadata": st.metadata(), "tensors": {k: st.get_tensor(k) for k in st.keys()}}
        else:
            out[key] = f.read_bytes()
    return out


def _tensors(tree: Any) -> Any:
    if isinstance(tree, np.ndarray):
        return torch.from_numpy(tree)
    if isinstance(tree, dict):
        return {k: _tensors(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_tensors(v) for v in tree)
    return tree


@pytest.mark.parametrize("fmt, grads, trainer", ROWS)
def test_every_entry_writes_the_same_checkpoint(fmt: str, grads: bool, trainer: dict[str, Any] | None,
                                                run_dir: Path, tmp_path: Path, cli: Any) -> None:
    written = {}
    for entry in ENTRIES:
        out = tmp_path / entry / "ckpt"
        _export(entry, run_dir, out, cli, format=fmt, grads=grads, trainer=trainer)
        written[entry] = _load(out)
    assert_same_tree(written["function"], written["method"], "function vs method")
    assert_same_tree(written["cli"], written["method"], "cli vs method")


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("kw, match", [
    ({"format": "torch", "trainer": {"train_batch_size": 8}}, "trainer"),
    ({"format": "hf-trainer", "trainer": {"train_batch_size": 8}, "grads": True}, "no gradients"),
    ({"format": "hf-trainer"}, "train_batch_size"),
    ({"format": "torch", "rank": 0}, "rank"),
])
def test_every_entry_refuses_the_same(entry: str, kw: dict[str, Any], match: str, run_dir: Path, tmp_path: Path,
                                      cli: Any) -> None:
    with pytest.raises(stepdump.ConfigError, match=match):
        _export(entry, run_dir, tmp_path / "x", cli, **kw)
    assert not (tmp_path / "x").exists()


READERS = [Run, RemoteRun, DistributedRun, RunReader]


@pytest.mark.parametrize("reader", READERS + [JointRun], ids=lambda c: c.__name__)
def test_every_reader_export_takes_the_function_s_arguments(reader: type) -> None:
    want = list(inspect.signature(export_checkpoint).parameters.values())[1:]  # less `run`
    got = [p for p in inspect.signature(reader.export).parameters.values() if p.name not in ("self", "model")]
    assert [(p.name, p.kind, p.default) for p in got] == [(p.name, p.kind, p.default) for p in want]


def test_rank_exports_one_rank_s_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: Any) -> None:
    """A multi-rank run: rank=None the consolidated tensors; rank=r that rank's store as recorded."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "pg"), 1), rank=0, world_size=1)
    try:
        record_run(tmp_path / "ranked", steps=3)
    finally:
        dist.destroy_process_group()
    with stepdump.open(tmp_path / "ranked") as run:
        assert isinstance(run, DistributedRun)
        one = _load(run.export(2, tmp_path / "r0.pt", rank=0))
        assert_same_tree(one[".pt"], _load(run.rank(0).export(2, tmp_path / "plain.pt"))[".pt"], "rank 0")
        with pytest.raises(stepdump.StepdumpError, match="rank 5"):
            run.export(2, tmp_path / "r5.pt", rank=5)
    cli("export", tmp_path / "ranked", "--step", 2, "-o", tmp_path / "cli.pt", "--rank", 0)
    assert_same_tree(_load(tmp_path / "cli.pt")[".pt"], one[".pt"], "cli --rank 0")
