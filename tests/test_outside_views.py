"""The outside-edit check's fingerprints by kept byte views (core/hashing.py ``LiveHasher.fingerprint_all``, issue 25).

What must hold: ``ParamWatch`` gives the numbers :func:`stepdump.capture.outside.fingerprints`
gives, for the params as they are at each call, whatever happened to them since the views were
made: an in-place write, a write through ``.data`` or a numpy view (no version bump), new memory
of the same shape (``param.data = ...``), another dtype or shape, a non-contiguous param, a param
added or gone; and a view never reads memory the param no longer has.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stepdump.capture import outside


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.nn.Parameter(torch.randn(4, 5, generator=g)), "b": torch.nn.Parameter(torch.randn(7, generator=g)),
            "c": torch.nn.Parameter(torch.randn(3, 3, generator=g, dtype=torch.float64))}


def _edit_inplace(ps):
    with torch.no_grad():
        ps["a"].add_(1.0)


def _edit_data(ps):
    ps["b"].data.mul_(-2.0)


def _edit_numpy(ps):
    ps["c"].detach().numpy()[0, 0] = 123.0


def _new_memory_same_shape(ps):
    ps["a"].data = torch.full((4, 5), 0.5)


def _other_dtype(ps):
    ps["b"].data = ps["b"].data.double()


def _other_shape(ps):
    ps["b"].data = torch.zeros(9)


def _non_contiguous(ps):
    ps["a"].data = torch.randn(5, 4).t()


def _added(ps):
    ps["d"] = torch.nn.Parameter(torch.ones(2))


def _gone(ps):
    del ps["c"]


def _bf16(ps):
    ps["c"].data = torch.randn(3, 3).bfloat16()


EDITS = [_edit_inplace, _edit_data, _edit_numpy, _new_memory_same_shape, _other_dtype, _other_shape,
         _non_contiguous, _added, _gone, _bf16]


@pytest.mark.parametrize("edit", EDITS, ids=lambda f: f.__name__.strip("_"))
def test_the_kept_views_give_the_fingerprints_of_the_params_now(edit) -> None:
    ps = _params()
    watch = outside.ParamWatch()
    assert watch._fingerprints(ps) == outside.fingerprints(ps)  # made
    assert watch._fingerprints(ps) == outside.fingerprints(ps)  # kept
    before = outside.fingerprints(ps)
    edit(ps)
    now = outside.fingerprints(ps)
    assert now != before  # each edit changes what the params hold (or which there are)
    assert watch._fingerprints(ps) == now, edit.__name__
    assert watch._fingerprints(ps) == now  # and again, from views made or kept after the edit


def test_an_edit_between_update_and_step_is_found_by_the_kept_views() -> None:
    ps = _params()
    watch = outside.ParamWatch()
    watch.after_update(ps)
    assert watch.before_update(1, ps)[1] == []
    watch.after_update(ps)
    ps["b"].detach().numpy()[3] = np.float32(9.0)  # no version bump, same memory
    assert watch.before_update(2, ps)[1] == ["b"]
