"""Activation capture in a loop whose forwards run under ``torch.func`` (MAML: ``grad`` and ``vmap``).

The module hooks see functorch's wrapped tensors (BatchedTensor, GradTrackingTensor) there; those
have no storage of their own to copy. What a plain forward shows is captured, the wrapped ones are
skipped with one warning, and params, grads and optimizer state are recorded at every step.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import stepdump


def _maml_loop(rec_dir, steps: int = 4, record: bool = True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    tasks = [(torch.randn(4, 5, 3, generator=g), torch.randn(4, 5, 1, generator=g)) for _ in range(steps)]

    def inner_loss(params, x, y):
        return ((functional_call(model, params, (x,)) - y) ** 2).mean()

    def adapted_loss(x, y):
        params = dict(model.named_parameters())
        grads = grad(inner_loss)(params, x, y)
        fast = {n: p - 0.1 * grads[n] for n, p in params.items()}
        return inner_loss(fast, x, y)

    kinds = ("params", "grads", "optimizer", "activations", "activation_grads", "inputs")
    rec = stepdump.Recorder(rec_dir, model, opt, capture=kinds, modules="*") if record else None
    try:
        for x, y in tasks:
            opt.zero_grad()
            meta_loss = vmap(adapted_loss)(x, y).mean()
            meta_loss = meta_loss + 0.0 * model(x[0]).sum()  # a plain forward: its activations are captured
            meta_loss.backward()
            opt.step()
    finally:
        if rec is not None:
            rec.close()
    return model, opt


def test_maml_records_every_step_and_skips_wrapped_activations_with_one_warning(tmp_path, caplog):
    ref_model, _ = _maml_loop(None, record=False)
    with caplog.at_level(logging.WARNING, logger="stepdump"):
        model, opt = _maml_loop(tmp_path / "r")
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)  # training untouched
    run = stepdump.open(tmp_path / "r")
    assert run.steps == [0, 1, 2, 3, 4]  # every step and the final record: nothing stepped aside
    assert set(run.names("grads")) == {
        "0.weight", "0.bias", "2.weight", "2.bias"}
    assert "0" in run.names("activations")  # the plain forward's output
    assert all("#" not in n for n in run.names("activations"))  # the wrapped forwards left nothing
    assert run.names("inputs") == ["args/0"]  # the plain forward's input, the wrapped ones skipped
    assert "0" in run.names("activation_grads")  # the plain forward's output grad
    final = run.state_dict(4)
    for k, v in model.state_dict().items():
        assert torch.equal(final[k], v)
    assert run.optimizer_state_dict(3)["state"][0]["exp_avg"].shape == (8, 3)
    wrapped = [r for r in caplog.records if "torch.func" in r.getMessage()]
    assert len(wrapped) == 1, [r.getMessage() for r in caplog.records]
