"""Triton kernels of :func:`gradstats.ops.fused.prune_quantize` for block-scaled formats (OCP MX: E8M0 block
scales; NVFP4: E4M3 block scales under a float32 tensor scale; NVFP4's training recipe with its random
Hadamard transform): stochastic pruning, the block scales, rounding and the call's counts and sums in one
pass over the gradient, with no host synchronisation.

The blocks are those of :mod:`gradstats.ops.layout`: ``block_size`` consecutive channels of one token
(``"rows"``; the channels are ``block_dim``, a convolution's dim 1), read in place (no channels-last copy);
with a Hadamard transform of ``n = block_size`` points (:mod:`gradstats.ops.hadamard`), each group of ``n``
tokens of a channel is rotated, quantised as one block (``"columns"``) and rotated back in registers. Each
element goes through the shared device functions of :mod:`gradstats.ops.triton.common` (the pruning and
rounding streams at the indices the CPU path uses: the pruning stream at the element's flat index, the
rounding stream at its index in the blocked layout of :func:`gradstats.ops.layout.to_blocks`), and the
block scale rule is :func:`gradstats.ops.block_scales.mx_shared_exponent`'s (E8M0, every scale rounding)
or NVFP4's (:func:`gradstats.ops.quantization.block_scales`), the E4M3 scale rounded by the same rounding
function as the elements. So the result equals the CPU path's bit for bit (``prune_quantize`` with the
same seed on the C/torch engines) and the counts are equal; the float64 sums agree to rounding.

NVFP4's tensor scale needs the largest magnitude of the pruned tensor before the first block is scaled. It
comes, in that order of preference, from ``tensor_amax`` (a host float, used as given), from ``stats`` (the
call's statistics vector on the device: its ``max_abs``, raised to the threshold where pruning rounds
values up to it, which is the pruned tensor's largest magnitude whenever any value is left), or from a
first pass of the same kernel that only reduces it (two launches). With a Hadamard transform it is the
largest magnitude of the *rotated* tensor, which no earlier pass knows: that call is always two launches
(unless ``tensor_amax`` is given).

Example:
    >>> from gradstats.scheme import Scheme
    >>> covers(Scheme.parse("nvfp4")), covers(Scheme.parse("nvfp4:hadamard=8"))
    (True, False)
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Union

import numpy as np
import torch

from gradstats.formats import ROUNDING_CODES
from gradstats.ops import random as _rng
from gradstats.ops.triton import interpreting, triton_available
from gradstats.scheme import E4M3 as _E4M3
from gradstats.scheme import Scheme

try:  # the kernel bodies refer to ``tl``; they are only compiled when Triton is installed
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the installation
    tl = None

__all__ = ["covers", "prune_quantize_blocks_triton", "TILE", "SCALE_ROUNDING_CODES"]

#: elements per Triton program (a tile of whole blocks)
TILE = 2048
#: warps per program (8: 8 elements per thread, which keeps the registers per thread near 100)
NUM_WARPS = 8
#: the E8M0 scale roundings by their kernel code (:data:`gradstats.scheme.SCALE_ROUNDINGS`)
SCALE_ROUNDING_CODES = {"floor": 0, "ceil": 1, "even": 2, "rceil": 3}



def _scale_src(amax, tmax, E4M3: tl.constexpr, SROUND: tl.constexpr, EMAX: tl.constexpr, MANB: tl.constexpr,
               FMAX: tl.constexpr, TDIV: tl.constexpr, SM: tl.constexpr, SMSUB: tl.constexpr, SE0F: tl.constexpr,
               SMAXBITS: tl.constexpr, SC0F: tl.constexpr):
    """The decode scale (float32) of blocks whose largest finite magnitude is ``amax`` (float32 >= 0):
    E8M0, ``2**e`` by :func:`gradstats.ops.block_scales.mx_shared_exponent` (``SROUND`` its rounding), or
    NVFP4's ``e4m3(amax / (fmax * t)) * t`` with ``t = tmax / (fmax * 448)`` (1 for ``tmax == 0``)."""
    if E4M3:
        fmax = tl.full([], FMAX, tl.float32)
        t = tl.where(tmax > 0, tl.math.div_rn(tmax, tl.full([], TDIV, tl.float32)), 1.0)
        v = tl.math.div_rn(amax, fmax * t)
        v = tl.minimum(v, 448.0)
        vb = v.to(tl.int32, bitcast=True)
        sb = _round(vb, vb, SM, SMSUB, SE0F, SMAXBITS, SC0F, 0).to(tl.float32, bitcast=True)  # noqa: F821
        return sb * t
    ab = amax.to(tl.int32, bitcast=True)
    if SROUND == 3:  # rceil: ceil(log2(amax / fmax)) exactly, on the bits of the float32 quotient
        vb = tl.math.div_rn(amax, tl.full([], FMAX, tl.float32)).to(tl.int32, bitcast=True)
        ex = vb >> 23
        e = tl.where(ex > 0, ex - 127 + ((vb & 0x7FFFFF) != 0).to(tl.int32), tl.where(vb > 0x400000, -126, -127))
    else:
        if SROUND == 2:
            ab = (ab + (1 << (22 - MANB))) & 0x7F800000
        e = ((ab >> 23) & 0xFF) - 127
        if SROUND == 1:
            e = e + ((ab & 0x7FFFFF) != 0).to(tl.int32)
        e = e - EMAX
    e = tl.where(amax > 0, e, -127)
    e = tl.minimum(tl.maximum(e, -127), 127)
    return tl.where(e >= -126, (e + 127) << 23, 0x400000).to(tl.float32, bitcast=True)  # 2**e (2**-127 subnormal)


def _quant_src(r, X, c, rk1, rk2, mask, FMAX: tl.constexpr, E4M3: tl.constexpr, M: tl.constexpr,
               MSUB: tl.constexpr, E0F: tl.constexpr, MAXBITS: tl.constexpr, C0F: tl.constexpr,
               ROUNDING: tl.constexpr, NEG_ZERO: tl.constexpr):
    """``Q(r / X) * X`` of the signed float32 tile ``r`` with decode scales ``X`` (broadcast to it; ``X == 0``,
    NVFP4's empty block: ``Q(r) * 0``), rounding stream words at counters ``c``; and the entries clipped
    (``|r| / X > fmax`` where ``X > 0``)."""
    rb = r.to(tl.int32, bitcast=True)
    neg = rb < 0
    isnan = (rb & 0x7FFFFFFF) > 0x7F800000
    Xd = tl.where(X > 0, X, 1.0)
    ws = tl.math.div_rn((rb & 0x7FFFFFFF).to(tl.float32, bitcast=True), Xd)
    over = (ws > FMAX) & (X > 0) & mask
    b = ws.to(tl.int32, bitcast=True)
    r23 = b
    if ROUNDING == 1:
        r23 = (_word(c, rk1, rk2) >> 9) & 0x7FFFFF  # noqa: F821
    o = _round(b, r23, M, MSUB, E0F, MAXBITS, C0F, ROUNDING).to(tl.float32, bitcast=True) * Xd  # noqa: F821
    if E4M3:
        o = tl.where(X > 0, o, o * 0.0)
    ob = o.to(tl.int32, bitcast=True)
    if NEG_ZERO:
        ob = tl.where(neg, ob | (-2147483648), ob)
    else:  # zeros are +0 in a format without -0
        ob = tl.where(neg & (ob != 0), ob | (-2147483648), ob)
    return tl.where(isnan, r, ob.to(tl.float32, bitcast=True)), over


def _threshold_src(A, a_f, t_hi, t_lo, s_hi, s_lo, ST, mu_hi, mu_lo, USED, first, A_PTR: tl.constexpr,
                   CORR_T: tl.constexpr, WRITE_USED: tl.constexpr, I_N: tl.constexpr, I_ZERO: tl.constexpr,
                   I_NONFIN: tl.constexpr, I_LN: tl.constexpr):
    """The threshold (float32) of the call: the host's (``a_f``, its float32 bits) or a one-element tensor's,
    or, with the lag correction (``CORR_T``), the host's float64 ``t`` times ``exp(drift)`` rounded to float32
    (as :func:`gradstats.ops.triton.fused.prune_quantize_triton` corrects it); program ``first`` records it
    and the host's scale (``s``) in ``USED`` as float64 (``WRITE_USED``)."""
    if A_PTR:
        a = tl.load(A).to(tl.float32)
        t64 = a.to(tl.float64)
    else:
        a = a_f.to(tl.float32, bitcast=True)
        t64 = _f64(t_hi, t_lo)  # noqa: F821
    if CORR_T:
        a = (t64 * tl.exp(_drift(ST, mu_hi, mu_lo, I_N, I_ZERO, I_NONFIN, I_LN))).to(tl.float32)  # noqa: F821
        t64 = a.to(tl.float64)
    if WRITE_USED:
        tl.store(USED + 0, t64, mask=first)
        tl.store(USED + 1, _f64(s_hi, s_lo), mask=first)  # noqa: F821
    return a


def _load_pruned_src(X, offs, mask, first, A, a_f, t_hi, t_lo, s_hi, s_lo, ST, mu_hi, mu_lo, USED, pk1, pk2,
                     A_PTR: tl.constexpr, CORR_T: tl.constexpr, WRITE_USED: tl.constexpr, I_N: tl.constexpr,
                     I_ZERO: tl.constexpr, I_NONFIN: tl.constexpr, I_LN: tl.constexpr, PRUNE: tl.constexpr):
    """A tile's prologue in both block kernels: the values ``v`` at ``offs`` (float32) and their bits
    ``vb``, the call's threshold ``a`` (:func:`_threshold_src`; program ``first`` records it), and the
    magnitudes ``w`` after stochastic pruning (``pruned``: the entries it set to zero)."""
    v = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    vb = v.to(tl.int32, bitcast=True)
    w = (vb & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    a = _threshold(A, a_f, t_hi, t_lo, s_hi, s_lo, ST, mu_hi, mu_lo, USED, first, A_PTR,  # noqa: F821
                   CORR_T, WRITE_USED, I_N, I_ZERO, I_NONFIN, I_LN)
    pruned = mask & (mask == 0)
    if PRUNE:
        w, pruned = _prune(w, offs.to(tl.int32), a, pk1, pk2)  # noqa: F821
        pruned = pruned & mask
    return v, vb, w, a, pruned


def _tensor_amax_src(A, ST, AMX, a, ta_f, PRUNE: tl.constexpr, TA_MODE: tl.constexpr, I_MAX: tl.constexpr):
    """NVFP4's tensor amax (float32): 1 the host's ``ta_f`` (bits), 2 the statistics vector's ``max_abs``
    (raised to the threshold when pruning), 3 the first pass's (bits in ``AMX``); 0: none (E8M0)."""
    if TA_MODE == 1:
        return ta_f.to(tl.float32, bitcast=True)
    if TA_MODE == 2:
        top = tl.load(ST + I_MAX)
        top = tl.where(top == top, top, 0.0).to(tl.float32)
        if PRUNE:
            top = tl.maximum(top, a)
        return top
    if TA_MODE == 3:
        return tl.load(AMX).to(tl.float32, bitcast=True)
    return tl.full([], 0.0, tl.float32)


def _rows_src(X, Y, A, ST, AMX, CNT, SUMS, USED, n_rows, Q, K, NB, KP, a_f, ta_f, pk1, pk2, rk1, rk2,
              t_hi, t_lo, s_hi, s_lo, mu_hi, mu_lo, CORR_T: tl.constexpr, WRITE_USED: tl.constexpr,
              I_N: tl.constexpr, I_ZERO: tl.constexpr, I_NONFIN: tl.constexpr, I_LN: tl.constexpr,
              AMAX_PASS: tl.constexpr, PRUNE: tl.constexpr, A_PTR: tl.constexpr, TA_MODE: tl.constexpr,
              I_MAX: tl.constexpr, E4M3: tl.constexpr, SROUND: tl.constexpr, EMAX: tl.constexpr,
              MANB: tl.constexpr, FMAX: tl.constexpr, TDIV: tl.constexpr, SM: tl.constexpr, SMSUB: tl.constexpr,
              SE0F: tl.constexpr, SMAXBITS: tl.constexpr, SC0F: tl.constexpr, M: tl.constexpr,
              MSUB: tl.constexpr, E0F: tl.constexpr, MAXBITS: tl.constexpr, C0F: tl.constexpr,
              ROUNDING: tl.constexpr, NEG_ZERO: tl.constexpr, B: tl.constexpr, BP: tl.constexpr, R: tl.constexpr,
              IDX64: tl.constexpr, Q1: tl.constexpr):
    # the tensor as (P, K, Q), K the channels; a tile is R blocks, enumerated (p, block of channels, q) with
    # q fastest (a convolution's consecutive blocks are consecutive pixels: coalesced loads); indices in
    # int32 below 2**31 elements (IDX64 off), the cheaper divisions; Q1: Q == 1 (a linear layer's gradient)
    if IDX64:
        g = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R).to(tl.int64)
    else:
        g = tl.program_id(0) * R + tl.arange(0, R)
    if Q1:
        q = g * 0
        h = g
    else:
        q = g % Q
        h = g // Q
    kb = h % NB
    p = h // NB
    i = tl.arange(0, BP)
    k = kb[:, None] * B + i[None, :]
    mask = (g < n_rows)[:, None] & (i < B)[None, :] & (k < K)
    offs = (p[:, None] * K + k) * Q + q[:, None]
    v, vb, w, a, pruned = _load_pruned(X, offs, mask, tl.program_id(0) == 0, A, a_f, t_hi, t_lo, s_hi, s_lo, ST, mu_hi,  # noqa: F821
                                       mu_lo, USED, pk1, pk2, A_PTR, CORR_T, WRITE_USED, I_N, I_ZERO, I_NONFIN,
                                       I_LN, PRUNE)
    amax = tl.reduce(tl.where(w < float("inf"), w, 0.0), 1, _max)  # noqa: F821
    if AMAX_PASS:
        tl.atomic_max(AMX, tl.reduce(amax, 0, _max).to(tl.int32, bitcast=True))  # noqa: F821
    else:
        tmax = _tensor_amax(A, ST, AMX, a, ta_f, PRUNE, TA_MODE, I_MAX)  # noqa: F821
        Xs = _scale(amax, tmax, E4M3, SROUND, EMAX, MANB, FMAX, TDIV, SM, SMSUB, SE0F, SMAXBITS, SC0F)  # noqa: F821
        y = tl.where(vb < 0, -w, w)  # the pruned value (a zero of x's sign)
        c = ((p * Q + q)[:, None] * KP + k).to(tl.int32)  # its index in the blocked (channels-last) layout
        o, over = _quant(y, Xs[:, None] + tl.full([R, BP], 0.0, tl.float32), c, rk1, rk2, mask, FMAX, E4M3,  # noqa: F821
                         M, MSUB, E0F, MAXBITS, C0F, ROUNDING, NEG_ZERO)
        tl.store(Y + offs, o, mask=mask)
        under = (w != 0.0) & (o == 0.0) & mask
        _accumulate(CNT, SUMS, v, o, mask, pruned, under, over)  # noqa: F821


def _fwht_src(r, LOGN: tl.constexpr):
    """The Sylvester Hadamard butterflies (unnormalised) along dim 0 of the tile ``r`` (``2**LOGN`` rows):
    at stage ``h``, ``(a, b) -> (a + b, a - b)`` for rows ``i`` and ``i + h``, as
    :func:`gradstats.ops.hadamard.rotate` computes them (the same float32 sums, bit for bit)."""
    j = tl.arange(0, r.shape[0])[:, None] + tl.full(r.shape, 0, tl.int32)
    for s in tl.static_range(LOGN):
        partner = tl.gather(r, j ^ (1 << s), 0)
        r = tl.where((j & (1 << s)) == 0, r + partner, partner - r)
    return r


def _hadamard_src(X, Y, A, SG, ST, AMX, CNT, SUMS, CLIP, USED, Mtok, Q, K, MP, a_f, ta_f, pk1, pk2, rk1, rk2,
                  t_hi, t_lo, s_hi, s_lo, mu_hi, mu_lo, CORR_T: tl.constexpr, WRITE_USED: tl.constexpr,
                  I_N: tl.constexpr, I_ZERO: tl.constexpr, I_NONFIN: tl.constexpr, I_LN: tl.constexpr,
                  AMAX_PASS: tl.constexpr, PRUNE: tl.constexpr, A_PTR: tl.constexpr, TA_MODE: tl.constexpr,
                  I_MAX: tl.constexpr, E4M3: tl.constexpr, SROUND: tl.constexpr, EMAX: tl.constexpr,
                  MANB: tl.constexpr, FMAX: tl.constexpr, TDIV: tl.constexpr, SM: tl.constexpr,
                  SMSUB: tl.constexpr, SE0F: tl.constexpr, SMAXBITS: tl.constexpr, SC0F: tl.constexpr,
                  M: tl.constexpr, MSUB: tl.constexpr, E0F: tl.constexpr, MAXBITS: tl.constexpr,
                  C0F: tl.constexpr, ROUNDING: tl.constexpr, NEG_ZERO: tl.constexpr, N: tl.constexpr,
                  LOGN: tl.constexpr, NORM: tl.constexpr, BK: tl.constexpr):
    # a tile: the N tokens of one rotation group (the last padded with zero tokens) x BK channels
    t = tl.program_id(0).to(tl.int64) * N + tl.arange(0, N).to(tl.int64)
    k = tl.program_id(1).to(tl.int64) * BK + tl.arange(0, BK).to(tl.int64)
    kmask = (k < K)[None, :]
    mask = (t < Mtok)[:, None] & kmask
    offs = ((t // Q)[:, None] * K + k[None, :]) * Q + (t % Q)[:, None]
    v, vb, w, a, pruned = _load_pruned(X, offs, mask, (tl.program_id(0) == 0) & (tl.program_id(1) == 0), A, a_f, t_hi, t_lo, s_hi, s_lo, ST, mu_hi,  # noqa: F821
                                       mu_lo, USED, pk1, pk2, A_PTR, CORR_T, WRITE_USED, I_N, I_ZERO, I_NONFIN,
                                       I_LN, PRUNE)
    s = tl.load(SG + tl.arange(0, N))[:, None]  # the random signs, +-1
    r = _fwht(tl.where(vb < 0, -w, w) * s, LOGN) * NORM  # noqa: F821 - R y, y the pruned value
    ar = tl.abs(r)
    amax = tl.reduce(tl.where(ar < float("inf"), ar, 0.0), 0, _max)  # noqa: F821 - per channel
    if AMAX_PASS:
        tl.atomic_max(AMX, tl.reduce(amax, 0, _max).to(tl.int32, bitcast=True))  # noqa: F821
    else:
        tmax = _tensor_amax(A, ST, AMX, a, ta_f, PRUNE, TA_MODE, I_MAX)  # noqa: F821
        Xs = _scale(amax, tmax, E4M3, SROUND, EMAX, MANB, FMAX, TDIV, SM, SMSUB, SE0F, SMAXBITS, SC0F)  # noqa: F821
        c = (k[None, :] * MP + t[:, None]).to(tl.int32)  # the index in the blocked layout (blocks along tokens)
        z, over = _quant(r, Xs[None, :] + tl.full([N, BK], 0.0, tl.float32), c, rk1, rk2, kmask, FMAX, E4M3,  # noqa: F821
                         M, MSUB, E0F, MAXBITS, C0F, ROUNDING, NEG_ZERO)
        o = (_fwht(z, LOGN) * NORM) * s  # noqa: F821 - R^T
        tl.store(Y + offs, o, mask=mask)
        under = (w != 0.0) & (o == 0.0) & mask
        _accumulate(CNT, SUMS, v, o, mask, pruned, under, mask & (mask == 0))  # noqa: F821
        tl.atomic_add(CLIP, tl.reduce(over.to(tl.int64), None, tl.standard._sum_combine))


_DEVICE_FUNCTIONS = {"_scale": _scale_src, "_quant": _quant_src, "_tensor_amax": _tensor_amax_src,
                     "_fwht": _fwht_src, "_threshold": _threshold_src, "_load_pruned": _load_pruned_src}


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """``(rows kernel, Hadamard kernel)``, built with the shared device functions."""
    import triton

    from gradstats.ops.triton import common

    g = dict(globals())
    g.update(common._helpers(interpret))
    made = {name: triton.jit(common._rebind(src, g)) for name, src in _DEVICE_FUNCTIONS.items()}
    g.update(made)
    host = ["a_f", "ta_f", "pk1", "pk2", "rk1", "rk2", "t_hi", "t_lo", "s_hi", "s_lo", "mu_hi", "mu_lo"]
    ns = ["n_rows", "Q", "K", "NB", "KP", *host]
    rows = triton.jit(common._rebind(_rows_src, g), do_not_specialize=ns)
    hs = ["Mtok", "Q", "K", "MP", *host]
    had = triton.jit(common._rebind(_hadamard_src, g), do_not_specialize=hs)
    return rows, had


def covers(s: Scheme | None, x: torch.Tensor | None = None, block_dim: int = -1) -> bool:
    """Whether :func:`prune_quantize_blocks_triton` takes a call of the resolved scheme ``s``: Triton installed;
    an element format the fused kernels cover (:func:`gradstats.ops.consts.fused_covers`), blocks of up to 256;
    no Hadamard transform or one of ``block_size`` points; and, given ``x``: a float32 tensor of at least one
    dim, ``block_dim`` one of its dims, whose element and blocked-layout indices stay below ``2**32`` (one
    segment of the random streams).

    Example:
        >>> from gradstats.scheme import Scheme
        >>> covers(Scheme.parse("mxfp4")), covers(Scheme.parse("e2m1fn")), covers(Scheme.parse("nvfp4_training"))
        (True, False, True)
    """
    from gradstats.ops.consts import fused_covers

    if s is None or s.block_size is None or not triton_available() or s.block_size > 256:
        return False
    block_size, hadamard = s.block_size, s.hadamard
    if hadamard is not None and hadamard != block_size:
        return False
    if not fused_covers(s.element, 1.0):
        return False
    if x is not None:
        if x.dtype != torch.float32 or x.dim() == 0:
            return False
        if not isinstance(block_dim, int) or not -x.dim() <= block_dim < x.dim():
            return False
        if max(x.numel(), _padded_numel(x, block_size, hadamard, block_dim)) >= 1 << 32:
            return False
    return True


def _geometry(x: torch.Tensor, block_dim: int) -> tuple[int, int, int]:
    """``(P, K, Q)`` of ``x`` (contiguous) about its channel dim (:func:`gradstats.ops.layout.geometry`)."""
    from gradstats.ops.layout import geometry

    return geometry(tuple(x.shape), block_dim)


def _padded_numel(x: torch.Tensor, block_size: int, hadamard: int | None, block_dim: int = -1) -> int:
    P, K, Q = _geometry(x, block_dim)
    if hadamard is not None:
        return -(-(P * Q) // hadamard) * hadamard * K
    return P * Q * (-(-K // block_size) * block_size)


def _bits(v: float) -> int:
    """The float32 bits of ``v`` as a signed int (a float kernel argument would arrive as float64 or float32
    depending on the mode; its bits arrive unchanged)."""
    return int(np.asarray(v, dtype=np.float32).view(np.int32))


def prune_quantize_blocks_triton(x: torch.Tensor, threshold: Union[float, torch.Tensor], s: Scheme, *,
                                 seed: int = 0, block_dim: int = -1, tensor_amax: Optional[float] = None,
                                 stats: torch.Tensor | None = None, out: torch.Tensor | None = None,
                                 counts: torch.Tensor | None = None, sums: torch.Tensor | None = None,
                                 solved_mu: float | None = None, correct_threshold: bool = True,
                                 used: torch.Tensor | None = None, scale: float = 1.0,
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stochastic pruning at ``threshold`` (0 = none; a Python float or a one-element tensor on ``x``'s
    device, rounded to float32), then block-scaled rounding as the resolved scheme ``s`` says
    (:meth:`gradstats.scheme.Scheme.of`), as :func:`gradstats.quantize` does it (``block_dim``, ``tensor_amax``:
    see there), in one Triton pass. Returns ``(result, counts, sums)``: int64[5] and float64[6] on ``x``'s
    device as :func:`gradstats.ops.triton.fused.prune_quantize_triton` makes them (added to when given),
    with ``saturated`` counted as :func:`gradstats.ops.fused.prune_quantize` counts it (with ``hadamard``,
    the clipped share of the rotated entries times ``n``). ``stats`` (the float64 statistics vector of
    ``x`` on its device) gives NVFP4's tensor amax without a second launch (see the module's docstring).
    With ``solved_mu`` (and ``stats``) a host ``threshold`` is corrected for the lag in the kernel as
    :func:`gradstats.ops.triton.fused.prune_quantize_triton` corrects it (``correct_threshold``), and
    ``used`` (float64, 2) receives the threshold used and ``scale`` (block scaling uses no per-tensor
    scale: it is only recorded), so that a planned block call is one statistics launch and this one.
    ``x``: float32, contiguous or not (copied), on CUDA or, under ``TRITON_INTERPRET=1``, the CPU; the
    call must be one :func:`covers` takes. Nothing is read back to the host. The kernels are compiled
    without floating-point contraction (``enable_fp_fusion=False``): a product feeding a sum (the scaled
    values into the inverse rotation) is rounded first, as on the CPU.

    Example (``TRITON_INTERPRET=1`` runs the kernel on the CPU; on CUDA it is not needed):
        >>> import os
        >>> old = os.environ.get("TRITON_INTERPRET"); os.environ["TRITON_INTERPRET"] = "1"
        >>> x = torch.tensor([[0.001, -0.3, 0.6, 5.0], [1.0, 2.0, 3.0, 100.0]])
        >>> y, counts, sums = prune_quantize_blocks_triton(x, 0.0, Scheme("e2m1fn", block_size=2))
        >>> y.tolist(), counts.tolist()
        ([[0.0, -0.25, 0.5, 4.0], [1.0, 2.0, 0.0, 96.0]], [2, 0, 2, 1, 0])
        >>> _ = os.environ.pop("TRITON_INTERPRET") if old is None else os.environ.update(TRITON_INTERPRET=old)
    """
    from gradstats.ops.consts import consts
    from gradstats.ops.triton.fused import _check_value, _halves, _prepare
    from gradstats.ops.triton.stats import SCALARS
    if not isinstance(s, Scheme):
        raise ValueError(f"prune_quantize_blocks_triton takes a resolved Scheme (gradstats.scheme.Scheme.of), got "
                         f"{type(s).__name__}")
    if not isinstance(x, torch.Tensor) or not covers(s, x, block_dim):
        got = (x.dtype, tuple(x.shape), block_dim) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"prune_quantize_blocks_triton takes a float32 tensor of at least one dim (fewer than 2**32 "
                         f"elements, padding included) with block_dim one of its dims, and a scheme whose format the "
                         f"fused kernels cover with block_size in [1, 256] and hadamard None or equal to block_size; "
                         f"got x (dtype, shape, block_dim) {got}, scheme {s}: use gradstats.ops.fused.prune_quantize")
    fmt, E4M3, rounding, hadamard, block_size = s.element, _E4M3, s.rounding, s.hadamard, s.block_size
    sround, e4m3 = s.scale_rounding or "floor", s.tensor_scale is not None   # E4M3 scales under a float32 one
    _check_value(threshold, "threshold", x, positive=False)
    if tensor_amax is not None and not (isinstance(tensor_amax, (int, float)) and math.isfinite(tensor_amax)
                                        and tensor_amax >= 0):
        raise ValueError(f"tensor_amax must be a finite number >= 0 (the whole tensor's largest magnitude), "
                         f"got {tensor_amax!r}")
    if stats is not None and (not isinstance(stats, torch.Tensor) or stats.dtype != torch.float64
                              or stats.dim() != 1 or stats.numel() < len(SCALARS) or stats.device != x.device):
        raise ValueError(f"stats must be the 1-d float64 statistics vector of x on {x.device} "
                         f"(gradstats.stats.fields.LAYOUT)")
    seed = _rng.resolve_seed(seed, None, "prune_quantize_blocks_triton")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale (only recorded in used) must be a float, got {type(scale).__name__}")
    p = _prepare(x, threshold, scale, out, counts, sums, stats, solved_mu, used)
    if p.n == 0:
        return p.res, p.counts, p.sums
    xc, res, counts, sums, n, correct = p.xc, p.res, p.counts, p.sums, p.n, p.correct
    a_ptr, prune, a_f, A = p.a_ptr, p.prune, p.a_f, p.A
    ta_mode, ta_f = 0, 0
    if e4m3:
        if tensor_amax is not None:
            ta_mode, ta_f = 1, _bits(tensor_amax)
        elif stats is not None and hadamard is None:
            ta_mode = 2
        else:
            ta_mode = 3
    amx = torch.zeros(1, dtype=torch.int32, device=x.device) if ta_mode == 3 else counts
    c, s = consts(fmt), consts(E4M3)
    sp, sr = _rng.segment_key(_rng.stream(seed, _rng.PRUNE), 0), _rng.segment_key(_rng.stream(seed, _rng.ROUND), 0)
    pk1, pk2, rk1, rk2 = (_rng._s32(v) for v in (*sp, *sr))
    P, K, Q = _geometry(xc, block_dim)
    common = dict(PRUNE=bool(prune), A_PTR=a_ptr, TA_MODE=ta_mode, I_MAX=SCALARS.index("max_abs"), E4M3=e4m3,
                  SROUND=SCALE_ROUNDING_CODES[sround], EMAX=fmt.emax, MANB=fmt.man_bits,
                  FMAX=float(fmt.max), TDIV=float(np.float32(fmt.max * E4M3.max)), SM=s.M, SMSUB=s.Msub,
                  SE0F=s.E0F, SMAXBITS=s.MAXBITS, SC0F=E4M3.min_normal, M=c.M, MSUB=c.Msub, E0F=c.E0F,
                  MAXBITS=c.MAXBITS, C0F=fmt.min_normal, ROUNDING=ROUNDING_CODES[rounding],
                  NEG_ZERO=bool(fmt.has_negative_zero))
    corr_t = correct and bool(correct_threshold) and not a_ptr and threshold > 0
    t_hi, t_lo = (0, 0) if a_ptr else _halves(threshold)
    s_hi, s_lo = _halves(scale)
    mu_hi, mu_lo = _halves(solved_mu) if correct else (0, 0)   # type: ignore[arg-type]
    common.update(CORR_T=corr_t, WRITE_USED=used is not None, **{f"I_{k.upper()}": SCALARS.index(v) for k, v in (
        ("n", "n"), ("zero", "n_zero"), ("nonfin", "n_nonfinite"), ("ln", "sum_ln_abs"))})
    host = (t_hi, t_lo, s_hi, s_lo, mu_hi, mu_lo)
    USED = used if used is not None else sums
    ST = stats if stats is not None else sums
    rows_k, had_k = _kernels(interpreting())
    passes = (True, False) if ta_mode == 3 else (False,)
    if hadamard is None:
        B = block_size
        BP = 1 << (B - 1).bit_length()
        R = max(1, TILE // BP)
        NB = -(-K // B)
        n_rows = P * NB * Q
        idx64 = max(n, n_rows * B) >= 1 << 31
        for amax_pass in passes:
            rows_k[(-(-n_rows // R),)](xc, res, A, ST, amx, counts, sums, USED, n_rows, Q, K, NB, NB * B, a_f, ta_f,
                                      pk1, pk2, rk1, rk2, *host, AMAX_PASS=amax_pass, B=B, BP=BP, R=R, IDX64=idx64,
                                      Q1=Q == 1, **common, enable_fp_fusion=False, num_warps=NUM_WARPS)
        return res.view(x.shape), counts, sums
    N = hadamard
    Mtok = P * Q
    MP = -(-Mtok // N) * N
    BK = max(1, min(max(1, TILE // N), 1 << (K - 1).bit_length()))
    SG = _signs_on(N, str(x.device))
    clip = torch.zeros(1, dtype=torch.int64, device=x.device)
    grid = (MP // N, -(-K // BK))
    for amax_pass in passes:
        had_k[grid](xc, res, A, SG, ST, amx, counts, sums, clip, USED, Mtok, Q, K, MP, a_f, ta_f, pk1, pk2, rk1, rk2,
                    *host, AMAX_PASS=amax_pass, N=N, LOGN=N.bit_length() - 1, NORM=float(np.float32(float(N) ** -0.5)),
                    BK=BK, **common, enable_fp_fusion=False, num_warps=NUM_WARPS)
    # the clipped share of the rotated entries (padding tokens included) times n, rounded down, as the CPU
    # path counts it: small device operations, nothing read back
    counts[3:4].add_(clip * n // (MP * K))
    return res.view(x.shape), counts, sums


@functools.lru_cache(maxsize=32)
def _signs_on(n: int, device: str) -> torch.Tensor:
    """The Hadamard transform's random signs (float32, :func:`gradstats.ops.hadamard.signs`) on ``device``, copied
    there once."""
    from gradstats.ops.hadamard import signs

    return torch.tensor(signs(n), dtype=torch.float32, device=device)
