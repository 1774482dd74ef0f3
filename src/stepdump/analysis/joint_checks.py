"""``stepdump.check`` on a joint run (several model/optimizer pairs): every rule on each pair's store.

Rules are about one store (one model and its optimizer), so they run on each pair's, and
each finding names its pair: its tensors as ``D/fc.weight``, its message led by ``D:``. The
scalars ``rec.log`` received live in the first pair's store (the objective rules read them
there); each pair's own ``lr`` is read in its own store.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from stepdump.analysis.findings import Finding
from stepdump.analysis.rule_runner import CachedRun, run_rules, sort_key
from stepdump.analysis.rules.base import RuleLike
from stepdump.read.joint import _OWN


def check_joint(run: Any, rules: list[RuleLike], objective: str | bool | None = None) -> list[Finding]:
    """Each rule on every pair's store; findings named by pair, in the order :func:`stepdump.check` sorts."""
    out: list[Finding] = []
    home = run.pair_names[0]
    owned = {p: {n for g in store.meta.get("layout", {}).get("groups", []) for n in g} for p, store in run.pair_stores()}
    model_of = run.doc["model_of"]
    for pair, store in run.pair_stores():
        def name(x: str, kind: str | None) -> str:
            return x if kind is None and pair == home and not _OWN.fullmatch(x) else f"{pair}/{x}"

        # A module two pairs share: each param is judged in the pair whose optimizer updates it
        # (in another pair's records it moves by an update that pair did not make).
        elsewhere = {n for q in run.pair_names if q != pair and model_of[q] == model_of[pair] for n in owned[q]}
        for f in run_rules(CachedRun(store, objective=objective if pair == home else None), rules):
            if f.kind is not None and f.tensor in elsewhere and all(t in elsewhere for t in f.tensors):
                continue
            out.append(replace(f, tensor=None if f.tensor is None else name(f.tensor, f.kind),
                               tensors=tuple(name(t, f.kind) for t in f.tensors), message=f"{pair}: {f.message}"))
    return sorted(out, key=sort_key)
