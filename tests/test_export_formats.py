"""The torch and safetensors export formats load back bit for bit (the final record, which has
no grads, included), and ``stepdump export`` writes every format, in a subprocess into a pipe."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_same, assert_same_tree, record_run, tiny_model
from safetensors.torch import load_file

import stepdump

STEPS = 6


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A 6-step run and the trained model's final state_dict."""
    model = tiny_model(0)
    path = record_run(tmp_path_factory.mktemp("fmt") / "run", steps=STEPS, model=model)
    return path, {k: v.clone() for k, v in model.state_dict().items()}


def test_torch_format_loads_back_bitwise(recorded: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    path, _ = recorded
    with stepdump.open(path) as run:
        for step in (0, 3):
            ckpt = torch.load(run.export(step, tmp_path / f"{step}.pt"), weights_only=True)
            assert ckpt["step"] == step
            assert_same_tree(ckpt["model"], run.state_dict(step), f"model @ {step}")
            assert_same_tree(ckpt["optimizer"], run.optimizer_state_dict(step), f"optimizer @ {step}")
            assert ckpt["scheduler"] == run.scheduler_state_dict(step)
            model = tiny_model(99)
            opt = torch.optim.Adam(model.parameters(), lr=1.0)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            for name, p in model.named_parameters():
                assert_same(p.detach(), run.tensor(name, step), name)


def test_the_last_record_exports_without_grads(recorded: tuple[Path, dict[str, torch.Tensor]],
                                               tmp_path: Path) -> None:
    """The last record is the trained model: whatever its kind (the final record after the
    last update has no grads), torch and safetensors exports of it are the trained weights."""
    path, final = recorded
    with stepdump.open(path) as run:
        last = run.all_steps[-1]
        ckpt = torch.load(run.export(last, tmp_path / "last.pt"), weights_only=True)
        tensors = load_file(run.export(last, tmp_path / "last.safetensors", format="safetensors"))
        if last == STEPS:  # a final record: the state after update STEPS-1
            for name, v in final.items():
                assert_same(ckpt["model"][name], v, name)
                assert_same(tensors[name], v, name)
            with pytest.raises(stepdump.TensorNotFoundError, match="no gradients"):
                run.export(last, tmp_path / "g.safetensors", format="safetensors", grads=True)
            assert not (tmp_path / "g.safetensors").exists()
        assert set(tensors) == set(run.names("params"))


def test_safetensors_format_loads_back_bitwise(recorded: tuple[Path, dict[str, torch.Tensor]],
                                               tmp_path: Path) -> None:
    path, _ = recorded
    with stepdump.open(path) as run:
        tensors = load_file(run.export(2, tmp_path / "s.safetensors", format="safetensors", grads=True))
        params, grads = run.tensors(2, "params"), run.tensors(2, "grads")
        assert set(tensors) == set(params) | {f"grads/{n}" for n in grads}
        for n, t in params.items():
            assert_same(tensors[n], t, n)
        for n, t in grads.items():
            assert_same(tensors[f"grads/{n}"], t, f"grads/{n}")


def test_wrong_options_say_what_to_do(recorded: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    from stepdump.export import CHECKPOINT_FORMATS, export_checkpoint

    assert CHECKPOINT_FORMATS == ("torch", "safetensors", "hf-trainer", "lightning")
    path, _ = recorded
    with stepdump.open(path) as run:
        with pytest.raises(stepdump.ConfigError, match="choose one of"):
            run.export(1, tmp_path / "x", format="onnx")
        with pytest.raises(stepdump.ConfigError, match="holds no gradients"):
            run.export(1, tmp_path / "x", format="lightning", grads=True)
        with pytest.raises(stepdump.ConfigError, match="trainer= is for"):
            export_checkpoint(run, 1, tmp_path / "x.pt", trainer={"train_batch_size": 2})
    assert list(tmp_path.iterdir()) == []


def test_cli_exports_every_format(recorded: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, cli,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``stepdump export``: with no -o the file is named after the step in the current folder;
    the hf-trainer journey runs the installed script in a subprocess, its output into a pipe."""
    path, _ = recorded
    monkeypatch.chdir(tmp_path)
    exe = Path(sys.executable).with_name("stepdump")
    command = f"'{exe}' export '{path}' --step 2 --format hf-trainer --trainer train_batch_size=4"
    proc = subprocess.run(["bash", "-c", f"set -o pipefail; {command} | cat"], capture_output=True, text=True,
                          check=False, timeout=120, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "wrote checkpoint-2", proc.stdout
    assert cli("export", path, "--step", "2").stdout.strip() == "wrote step-2.pt"
    cli("export", path, "--step", "2", "--format", "safetensors", "--grads")
    cli("export", path, "--step", "2", "--format", "lightning", "--trainer", "num_training_batches=4",
        "--trainer", "accumulate_grad_batches=1")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["checkpoint-2", "step-2.pt", "step-2.safetensors", "step=2.ckpt"]
    with stepdump.open(path) as run:
        sd = run.state_dict(2)
        for name, t in load_file(tmp_path / "checkpoint-2" / "model.safetensors").items():
            assert_same(t, sd[name], name)
        state = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
        assert state["global_step"] == 2 and state["train_batch_size"] == 4
        assert "grads/0.weight" in load_file(tmp_path / "step-2.safetensors")
        ckpt = torch.load(tmp_path / "step=2.ckpt", weights_only=True)
        assert_same_tree(ckpt["state_dict"], sd, "lightning state_dict")
        assert ckpt["global_step"] == 2 and ckpt["epoch"] == 0

    bad = cli("export", path, "--step", "2", "--format", "hf-trainer", "-o", tmp_path / "h", ok=None)
    assert bad.code != 0 and "train_batch_size" in bad.stderr
    assert cli("export", path, "--step", "2", "--format", "lightning", "--trainer", "oops", ok=None).code != 0
