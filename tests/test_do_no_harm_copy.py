"""Do no harm, copies (issue 22, item 1): a live Recorder never breaks a copy of what it watches.

``copy.deepcopy(model)`` (EMA), ``torch.save(model)`` (a whole-model pickle),
``copy.deepcopy(optimizer)`` and pickles of them are everyday lines. The row of cases:
every way of copying {deepcopy / pickle / torch.save of the model, of the optimizer, of
model+optimizer(+scaler) together, the optimizer's state_dict, an EMA kept by deepcopy and
lerp} x every recording mode {full, stats only, tiered, ring, gradient log, keyframes,
activations + activation grads, inputs (log_batch), GradScaler}. Each case trains three times:

1. recorded, copying mid-iteration (after backward, before the step; the EMA after the step,
   before ``rec.log``), and training the copy one step (forward with grad, backward, step);
2. the same without a Recorder;
3. recorded, without any copy.

It checks that the copy works (no exception), that the copy trained bitwise like the copy
made without a Recorder, that the original trained bitwise like the unrecorded run, that
the copy recorded nothing (the run of 1 holds exactly what the run of 3 holds: steps,
fingerprints of every record, stats, scalars), that a deep copy of a module drops the inert
hooks it carried at its first forward, and that a pickle names nothing of stepdump (it loads
without stepdump; the Recorder's hooks are no-ops ``().__init__`` in it).
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_same, assert_same_tree, gen, tiny_batch, tiny_model
from torch import nn

import stepdump

STEPS = 6
BASE = ("params", "grads", "optimizer")


def _fire_at_3(info: Any) -> bool:
    """A ring trigger that fires once, so the ring writes what it held."""
    return bool(info.step == 3)


MODES: dict[str, dict[str, Any]] = {
    "full": {},
    "stats_only": {"every": None, "stats_every": 1},
    "tiered": {"every": 5, "stats_every": 1},
    "ring": {"ring": 4, "trigger": _fire_at_3},
    "gradient_log": {"gradient_log": 3},
    "keyframes": {"keyframe_every": 3},
    "activations": {"capture": (*BASE, "activations", "activation_grads")},
    "inputs": {"capture": (*BASE, "inputs")},
    "scaler": {},
}


def _roundtrip_pickle(obj: Any) -> Any:
    data = pickle.dumps(obj)
    assert b"stepdump" not in data, "a pickle made while recording needs stepdump to load"
    return pickle.loads(data)


def _roundtrip_torch_save(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    assert b"stepdump" not in buf.getvalue(), "a torch.save made while recording needs stepdump to load"
    buf.seek(0)
    return torch.load(buf, weights_only=False)


_NO_OP = ().__init__  # what a pickle holds where the Recorder's hooks were (does nothing)


def _leftover_hooks(m: nn.Module) -> list[Any]:
    return [h for mod in m.modules() for d in (mod._forward_pre_hooks, mod._forward_hooks) for h in d.values()]


def _train_model_copy(m2: nn.Module, t: int, opt2: torch.optim.Optimizer | None = None,
                      scaler2: Any = None, pickled: bool = False) -> list[torch.Tensor]:
    """One training step of a copied model (a forward with grad, so the hooks it carries run)."""
    m2.train()
    if opt2 is None:
        opt2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    x, y = tiny_batch(100 + t)
    opt2.zero_grad()
    loss = nn.functional.mse_loss(m2(x), y)
    if scaler2 is not None:
        scaler2.scale(loss).backward()
        scaler2.step(opt2)
        scaler2.update()
    else:
        loss.backward()
        opt2.step()
    left = _leftover_hooks(m2)  # a deep copy drops its inert hooks at its first forward
    assert all(h == _NO_OP for h in left) if pickled else not left, f"the copy kept hooks: {left}"
    return [loss.detach(), *(p.detach().clone() for p in m2.parameters())]


def _step_optimizer_copy(o2: torch.optim.Optimizer, t: int) -> list[torch.Tensor]:
    """Step a copied optimizer on grads of its own (its params are copies, in no model)."""
    params = [p for g in o2.param_groups for p in g["params"]]
    g = gen(t, salt=7)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    o2.step()
    o2.step()
    return [p.detach().clone() for p in params] + [
        v.clone() for s in o2.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _model_copy(roundtrip: Callable[[Any], Any]) -> Callable[..., list[torch.Tensor]]:
    pickled = roundtrip is not copy.deepcopy
    return lambda t, model, opt, scaler: _train_model_copy(roundtrip(model), t, pickled=pickled)


def _optimizer_copy(roundtrip: Callable[[Any], Any]) -> Callable[..., list[torch.Tensor]]:
    return lambda t, model, opt, scaler: _step_optimizer_copy(roundtrip(opt), t)


def _training_copy(roundtrip: Callable[[Any], Any]) -> Callable[..., list[torch.Tensor]]:
    def run(t: int, model: nn.Module, opt: torch.optim.Optimizer, scaler: Any) -> list[torch.Tensor]:
        m2, o2, s2 = roundtrip((model, opt, scaler))  # one copy: o2 updates m2's params
        if s2 is not None:  # the Recorder's scaler.step wrapper became the copy's own step
            assert s2.step.__self__ is s2 and s2.step.__func__ is type(s2).step
        return _train_model_copy(m2, t, o2, s2, pickled=roundtrip is not copy.deepcopy)
    return run


def _state_dict_copy(t: int, model: nn.Module, opt: torch.optim.Optimizer, scaler: Any) -> list[torch.Tensor]:
    sd = _roundtrip_torch_save(_roundtrip_pickle(opt.state_dict()))
    fresh = tiny_model(seed=1)
    o2 = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    if opt.state:
        o2.load_state_dict(sd)
    return _step_optimizer_copy(o2, t)


COPIES: dict[str, Callable[..., list[torch.Tensor]]] = {
    "deepcopy_model": _model_copy(copy.deepcopy),
    "pickle_model": _model_copy(_roundtrip_pickle),
    "torch_save_model": _model_copy(_roundtrip_torch_save),
    "deepcopy_optimizer": _optimizer_copy(copy.deepcopy),
    "pickle_optimizer": _optimizer_copy(_roundtrip_pickle),
    "deepcopy_training": _training_copy(copy.deepcopy),
    "pickle_training": _training_copy(_roundtrip_pickle),
    "optimizer_state_dict": _state_dict_copy,
}


class _Ema:
    """An EMA of the model kept the common way: a deepcopy every 3 steps, lerp in between,
    evaluated with grad enabled (people forget no_grad), between the step and ``rec.log``."""

    def __init__(self) -> None:
        self.ema: nn.Module | None = None

    def __call__(self, t: int, model: nn.Module, opt: Any, scaler: Any) -> list[torch.Tensor]:
        if self.ema is None or t % 3 == 0:
            self.ema = copy.deepcopy(model)
        else:
            with torch.no_grad():
                for e, p in zip(self.ema.parameters(), model.parameters()):
                    e.lerp_(p, 0.1)
        out = self.ema(tiny_batch(200 + t)[0])
        return [out.detach(), *(p.detach().clone() for p in self.ema.parameters())]


def _train(path: Any, mode: str, copier: Callable[..., list[torch.Tensor]] | None, *,
           ema: bool = False) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Train STEPS iterations (recorded into ``path`` unless it is None), calling ``copier`` in
    each; return the original's final params and optimizer tensors, and what each copy gave."""
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4) if mode == "scaler" else None
    rec = stepdump.Recorder(path, model, opt, scaler=scaler, on_error="raise", **MODES[mode]) \
        if path is not None else None
    outs: list[list[torch.Tensor]] = []
    try:
        for t in range(STEPS):
            x, y = tiny_batch(t)
            if rec is not None and mode == "inputs":
                rec.log_batch((x, y))
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if copier is not None and not ema:
                outs.append(copier(t, model, opt, scaler))
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            if copier is not None and ema:
                outs.append(copier(t, model, opt, scaler))
            if rec is not None:
                rec.log(loss=loss)
    finally:
        if rec is not None:
            rec.close()
    final = [p.detach().clone() for p in model.parameters()] + [
        v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return final, outs


def _content(path: Any) -> dict[str, Any]:
    """Everything a run holds, as comparable values."""
    with stepdump.open(path) as run:
        assert "recording_stopped" not in run.meta
        return {
            "steps": run.steps, "stats_steps": run.stats_steps, "skipped": run.skipped_steps,
            "fingerprints": {s: run.fingerprints(s) for s in run.all_steps},
            "scalars": [r for r in run.scalar_rows() if not r[1].startswith("sys/")],  # sys/: timings
            "stats": run.stats().to_dict("list"),
        }


_REFERENCE: dict[tuple[str, str], Any] = {}


def _reference(tmp_path_factory: Any, mode: str, what: str, copier: Callable[..., Any] | None = None,
               ema: bool = False) -> Any:
    """A run without copies (per mode), or an unrecorded run with copies (per copy): computed once."""
    key = (mode, what)
    if key not in _REFERENCE:
        if copier is None:
            path = tmp_path_factory.mktemp("ref") / "run"
            final, _ = _train(path, mode, None)
            _REFERENCE[key] = (final, _content(path))
        else:
            _REFERENCE[key] = _train(None, mode, copier, ema=ema)
    return _REFERENCE[key]


def _assert_no_harm(tmp_path: Any, tmp_path_factory: Any, mode: str, what: str,
                    make: Callable[[], Callable[..., list[torch.Tensor]]], ema: bool = False) -> None:
    final, outs = _train(tmp_path / "run", mode, make(), ema=ema)
    plain_final, plain_outs = _reference(tmp_path_factory, "scaler" if mode == "scaler" else "plain", what,
                                         make(), ema)
    ref_final, ref_content = _reference(tmp_path_factory, mode, "no copy")
    assert_same_tree(outs, plain_outs, "the copy trained differently than a copy made without a Recorder")
    for i, (a, b) in enumerate(zip(final, plain_final)):
        assert_same(a, b, f"original training, tensor {i}, vs unrecorded")
    for i, (a, b) in enumerate(zip(final, ref_final)):
        assert_same(a, b, f"original training, tensor {i}, vs recorded without copies")
    assert _content(tmp_path / "run") == ref_content, "the copy recorded into the run or changed it"


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("what", list(COPIES))
def test_copies_work_record_nothing_and_change_nothing(tmp_path, tmp_path_factory, mode, what):
    _assert_no_harm(tmp_path, tmp_path_factory, mode, what, lambda: COPIES[what])


@pytest.mark.parametrize("mode", list(MODES))
def test_ema_by_deepcopy_under_the_recorder(tmp_path, tmp_path_factory, mode):
    _assert_no_harm(tmp_path, tmp_path_factory, mode, "ema", _Ema, ema=True)
