"""A gradient log's step state JSON made with a memo of the last step's (tjson.Memo): the same text
and the same state tensors, in the same order, as encoding it afresh; only cheaper.

The memo keeps the text of the state's plain parts (param groups: names, hyperparameters) and
takes it again while a part is the same by value and exact type. These tests hold it to the
uncached path over states that change the ways training changes them (a scheduler's lr at every
step, a param group added, the scaler's and scheduler's state, a non-tensor optimizer extra) and
the ways that compare equal in Python yet encode apart (1, 1.0 and True; 0.0 and -0.0; a list
and a tuple), and through a Recorder: every step's stored state says what that step had.
"""

from __future__ import annotations

import copy

import torch
from helpers import python_calls
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import stepdump
from stepdump.capture.step_state import Entry, full_state, state_json
from stepdump.core import tjson
from stepdump.core.layout import build_layout


def _both(state: dict, memo: tjson.Memo, begin: dict | None = None, extra: dict | None = None
          ) -> tuple[str, list[Entry], str, list[Entry]]:
    """(text, entries) of ``state`` through the memo and afresh (each on a copy: state_json adds keys)."""
    got: list[Entry] = []
    want: list[Entry] = []
    text = state_json(dict(state), begin, None, got, extra, memo=memo)
    plain = state_json(dict(state), begin, None, want, extra)
    return text, got, plain, want


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same tensor, or views of the same memory alike (a sparse tensor's ``_indices()`` is a new view each call)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
                      and a.stride() == b.stride() and torch.equal(a, b))


def _assert_same(text: str, got: list[Entry], plain: str, want: list[Entry], what: str) -> None:
    assert text == plain, f"{what}: the memo's JSON differs\n{text}\n{plain}"
    assert [(e.kind, e.name, e.full) for e in got] == [(e.kind, e.name, e.full) for e in want], what
    assert all(_same_tensor(a.tensor, b.tensor) for a, b in zip(got, want, strict=True)), what


_LEAF = st.sampled_from([0, 1, 0.0, -0.0, 1.0, 2.5, True, False, None, "a", "b", "$tuple", "\u00e9",
                         float("inf"), float("nan"), 10**20])
_TENSORS = [torch.zeros(2), torch.arange(3), torch.tensor([1.0, 2.0]).to_sparse()]
_LEAVES = st.one_of(_LEAF, _LEAF, _LEAF, st.sampled_from(_TENSORS))
_KEYS = st.sampled_from(["a", "b", "a/b", "0", "$dict"]) | st.sampled_from([0, 1])
_TREES = st.recursive(_LEAVES, lambda c: st.one_of(
    st.lists(c, max_size=3), st.lists(c, max_size=3).map(tuple), st.dictionaries(_KEYS, c, max_size=3)),
    max_leaves=12)
_STATES = st.dictionaries(st.sampled_from(["groups", "rng", "a", "a/b", "$tuple"]), _TREES, max_size=4)


@settings(max_examples=300, deadline=None)
@given(st.lists(_STATES, min_size=1, max_size=3), st.lists(st.integers(0, 2), min_size=2, max_size=8))
def test_the_memo_writes_what_encoding_afresh_writes(pool, order) -> None:
    """States drawn again and again from a small pool (copies: the same values, other objects),
    so that parts are the same, or equal in Python but typed apart, from one call to the next."""
    memo = tjson.Memo()
    for i, k in enumerate(order):
        state = copy.deepcopy(pool[k % len(pool)])
        got: list[tuple[str, torch.Tensor]] = []
        want: list[tuple[str, torch.Tensor]] = []
        text = memo.dumps(state, lambda r, t: got.append((r, t)))
        assert text == tjson.dumps(tjson.encode(state, lambda r, t: want.append((r, t)))), f"call {i}"
        assert [r for r, _ in got] == [r for r, _ in want] and all(_same_tensor(a, b) for (_, a), (_, b) in zip(got, want))


def test_values_equal_in_python_but_written_apart_are_written_anew() -> None:
    memo = tjson.Memo()
    seq = [{"g": [{"lr": 1, "wd": 0.0, "b": (0.9, 0.99), "n": ["a", "b"]}]},
           {"g": [{"lr": 1.0, "wd": 0.0, "b": (0.9, 0.99), "n": ["a", "b"]}]},
           {"g": [{"lr": True, "wd": 0.0, "b": (0.9, 0.99), "n": ["a", "b"]}]},
           {"g": [{"lr": True, "wd": -0.0, "b": (0.9, 0.99), "n": ["a", "b"]}]},
           {"g": [{"lr": True, "wd": -0.0, "b": [0.9, 0.99], "n": ["a", "b"]}]},
           {"g": [{"lr": True, "wd": -0.0, "b": [0.9, 0.99], "n": ("a", "b")}]},
           {"g": [{"lr": True, "wd": -0.0, "b": [0.9, 0.99], "n": ("a", "b"), "x": float("nan")}]},
           {"g": [{"lr": True, "wd": -0.0, "b": [0.9, 0.99], "n": ("a", "b"), "x": float("nan")}]},
           {"g": [{"lr": True, "wd": -0.0, "b": [0.9, 0.99], "n": ("a", "b"), "x": torch.ones(2)}]},
           {"g": [{"lr": True, "wd": -0.0, "b": [0.9, 0.99], "n": ("a", "b"), "x": torch.ones(2)}],
            "a/b": torch.zeros(1), "a": {"b": torch.zeros(1)}},
           {"g": [{"lr": True, "wd": -0.0, "b": [0.9, 0.99], "n": ("a", "b"), "x": torch.ones(2)}],
            "a/b": torch.zeros(1), "a": {"b": torch.empty(2, device="meta")}}]
    texts = []
    for state in seq:
        got: list[str] = []
        want: list[str] = []
        text = memo.dumps(state, lambda r, t: got.append(r))
        assert text == tjson.dumps(tjson.encode(state, lambda r, t: want.append(r)))
        assert got == want
        texts.append(text)
    assert len(set(texts)) == len(texts) - 1  # all apart but the repeated nan


def test_a_value_changed_in_place_after_its_step_is_not_taken_for_the_last_one() -> None:
    """The memo keeps copies: a live list changed in place (a scheduler's base_lrs) is seen changed."""
    memo = tjson.Memo()
    live = {"base_lrs": [0.1, 0.2], "names": ["a"]}
    first = memo.dumps({"s": live}, lambda r, t: None)
    live["base_lrs"][0] = 0.5
    live["names"].append("b")
    assert memo.dumps({"s": live}, lambda r, t: None) == tjson.dumps(tjson.encode({"s": live}, lambda r, t: None))
    assert first != tjson.dumps(tjson.encode({"s": live}, lambda r, t: None))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2), nn.Linear(2, 2))


def test_real_training_states_through_the_memo_match_the_uncached_json() -> None:
    """lr changed by a scheduler at every step, a param group added at step 3, the scaler's state
    changed (its scale halved), the scheduler's state, and a non-tensor optimizer extra changed at
    step 5 (and a tensor one): every step's text and state tensors are the uncached ones."""
    model = _model()
    last = model[3]
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.01}],
                            lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    memo = tjson.Memo()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    seen = set()
    for step in range(8):
        if step == 3:
            opt.add_param_group({"params": last.parameters(), "lr": 0.5})
            sched.base_lrs.append(0.5)
            sched.lr_lambdas.append(sched.lr_lambdas[0])
        scaler.scale(model(x).square().sum()).backward()
        scaler.step(opt)
        scaler.update(new_scale=scaler.get_scale() / 2 if step in (2, 6) else None)  # its growth tracker: every step
        opt.zero_grad()
        sched.step()
        p0 = model[0].weight
        if step >= 5:
            opt.state[p0]["note"] = f"step {step}"  # a non-tensor extra, changing at every step from 5
            opt.state[p0]["coo"] = torch.ones(2).to_sparse()
        layout = build_layout(model, opt)
        begin = {"rng": {"torch": torch.get_rng_state(), "numpy": {"pos": step, "g": 0.0}}, "forward_rng": [None, 1]}
        state = full_state(layout, opt, sched, scaler)
        text, got, plain, want = _both(state, memo, begin, extra={"ema": {"$extra": "ema"}} if step % 2 else None)
        _assert_same(text, got, plain, want, f"step {step}")
        back = tjson.loads(text)
        assert [g["hyper"]["lr"] for g in back["groups"]] == [g["lr"] for g in opt.param_groups]
        seen.add(text)
    assert len(seen) == 8


def test_an_unchanged_state_costs_few_calls_through_the_memo() -> None:
    """A nanoGPT-tiny-sized AdamW state (28 param names, one group) and an RNG state: the memo's
    repeat writes the groups' text from the last step's (no encoding of each hyperparameter and
    name): at most 60% of the Python calls of encoding it afresh (78 of 187 here)."""
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(14)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    layout = build_layout(model, opt)
    begin = {"rng": {"torch": torch.get_rng_state(), "numpy": {"alg": "MT19937", "keys": torch.zeros(3),
                                                               "pos": 3, "has_gauss": 0, "cached_gaussian": 0.0}}}
    memo = tjson.Memo()
    state_json(full_state(layout, opt, None, None), begin, None, [], memo=memo)
    state = full_state(layout, opt, None, None)
    fresh = python_calls(lambda: state_json(dict(state), begin, None, []))
    memoed = python_calls(lambda: state_json(dict(state), begin, None, [], memo=memo))
    assert memoed * 10 <= fresh * 6, f"{memoed} calls through the memo, {fresh} afresh"


class _NotingSGD(torch.optim.SGD):
    """SGD whose step writes a non-tensor extra into its first param's state from its 6th step on
    (as LBFGS keeps ``func_evals``): written by step(), where an optimizer writes its state."""

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        out = super().step(closure)
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls >= 6:
            self.state[self.param_groups[0]["params"][0]]["note"] = self.calls
        return out


def test_every_stored_step_state_says_what_its_step_had(tmp_path) -> None:
    """Through a Recorder in gradient-log mode: lr changed at every step by a scheduler, a group added
    at step 4, a non-tensor optimizer extra changing at every step from step 6: each step's stored
    state has that step's (as the optimizer was when its step began)."""
    model = _model()
    opt = _NotingSGD([{"params": list(model[0].parameters()) + list(model[2].parameters())}], lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    lrs, groups, notes = {}, {}, {}
    with stepdump.Recorder(tmp_path / "run", model, opt, scheduler=sched, gradient_log=4, on_error="raise"):
        for step in range(10):
            if step == 4:
                opt.add_param_group({"params": model[3].parameters(), "lr": 0.05})
                sched.base_lrs.append(0.05)
                sched.lr_lambdas.append(sched.lr_lambdas[0])
            model(x).square().sum().backward()
            lrs[step] = [g["lr"] for g in opt.param_groups]
            groups[step] = len(opt.param_groups)
            notes[step] = opt.state[model[0].weight].get("note")
            opt.step()
            opt.zero_grad()
            sched.step()
    run = stepdump.open(tmp_path / "run")
    for step in range(10):
        st_ = run.step_state(step)
        assert [g["hyper"]["lr"] for g in st_["groups"]] == lrs[step], step
        assert len(st_["groups"]) == groups[step], step
        assert st_["optimizer_extra"].get("0.weight", {}).get("note") == notes[step], step
    assert [notes[s] for s in range(10)] == [None] * 6 + [6, 7, 8, 9]
