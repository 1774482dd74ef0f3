"""Issue 25.1: the training thread's fixed work per lean step, counted (a deterministic measure).

A small model's lean step (``every=None, stats_every=1``) costs what the recorder's hooks do
on the training thread, and on a millisecond step that is Python work, not bytes: every call
(a Python function, or a builtin: a torch op, a lock's ``acquire``) is interpreter time taken
from training. Wall timings on a shared machine are noise; calls are not. Here a profile
function counts the training thread's calls over the same steps of the same loop, without a
Recorder and with a lean one, and the difference per step must stay under a budget: no
per-tensor Python, nothing rebuilt that did not change (the layout's entries and plan, the
optimizer state on steps that do not read it). The steps are a multiple of
``lean.OPTIMIZER_EVERY`` so that steps reading the optimizer state count in their share.

Cases: the loop calling the model through ``forward`` or through its submodules (the forward
hooks never fire), SGD or Adam, gradient accumulation, and clipping.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import stepdump
from stepdump.capture import lean

# Calls (Python + builtin) the recorder may add per lean step on the training thread: 241-303
# after the lean path's third pass; the watch for params the loop changes between updates (two
# whole-set hashes a step, capture/outside.py, which every mode runs for re-execution) added ~35;
# 244-298 since the slots' free list is a SimpleQueue and an empty stage returns at once;
# 223-278 since a lean step that stages nothing takes no staging slot (270-301 before).
BUDGET = 290
STEPS = 2 * lean.OPTIMIZER_EVERY
WARM = lean.OPTIMIZER_EVERY + 2  # plans for both layouts (with and without the optimizer state) made


class _Net(nn.Module):
    """A PPO-sized MLP (actor and critic heads), callable through ``forward`` or ``encode``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.actor = nn.Linear(64, 4)
        self.critic = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encode(x)

    def encode(self, x: torch.Tensor) -> torch.Tensor:  # the submodules one by one: no hook of self fires
        h = self.body(x)
        return self.actor(h).logsumexp(-1).mean() + self.critic(h).pow(2).mean()


CASES: dict[str, dict[str, Any]] = {
    "adam, forward": {"opt": "adam"},
    "adam, through another entry point": {"opt": "adam", "entry": "encode"},
    "sgd momentum, forward": {"opt": "sgd"},
    "adam, accumulation 2 + clipping": {"opt": "adam", "accum": 2, "clip": True},
}


class _Deep(nn.Module):
    """``layers`` Linear(width, width) in a row: 2 x ``layers`` tensors of one kind, whatever their count."""

    def __init__(self, layers: int, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).pow(2).mean()


def _loop(case: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    model: nn.Module = _Deep(case["layers"], case.get("width", 8)) if "layers" in case else _Net()
    opt: torch.optim.Optimizer = (torch.optim.Adam(model.parameters(), lr=1e-3) if case["opt"] == "adam"
                                  else torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    x = torch.randn(32, case.get("width", 8), generator=torch.Generator().manual_seed(1))
    call = model.encode if case.get("entry") == "encode" else model

    def step() -> None:
        opt.zero_grad()
        for _ in range(case.get("accum", 1)):
            call(x).backward()
        if case.get("clip"):
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()

    return model, opt, step


# A thread's waits (an Event's or a Condition's): how many calls their timed loops make depends on
# how long the writer takes, not on the step's work (_calls(waits=False) leaves them out).
_WAITS = {threading.Event.wait.__code__, threading.Condition.wait.__code__, threading.Condition.wait_for.__code__}


def _calls(case: dict[str, Any], recorded: bool, path: Any, waits: bool = True, **schedule: Any) -> int:
    """Calls (Python + builtin) on this thread over STEPS steps of ``case``'s loop (recorded with
    ``schedule``; lean by default). ``waits`` False: not the calls made inside a thread wait."""
    model, opt, step = _loop(case)
    schedule = schedule or {"every": None, "stats_every": 1}
    rec = stepdump.Recorder(path, model, opt, on_error="raise", **schedule) if recorded else None
    counts: Counter[str] = Counter()
    me = threading.get_ident()
    inside: list[Any] = []  # the wait frames entered and not yet returned from

    def prof(frame: Any, event: str, arg: Any) -> None:
        if threading.get_ident() != me:
            return
        if not waits:
            if event == "call" and frame.f_code in _WAITS:
                inside.append(frame)
            elif event == "return" and inside and frame is inside[-1]:
                inside.pop()
                return
            if inside:
                return
        if event in ("call", "c_call"):
            counts[event] += 1

    try:
        for _ in range(WARM):
            step()
        sys.setprofile(prof)
        try:
            for _ in range(STEPS):
                step()
        finally:
            sys.setprofile(None)
    finally:
        if rec is not None:
            rec.close()
    return counts["call"] + counts["c_call"]


@pytest.mark.parametrize("case", list(CASES))
def test_a_lean_step_adds_few_calls_on_the_training_thread(tmp_path, case: str) -> None:
    plain = _calls(CASES[case], False, tmp_path / "plain")
    added = (_calls(CASES[case], True, tmp_path / "run") - plain) / STEPS
    assert added <= BUDGET, f"{case}: the recorder added {added:.0f} calls per lean step (budget {BUDGET})"


@pytest.mark.parametrize("schedule", [{"every": None, "stats_every": 1}, {"gradient_log": 4 * lean.OPTIMIZER_EVERY}],
                         ids=["lean", "gradient log"])
@pytest.mark.parametrize(("width", "counts"), [(8, (2, 32)), (256, (12, 36))],
                         ids=["small, read whole at the pre-hook", "over lean.INLINE_BYTES, read by the worker"])
def test_the_training_threads_work_per_step_does_not_grow_with_the_tensor_count(tmp_path, schedule, width,
                                                                                counts) -> None:
    """The recorder's added calls per step on the training thread for few and for many tensors of the
    same kind (Linear layers, Adam): no Python per tensor, so the same count but for a few calls. Both
    ways a lean step is read: a small record whole at the pre-hook (4 and 64 tensors of Linear(8, 8)),
    a larger one by the worker from the forward on, its rows checked at the pre-hook (24 and 72 of
    Linear(256, 256); it grew by about 40 calls a tensor before the rows were checked all at once)."""
    added = {}
    for layers in counts:
        case = {"opt": "adam", "layers": layers, "width": width}
        plain = _calls(case, False, tmp_path / f"plain{layers}", waits=False)
        added[layers] = (_calls(case, True, tmp_path / f"run{layers}", waits=False, **schedule) - plain) / STEPS
    few, many = counts
    # Less than a call per four tensors more (per-tensor work would be one call or more a tensor): the
    # time-driven calls left (a wake-up of the writer once a commit window, a timed wait's loop around
    # its wait) vary by a few a step with how long the writer takes.
    assert abs(added[many] - added[few]) <= max(8, (many - few) // 2), \
        f"added calls per step: {added} ({2 * few} vs {2 * many} tensors)"
