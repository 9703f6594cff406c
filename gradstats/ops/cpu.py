"""The CPU engine: the native stochastic prune and cache-blocked numpy sweeps over a flat
float32/float64 array.

Stochastic pruning of float32 arrays goes through the C kernel of
``gradstats/ops/native/prune_quant.c`` in its prune-only mode (:func:`native_stochastic_prune`),
the same kernel that prunes and quantises in the apply module's backward pass: one read of
``x``, one write, the uniform made in registers from the counter-based stream of
``(seed, index)`` (:func:`gradstats.ops.random.uniforms` reproduces it), blocks spread over OpenMP threads.
The result depends on the seed alone, not on the number of threads. float64 arrays take the
kernel's float64 twin (``gs_stochastic_prune_f64``, 53-bit uniforms).

Without a C compiler (or with ``GRADSTATS_NATIVE=0``), for explicit uniforms,
and for the statistics and histogram sweeps, the numpy engine below is used. Whole-tensor
torch ops on the CPU each stream the full tensor through memory, and torch's generator fills
uniforms on one thread; a stochastic prune written that way makes about eight passes over the
data. Here the tensor is cut into blocks that stay in the L2 cache; each block goes through a
short sequence of numpy ufuncs (which release the GIL) on per-thread scratch buffers, and
blocks are spread over a small thread pool. Memory sees one read of ``x`` per sweep and one
write of the output.

Random numbers (both engines): the one counter-based stream of :mod:`gradstats.ops.random`,
the pruning stream of the seed at each element's index (24-bit uniforms for float32, 53-bit for
float64), so the C kernel, the numpy engine, the torch path and the Triton kernel give the same
bits for the same seed, whatever the block size or the number of threads.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable

import numpy as np

from gradstats import _threads
from gradstats.ops import random as _rng

#: elements per block (float32: 256 KiB, a fraction of a core's L2 cache)
BLOCK = 1 << 16

_local = threading.local()
_SIGN32 = np.int32(-2 ** 31)
_SIGN64 = np.int64(-2 ** 63)


def _map(fn: Callable[[int], Any], n: int) -> list[Any]:
    k = (n + BLOCK - 1) // BLOCK
    if k <= 1 or _threads.workers() == 1 or _threads.in_worker():
        return [fn(i) for i in range(k)]
    return list(_threads.pool().map(fn, range(k)))


def _scratch(dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    key = np.dtype(dtype).char
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    if key not in bufs or bufs[key][0].shape[0] < BLOCK:
        bufs[key] = (np.empty(BLOCK, dtype), np.empty(BLOCK, dtype), np.empty(BLOCK, np.bool_))
    return bufs[key]


def _uscratch(wide: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Per-thread uint32 scratch (two words) and, for float64 uniforms, a uint64 one."""
    bufs = getattr(_local, "ubufs", None)
    if bufs is None or bufs[0].shape[0] < BLOCK or (wide and bufs[2] is None):
        bufs = _local.ubufs = (np.empty(BLOCK, np.uint32), np.empty(BLOCK, np.uint32),
                               np.empty(BLOCK, np.uint64) if wide else None)
    return bufs


# --------------------------------------------------------------------------- statistics sweep
def _ones(dtype: np.dtype) -> np.ndarray:
    key = "ones" + np.dtype(dtype).char
    v = getattr(_local, key, None)
    if v is None or v.shape[0] < BLOCK:
        v = np.ones(BLOCK, dtype)
        setattr(_local, key, v)
    return v


def _log_centre(x: np.ndarray) -> float:
    """A rough mean of ``ln|x|`` from at most 4096 evenly spaced entries (0 if all are zero)."""
    step = max(1, x.shape[0] // 4096)
    a = np.abs(x[::step].astype(np.float64))
    a = a[(a > 0) & np.isfinite(a)]
    return float(np.log(a).mean()) if a.size else 0.0


def moments(x: np.ndarray, *, logs: bool = True, sums: bool = False) -> dict[str, Any]:
    """One sweep over a flat array: ``n``, ``n_zero``; with ``logs`` the sums ``sum_ln_abs``,
    ``sum_ln_abs_sq`` over the non-zero entries; with ``sums`` also ``sum_abs``, ``sum_sq``.

    The logs are taken of ``|x| * e^-c`` with ``c`` a rough mean of ``ln|x|`` (from a few
    thousand entries), so the squares summed in the array's dtype are of centred values and a
    large ``|mu|`` costs no precision; zeros are mapped to 1 before the log (contributing 0).
    Block sums are BLAS dot products; blocks are combined in float64. ``finite`` is False when
    inf/NaN (or an overflowing sum) made a requested sum non-finite; the caller then uses the
    robust :mod:`gradstats.stats` path.
    """
    n = x.shape[0]
    dt = x.dtype.type
    c = _log_centre(x) if logs else 0.0
    k_scale = dt(math.exp(-c))

    def block(k: int) -> tuple[float, ...]:
        s, e = k * BLOCK, min(n, (k + 1) * BLOCK)
        w, z, m = _scratch(x.dtype)
        w, z, m = w[: e - s], z[: e - s], m[: e - s]
        ones = _ones(x.dtype)[: e - s]
        np.abs(x[s:e], out=w)
        sabs = ssq = 0.0
        if sums:
            sabs, ssq = float(np.dot(w, ones)), float(np.dot(w, w))
        np.equal(w, 0, out=m)
        n0 = int(np.count_nonzero(m))
        if not logs or n0 == e - s:
            return (n0, sabs, ssq, 0.0, 0.0)
        np.multiply(w, k_scale, out=w)
        if n0:
            np.copyto(z, m, casting="unsafe")
            np.add(w, z, out=w)  # zeros -> 1, whose log is 0
        np.log(w, out=w)  # inf and NaN propagate into both sums
        return (n0, sabs, ssq, float(np.dot(w, ones)), float(np.dot(w, w)))

    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        parts = np.array(_map(block, n), dtype=np.float64).reshape(-1, 5)
        tot = parts.sum(axis=0)
        n0 = int(tot[0])
        nz = n - n0
        s1, s2 = tot[3], tot[4]  # sums of l - c and (l - c)^2 over the non-zero entries
        sq = float(s2 + 2.0 * c * s1 + nz * c * c)
    out: dict[str, Any] = {"n": n, "n_zero": n0, "n_nonfinite": 0,
                           "sum_ln_abs": float(s1 + nz * c), "sum_ln_abs_sq": sq}
    if sums:
        out["sum_abs"], out["sum_sq"] = float(tot[1]), float(tot[2])
    out["finite"] = bool(np.isfinite(tot).all())
    return out


def log2_histogram(x: np.ndarray, mbits: int = 2) -> np.ndarray:
    """Counts of ``(bits of |x|) >> (mantissa bits - mbits)``: ``2**mbits`` bins per binade
    (see :meth:`gradstats.pruning.histogram.LogHistogram.from_counts`), in one sweep."""
    n = x.shape[0]
    f32 = x.dtype == np.float32
    ib, mask, shift = ((np.int32, np.int32(0x7FFFFFFF), 23 - mbits) if f32 else
                       (np.int64, np.int64(0x7FFFFFFFFFFFFFFF), 52 - mbits))
    size = (256 if f32 else 2048) << mbits

    def block(k: int) -> np.ndarray:
        s, e = k * BLOCK, min(n, (k + 1) * BLOCK)
        w, _, _ = _scratch(x.dtype)
        key = w[: e - s].view(ib)
        np.bitwise_and(x[s:e].view(ib), mask, out=key)
        np.right_shift(key, shift, out=key)
        return np.bincount(key, minlength=size)

    return np.sum(_map(block, n), axis=0)


# --------------------------------------------------------------------------- stochastic prune
def stochastic_prune(x: np.ndarray, a: float, out: np.ndarray, *, seed: int | None = None,
                     uniforms: np.ndarray | None = None) -> None:
    """``out = T_a(x)``: ``x`` where ``|x| >= a``, else ``sign(x) * a`` when ``u * a < |x|``
    and 0 otherwise, with ``u`` the uniforms given or those of the user seed ``seed``
    (:func:`gradstats.ops.random.reference_uniforms`; the numpy engine,
    :func:`native_stochastic_prune` is the float32 path when compiled, with the same result).

    Every block reads its part of ``x`` before writing its part of ``out``, so ``out`` may be
    ``x`` itself. Pruned entries are zeros of either sign; NaN stays NaN, inf stays inf.
    """
    n = x.shape[0]
    dt = x.dtype
    f32 = dt == np.float32
    av = dt.type(a)
    if uniforms is None:
        if seed is None:
            raise ValueError("stochastic_prune: give seed or uniforms")
        sp, sl = _rng.stream(seed, _rng.PRUNE), _rng.stream(seed, _rng.PRUNE_LOW)
    ibits, sign = (np.int32, _SIGN32) if f32 else (np.int64, _SIGN64)
    # u * a for u = r * 2^-k, computed as r * (a * 2^-k) (both exact scalings) when a * 2^-k
    # stays a normal number; otherwise the uniform is formed first
    mant = 24 if f32 else 53
    scaled = dt.type(math.ldexp(float(av), -mant))
    direct = bool(scaled >= np.finfo(dt).tiny)

    def block(k: int) -> None:
        s, e = k * BLOCK, min(n, (k + 1) * BLOCK)
        u, w, m = _scratch(dt)
        u, w, m = u[: e - s], w[: e - s], m[: e - s]
        xc = x[s:e]
        if uniforms is not None:
            np.multiply(uniforms[s:e], av, out=u)
        else:
            b0, b1, wide = _uscratch(not f32)
            b0, b1 = b0[: e - s], b1[: e - s]
            _rng.np_bits_into(sp, s, b0, b1)
            np.right_shift(b0, np.uint32(8), out=b0)
            if f32 and direct:  # b0 < 2**24 converts exactly: one float32 pass for r * (a * 2^-24)
                np.multiply(b0, scaled, out=u, dtype=np.float32, casting="unsafe")
            elif f32:
                np.copyto(u, b0, casting="unsafe")
            else:  # 53 bits: (b0 >> 8) << 29 | (b1 >> 3), b1 from the PRUNE_LOW stream
                r = wide[: e - s]
                np.copyto(r, b0, casting="unsafe")
                np.left_shift(r, np.uint64(29), out=r)
                _rng.np_bits_into(sl, s, b0, b1)
                np.right_shift(b0, np.uint32(3), out=b0)
                np.bitwise_or(r, b0, out=r)
                np.copyto(u, r, casting="unsafe")
            if direct and not f32:
                np.multiply(u, scaled, out=u)
            elif not direct:
                np.multiply(u, dt.type(2.0 ** -mant), out=u)
                np.multiply(u, av, out=u)
        np.abs(xc, out=w)
        np.less(u, w, out=m)            # keep: u * a < |x| (always true where |x| >= a)
        np.maximum(w, av, out=w)        # max(|x|, a); NaN propagates
        wi = w.view(ibits)
        ui = u.view(ibits)
        np.bitwise_and(xc.view(ibits), sign, out=ui)
        np.bitwise_or(wi, ui, out=wi)   # sign(x) * max(|x|, a)
        np.copyto(u, m, casting="unsafe")
        np.multiply(w, u, out=out[s:e])

    _map(block, n)


def hard_prune(x: np.ndarray, a: float, out: np.ndarray) -> None:
    """``out = x`` where ``|x| >= a`` else 0 (NaN stays NaN); ``out`` may be ``x``."""
    n = x.shape[0]
    av = x.dtype.type(a)

    def block(k: int) -> None:
        s, e = k * BLOCK, min(n, (k + 1) * BLOCK)
        w, z, m = _scratch(x.dtype)
        w, z, m = w[: e - s], z[: e - s], m[: e - s]
        np.abs(x[s:e], out=w)
        np.less(w, av, out=m)
        np.logical_not(m, out=m)       # not (|x| < a): keeps NaN and inf
        np.copyto(z, m, casting="unsafe")
        np.multiply(x[s:e], z, out=out[s:e])

    _map(block, n)


# --------------------------------------------------------------------------- native kernel
def native_kernel() -> Any:
    """The C prune/quantise kernel (:func:`gradstats.ops.native.prune_quant`), or None when it
    is unavailable (no C compiler, or ``GRADSTATS_NATIVE=0``)."""
    from gradstats.ops.native import prune_quant

    return prune_quant()


def native_stochastic_prune(x: np.ndarray, a: float, out: np.ndarray, seed: int) -> None:
    """``out = T_a(x)`` for a flat float32 or float64 ``x`` by the C kernel (prune only, no
    rounding): ``x`` where ``|x| >= a``, else ``sign(x) * a`` when ``u * a < |x|`` (``u * a``
    rounded to ``x``'s dtype) and 0 otherwise, with ``u`` the uniforms of the user seed ``seed``
    (:func:`gradstats.ops.random.uniforms`: 24 bits for float32, 53 for float64, as the numpy
    engine); ``a`` must be a value of ``x``'s dtype > 0. Pruned entries are zeros of ``x``'s sign; NaN stays NaN, inf stays inf. ``out``
    may be ``x``. Spread over ``torch.get_num_threads()`` OpenMP threads; the result does not
    depend on their number. Raises RuntimeError when the kernel is unavailable (check
    :func:`native_kernel` first)."""
    if native_kernel() is None:
        raise RuntimeError("the native prune kernel is not available (no C compiler or GRADSTATS_NATIVE=0)")
    if x.dtype not in (np.float32, np.float64) or out.dtype != x.dtype or x.shape != out.shape or x.ndim != 1:
        raise ValueError("native_stochastic_prune expects flat float32 or float64 arrays of one length and dtype")
    if x.dtype == np.float64:
        from gradstats.ops.native import prune_f64

        prune_f64()(x.ctypes.data, out.ctypes.data, x.shape[0], float(a), _rng.stream(seed, _rng.PRUNE),
                    _rng.stream(seed, _rng.PRUNE_LOW), _threads.workers())
        return
    fn = native_kernel()
    counts = np.zeros(5, np.int64)
    rc = fn(x.ctypes.data, out.ctypes.data, x.shape[0], float(a), 1.0, 0, 0, 0, 0.0, 1, 0, 1,
            _rng.stream(seed, _rng.PRUNE), _rng.stream(seed, _rng.ROUND), _threads.workers(), counts.ctypes.data,
            None)
    if rc != 0:  # pragma: no cover - the prune-only mode accepts every argument it is given here
        raise RuntimeError(f"the native prune kernel rejected its arguments (code {rc})")
