"""The fused lean kernel's Triton code (the host side, tables and launches, is
:mod:`stepdump.core.device_lean_triton`, whose docstring says what the kernels compute and why).

Two kernels: :func:`_chunk_kernel`, one program per chunk of one tensor, writes its partials;
:func:`_combine_kernel`, one program per tensor, combines them in chunk order into the packed row.
Imports without Triton (then ``triton`` and ``tl`` are None and no kernel is defined).
"""

from __future__ import annotations

from typing import no_type_check

try:  # optional: never a dependency of stepdump (pyproject.toml); found at run time
    import triton  # type: ignore[import-not-found,unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # pragma: no cover - depends on the machine
    triton = None  # type: ignore[assignment,unused-ignore]
    tl = None  # type: ignore[assignment,unused-ignore]

if triton is not None:

    @triton.jit
    @no_type_check  # a kernel: Triton's language, not Python's types
    def _fmix(x):
        """murmur3's 64-bit finalizer on uint64 (wrapping multiply, logical shifts)."""
        x = x ^ (x >> 33)
        x = x * 0xFF51AFD7ED558CCD
        x = x ^ (x >> 33)
        x = x * 0xC4CEB9FE1A85EC53
        return x ^ (x >> 33)

    @triton.jit
    @no_type_check  # a kernel: Triton's language, not Python's types
    def _values(raw, KIND: tl.constexpr, R: tl.constexpr, VT: tl.constexpr):
        """The elements' values as float64 (device_stats: floats through float32 or float64, ints as float64)."""
        if KIND == 0:
            if R == 1:
                x = raw.to(tl.float64, bitcast=True)
            else:
                x = raw.to(VT, bitcast=True).to(tl.float32).to(tl.float64)
        elif KIND == 4:  # bfloat16: the top half of a float32, exactly (subnormals included)
            x = (raw.to(tl.uint32) << 16).to(tl.float32, bitcast=True).to(tl.float64)
        elif KIND == 1:
            x = raw.to(VT, bitcast=True).to(tl.float64)
        elif KIND == 2:
            x = raw.to(tl.float64)
        else:
            x = (raw != 0).to(tl.float64)
        return x

    @triton.jit
    @no_type_check  # a kernel: Triton's language, not Python's types
    def _element(words, j, KIND: tl.constexpr, R: tl.constexpr, VT: tl.constexpr, F32: tl.constexpr):
        """Element j of each 8-byte word (little-endian: bits 64/R*j and up) as the value the
        stats are taken of: float32 for float32 and narrower floats (F32), else float64."""
        if R == 1:
            raw = words
        elif R == 2:
            raw = (words >> (j * 32)).to(tl.uint32)
        elif R == 4:
            raw = ((words >> (j * 16)) & 0xFFFF).to(tl.uint16)
        else:
            raw = ((words >> (j * 8)) & 0xFF).to(tl.uint8)
        if F32:
            if KIND == 4:  # bfloat16: the top half of a float32, exactly (subnormals included)
                v = (raw.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            else:
                v = raw.to(VT, bitcast=True).to(tl.float32)
        else:
            v = _values(raw, KIND, R, VT)
        return v

    @triton.jit
    @no_type_check  # a kernel: Triton's language, not Python's types
    def _accumulate(words, left, c, inf_v, a_fin, a_nan, a_pinf, a_ninf, a_zero, a_lo, a_hi, a_s1, a_s2, a_sq,
                    MASKED: tl.constexpr, KIND: tl.constexpr, R: tl.constexpr, VT: tl.constexpr,
                    F32: tl.constexpr):
        """A block's words into the per-lane accumulators: each word's R elements in turn. MASKED:
        only elements ``lane * R + j < left`` count (the chunk's last block); else all do (no mask
        work in the main loop)."""
        lanes = tl.arange(0, words.shape[0])
        for j in tl.static_range(R):
            v = _element(words, j, KIND, R, VT, F32)
            if MASKED:
                valid = lanes * R + j < left
                finite = valid & (tl.abs(v) < inf_v)
                a_nan += (valid & (v != v)).to(tl.int32)
                a_pinf += (valid & (v == inf_v)).to(tl.int32)
                a_ninf += (valid & (v == -inf_v)).to(tl.int32)
                a_zero += (valid & (v == 0)).to(tl.int32)
            else:
                finite = tl.abs(v) < inf_v
                a_nan += (v != v).to(tl.int32)
                a_pinf += (v == inf_v).to(tl.int32)
                a_ninf += (v == -inf_v).to(tl.int32)
                a_zero += (v == 0).to(tl.int32)
            a_fin += finite.to(tl.int32)
            a_lo = tl.minimum(a_lo, tl.where(finite, v, inf_v))
            a_hi = tl.maximum(a_hi, tl.where(finite, v, -inf_v))
            x = v.to(tl.float64)
            d = tl.where(finite, x - c, 0.0)
            a_s1 += d
            a_s2 += d * d
            xf = tl.where(finite, x, 0.0)
            a_sq += xf * xf
        return a_fin, a_nan, a_pinf, a_ninf, a_zero, a_lo, a_hi, a_s1, a_s2, a_sq

    # first_chunk takes any value (a dtype group's first row): not specialised, so one compile per dtype.
    @triton.jit(do_not_specialize=["first_chunk"])
    @no_type_check  # a kernel: Triton's language, not Python's types
    def _chunk_kernel(ptrs, chunk_tensor, chunk_start, chunk_count, first_chunk, fpart, ipart,
                      BLOCK: tl.constexpr, R: tl.constexpr, KIND: tl.constexpr, VT: tl.constexpr,
                      F32: tl.constexpr, ALIGNED: tl.constexpr):
        """One chunk (up to _CHUNK elements) of one tensor, BLOCK elements at a time into per-lane
        accumulators reduced once at the end: its partials (fpart: sum, M2, sumsq, min, max; ipart:
        finite, NaN, +Inf, -Inf, zero counts, fingerprint partial). R elements make one 8-byte word.

        ALIGNED (every tensor of the launch starts on an 8-byte boundary): the chunk's whole blocks
        are read as 8-byte words, unmasked, each word's elements taken apart in registers (no
        cross-lane shuffles to build the fingerprint's words, no mask per element); the last,
        partial block (and every block of an unaligned launch) is read element by element, masked,
        and its words built from the elements (never a byte past the tensor's end).

        The sums are shifted by the mean ``c`` of the chunk's first block (read twice: 1/16 of the
        chunk at most): M2 = S2 - S1^2 / n, with every term (x - c)^2 exact for float32 and
        narrower, loses to cancellation only (mean - c)^2 / variance ulps: within the 1e-12 the
        contract allows while the chunk's mean is within ~100 standard deviations of its first
        block's (a chunk of one tensor, at most _CHUNK elements)."""
        row = first_chunk + tl.program_id(0)
        tid = tl.load(chunk_tensor + row)
        start = tl.load(chunk_start + row)  # int64; a multiple of _CHUNK, so of BLOCK and R
        count = tl.load(chunk_count + row)
        addr = tl.load(ptrs + tid)
        if R == 1:  # the element's width (8 // R bytes), as an unsigned integer: its exact bits
            base = addr.to(tl.pointer_type(tl.uint64))
        elif R == 2:
            base = addr.to(tl.pointer_type(tl.uint32))
        elif R == 4:
            base = addr.to(tl.pointer_type(tl.uint16))
        else:
            base = addr.to(tl.pointer_type(tl.uint8))
        base = base + start
        wbase = addr.to(tl.pointer_type(tl.uint64)) + start // R  # start * element bytes is a multiple of 8
        offs = tl.arange(0, BLOCK)
        woffs = tl.arange(0, BLOCK // R)
        shifts = (tl.arange(0, R) * (64 // R)).to(tl.uint64)
        inf = tl.full([BLOCK], 0x7FF0000000000000, tl.int64).to(tl.float64, bitcast=True)
        # c: the mean of the first block's finite elements (0 when it has none)
        valid = offs < count
        x = _values(tl.load(base + offs, mask=valid, other=0), KIND, R, VT)
        finite = valid & (tl.abs(x) < inf)
        c = tl.sum(tl.where(finite, x, 0.0), axis=0) / tl.maximum(tl.sum(finite.to(tl.int32), axis=0), 1).to(tl.float64)
        # Counts, min and max of float32 and narrower floats in float32 (exact: the same values,
        # half the float64 work); the sums in float64, where (x - c)^2 of a float32 is exact.
        a_fin = tl.zeros([BLOCK // R], tl.int32)
        a_nan = tl.zeros([BLOCK // R], tl.int32)
        a_pinf = tl.zeros([BLOCK // R], tl.int32)
        a_ninf = tl.zeros([BLOCK // R], tl.int32)
        a_zero = tl.zeros([BLOCK // R], tl.int32)
        a_s1 = tl.zeros([BLOCK // R], tl.float64)
        a_s2 = tl.zeros([BLOCK // R], tl.float64)
        a_sq = tl.zeros([BLOCK // R], tl.float64)
        if F32:
            inf_v = tl.full([BLOCK // R], 0x7F800000, tl.int32).to(tl.float32, bitcast=True)
        else:
            inf_v = tl.full([BLOCK // R], 0x7FF0000000000000, tl.int64).to(tl.float64, bitcast=True)
        a_lo = inf_v
        a_hi = -inf_v
        a_fp = tl.zeros([BLOCK // R], tl.uint64)
        # (i + 1) * K1 of the block's words, advanced by a scalar each block (one 64-bit add a word)
        key = ((start // R + woffs + 1).to(tl.uint64)) * 0x9E3779B97F4A7C15
        step_key = tl.full([], BLOCK // R, tl.uint64) * 0x9E3779B97F4A7C15
        whole = count * 0  # the whole blocks read as words: none unless ALIGNED
        if ALIGNED:
            whole = (count // BLOCK) * BLOCK
        for blk in range(0, whole, BLOCK):
            words = tl.load(wbase + blk // R + woffs)  # the only read of these bytes
            a_fp += _fmix(words + key)
            key += step_key
            a_fin, a_nan, a_pinf, a_ninf, a_zero, a_lo, a_hi, a_s1, a_s2, a_sq = _accumulate(
                words, BLOCK, c, inf_v, a_fin, a_nan, a_pinf, a_ninf, a_zero, a_lo, a_hi, a_s1, a_s2, a_sq,
                False, KIND, R, VT, F32)
        for blk in range(whole, count, BLOCK):
            valid = blk + offs < count
            raw = tl.load(base + blk + offs, mask=valid, other=0)  # the only read of these bytes
            # The fingerprint's words: R elements side by side, little-endian (element j of a word
            # in bits 64/R*j and up); masked lanes load as 0, the definition's zero padding.
            if R == 1:
                words = raw.to(tl.uint64, bitcast=True)
            else:
                words = tl.sum(tl.reshape(raw.to(tl.uint64), (BLOCK // R, R)) << shifts[None, :], axis=1)
            a_fp += tl.where(blk + woffs * R < count, _fmix(words + key), 0)
            key += step_key
            a_fin, a_nan, a_pinf, a_ninf, a_zero, a_lo, a_hi, a_s1, a_s2, a_sq = _accumulate(
                words, count - blk, c, inf_v, a_fin, a_nan, a_pinf, a_ninf, a_zero, a_lo, a_hi, a_s1, a_s2, a_sq,
                True, KIND, R, VT, F32)
        n_fin = tl.sum(a_fin.to(tl.int64), axis=0)
        nf = tl.maximum(n_fin, 1).to(tl.float64)
        s1 = tl.sum(a_s1, axis=0)
        m2 = tl.maximum(tl.sum(a_s2, axis=0) - s1 * s1 / nf, 0.0)
        tl.store(fpart + row * 5 + 0, c * n_fin.to(tl.float64) + s1)
        tl.store(fpart + row * 5 + 1, m2)
        tl.store(fpart + row * 5 + 2, tl.sum(a_sq, axis=0))
        tl.store(fpart + row * 5 + 3, tl.min(a_lo, axis=0).to(tl.float64))
        tl.store(fpart + row * 5 + 4, tl.max(a_hi, axis=0).to(tl.float64))
        tl.store(ipart + row * 6 + 0, n_fin)
        tl.store(ipart + row * 6 + 1, tl.sum(a_nan.to(tl.int64), axis=0))
        tl.store(ipart + row * 6 + 2, tl.sum(a_pinf.to(tl.int64), axis=0))
        tl.store(ipart + row * 6 + 3, tl.sum(a_ninf.to(tl.int64), axis=0))
        tl.store(ipart + row * 6 + 4, tl.sum(a_zero.to(tl.int64), axis=0))
        tl.store(ipart + row * 6 + 5, tl.sum(a_fp, axis=0).to(tl.int64, bitcast=True))

    @triton.jit
    @no_type_check  # a kernel: Triton's language, not Python's types
    def _combine_kernel(tensor_first, tensor_tiles, tensor_numel, tensor_nbytes, fpart, ipart, out,
                        CB: tl.constexpr, OUT_LEN: tl.constexpr):
        """One tensor: its tiles' partials combined in tile order, then its packed row."""
        i = tl.program_id(0)
        first = tl.load(tensor_first + i)
        ntiles = tl.load(tensor_tiles + i)
        numel = tl.load(tensor_numel + i)
        nbytes = tl.load(tensor_nbytes + i)
        lanes = tl.arange(0, CB)
        inf = tl.full([CB], 0x7FF0000000000000, tl.int64).to(tl.float64, bitcast=True)
        a_fin = tl.zeros([CB], tl.int64)
        a_nan = tl.zeros([CB], tl.int64)
        a_pinf = tl.zeros([CB], tl.int64)
        a_ninf = tl.zeros([CB], tl.int64)
        a_zero = tl.zeros([CB], tl.int64)
        a_fp = tl.zeros([CB], tl.uint64)
        a_sum = tl.zeros([CB], tl.float64)
        a_sq = tl.zeros([CB], tl.float64)
        a_lo = inf
        a_hi = -inf
        for c in range(0, ntiles, CB):
            m = c + lanes < ntiles
            r = first + c + lanes
            a_fin += tl.load(ipart + r * 6 + 0, mask=m, other=0)
            a_nan += tl.load(ipart + r * 6 + 1, mask=m, other=0)
            a_pinf += tl.load(ipart + r * 6 + 2, mask=m, other=0)
            a_ninf += tl.load(ipart + r * 6 + 3, mask=m, other=0)
            a_zero += tl.load(ipart + r * 6 + 4, mask=m, other=0)
            a_fp += tl.load(ipart + r * 6 + 5, mask=m, other=0).to(tl.uint64, bitcast=True)
            a_sum += tl.load(fpart + r * 5 + 0, mask=m, other=0.0)
            a_sq += tl.load(fpart + r * 5 + 2, mask=m, other=0.0)
            a_lo = tl.minimum(a_lo, tl.where(m, tl.load(fpart + r * 5 + 3, mask=m, other=0.0), inf))
            a_hi = tl.maximum(a_hi, tl.where(m, tl.load(fpart + r * 5 + 4, mask=m, other=0.0), -inf))
        n_fin = tl.sum(a_fin, axis=0)
        cnt = tl.maximum(n_fin, 1).to(tl.float64)
        mean = tl.sum(a_sum, axis=0) / cnt
        # Chan et al.: M2 = sum_b (M2_b + n_b * (mean_b - mean)^2), in tile order.
        a_m2 = tl.zeros([CB], tl.float64)
        for c in range(0, ntiles, CB):
            m = c + lanes < ntiles
            r = first + c + lanes
            nb = tl.load(ipart + r * 6 + 0, mask=m, other=0)
            sb = tl.load(fpart + r * 5 + 0, mask=m, other=0.0)
            m2b = tl.load(fpart + r * 5 + 1, mask=m, other=0.0)
            d = sb / tl.maximum(nb, 1).to(tl.float64) - mean
            a_m2 += tl.where(nb > 0, m2b + nb.to(tl.float64) * d * d, 0.0)
        std = tl.sqrt(tl.sum(a_m2, axis=0) / cnt)
        norm = tl.sqrt(tl.sum(a_sq, axis=0))
        lo = tl.min(a_lo, axis=0)
        hi = tl.max(a_hi, axis=0)
        s = tl.sum(a_fp, axis=0)
        fp = _fmix(s + nbytes.to(tl.uint64) * 0xC2B2AE3D27D4EB4F)
        nan_bits = tl.full([], 0x7FF8000000000000, tl.int64)  # the NaN torch writes for "no value"
        none = n_fin == 0
        row = out + i * OUT_LEN
        tl.store(row + 0, numel.to(tl.float64).to(tl.int64, bitcast=True))
        tl.store(row + 1, tl.sum(a_nan, axis=0).to(tl.float64).to(tl.int64, bitcast=True))
        tl.store(row + 2, tl.sum(a_pinf, axis=0).to(tl.float64).to(tl.int64, bitcast=True))
        tl.store(row + 3, tl.sum(a_ninf, axis=0).to(tl.float64).to(tl.int64, bitcast=True))
        tl.store(row + 4, tl.where(none, nan_bits, lo.to(tl.int64, bitcast=True)))
        tl.store(row + 5, tl.where(none, nan_bits, hi.to(tl.int64, bitcast=True)))
        tl.store(row + 6, tl.where(none, nan_bits, mean.to(tl.int64, bitcast=True)))
        tl.store(row + 7, tl.where(none, nan_bits, std.to(tl.int64, bitcast=True)))
        tl.store(row + 8, tl.where(none, nan_bits, norm.to(tl.int64, bitcast=True)))
        zero_frac = tl.sum(a_zero, axis=0).to(tl.float64) / tl.maximum(numel, 1).to(tl.float64)
        tl.store(row + 9, tl.where(numel == 0, nan_bits, zero_frac.to(tl.int64, bitcast=True)))
        tl.store(row + 10, fp.to(tl.int64, bitcast=True))
