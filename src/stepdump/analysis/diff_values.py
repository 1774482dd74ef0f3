"""Element-wise comparison of two tensors, with an error measure that cannot blow up.

The relative error is guarded: ``|a - b| / max(|a|, |b|, floor)``, where the floor is the
dtype's epsilon times the larger of the two tensors' largest finite magnitudes. It is
symmetric, at most 2 (a sign flip), 1 when one side is 0, and an element far below the
tensor's scale is measured against the scale rather than against itself, so a ``1e-30``
that became ``0`` does not read as a relative error of ``1e+304``. Where the largest
relative error sits on an element one side of which is (about) 0, the description says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorDiff:
    """How one tensor differs at one step.

    ``reason`` is ``values`` (errors computed), ``fingerprint`` (bytes differ but
    values were not stored at this step), ``dtype``, ``shape`` or ``structure`` (two
    sparse tensors that stand for the same dense values but hold other indices, in
    another order, or another coalesced flag: an update adds them in another order).
    For sparse tensors with the same indices the elements compared are their stored
    values (``at`` indexes those); otherwise the dense tensors they stand for.

    For ``values``: ``n_diff`` of ``numel`` elements differ; ``max_abs`` and
    ``max_rel`` are the largest absolute and guarded relative errors over the
    finite ones (``inf`` if every differing element is NaN/Inf on one side);
    ``n_nonfinite`` of them are NaN/Inf in one run and not the same in the other;
    ``at`` is the index of the element with the largest relative error, whose
    values are ``a_at`` in run A and ``b_at`` in run B, and ``floor`` the
    magnitude below which a value counts as about 0.
    """

    kind: str
    name: str
    reason: str
    max_abs: float | None = None
    max_rel: float | None = None
    n_diff: int | None = None
    numel: int | None = None
    n_nonfinite: int = 0
    at: tuple[int, ...] | None = None
    a_at: float | None = None
    b_at: float | None = None
    floor: float | None = None

    def describe(self) -> str:
        """One line: which tensor, how many elements, how far apart, where."""
        if self.reason == "values":
            text = (f"{self.kind} {self.name}: {self.n_diff}/{self.numel} elements differ, max abs "
                    f"{self.max_abs:.3g}, max rel {self.max_rel:.3g}")
            if self.at is not None and self.a_at is not None and self.b_at is not None:
                text += f" at {list(self.at)} (A {self.a_at:.6g}, B {self.b_at:.6g}{self._zero_note()})"
            if self.n_nonfinite:
                text += f"; {self.n_nonfinite} NaN/Inf in one run only"
            return text
        if self.reason == "fingerprint":
            return f"{self.kind} {self.name}: bytes differ (values not stored at this step)"
        if self.reason == "structure":
            return (f"{self.kind} {self.name}: the sparse structure differs (indices, their order or the coalesced "
                    "flag); the dense values are equal")
        return f"{self.kind} {self.name}: {self.reason} differs"

    def _zero_note(self) -> str:
        """``: A was 0`` style, when the worst relative error is against (about) nothing."""
        if self.a_at is None or self.b_at is None or self.floor is None:
            return ""
        for side, v in (("A", self.a_at), ("B", self.b_at)):
            if v == 0:
                return f": {side} was 0"
            if abs(v) <= self.floor:
                return f": {side} was ~0"
        if (self.a_at < 0) != (self.b_at < 0):
            return ": sign flipped"
        return ""


def compare_tensors(kind: str, name: str, ta: torch.Tensor, tb: torch.Tensor, atol: float = 0.0,
                    rtol: float = 0.0) -> TensorDiff | None:
    """Element-wise comparison; None when equal (bitwise, or within the tolerance).

    With ``atol == rtol == 0`` equal means the same bits (a NaN equals the very same
    NaN; -0.0 differs from 0.0). Otherwise an element differs when
    ``|a - b| > atol + rtol * |b|`` and is not NaN on both sides.
    """
    if ta.layout == torch.sparse_coo or tb.layout == torch.sparse_coo:
        return _compare_sparse(kind, name, ta, tb, atol, rtol)
    if ta.is_complex():
        xa, xb = ta.to(torch.complex128), tb.to(torch.complex128)
    else:
        xa, xb = ta.to(torch.float64), tb.to(torch.float64)
    err = (xa - xb).abs()
    if atol == 0 and rtol == 0:
        differs = ~_bit_equal(ta, tb)
    else:
        both_nan = torch.isnan(xa) & torch.isnan(xb)
        differs = ~(both_nan | (err <= atol + rtol * xb.abs()))
    n = int(differs.sum())
    if n == 0:
        return None
    finite = torch.isfinite(xa) & torch.isfinite(xb)
    n_nonfinite = int((differs & ~finite).sum())
    mag_a, mag_b = xa.abs(), xb.abs()
    scale = max(_max_finite(mag_a), _max_finite(mag_b))
    eps = torch.finfo(ta.dtype).eps if ta.is_floating_point() or ta.is_complex() else 0.0
    floor = max(torch.finfo(torch.float64).tiny, eps * scale)
    judged = differs & finite
    if not bool(judged.any()):  # every difference is a NaN/Inf: no finite error to give
        return TensorDiff(kind, name, "values", float("inf"), float("inf"), n, ta.numel(), n_nonfinite,
                          floor=floor)
    rel = err / torch.maximum(torch.maximum(mag_a, mag_b), torch.full_like(mag_a, floor))
    rel = torch.where(judged, rel, torch.zeros_like(rel))
    max_abs = float(torch.where(judged, err, torch.zeros_like(err)).max())
    flat = int(rel.reshape(-1).argmax())
    at = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), ta.shape)) if ta.dim() else ()
    a_at = b_at = None
    if not ta.is_complex():
        a_at, b_at = float(xa.reshape(-1)[flat]), float(xb.reshape(-1)[flat])
    return TensorDiff(kind, name, "values", max_abs, float(rel.reshape(-1)[flat]), n, ta.numel(), n_nonfinite,
                      at, a_at, b_at, floor)


def _compare_sparse(kind: str, name: str, ta: torch.Tensor, tb: torch.Tensor, atol: float,
                    rtol: float) -> TensorDiff | None:
    """:func:`compare_tensors` when one side is sparse COO: with the same indices (same order,
    same coalesced flag) the stored values, element by element; else the dense tensors they
    stand for, and when those are equal bit for bit the structure itself is the difference."""
    sparse_a, sparse_b = ta.layout == torch.sparse_coo, tb.layout == torch.sparse_coo
    if (sparse_a and sparse_b and ta.sparse_dim() == tb.sparse_dim() and ta.is_coalesced() == tb.is_coalesced()
            and torch.equal(ta._indices(), tb._indices())):
        return compare_tensors(kind, name, ta._values(), tb._values(), atol, rtol)
    d = compare_tensors(kind, name, ta.to_dense() if sparse_a else ta, tb.to_dense() if sparse_b else tb, atol, rtol)
    if d is None and atol == 0 and rtol == 0:
        return TensorDiff(kind, name, "structure", numel=ta.numel())
    return d


def _max_finite(mag: torch.Tensor) -> float:
    fin = mag[torch.isfinite(mag)]
    return float(fin.max()) if fin.numel() else 0.0


def _bit_equal(ta: torch.Tensor, tb: torch.Tensor) -> torch.Tensor:
    """Element-wise "same bits" (a NaN equals the same NaN; -0.0 is not 0.0)."""
    if ta.is_complex():
        ta, tb = torch.view_as_real(ta), torch.view_as_real(tb)
        return _bit_equal(ta, tb).all(dim=-1)
    size = ta.element_size()
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(size)
    if view is None or ta.dtype == torch.bool:
        return ta == tb
    return ta.contiguous().view(view) == tb.contiguous().view(view)
