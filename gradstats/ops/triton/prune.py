"""Fused stochastic pruning: a Triton kernel (GPU; the CPU under ``TRITON_INTERPRET=1``) and
the plain torch reference path.

Both compute, for threshold ``a`` and a uniform ``u`` per entry,

    T(x) = x                if not |x| < a        (kept; also inf and NaN)
           copysign(a, x)   if u * a < |x| < a    (rounded up, probability |x|/a)
           0                otherwise

with ``u * a`` rounded to the compute dtype (float32, or float64 for float64 tensors) before the
comparison. Given the same uniforms (``uniforms=``) the kernel and the reference agree bit for
bit. Without them the kernel makes ``u`` from a counter-based hash of ``(seed, index)``
(the SplitMix64 output function on ``seed + (index + 1) * 0x9E3779B97F4A7C15``; its top 24 bits
for float32, 53 for float64): a result is reproducible from ``(seed, x)``, costs no extra memory
pass, and :func:`hash_uniforms` reproduces the very same uniforms on the CPU (so the seeded
kernel, too, can be checked bit for bit). The reference draws ``torch.rand`` from a torch
generator unless given uniforms.

Example:
    >>> import torch
    >>> x = torch.tensor([0.5, -0.05, 0.02, -2.0])
    >>> u = torch.tensor([0.9, 0.1, 0.5, 0.3])
    >>> stochastic_prune_torch(x, 0.1, uniforms=u).tolist()
    [0.5, -0.10000000149011612, 0.0, -2.0]
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from gradstats.ops.triton import interpreting

#: elements per Triton program
BLOCK = 2048


_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def hash_uniforms(seed: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The uniforms the kernel draws for ``seed`` at indices ``0..n-1`` (computed on the CPU
    in numpy's wrapping uint64 arithmetic).

    Example:
        >>> u = hash_uniforms(7, 5)
        >>> u.shape, bool(((u >= 0) & (u < 1)).all())
        (torch.Size([5]), True)
    """
    u64 = np.uint64
    z = np.arange(1, n + 1, dtype=u64)
    z *= u64(_GOLDEN)
    z += u64(seed % 2 ** 64)
    z ^= z >> u64(30)
    z *= u64(_MIX1)
    z ^= z >> u64(27)
    z *= u64(_MIX2)
    z ^= z >> u64(31)
    if dtype == torch.float64:
        return torch.from_numpy((z >> u64(11)).astype(np.float64) * 2.0 ** -53)
    return torch.from_numpy((z >> u64(40)).astype(np.float32) * np.float32(2.0 ** -24))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def stochastic_prune_torch(x: torch.Tensor, a: float, *, generator: torch.Generator | None = None,
                           uniforms: torch.Tensor | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """The reference path in plain torch ops (any device and floating dtype; half precision is
    computed in float32). ``a`` should already be representable in ``x.dtype``."""
    cd = _compute_dtype(x.dtype)
    xf = x.detach().to(cd)
    if uniforms is None:
        u = torch.rand(x.shape, generator=generator, device=x.device, dtype=cd)
    else:
        u = uniforms.to(device=x.device, dtype=cd)
    ax = xf.abs()
    up = torch.where(u * a < ax, torch.copysign(torch.full_like(xf, a), xf), torch.zeros_like(xf))
    y = torch.where(ax < a, up, xf).to(x.dtype)
    if out is None:
        return y
    return out.copy_(y)


@functools.lru_cache(maxsize=None)
def _kernel(interpret: bool):  # noqa: ARG001 - the cache key: Triton decides at decoration
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["seed"])
    def prune_kernel(x_ptr, u_ptr, a_ptr, out_ptr, n, seed,
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
            # SplitMix64 output function of seed + (index + 1) * golden (uint64, wrapping)
            z = seed.to(tl.uint64) + (offs.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
            z = (z ^ (z >> 27)) * 0x94D049BB133111EB
            z = z ^ (z >> 31)
            if F64:
                u = (z >> 11).to(tl.float64) * 1.1102230246251565e-16
            else:
                u = (z >> 40).to(tl.float32) * 5.960464477539063e-08
        ax = tl.abs(xf)
        ua = u * a
        up = tl.where(ua < ax, tl.where(xf < 0, -a, a), 0.0)
        y = tl.where(ax < a, up, xf)
        tl.store(out_ptr + offs, y.to(x_ptr.dtype.element_ty), mask=mask)

    return prune_kernel


def stochastic_prune(x: torch.Tensor, a: float, *, seed: int | None = None,
                     uniforms: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Stochastic pruning through the Triton kernel. Give either ``seed`` (uniforms from the
    counter hash, see :func:`hash_uniforms`) or ``uniforms`` (a tensor of ``x``'s shape).
    ``out`` may be ``x``.

    Example (on a CUDA device, or on the CPU with ``TRITON_INTERPRET=1``)::

        y = stochastic_prune(x, 1e-3, seed=1234)
    """
    if (seed is None) == (uniforms is None):
        raise ValueError("give exactly one of seed and uniforms")
    cd = _compute_dtype(x.dtype)
    xc = x.detach().contiguous()
    direct = out is not None and out.is_contiguous()
    res = out if direct else torch.empty_like(xc)
    a_t = torch.tensor([a], dtype=cd, device=x.device)
    u = uniforms.detach().to(device=x.device, dtype=cd).contiguous() if uniforms is not None else xc
    n = xc.numel()
    grid = ((n + BLOCK - 1) // BLOCK,)
    _kernel(interpreting())[grid](xc, u, a_t, res, n, int(seed or 0), BLOCK=BLOCK,
                                  HAS_U=uniforms is not None, F64=cd == torch.float64)
    if direct:
        return out  # type: ignore[return-value]
    res = res.reshape(x.shape)
    return out.copy_(res) if out is not None else res
