"""Device functions the fused Triton kernels share, one home each: the random word of
:mod:`gradstats.ops.random`, stochastic pruning, the rounding of a magnitude to a format on its float32
bits, the per-tile counts and sums that :class:`gradstats.ops.fused.CompressCounts` reports, and the
drift of the lag correction (:func:`gradstats.apply.device.current_settings`).

The per-tensor kernel (:mod:`gradstats.ops.triton.fused`), the block-scaled kernels
(:mod:`gradstats.ops.triton.blocks`) and the quantiser's kernel (:mod:`gradstats.ops.triton.quantize`) call them; :func:`jit` builds a kernel with them bound, as Triton
functions (``triton.jit`` is applied on first use, so that ``TRITON_INTERPRET=1`` set before the first
call runs everything in Triton's interpreter).

Example:
    >>> sorted(HELPERS)
    ['_accumulate', '_drift', '_f64', '_max', '_prune', '_round', '_word']
"""
from __future__ import annotations

import functools
import types
from typing import Any, Callable

try:  # the bodies refer to ``tl``; they are only compiled when Triton is installed
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the installation
    tl = None

__all__ = ["HELPERS", "jit"]


def _word_src(c, k1, k2):
    """The 32-bit word of :mod:`gradstats.ops.random` at the low counter word ``c`` (int32), with ``k1`` the
    segment's first key plus the launch's start and ``k2`` its second key (int32 arithmetic wraps;
    ``>> s & mask`` is the logical shift)."""
    h = (c + k1) * 0x7FEB352D
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * (-2073254261) + k2
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * (-1640531535)
    return h


def _prune_src(w, c, a, pk1, pk2):
    """Stochastic pruning of the magnitudes ``w`` (float32; inf and NaN kept) at the float32 threshold ``a``:
    ``(w', pruned)``, with ``u`` the top 24 bits of the pruning stream's word at counter ``c`` and the test
    ``u * a < w`` in float32 (every engine's). ``pruned``: non-zero entries set to zero."""
    u = ((_word(c, pk1, pk2) >> 8) & 0xFFFFFF).to(tl.float32) * 5.960464477539063e-08  # noqa: F821 - bound by jit
    small = w < a
    up = u * a < w
    pruned = small & (up == 0) & (w != 0.0)
    return tl.where(small, tl.where(up, a, 0.0), w), pruned


def _round_src(b, r23, M: tl.constexpr, MSUB: tl.constexpr, E0F: tl.constexpr, MAXBITS: tl.constexpr,
               C0F: tl.constexpr, ROUNDING: tl.constexpr, OVFBITS: tl.constexpr = -1, TIES_UP: tl.constexpr = False,
               T_SUB: tl.constexpr = 0, SH_SUB: tl.constexpr = 0):
    """The float32 bits of the magnitude with bits ``b`` (int32 >= 0, inf included; a NaN's result means
    nothing, the caller replaces it) rounded to a format (``M`` mantissa bits, ``MSUB`` below ``2**emin``,
    ``E0F`` the biased float32 exponent of ``2**emin``, ``MAXBITS`` its max's bits, ``C0F`` its ``2**emin``),
    saturated at its max. ``ROUNDING``: 0 nearest-even, 1 stochastic with the 23 random bits ``r23``, 2
    toward zero. Integer arithmetic on the bits (no float arithmetic on subnormals, so a device that flushes
    them agrees).

    The quantiser's options (:mod:`gradstats.ops.triton.quantize`; the defaults are the fused kernels'):
    ``OVFBITS`` (>= 0) the bits a result above the max becomes instead of the max (its "nonfinite" mode);
    ``TIES_UP``: ties of a mantissa-free format (``M = 0``) round up in the normal range
    (:func:`gradstats.quantize`'s rule) instead of to the even exponent (the C kernel's); ``T_SUB`` (> 0):
    codes ``q < T_SUB`` below ``2**emin`` are float32 subnormals, made as ``q << SH_SUB`` (steps below
    float32's normal range)."""
    ex = b >> 23
    eff = tl.maximum(ex, 1)
    sig = (b & 0x7FFFFF) | tl.where(ex > 0, 0x800000, 0)
    sub = b < (E0F << 23)
    pre = tl.minimum(tl.where(sub, E0F - eff, 0), 30)
    if ROUNDING == 1:
        # normal range: add random bits below the kept ones, truncate (carries reach the exponent)
        res_n = ((b + (r23 >> M)) >> (23 - M)) << (23 - M)
        # below 2**emin: nearest-even on the grid 2**(emin-23), then the same on the fixed grid
        q0 = sig >> pre
        rem = sig - (q0 << pre)
        half = (1 << pre) >> 1
        nn = q0 + (((rem > half) | ((rem == half) & ((q0 & 1) == 1))) & (pre > 0)).to(tl.int32)
        q = (nn + (r23 >> MSUB)) >> (23 - MSUB)
    else:
        sh = tl.where(sub, tl.minimum(23 - MSUB + pre, 30), 23 - M)
        base = tl.where(sub, sig, b)
        q = base >> sh
        if ROUNDING == 0:  # nearest, ties to the even code (the exponent's lsb when M = 0)
            rem = base - (q << sh)
            half = (1 << sh) >> 1
            odd = (q & 1) == 1
            if TIES_UP:
                if M == 0:  # the significand 1 is odd: ties of a mantissa-free format round up
                    odd = odd | (sub == 0)
            q = q + (((rem > half) | ((rem == half) & odd)) & (sh > 0)).to(tl.int32)
        res_n = q << sh
    # q * 2**(emin - MSUB) below 2**emin: a float32 normal (the format's steps are), by an exact subtraction
    g = ((E0F << 23) + (q << (23 - MSUB))).to(tl.float32, bitcast=True)
    res_s = (g - C0F).to(tl.int32, bitcast=True)
    if T_SUB > 0:  # a float32 subnormal: by an integer shift
        res_s = tl.where(q < T_SUB, q << SH_SUB, res_s)
    res = tl.where(sub, res_s, res_n)
    if OVFBITS < 0:  # saturate, inf included
        res = tl.where(res > MAXBITS, MAXBITS, res)
    else:
        res = tl.where(res > MAXBITS, OVFBITS, res)
    return res


def _accumulate_src(CNT, SUMS, v, ow, mask, pruned, under, over):
    """Add a tile's counts (zeros of the result ``ow`` as written, pruned, underflow, saturated, non-finite
    inputs: int64) and sums (over the finite entries of the input ``v``: ``v*o``, ``v**2``, ``(o-v)**2``,
    ``v**2 (o-v)**2``, ``|o|``, ``|v|``, float64) to the call's totals, atomically. ``tl.reduce`` with
    ``tl.sum``'s combine function (what ``tl.sum`` does), which Triton's interpreter runs also when it was
    switched on after triton was imported; over every dimension of the tile."""
    fin = (v.to(tl.int32, bitcast=True) & 0x7FFFFFFF) < 0x7F800000
    tl.atomic_add(CNT + 0, tl.reduce(((ow == 0.0) & mask).to(tl.int64), None, tl.standard._sum_combine))
    tl.atomic_add(CNT + 1, tl.reduce(pruned.to(tl.int64), None, tl.standard._sum_combine))
    tl.atomic_add(CNT + 2, tl.reduce(under.to(tl.int64), None, tl.standard._sum_combine))
    tl.atomic_add(CNT + 3, tl.reduce(over.to(tl.int64), None, tl.standard._sum_combine))
    tl.atomic_add(CNT + 4, tl.reduce(((fin == 0) & mask).to(tl.int64), None, tl.standard._sum_combine))
    keep = fin & mask
    xd = tl.where(keep, v, 0.0).to(tl.float64)
    od = tl.where(keep, ow, 0.0).to(tl.float64)
    d = od - xd
    xx = xd * xd
    tl.atomic_add(SUMS + 0, tl.reduce(xd * od, None, tl.standard._sum_combine))
    tl.atomic_add(SUMS + 1, tl.reduce(xx, None, tl.standard._sum_combine))
    tl.atomic_add(SUMS + 2, tl.reduce(d * d, None, tl.standard._sum_combine))
    tl.atomic_add(SUMS + 3, tl.reduce(xx * (d * d), None, tl.standard._sum_combine))
    tl.atomic_add(SUMS + 4, tl.reduce(tl.abs(od), None, tl.standard._sum_combine))
    tl.atomic_add(SUMS + 5, tl.reduce(tl.abs(xd), None, tl.standard._sum_combine))


def _f64_src(hi, lo):
    """The float64 whose bits are the int32 halves ``hi`` (high word) and ``lo``."""
    return ((hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)).to(tl.float64, bitcast=True)


def _drift_src(ST, mu_hi, mu_lo, I_N: tl.constexpr, I_ZERO: tl.constexpr, I_NONFIN: tl.constexpr,
               I_LN: tl.constexpr):
    """The lag correction's drift (float64): the mean ``ln|g|`` of the statistics vector ``ST`` minus the
    ``solved_mu`` whose bits are ``mu_hi, mu_lo`` (0 without non-zero finite entries), as
    :func:`gradstats.apply.device.current_settings` makes it."""
    mu = _f64(mu_hi, mu_lo)  # noqa: F821 - bound by jit
    n_nz = tl.load(ST + I_N) - tl.load(ST + I_ZERO) - tl.load(ST + I_NONFIN)
    return tl.where(n_nz > 0, tl.load(ST + I_LN) / tl.maximum(n_nz, 1.0) - mu, 0.0)


def _max_src(a, b):
    """The combine function of a maximum (``tl.reduce(x, axis, _max)``), built with the kernels, so that Triton's
    interpreter runs it also when it was switched on after triton was imported (``tl.max``'s is not)."""
    return tl.maximum(a, b)


#: the shared device functions by the name kernels call them with
HELPERS: dict[str, Callable[..., Any]] = {"_word": _word_src, "_prune": _prune_src, "_round": _round_src,
                                          "_accumulate": _accumulate_src, "_max": _max_src, "_f64": _f64_src,
                                          "_drift": _drift_src}


def _rebind(fn: Callable[..., Any], g: dict[str, Any]) -> Callable[..., Any]:
    """``fn`` with the globals ``g`` (its code, name and source unchanged)."""
    new = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    new.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    return new


@functools.lru_cache(maxsize=2)
def _helpers(interpret: bool) -> dict[str, Any]:  # noqa: ARG001 - the cache key: Triton decides at decoration
    import triton

    g = dict(globals())
    made = {name: triton.jit(_rebind(src, g)) for name, src in HELPERS.items()}
    g.update(made)  # the helpers call each other through g
    return made


def jit(src: Callable[..., Any], interpret: bool, **kwargs: Any) -> Any:
    """``triton.jit`` of the kernel source ``src`` with the shared device functions (:data:`HELPERS`) bound
    to its names (the keys of :data:`HELPERS`); ``interpret``: whether Triton's
    interpreter is on (the cache key: Triton decides at decoration).

    Example (needs Triton)::

        kernel = jit(_kernel_src, interpreting(), do_not_specialize=["n"])
    """
    import triton

    g = dict(src.__globals__)
    g.update(_helpers(interpret))
    return triton.jit(_rebind(src, g), **kwargs)
