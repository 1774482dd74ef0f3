"""Runs written to and read from fsspec URLs: memory://, file:// and S3 (a local moto server)."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
import torch
import xxhash
from helpers import assert_same, record_run, tiny_model
from torch import nn

import stepdump
from stepdump.errors import (
    ConfigError,
    CorruptDataError,
    NotARunError,
    RunExistsError,
    WriterError,
)
from stepdump.store.fsspec_storage import FsspecStorage

STEPS = 6


def url(scheme: str = "memory://") -> str:
    return f"{scheme}stepdump-tests/{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same training run recorded into a local directory."""
    return record_run(tmp_path_factory.mktemp("ref") / "run", steps=STEPS)


def assert_same_run(run, ref_path: Path) -> None:
    """Every step, tensor, scalar and state of ``run`` equals the local reference, bit for bit."""
    with stepdump.open(ref_path) as ref:
        assert run.steps == ref.steps and run.all_steps == ref.all_steps
        for kind in ("params", "grads", "optimizer"):
            assert run.names(kind) == ref.names(kind)
            for step in ref.steps:
                got, want = run.tensors(step, kind), ref.tensors(step, kind)
                assert sorted(got) == sorted(want)
                for n in want:
                    assert_same(got[n], want[n], f"{kind} {n} step {step}")
        assert run.scalars().equals(ref.scalars())
        assert run.scheduler_state_dict(3) == ref.scheduler_state_dict(3)
        assert stepdump.diff(run, ref).identical


# -- memory:// ------------------------------------------------------------------------


def test_memory_url_round_trip(reference: Path, tmp_path: Path) -> None:
    where = url()
    record_run(where, steps=STEPS, remote=stepdump.options.Remote(upload_every=2))
    with stepdump.open(where, cache_dir=tmp_path / "cache") as run:
        assert isinstance(run, stepdump.types.RemoteRun) and run.url == where
        assert_same_run(run, reference)
        # Restore from the remote copy, then the next step reproduces the recorded one.
        model = tiny_model(5)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        run.restore(3, model, opt, sched)
        g = torch.Generator().manual_seed(3)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        for n, p in model.named_parameters():
            assert_same(p.detach(), run.tensor(n, 4), n)


def test_staging_is_removed_after_upload_unless_kept(tmp_path: Path) -> None:
    staging = tmp_path / "stage"
    record_run(url(), steps=2, remote=stepdump.options.Remote(staging=staging))
    assert not staging.exists()
    record_run(url(), steps=2, remote={"staging": str(staging), "keep_staging": True})
    with stepdump.open(staging) as local:  # the staging directory is an ordinary run
        assert local.steps == [0, 1, 2] and local.meta["final_step"] == 2  # 2: the final record


def test_published_steps_are_visible_while_recording(tmp_path: Path) -> None:
    where = url()
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen = []
    with stepdump.Recorder(where, model, opt, remote=stepdump.options.Remote(upload_every=2, upload_interval=None)) as rec:
        for step in range(7):
            opt.zero_grad()
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            rec.log(loss=float(step))
            if step == 3:
                deadline = time.monotonic() + 20
                run = None
                while time.monotonic() < deadline:
                    try:
                        run = stepdump.open(where, cache_dir=tmp_path / "live")
                        if len(run.steps) >= 2:
                            break
                        run.close()
                    except NotARunError:
                        pass
                    time.sleep(0.05)
                assert run is not None
                seen = run.steps
                # Every visible step is complete: its tensors read back, checksums and all.
                for s in seen:
                    assert set(run.tensors(s, "params")) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert 2 <= len(seen) <= 4 and seen == list(range(len(seen)))
    run.refresh()  # the final publish at close() holds every step, and the final record 7
    assert run.steps == list(range(8)) and run.meta["final_step"] == 7
    assert run.scalars()["loss"].dropna().tolist() == [float(s) for s in range(7)]
    run.close()


def test_url_arguments_are_checked(tmp_path: Path) -> None:
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    where = url()
    record_run(where, steps=1)
    with pytest.raises(RunExistsError, match="already holds"):
        stepdump.Recorder(where, model, opt)
    with pytest.raises(ConfigError, match="resume=True is not supported"):
        stepdump.Recorder(url(), model, opt, resume=True)
    with pytest.raises(ConfigError, match="applies to URLs"):
        stepdump.Recorder(tmp_path / "local", model, opt, remote=stepdump.options.Remote())
    with pytest.raises(ConfigError, match="apply to URLs"):
        stepdump.open(tmp_path, storage_options={})
    for bad in ({"upload_every": 0}, {"upload_interval": -1.0}, {"segment_bytes": 0}, {"storage_options": 3}):
        with pytest.raises(ConfigError):
            stepdump.options.Remote(**bad)
    with pytest.raises(ConfigError, match="remote="):
        stepdump.Recorder(url(), model, opt, remote={"bogus": 1})
    with pytest.raises(NotARunError, match="holds no stepdump run"):
        stepdump.open(url(), cache_dir=tmp_path / "c")


def test_failed_upload_raises_at_close_and_keeps_the_staging_run(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    def refuse(self, key, local):  # noqa: ANN001
        raise OSError("bucket is read-only")

    monkeypatch.setattr(FsspecStorage, "put_file", refuse)
    staging = tmp_path / "stage"
    with pytest.raises(WriterError, match="could not upload .*bucket is read-only.*staging directory"):
        record_run(url(), steps=3, remote=stepdump.options.Remote(staging=staging, upload_every=1), on_error="raise")
    with stepdump.open(staging) as local:  # complete, final record 3 included: only the upload failed
        assert local.steps == [0, 1, 2, 3] and local.meta["final_step"] == 3


def test_failed_upload_warns_by_default_and_the_training_script_goes_on(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path, caplog) -> None:
    def refuse(self, key, local):  # noqa: ANN001
        raise OSError("bucket is read-only")

    monkeypatch.setattr(FsspecStorage, "put_file", refuse)
    staging = tmp_path / "stage"
    with caplog.at_level("WARNING", logger="stepdump"):
        record_run(url(), steps=3, remote=stepdump.options.Remote(staging=staging, upload_every=1))  # close() does not raise
    assert any("could not upload" in r.getMessage() and str(staging) in r.getMessage() for r in caplog.records)
    with stepdump.open(staging) as local:
        assert local.steps == [0, 1, 2, 3] and local.meta["final_step"] == 3


def test_ranges_are_cached_and_checked(tmp_path: Path) -> None:
    where = url()
    record_run(where, steps=2)
    cache = tmp_path / "cache"
    with stepdump.open(where, cache_dir=cache) as run:
        w = run.tensor("0.weight", 1)
        assert list((cache / "ranges").rglob("segments/*/*-*"))  # the fetched range is kept (per run)
        storage = FsspecStorage(where)
        seg = [k for k in storage.fs.find(storage.root) if k.endswith(".seg")][0]
        data = bytearray(storage.fs.cat_file(seg))
        storage.fs.rm(seg)
        assert_same(run.tensor("0.weight", 1), w)  # served from the cache
        with pytest.raises(CorruptDataError, match="missing"):
            run.tensor("0.bias", 1)
        data[len(data) // 2] ^= 0xFF  # flip a byte somewhere in the middle of the segment
        storage.fs.pipe_file(seg, bytes(data))
    with stepdump.open(where, cache_dir=tmp_path / "fresh") as run:
        with pytest.raises(CorruptDataError, match="checksum"):
            for t in run.steps:  # 0, 1 and the final record 2: the flipped byte is in one of their blobs
                for kind in ("params", "grads", "optimizer"):
                    run.tensors(t, kind)
                run.rng_state(t)  # (the middle of the segment may be a step's RNG state)


def test_fsspec_storage_read_protocol(tmp_path: Path) -> None:
    """FsspecStorage is a ReadStorage: checked ranges of objects the uploader put whole."""
    storage = FsspecStorage(url(), cache_dir=tmp_path / "c")
    storage.put_bytes("segments/000001.seg", b"hello world")
    assert storage.read("segments/000001.seg", 6, 5) == b"world"
    assert storage.refetch("segments/000001.seg", 6, 5) is None  # no run tagged yet: nothing was cached
    with pytest.raises(CorruptDataError, match="short"):
        storage.read("segments/000001.seg", 8, 10)
    with pytest.raises(CorruptDataError, match="missing"):
        storage.read("segments/000002.seg", 0, 1)
    with pytest.raises(CorruptDataError, match="refusing storage key"):
        storage.read("../escape", 0, 1)
    storage.use_run("run-a")
    assert storage.read("segments/000001.seg", 0, 5) == b"hello"  # now kept in the range cache
    storage.fs.pipe_file(storage.path("segments/000001.seg"), b"HELLO world")
    assert storage.read("segments/000001.seg", 0, 5) == b"hello"  # the cached range
    assert storage.refetch("segments/000001.seg", 0, 5) == b"HELLO"  # the object itself
    storage.close()


# -- file:// ---------------------------------------------------------------------------


def test_file_url(reference: Path, tmp_path: Path) -> None:
    where = (tmp_path / "published").as_uri()
    record_run(where, steps=STEPS, remote=stepdump.options.Remote(upload_every=3))
    with stepdump.open(where, cache_dir=tmp_path / "cache") as run:
        assert_same_run(run, reference)
    assert not list((tmp_path / "published").rglob("*.part-*"))  # atomic replaces left no temporaries


# -- S3, served by moto on 127.0.0.1 -------------------------------------------------------


@pytest.fixture(scope="module")
def s3() -> dict:
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        options = {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing"}
        import s3fs

        s3fs.S3FileSystem(**options).mkdir("stepdump-bucket")
        yield options
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_s3_round_trip(s3: dict, reference: Path, tmp_path: Path) -> None:
    where = f"s3://stepdump-bucket/runs/{uuid.uuid4().hex}"
    record_run(where, steps=STEPS, remote=stepdump.options.Remote(storage_options=s3, upload_every=2, segment_bytes=4096))
    storage = FsspecStorage(where, s3)
    keys = sorted(k.rsplit("/", 2)[-2] + "/" + k.rsplit("/", 1)[-1] if "/segments/" in k else k.rsplit("/", 1)[-1]
                  for k in storage.fs.find(storage.root))
    assert keys[0] == "catalog.sqlite" and len(keys) > 3  # small segments: several objects
    assert keys[-1] == "stats.parquet" and all(k.startswith("segments/") for k in keys[1:-1])
    with stepdump.open(where, storage_options=s3, cache_dir=tmp_path / "cache") as run:
        assert_same_run(run, reference)
        assert run.meta["url"] == where
        # close() wrote stats.parquet before the last publish: the published catalog describes it
        published = storage.get_bytes("stats.parquet")
        assert published is not None and len(published) == run.meta["stats_parquet"]["bytes"]
        assert xxhash.xxh3_64_hexdigest(published) == run.meta["stats_parquet"]["xxh3"]
