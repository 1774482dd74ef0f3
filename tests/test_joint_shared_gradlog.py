"""A joint run whose pairs share one module, recorded as a gradient log (SAC's shared trunk).

The trunk and the actor head are in the actor's optimizer, the critic head in the critic's; both
pairs record the whole network. Each pair's record of the params *another* pair's optimizer
updates changes between its own updates, by that other update: not an edit "outside the
optimizer". The joint recorder knows which optimizer updates which param, so no warning is given
and those params are not stored in full at every step; every read of every step is still bitwise
the live value at that pair's record (taken from the pair that updates them).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import stepdump
from stepdump.errors import RebuildError

N, B = 10, 6


class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.actor = nn.Linear(8, 3)
        self.critic = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.actor(h), self.critic(h)


OBS = torch.linspace(-1, 1, N * B * 4).view(N, B, 4).cos()


def _objects():
    torch.manual_seed(0)
    m = ActorCritic()
    return (m, torch.optim.Adam([*m.trunk.parameters(), *m.actor.parameters()], lr=1e-2),
            torch.optim.SGD(m.critic.parameters(), lr=1e-2, momentum=0.9))


def _iteration(i: int, m: ActorCritic, opt_a, opt_c, seen: dict | None = None) -> None:
    logits, _ = m(OBS[i])
    opt_a.zero_grad()
    (-logits.log_softmax(-1)[:, 0].mean()).backward()
    if seen is not None:
        seen.setdefault("actor", []).append({n: p.detach().clone() for n, p in m.named_parameters()})
    opt_a.step()
    _, value = m(OBS[i])  # the critic's pass sees the trunk after the actor's update
    opt_c.zero_grad()
    (value.squeeze(1) - OBS[i][:, 0]).pow(2).mean().backward()
    if seen is not None:
        seen.setdefault("critic", []).append({n: p.detach().clone() for n, p in m.named_parameters()})
    opt_c.step()


def test_shared_module_in_a_gradient_log_is_rebuilt_exactly_without_outside_warnings(tmp_path, caplog):
    ref, ra, rc = _objects()
    for i in range(N):
        _iteration(i, ref, ra, rc)
    m, opt_a, opt_c = _objects()
    seen: dict[str, list[dict[str, torch.Tensor]]] = {}
    with caplog.at_level(logging.WARNING, logger="stepdump"):
        with stepdump.Recorder(tmp_path / "j", models={"actor": m, "critic": m},
                               optimizers={"actor": opt_a, "critic": opt_c}, gradient_log=32):
            for i in range(N):
                _iteration(i, m, opt_a, opt_c, seen)
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n  # training untouched
    outside = [r.getMessage() for r in caplog.records if "outside the optimizer" in r.getMessage()]
    assert outside == []
    run = stepdump.open(tmp_path / "j")
    for pair in ("actor", "critic"):
        store = run.pair(pair)
        # Between keyframes (step 0 and the final record) no param is stored in full.
        assert [s for s in range(1, N) if store.catalog.stored_names(s, "params")] == []
        for step in range(N):
            for n, want in seen[pair][step].items():
                got = run.tensor(f"{pair}/{n}", step)
                assert torch.equal(got, want), (pair, step, n)
            sd = store.state_dict(step)  # the pair's whole model, between keyframes
            assert all(torch.equal(sd[n], want) for n, want in seen[pair][step].items()), (pair, step)
    # Restore a step between keyframes and train on: bitwise the recorded training.
    m1, a1, c1 = _objects()
    torch.manual_seed(123)  # restore sets what the run recorded
    run.restore(5, models={"actor": m1, "critic": m1}, optimizers={"actor": a1, "critic": c1})
    for i in range(5, N):
        _iteration(i, m1, a1, c1)
    for (n, p), q in zip(m1.named_parameters(), m.parameters()):
        assert torch.equal(p, q), n
    # A pair's store opened alone cannot take those params from the other pair: refused, saying where.
    alone = stepdump.open(tmp_path / "j" / "critic")
    with pytest.raises(RebuildError, match="joint run"):
        alone.tensor("trunk.0.weight", 4)
    assert torch.equal(alone.tensor("critic.weight", 4), seen["critic"][4]["critic.weight"])  # its own: rebuilt
