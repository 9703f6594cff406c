"""Triton kernel of :func:`gradstats.ops.fused.prune_quantize`: stochastic pruning, rounding to a format at a
per-tensor scale, and the call's counts and sums, in one pass over the tensor with no host synchronisation.

The kernel reads ``x`` once in its own dtype (float32, bfloat16 or float16; computed in float32) and writes
the result once in that dtype. Each program reduces its tile's counts (zeros, pruned, underflow, saturated,
non-finite: int64) and sums (``x*o``, ``x**2``, ``(o-x)**2``, ``x**2 (o-x)**2``, ``|o|``, ``|x|`` over the
finite entries: float64) and adds them to two small device tensors with ``tl.atomic_add``, so a caller
can accumulate over many calls and read the totals once. The threshold and the scale may be Python floats
or one-element tensors on ``x``'s device, read inside the kernel: a threshold solved on the device
never visits the host. Given the call's statistics vector, the kernel also corrects host-solved settings
for the drift of the gradient's location (what :func:`gradstats.apply.device.current_settings` does with
small tensor operations), in float64 in every program, and records the settings it used: a planned call
on the device is then one statistics launch and this one.

The semantics are those of the fused C kernel (``gradstats/ops/native/prune_quant.c``), element by
element: the same random words (the pruning and rounding streams of one seed of
:mod:`gradstats.ops.random`, at each element's flat index), the pruning test ``u * a < |x|`` in float32,
the rounding of ``|x| * scale`` on its float32 bits (integer arithmetic, as the quantiser's kernel
:mod:`gradstats.ops.triton.quantize`; ties of a mantissa-free format go to the even exponent, as in the
C kernel), saturation at the format's max, division by multiplying with ``1 / scale`` rounded to
float32, and NaN passed through. So for one seed the result equals the C kernel's on ``x.float()`` bit
for bit, and ``quantize(stochastic_prune(x, a, seed=s), fmt, scale=, rounding=, seed=s)`` for power-of-two
scales (except ties in a mantissa-free format, which :func:`gradstats.quantize` rounds up, and, for half
inputs, a threshold that is not a value of ``x``'s dtype: the threshold is rounded to float32 here, to
``x``'s dtype there). Counts are exact; the float64 sums are added in an order that depends on the
scheduling, so they agree with the C kernel's to rounding (the tests ask 1e-9 relative). For half-precision inputs the zeros and the
sums are those of the result as written (in ``x``'s dtype), the underflow and saturation counts those
of the rounding step.

Example:
    >>> from gradstats.formats import FPFormat
    >>> supports(FPFormat.parse("e4m3fn")), supports(FPFormat.parse("e4m3fn"), block_size=32)
    (True, False)
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Union

import numpy as np
import torch

from gradstats.formats import ROUNDING_CODES, FPFormat
from gradstats.ops import random as _rng
from gradstats.ops.triton import interpreting, triton_available

try:  # the kernel body refers to ``tl``; it is only compiled when Triton is installed
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the installation
    tl = None

__all__ = ["supports", "prune_quantize_triton", "BLOCK", "COUNT_NAMES", "SUM_NAMES"]

#: elements per Triton program (one tile; its counts and sums are added atomically)
BLOCK = 2048
#: the entries of the ``counts`` tensor (int64)
COUNT_NAMES = ("zeros", "pruned", "underflow", "saturated", "nonfinite")
#: the entries of the ``sums`` tensor (float64), as :class:`gradstats.ops.fused.CompressCounts` names them
SUM_NAMES = ("dot", "norm2", "err2", "noise2", "abs_out", "abs_in")

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supports(fmt: FPFormat | str | None, block_size: int | None = None) -> bool:
    """Whether :func:`prune_quantize_triton` handles ``fmt``: no format (pruning only) or one the fused C
    kernel covers (signed, with a zero, steps not below float32's subnormal range), a per-tensor scale
    (``block_size`` None), and Triton installed.

    Example:
        >>> supports(None), supports("e2m1fn"), supports("bf16"), supports("e2m1fn", block_size=16)
        (True, True, False, False)
    """
    from gradstats.ops.consts import fused_covers

    if block_size is not None or not triton_available():
        return False
    fmt = FPFormat.parse(fmt) if isinstance(fmt, str) else fmt
    return fused_covers(fmt, 1.0)


def _kernel_src(X, Y, A, S, CNT, SUMS, ST, USED, n, a_f, scale_f, inv_f, pk1, pk2, rk1, rk2,  # floats as int32 bits
                t_hi, t_lo, s_hi, s_lo, mu_hi, mu_lo, l2_hi, l2_lo,  # float64s as the two halves of their bits
                PRUNE: tl.constexpr, A_PTR: tl.constexpr, QUANT: tl.constexpr, SCALE_MODE: tl.constexpr,
                S_PTR: tl.constexpr, CORRECT: tl.constexpr, CORR_T: tl.constexpr, WRITE_USED: tl.constexpr,
                I_N: tl.constexpr, I_ZERO: tl.constexpr, I_NONFIN: tl.constexpr, I_LN: tl.constexpr,
                I_MAX: tl.constexpr, FMAX_BITS: tl.constexpr,
                M: tl.constexpr, MSUB: tl.constexpr, E0F: tl.constexpr, MAXBITS: tl.constexpr,
                C0F: tl.constexpr, ROUNDING: tl.constexpr, NEG_ZERO: tl.constexpr, BF16: tl.constexpr,
                BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # int64: tensors beyond 2**31 elements
    mask = offs < n
    # the host's float64s (threshold, scale: what is used, and corrected, unless a tensor or corrected below)
    t64 = _f64(t_hi, t_lo)  # noqa: F821 - bound by common.jit
    s64 = _f64(s_hi, s_lo)  # noqa: F821
    if A_PTR:
        t64 = tl.load(A).to(tl.float64)
    if S_PTR:
        s64 = tl.load(S).to(tl.float64)
    if CORRECT:  # the lag correction (gradstats.apply.device.current_settings), the same scalars in every program
        drift = _drift(ST, mu_hi, mu_lo, I_N, I_ZERO, I_NONFIN, I_LN)  # noqa: F821
        if CORR_T:
            a_c = (t64 * tl.exp(drift)).to(tl.float32)
            t64 = a_c.to(tl.float64)
        if SCALE_MODE == 3:
            l2 = _f64(l2_hi, l2_lo)  # noqa: F821
            ln2 = tl.full([], 0x3FE62E42FEFA39EF, tl.int64).to(tl.float64, bitcast=True)  # math.log(2)
            y = l2 - drift / ln2
            r = tl.floor(y)  # rounded half to even (torch.round): y - floor(y) is exact
            d = y - r
            odd = tl.floor(r * 0.5) * 2.0 != r
            r = tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)
            s_c = tl.exp2(r)
            top = tl.load(ST + I_MAX)  # nan_to_num(top, 0.0): NaN to 0, +-inf to +-the largest float64
            big = tl.full([], 0x7FEFFFFFFFFFFFFF, tl.int64).to(tl.float64, bitcast=True)
            top = tl.where(top != top, 0.0, tl.where(top == float("inf"), big, tl.where(top == -float("inf"), -big,
                                                                                         top)))
            top = tl.maximum(top, t64)
            tiny = tl.full([], 0x01A56E1FC2F8F359, tl.int64).to(tl.float64, bitcast=True)  # 1e-300
            fmax = tl.full([], FMAX_BITS, tl.int64).to(tl.float64, bitcast=True)
            room = (1.0 / tl.maximum(top, tiny)) * fmax  # fmax / top as torch makes it: reciprocal, then product
            cap = tl.where(top > 0, tl.exp2(tl.floor(tl.log2(room))), s_c)
            s_c = tl.minimum(s_c, cap).to(tl.float32)
            s64 = s_c.to(tl.float64)
    if WRITE_USED:  # program 0 records the threshold and the scale of the call
        tl.store(USED + 0, t64, mask=pid == 0)
        tl.store(USED + 1, s64, mask=pid == 0)
    if BF16:  # widened by its bits: exact everywhere (Triton's interpreter mangles float32-subnormal bfloat16)
        v = (tl.load(X + offs, mask=mask, other=0.0).to(tl.int16, bitcast=True).to(tl.int32) << 16).to(
            tl.float32, bitcast=True)
    else:
        v = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    vb = v.to(tl.int32, bitcast=True)
    neg = vb < 0
    absb = vb & 0x7FFFFFFF
    isnan = absb > 0x7F800000
    w = absb.to(tl.float32, bitcast=True)
    c = offs.to(tl.int32)  # the low word of the element's counter (k1 carries the segment's start)
    pruned = mask & (mask == 0)
    if PRUNE:
        if CORR_T:
            a = a_c
        elif A_PTR:
            a = tl.load(A).to(tl.float32)
        else:
            a = a_f.to(tl.float32, bitcast=True)
        w, pruned = _prune(w, c, a, pk1, pk2)  # noqa: F821 - bound by common.jit
        pruned = pruned & mask
    rb = w.to(tl.int32, bitcast=True)
    under = pruned & (mask == 0)
    over = under
    if QUANT:
        if SCALE_MODE == 1:
            ws = w * scale_f.to(tl.float32, bitcast=True)
            inv = inv_f.to(tl.float32, bitcast=True)
        elif SCALE_MODE == 2:
            s = tl.load(S).to(tl.float32)
            ws = w * s
            inv = tl.math.div_rn(tl.full([BLOCK], 1.0, tl.float32), s)
        elif SCALE_MODE == 3:
            ws = w * s_c
            inv = tl.math.div_rn(tl.full([BLOCK], 1.0, tl.float32), s_c)
        else:
            ws = w
        b = ws.to(tl.int32, bitcast=True)  # >= 0: |x| * scale
        over = (b > MAXBITS) & (b <= 0x7F800000) & mask
        r23 = b
        if ROUNDING == 1:
            r23 = (_word(c, rk1, rk2) >> 9) & 0x7FFFFF  # noqa: F821 - the rounding stream's word
        res = _round(b, r23, M, MSUB, E0F, MAXBITS, C0F, ROUNDING)  # noqa: F821
        under = (res == 0) & (w != 0.0) & (isnan == 0) & mask
        if SCALE_MODE == 0:
            rb = res
        else:
            rb = (res.to(tl.float32, bitcast=True) * inv).to(tl.int32, bitcast=True)
    if NEG_ZERO:
        ob = tl.where(neg, rb | (-2147483648), rb)
    else:  # zeros are +0 in a format without -0
        ob = tl.where(neg & (rb != 0), rb | (-2147483648), rb)
    o = tl.where(isnan, v, ob.to(tl.float32, bitcast=True))
    if BF16:  # rounded to nearest even by its bits (a NaN stays a NaN), as the hardware's conversion
        o32 = o.to(tl.int32, bitcast=True)
        r = tl.where(isnan, o32 | 0x400000, o32 + 0x7FFF + ((o32 >> 16) & 1))
        h = (r >> 16).to(tl.int16)
        tl.store(Y + offs, h.to(tl.bfloat16, bitcast=True), mask=mask)
        ow = (h.to(tl.int32) << 16).to(tl.float32, bitcast=True)  # the result as written
    else:
        ov = o.to(Y.dtype.element_ty)
        tl.store(Y + offs, ov, mask=mask)
        ow = ov.to(tl.float32)  # the result as written
    _accumulate(CNT, SUMS, v, ow, mask, pruned, under, over)  # noqa: F821 - bound by common.jit


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):  # noqa: ARG001 - the cache key: Triton decides at decoration
    from gradstats.ops.triton.common import jit

    return jit(_kernel_src, interpret, do_not_specialize=["n", "a_f", "scale_f", "inv_f", "pk1", "pk2", "rk1", "rk2",
                                                   "t_hi", "t_lo", "s_hi", "s_lo", "mu_hi", "mu_lo", "l2_hi", "l2_lo"])


def _bits(v) -> int:
    """The float32 bits of ``v`` as a signed int: a float kernel argument arrives as float64 where it is not a
    float32 normal (``2**-127``) and as a Python float in the interpreter; its bits arrive unchanged."""
    return int(np.asarray(v, dtype=np.float32).view(np.int32))


def _halves(v: float) -> tuple[int, int]:
    """The float64 bits of ``v`` as two signed int32s, high word first: a float64 reaches the kernel exactly (a
    float kernel argument arrives as float32 where it is one) and an int32 argument keeps one signature."""
    b = int(np.asarray(v, dtype=np.float64).view(np.int64))
    return b >> 32, _rng._s32(b)


def _segments(n: int) -> list[tuple[int, int]]:
    """``(start, length)`` of the launches: one per ``2**32`` segment of the counter (each has its own keys)."""
    seg = 1 << 32
    return [(p, min(n - p, seg)) for p in range(0, n, seg)]


def _check_value(v, name: str, x: torch.Tensor, positive: bool) -> None:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or not v.is_floating_point() or v.device != x.device:
            raise ValueError(f"{name} as a tensor must hold one floating-point value on x's device {x.device}; "
                             f"got shape {tuple(v.shape)}, dtype {v.dtype}, device {v.device}")
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a float or a one-element tensor, got {type(v).__name__}")
    if not math.isfinite(v) or (v <= 0 if positive else v < 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0 (0 = no pruning)'}, got {v}")


def _check_acc(t: torch.Tensor | None, name: str, size: int, dtype: torch.dtype, x: torch.Tensor) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.shape != (size,) or t.device != x.device \
            or not t.is_contiguous():
        got = (tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape ({size},) on {x.device} "
                         f"(it is added to); got {got}")


def _check_correction(x: torch.Tensor, threshold, scale, stats, solved_mu, used) -> bool:
    """Validate the lag correction's arguments; whether it applies (``stats`` and a finite ``solved_mu``)."""
    if used is not None and (not isinstance(used, torch.Tensor) or used.dtype != torch.float64
                             or used.shape != (2,) or used.device != x.device or not used.is_contiguous()):
        got = (tuple(used.shape), used.dtype, used.device) if isinstance(used, torch.Tensor) else type(used).__name__
        raise ValueError(f"used must be a contiguous float64 tensor of shape (2,) on {x.device} (the threshold and "
                         f"scale are written into it); got {got}")
    if stats is None:
        if solved_mu is not None:
            raise ValueError("solved_mu corrects the settings by the call's statistics: pass stats= (the float64 "
                             "statistics vector of x on its device) with it, or leave solved_mu out")
        return False
    from gradstats.ops.triton.stats import SCALARS as SCALAR_FIELDS

    if not isinstance(stats, torch.Tensor) or stats.dtype != torch.float64 or stats.dim() != 1 \
            or stats.numel() < len(SCALAR_FIELDS) or stats.device != x.device or not stats.is_contiguous():
        got = (tuple(stats.shape), stats.dtype, stats.device) if isinstance(stats, torch.Tensor) \
            else type(stats).__name__
        raise ValueError(f"stats must be a contiguous 1-d float64 statistics vector (gradstats.stats.fields.LAYOUT, "
                         f"at least {len(SCALAR_FIELDS)} entries) on {x.device}; got {got}")
    if solved_mu is None:
        return False
    if isinstance(solved_mu, bool) or not isinstance(solved_mu, (int, float)) or math.isinf(solved_mu):
        raise ValueError(f"solved_mu must be a finite float (NaN: nothing to correct), got {solved_mu!r}")
    if math.isnan(solved_mu):
        return False
    if isinstance(threshold, torch.Tensor) or isinstance(scale, torch.Tensor):
        raise ValueError("with solved_mu the threshold and scale are the host-solved Python floats the kernel "
                         "corrects; pass floats, or leave solved_mu out to use tensors as they are")
    return True


class _Prepared(NamedTuple):
    """What :func:`_prepare` makes of a kernel call's arguments."""

    xc: torch.Tensor  # x, detached and contiguous
    res: torch.Tensor  # the result: out, or a new contiguous tensor like x
    counts: torch.Tensor  # int64[5], given or zeroed
    sums: torch.Tensor  # float64[6], given or zeroed
    n: int  # x's number of elements (0: launch nothing)
    correct: bool  # whether the lag correction applies
    a_ptr: bool  # the threshold is a one-element tensor read by the kernel
    prune: bool  # whether the kernel prunes
    a_f: int  # a host threshold's float32 bits (0 for a tensor)
    A: torch.Tensor  # the threshold's pointer (counts when it is a host float: not read)


def _prepare(x: torch.Tensor, threshold, scale, out: torch.Tensor | None, counts: torch.Tensor | None,
             sums: torch.Tensor | None, stats, solved_mu, used) -> _Prepared:
    """The checks and set-up the per-tensor and the block kernels' entries share: ``out``, ``counts``, ``sums``
    and the lag correction's arguments validated (``threshold`` and ``scale`` already are), ``x`` made
    contiguous, the result, ``counts`` and ``sums`` allocated where not given, and the threshold as the
    kernels take it. The caller returns ``(res, counts, sums)`` as they are when ``n`` is 0."""
    if out is not None and (not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype
                            or out.device != x.device or not out.is_contiguous()):
        seen = (tuple(out.shape), out.dtype, out.device) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out must be a contiguous tensor of x's shape {tuple(x.shape)}, dtype {x.dtype} and "
                         f"device {x.device}; got {seen}")
    _check_acc(counts, "counts", 5, torch.int64, x)
    _check_acc(sums, "sums", 6, torch.float64, x)
    correct = _check_correction(x, threshold, scale, stats, solved_mu, used)
    xc = x.detach()
    if not xc.is_contiguous():
        xc = xc.contiguous()
    res = out if out is not None else torch.empty_like(xc, memory_format=torch.contiguous_format)
    if counts is None:
        counts = torch.zeros(5, dtype=torch.int64, device=x.device)
    if sums is None:
        sums = torch.zeros(6, dtype=torch.float64, device=x.device)
    a_ptr = isinstance(threshold, torch.Tensor)
    prune = a_ptr or threshold > 0
    a_f = 0 if a_ptr else _bits(threshold)
    A = threshold.reshape(1) if isinstance(threshold, torch.Tensor) else counts
    return _Prepared(xc, res, counts, sums, xc.numel(), correct, a_ptr, bool(prune), a_f, A)


def prune_quantize_triton(x: torch.Tensor, threshold: Union[float, torch.Tensor], fmt: FPFormat | str | None, *,
                          scale: Union[float, torch.Tensor] = 1.0, rounding: str = "nearest", seed: int = 0,
                          out: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                          sums: torch.Tensor | None = None, stats: torch.Tensor | None = None,
                          solved_mu: float | None = None, correct_threshold: bool = True,
                          correct_scale: bool = True, used: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stochastic pruning at ``threshold`` (0 = none), then rounding to ``fmt`` (None = none) at ``scale``
    with ``rounding``, saturating at the format's max, in one Triton kernel. Returns ``(result, counts, sums)``.

    ``threshold`` and ``scale`` are Python floats or one-element floating-point tensors on ``x``'s device
    (read by the kernel, rounded to float32; a tensor threshold <= 0 prunes nothing, a tensor scale must be
    positive: its value is not checked, which would need the host). ``seed`` (an int in ``[0, 2**64)``)
    seeds the pruning and the rounding streams. ``counts`` (int64, 5: zeros, pruned, underflow, saturated,
    nonfinite; :data:`COUNT_NAMES`) and ``sums`` (float64, 6: dot, norm2, err2, noise2, abs_out, abs_in;
    :data:`SUM_NAMES`) are added to when given, else made zeroed; ``out`` (contiguous, of ``x``'s shape,
    dtype and device) receives the result. ``x`` is float32, bfloat16 or float16 on CUDA (or the CPU
    under ``TRITON_INTERPRET=1``); a non-contiguous ``x`` is copied first (one more pass). Nothing is read
    back to the host; the only ATen op on a tensor of ``x``'s size is the allocation of the result.

    **The lag correction.** With ``stats`` (the call's float64 statistics vector on ``x``'s device, layout
    :data:`gradstats.stats.fields.LAYOUT`) and ``solved_mu`` (the mean ``ln|g|`` the host-solved ``threshold``
    and ``scale``, Python floats, were solved from; NaN = nothing to correct), every program first computes
    the settings :func:`gradstats.apply.device.current_settings` makes with about a dozen small ops, in the
    same float64 arithmetic: ``drift = mean ln|g| of stats - solved_mu`` (0 without non-zero finite entries);
    the threshold ``threshold * exp(drift)`` rounded to float32 (when ``threshold > 0`` and
    ``correct_threshold``); the scale (when quantising and ``correct_scale``: per-tensor, not "fixed")
    ``2**round(log2(scale) - drift / ln 2)``, lowered to ``2**floor(log2(fmax / top))`` where ``top``, the
    larger of the statistics' ``max_abs`` and the threshold, would saturate, rounded to float32. It then
    prunes and rounds with them as with one-element tensors of those values, in the same launch.
    ``used`` (float64, 2, on ``x``'s device) receives the ``(threshold, scale)`` the kernel used, as float64
    (written by program 0, also without the correction). An empty ``x`` launches nothing: ``counts``, ``sums``
    and ``used`` are left as they are.

    Example (``TRITON_INTERPRET=1`` runs the kernel on the CPU; on CUDA it is not needed):
        >>> import os
        >>> old = os.environ.get("TRITON_INTERPRET"); os.environ["TRITON_INTERPRET"] = "1"
        >>> x = torch.tensor([0.001, -0.3, 0.6, 5.0, 1000.0])
        >>> y, counts, sums = prune_quantize_triton(x, 0.5, "e3m2fn", seed=0)
        >>> y.tolist()[2:], counts.tolist()
        ([0.625, 5.0, 28.0], [2, 2, 0, 1, 0])
        >>> from gradstats.stats import tensor_stats_vector
        >>> v, used = tensor_stats_vector(x, full=False), torch.zeros(2, dtype=torch.float64)
        >>> mu_now = float(v[6] / v[0])  # solved when the gradient was half as large: drift ln 2
        >>> y, counts, _ = prune_quantize_triton(x, 0.5, "e3m2fn", stats=v, solved_mu=mu_now - math.log(2), used=used)
        >>> used.tolist(), y.tolist()[3:]  # threshold 0.5 * 2; scale 1/2, capped at 2**-6 (28 / 1000)
        ([1.0, 0.015625], [4.0, 1024.0])
        >>> _ = os.environ.pop("TRITON_INTERPRET") if old is None else os.environ.update(TRITON_INTERPRET=old)
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in _DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"prune_quantize_triton expects a float32, bfloat16 or float16 tensor, got {got}")
    fmt = FPFormat.parse(fmt) if isinstance(fmt, str) else fmt
    if fmt is not None and not isinstance(fmt, FPFormat):
        raise ValueError(f"fmt must be an FPFormat, a format name or None, got {type(fmt).__name__}")
    if not supports(fmt):
        raise ValueError(f"format {fmt} is not one the fused kernel covers (signed, with a zero, steps not below "
                         f"float32's subnormal range) or Triton is missing: use gradstats.ops.fused.prune_quantize")
    if rounding not in ROUNDING_CODES:
        raise ValueError(f"rounding must be one of {sorted(ROUNDING_CODES)}, got {rounding!r}")
    _check_value(threshold, "threshold", x, positive=False)
    _check_value(scale, "scale", x, positive=True)
    seed = _rng.resolve_seed(seed, None, "prune_quantize_triton")
    p = _prepare(x, threshold, scale, out, counts, sums, stats, solved_mu, used)
    if p.n == 0:
        return p.res, p.counts, p.sums
    xc, res, counts, sums, n, correct = p.xc, p.res, p.counts, p.sums, p.n, p.correct
    a_ptr, prune, a_f, A = p.a_ptr, p.prune, p.a_f, p.A
    q = fmt is not None
    s_ptr = isinstance(scale, torch.Tensor)
    S, scale_f, inv_f, smode = (scale.reshape(1) if s_ptr else counts), 0, 0, 0
    corr_t = correct and bool(correct_threshold) and threshold > 0
    if q and correct and correct_scale:
        smode = 3
    elif q and s_ptr:
        smode = 2
    elif q and float(scale) != 1.0:
        s32 = np.float32(scale)
        scale_f, inv_f, smode = _bits(s32), _bits(np.float32(1.0) / s32), 1  # 1 / scale as the C kernel
    t_hi, t_lo = (0, 0) if a_ptr else _halves(threshold)
    s_hi, s_lo = (0, 0) if s_ptr else _halves(scale)
    mu_hi, mu_lo = _halves(solved_mu) if correct else (0, 0)
    l2_hi, l2_lo = _halves(math.log2(scale)) if smode == 3 else (0, 0)
    ST = stats if correct else sums
    USED = used if used is not None else sums
    from gradstats.ops.triton.stats import SCALARS

    ix = {k: SCALARS.index(k) for k in ("n", "n_zero", "n_nonfinite", "sum_ln_abs", "max_abs")}
    if fmt is not None:
        from gradstats.ops.consts import consts

        c = consts(fmt)
        M, MSUB, E0F, MAXBITS, C0F = c.M, c.Msub, c.E0F, c.MAXBITS, fmt.min_normal
        neg_zero = fmt.has_negative_zero
        fmax_bits = int(np.asarray(fmt.max, dtype=np.float64).view(np.int64))
    else:
        M, MSUB, E0F, MAXBITS, C0F, neg_zero, fmax_bits = 0, 0, 1, 0, 1.0, True, 0
    sp, sr = _rng.stream(seed, _rng.PRUNE), _rng.stream(seed, _rng.ROUND)
    kern = _kernel(interpreting())
    segs = _segments(n)
    for pos, m in segs:
        (p1, p2), (r1, r2) = _rng.segment_key(sp, pos >> 32), _rng.segment_key(sr, pos >> 32)
        pk1, pk2, rk1, rk2 = _rng._s32(pos + p1), _rng._s32(p2), _rng._s32(pos + r1), _rng._s32(r2)
        X, Y = (xc, res) if len(segs) == 1 else (xc.view(-1)[pos:pos + m], res.view(-1)[pos:pos + m])
        kern[(-(-m // BLOCK),)](
            X, Y, A, S, counts, sums, ST, USED, m, a_f, scale_f, inv_f, pk1, pk2, rk1, rk2,
            t_hi, t_lo, s_hi, s_lo, mu_hi, mu_lo, l2_hi, l2_lo,
            PRUNE=bool(prune), A_PTR=a_ptr, QUANT=q, SCALE_MODE=smode, S_PTR=s_ptr, CORRECT=correct,
            CORR_T=bool(corr_t), WRITE_USED=used is not None, I_N=ix["n"], I_ZERO=ix["n_zero"],
            I_NONFIN=ix["n_nonfinite"], I_LN=ix["sum_ln_abs"], I_MAX=ix["max_abs"], FMAX_BITS=fmax_bits,
            M=M, MSUB=MSUB, E0F=E0F, MAXBITS=MAXBITS,
            C0F=C0F, ROUNDING=ROUNDING_CODES[rounding], NEG_ZERO=bool(neg_zero), BF16=xc.dtype == torch.bfloat16,
            BLOCK=BLOCK)
    return res, counts, sums
