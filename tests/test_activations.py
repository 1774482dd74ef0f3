"""Activations, activation grads, inputs and the recorder's profiling (issue 5)."""

from __future__ import annotations

import gc
import logging
import weakref

import torch
from reliability.load import activation_load
from torch import nn

import stepdump

KINDS = ("params", "grads", "activations", "activation_grads", "inputs")


class SimpleMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(784, 128)
        self.relu = nn.ReLU(inplace=True)  # modifies fc1's output after its hook ran
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x)))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 784, generator=g), torch.randint(0, 10, (8,), generator=g)


def test_fc1_outputs_and_grads_equal_hand_registered_hooks(tmp_path):
    torch.manual_seed(0)
    model = SimpleMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen_out: list[torch.Tensor] = []
    seen_grad: list[torch.Tensor] = []

    def hand_hook(mod, args, out):
        seen_out.append(out.detach().clone())
        if out.requires_grad:
            out.register_hook(lambda g: seen_grad.append(g.detach().clone()))

    model.fc1.register_forward_hook(hand_hook)
    with stepdump.Recorder(tmp_path / "r", model, opt, capture=KINDS, modules="fc*"):
        for step in range(5):
            x, y = data(step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            with torch.no_grad():  # an evaluation pass: not part of the step record
                model(x)
    run = stepdump.open(tmp_path / "r")
    assert run.names("activations") == ["fc1", "fc2"]
    train_outs = seen_out[0::2]  # every other forward was the no_grad one
    for step in range(5):
        rec_out = run.tensor("fc1", step, kind="activations")
        assert torch.equal(rec_out, train_outs[step])
        assert (rec_out < 0).any(), "values as at the hook, before the in-place ReLU"
        assert torch.equal(run.tensor("fc1", step, kind="activation_grads"), seen_grad[step])
        assert torch.equal(run.tensor("args/0", step, kind="inputs"), data(step)[0])
    assert len(seen_grad) == 5


class DictHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, h: torch.Tensor) -> dict[str, object]:
        out = self.lin(h)
        return {"logits": out, "pair": (out.sum(1), h.detach())}


class TwiceAndDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.head = DictHead()

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        return self.head(self.shared(torch.tanh(self.shared(x))))


def test_module_used_twice_dict_outputs_and_log_batch(tmp_path):
    torch.manual_seed(0)
    model = TwiceAndDict()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    calls: list[torch.Tensor] = []
    model.shared.register_forward_hook(lambda m, a, o: calls.append(o.detach().clone()))
    with stepdump.Recorder(tmp_path / "r", model, opt, capture=KINDS) as rec:
        for step in range(3):
            x = torch.randn(3, 4)
            target = torch.randn(3, 2)
            rec.log_batch({"x": x, "target": target})
            opt.zero_grad()
            out = model(x)
            (out["logits"] - target).pow(2).mean().backward()
            opt.step()
    run = stepdump.open(tmp_path / "r")
    acts = set(run.names("activations"))
    assert {"shared", "shared#1", "head/logits", "head/pair/0", "head/pair/1", "head.lin"} <= acts
    for step in range(3):
        assert torch.equal(run.tensor("shared", step, "activations"), calls[2 * step])
        assert torch.equal(run.tensor("shared#1", step, "activations"), calls[2 * step + 1])
    logits = run.tensor("head/logits", 2, "activations")
    assert torch.equal(logits, run.tensor("head.lin", 2, "activations"))
    assert torch.equal(run.tensor("head/pair/0", 2, "activations"), logits.sum(1))
    assert torch.equal(run.tensor("batch/target", 2, kind="inputs"), target)
    assert {"batch/x", "batch/target", "args/0"} <= set(run.names("inputs"))
    # grads only where they flow: logits and pair/0 get one, the detached pair/1 does not
    grads = set(run.names("activation_grads"))
    assert "head/logits" in grads and "head/pair/1" not in grads


def test_nan_in_module_output_is_found_by_check_at_that_module(tmp_path):
    torch.manual_seed(0)
    model = SimpleMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    k = 3

    def plant(mod, args, out):
        if plant.step == k:
            out = out.clone()
            out[0, 0] = float("nan")
            return out
        return None

    plant.step = 0
    model.fc2.register_forward_hook(plant)
    with stepdump.Recorder(tmp_path / "r", model, opt, capture=KINDS):
        for step in range(6):
            plant.step = step
            x, y = data(step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    run = stepdump.open(tmp_path / "r")
    # our hook runs after the planting hook only if registered later: the recorder's came first
    stats = run.stats(kind="activation_grads", steps=k)
    assert (stats["nan"] > 0).any()
    findings = [f for f in stepdump.check(run) if f.rule == "nan_inf"]
    assert findings and findings[0].step == k
    assert findings[0].kind in ("activations", "activation_grads")


def test_hooks_removed_and_nothing_leaks(tmp_path):
    model = SimpleMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rec = stepdump.Recorder(tmp_path / "r", model, opt, capture=KINDS)
    assert model.fc1._forward_hooks
    rec.close()
    assert not model.fc1._forward_hooks and not model._forward_pre_hooks
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    ref = weakref.ref(rec)
    del rec
    gc.collect()
    assert ref() is None


def test_memory_bounded_over_steps(tmp_path):
    """A 500-step twin of `make soak`'s 5,000-step activation run (tests/reliability/soak.py):
    memory from step 250 (the caches warmed up) to the last grows < 40 MB, and every step's stats
    are there. (From step 50 the warm-up alone was 30-45 MB: the bound failed on a loaded machine.)"""
    rss = activation_load(tmp_path / "r", 500)
    assert rss[499] - rss[250] < 40, rss



def test_no_profiler_ranges_are_opened_while_no_profiler_is_on(tmp_path, monkeypatch):
    """A torch profiler range costs a dispatcher call each way, at every module forward the
    activations hook sees and every iteration start: opened only while a profiler records."""
    opened = []
    real = torch.profiler.record_function

    def counting(*a, **k):
        opened.append(a)
        return real(*a, **k)

    monkeypatch.setattr(torch.profiler, "record_function", counting)
    model = SimpleMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with stepdump.Recorder(tmp_path / "r", model, opt, capture=KINDS):  # every step full: begin taken too
        for step in range(3):
            x, y = data(step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert stepdump.open(tmp_path / "r").activations(0)  # the activations were recorded
    assert opened == []

def test_profiler_sees_recorder_ranges_and_sys_scalars(tmp_path):
    model = SimpleMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with stepdump.Recorder(tmp_path / "r", model, opt, capture=KINDS):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for step in range(3):
                x, y = data(step)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
    names = {e.name for e in prof.events()}
    assert {"stepdump.capture", "stepdump.activations", "stepdump.begin"} <= names
    prof_df = stepdump.open(tmp_path / "r").profile()
    # A row per step; the final record (3, written by close(), not an iteration) has no profile.
    assert list(prof_df.index) == [0, 1, 2, 3]
    assert prof_df.loc[3, ["sys/iter_ms", "sys/recorder_ms", "sys/peak_mem_mb"]].isna().all()
    prof_df = prof_df.loc[[0, 1, 2]]
    # what the recorder cost an iteration is part of it (its threads' CPU on another core is capped there)
    assert (prof_df["sys/iter_ms"] >= prof_df["sys/recorder_ms"]).all()
    assert (prof_df["sys/recorder_ms"] > 0).all() and (prof_df["sys/peak_mem_mb"] > 10).all()
    assert "sys/iter_ms" not in stepdump.open(tmp_path / "r").scalars().columns


def test_compiled_model_records_params_grads_and_activations(tmp_path):
    def record(path, compile_it):
        torch.manual_seed(0)
        model = SimpleMLP()
        target = torch.compile(model, backend="eager") if compile_it else model
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        clones = []
        with stepdump.Recorder(path, target, opt, capture=KINDS):
            for step in range(3):
                x, y = data(step)
                opt.zero_grad()
                nn.functional.cross_entropy(target(x), y).backward()
                clones.append(model.fc1.weight.grad.clone())
                opt.step()
        return model, clones

    model, clones = record(tmp_path / "r", compile_it=True)
    record(tmp_path / "plain", compile_it=False)
    run, plain = stepdump.open(tmp_path / "r"), stepdump.open(tmp_path / "plain")
    # Exactly the plain model's names, for every kind (no "_orig_mod." prefix anywhere).
    assert run.names("params") == [n for n, _ in model.named_parameters()]
    for kind in KINDS:
        assert run.names(kind) == plain.names(kind), kind
    assert run.names("activations") == ["fc1", "relu", "fc2"]
    for step in range(3):
        assert torch.equal(run.tensor("fc1.weight", step, kind="grads"), clones[step])
    # A record of the compiled model restores into the plain model, and into a compiled one.
    for target in (SimpleMLP(), torch.compile(SimpleMLP(), backend="eager")):
        run.restore(1, target, rng=False)
        plain = getattr(target, "_orig_mod", target)
        assert torch.equal(plain.fc1.weight, run.tensor("fc1.weight", 1))


def test_scripted_module_records_the_rest_and_says_why(tmp_path, caplog):
    model = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="stepdump"):
        with stepdump.Recorder(tmp_path / "r", model, opt, capture=KINDS):
            for _ in range(2):
                opt.zero_grad()
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
    assert "TorchScript" in caplog.text
    run = stepdump.open(tmp_path / "r")
    assert run.steps == [0, 1, 2] and run.meta["final_step"] == 2 and run.names("activations") == []
    assert run.names("grads") == ["0.weight", "0.bias", "2.weight", "2.bias"]
