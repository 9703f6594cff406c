"""Fused stochastic pruning: a Triton kernel (GPU; the CPU under ``TRITON_INTERPRET=1``) and
the plain torch reference path.

Both compute, for threshold ``a`` and a uniform ``u`` per entry,

    T(x) = x                if not |x| < a        (kept; also inf and NaN)
           copysign(a, x)   if u * a < |x| < a    (rounded up, probability |x|/a)
           0                otherwise (a zero of x's sign)

with ``u * a`` rounded to the compute dtype (float32, or float64 for float64 tensors) before the
comparison. Given the same uniforms (``uniforms=``) the kernel and the reference agree bit for
bit. Without them both make ``u`` from the one counter-based stream of :mod:`gradstats.ops.random`
(the pruning stream of the seed at each element's flat index: 24-bit uniforms, 53-bit for
float64), so the same seed gives the same result on every engine (the C kernel and the numpy
engine of the CPU included); :func:`gradstats.ops.random.uniforms` gives those uniforms.

Example:
    >>> import torch
    >>> x = torch.tensor([0.5, -0.05, 0.02, -2.0])
    >>> u = torch.tensor([0.9, 0.1, 0.5, 0.3])
    >>> stochastic_prune_torch(x, 0.1, uniforms=u).tolist()
    [0.5, -0.10000000149011612, 0.0, -2.0]
"""
from __future__ import annotations

import functools

import torch

from gradstats.ops import random as _rng
from gradstats.ops.triton import interpreting

#: elements per Triton program
BLOCK = 2048


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def stochastic_prune_torch(x: torch.Tensor, a: float, *, generator: torch.Generator | None = None,
                           uniforms: torch.Tensor | None = None, out: torch.Tensor | None = None,
                           seed: int | None = None) -> torch.Tensor:
    """The reference path in plain torch ops (any device and floating dtype; half precision is
    computed in float32). ``a`` should already be representable in ``x.dtype``. Without
    ``uniforms`` the uniforms of ``seed`` (else of one seed drawn from ``generator``) are used:
    :func:`gradstats.ops.random.uniforms`, as every other engine."""
    cd = _compute_dtype(x.dtype)
    xf = x.detach().to(cd)
    if uniforms is None:
        s = _rng.resolve_seed(seed, generator, "stochastic_prune")
        u = _rng.uniforms(s, x.numel(), cd, x.device).reshape(x.shape)
    else:
        u = uniforms.to(device=x.device, dtype=cd)
    ax = xf.abs()
    # rounded up to a, or pruned to a zero of x's sign (as the CPU engines)
    up = torch.copysign(torch.where(u * a < ax, torch.full_like(xf, a), torch.zeros_like(xf)), xf)
    y = torch.where(ax < a, up, xf).to(x.dtype)
    if out is None:
        return y
    return out.copy_(y)


@functools.lru_cache(maxsize=None)
def _kernel(interpret: bool):  # noqa: ARG001 - the cache key: Triton decides at decoration
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n", "k1", "k2", "j1", "j2"])
    def prune_kernel(x_ptr, u_ptr, a_ptr, out_ptr, n, k1, k2, j1, j2,
                     BLOCK: tl.constexpr, HAS_U: tl.constexpr, F64: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        a = tl.load(a_ptr)
        if F64:
            xf = x.to(tl.float64)
        else:
            xf = x.to(tl.float32)
        if HAS_U:
            u = tl.load(u_ptr + offs, mask=mask, other=0.0)
        else:
            # the word of gradstats.ops.random at counter c + offs: k1 = c_lo + (the segment's k1),
            # k2 its second key (int32, wrapping; ">> s & mask" is the logical shift)
            c = offs.to(tl.int32)
            h = (c + k1) * 0x7FEB352D
            h = h ^ ((h >> 16) & 0xFFFF)
            h = h * (-2073254261) + k2
            h = h ^ ((h >> 15) & 0x1FFFF)
            h = h * (-1640531535)
            u24 = (h >> 8) & 0xFFFFFF
            if F64:
                g = (c + j1) * 0x7FEB352D  # the low word, from the PRUNE_LOW stream
                g = g ^ ((g >> 16) & 0xFFFF)
                g = g * (-2073254261) + j2
                g = g ^ ((g >> 15) & 0x1FFFF)
                g = g * (-1640531535)
                u = (u24.to(tl.float64) * 5.960464477539063e-08
                     + ((g >> 3) & 0x1FFFFFFF).to(tl.float64) * 1.1102230246251565e-16)
            else:
                u = u24.to(tl.float32) * 5.960464477539063e-08
        ax = tl.abs(xf)
        ua = u * a
        if F64:
            neg = xf.to(tl.int64, bitcast=True) < 0
        else:
            neg = xf.to(tl.int32, bitcast=True) < 0
        up = tl.where(ua < ax, a, 0.0)
        up = tl.where(neg, -up, up)  # a zero of x's sign when pruned (as the CPU engines)
        y = tl.where(ax < a, up, xf)
        tl.store(out_ptr + offs, y.to(x_ptr.dtype.element_ty), mask=mask)

    return prune_kernel


def stochastic_prune(x: torch.Tensor, a: float | torch.Tensor, *, seed: int | None = None,
                     uniforms: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, index_start: int = 0) -> torch.Tensor:
    """Stochastic pruning through the Triton kernel. Give either ``seed`` (a user seed: the
    uniforms of :func:`gradstats.ops.random.uniforms`) or ``uniforms`` (a tensor of ``x``'s shape).
    ``out`` may be ``x``. ``index_start`` offsets the counters (for tests of far indices). ``a`` may
    be a one-element tensor on ``x``'s device (a threshold solved there: not read back).

    Example (on a CUDA device, or on the CPU with ``TRITON_INTERPRET=1``)::

        y = stochastic_prune(x, 1e-3, seed=1234)
    """
    if (seed is None) == (uniforms is None):
        raise ValueError("give exactly one of seed and uniforms")
    cd = _compute_dtype(x.dtype)
    xc = x.detach().contiguous()
    direct = out is not None and out.is_contiguous()
    res = out if direct else torch.empty_like(xc)
    # a threshold solved on the device stays there (reading it would synchronise)
    a_t = (a.detach().reshape(1).to(device=x.device, dtype=cd) if isinstance(a, torch.Tensor)
           else torch.tensor([a], dtype=cd, device=x.device))
    u = uniforms.detach().to(device=x.device, dtype=cd).contiguous().view(-1) if uniforms is not None else None
    n = xc.numel()
    xf, rf = xc.view(-1), res.view(-1)
    sp = _rng.stream(seed, _rng.PRUNE) if seed is not None else 0
    sl = _rng.stream(seed, _rng.PRUNE_LOW) if seed is not None else 0
    pos = 0
    while pos < n:  # one launch per 2**32 segment of the counter (each has its own key)
        ctr = index_start + pos
        m = min(n - pos, (1 << 32) - (ctr & 0xFFFFFFFF))
        k1 = k2 = j1 = j2 = 0
        if seed is not None:
            (p1, p2), (q1, q2) = _rng.segment_key(sp, ctr >> 32), _rng.segment_key(sl, ctr >> 32)
            k1, k2, j1, j2 = _rng._s32(ctr + p1), _rng._s32(p2), _rng._s32(ctr + q1), _rng._s32(q2)
        grid = ((m + BLOCK - 1) // BLOCK,)
        _kernel(interpreting())[grid](xf[pos:pos + m], u[pos:pos + m] if u is not None else xf, a_t,
                                      rf[pos:pos + m], m, k1, k2, j1, j2, BLOCK=BLOCK,
                                      HAS_U=uniforms is not None, F64=cd == torch.float64)
        pos += m
    if direct:
        return out  # type: ignore[return-value]
    res = res.reshape(x.shape)
    return out.copy_(res) if out is not None else res
