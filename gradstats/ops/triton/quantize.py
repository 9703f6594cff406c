"""Triton kernel of :func:`gradstats.ops.quantization.quantize`: one pass, integer arithmetic on float32 bits.

The kernel reads ``x`` in its own dtype, applies an optional scale (a float, or a tensor indexed as
``(i // div) % mod`` of the flat element index ``i``), rounds, handles overflow, NaN, signs, and
writes ``x``'s dtype. Rounding is done on the int32 pattern only (no float arithmetic on
subnormals, so a device that flushes subnormals gets the same bits); values below ``2**emin`` are
rebuilt by a float subtraction of two normal numbers or, when the result is a float32 subnormal, by
an integer shift. Stochastic rounding draws its bits from the one counter-based stream of
:mod:`gradstats.ops.random` (the rounding stream of the seed, at each element's flat index), as the
torch path does, so CPU and GPU give identical results for the same seed or generator state. The random
word and the rounding are the shared device functions of :mod:`gradstats.ops.triton.common`.

The torch path (``gradstats.ops.quantization``) is the reference; ``tests/ops/test_quantization_triton.py`` runs this kernel
on the CPU under ``TRITON_INTERPRET=1`` and compares bit for bit. The kernel is built on first use
(``triton.jit`` is applied then), so setting ``TRITON_INTERPRET=1`` before the first call suffices.

Example:
    >>> import torch
    >>> from gradstats.ops.triton.quantize import supports
    >>> from gradstats.formats import ROUNDING_CODES, FPFormat
    >>> supports(FPFormat.parse("e4m3fn")), supports(FPFormat.parse("e8m0fnu"))
    (True, False)
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Union

import torch

from gradstats.formats import ROUNDING_CODES, FPFormat
from gradstats.ops.triton import interpreting, triton_available

try:  # the kernel body refers to ``tl``; it is only compiled when Triton is installed
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the installation
    tl = None

__all__ = ["supports", "quantize_triton", "BLOCK"]

BLOCK = 1024


def supports(fmt: FPFormat) -> bool:
    """Whether the kernel handles ``fmt`` (all formats but the unsigned ``fnu`` ones, which take the torch path)."""
    return fmt.special != "fnu" and triton_available()


def _kernel_src(X, Y, S, RB, start, n, scale_f, s_div, s_mod, k1, k2,
                M: tl.constexpr, MSUB: tl.constexpr, E0F: tl.constexpr, MAXBITS: tl.constexpr,
                OVFBITS: tl.constexpr, ROUNDING: tl.constexpr, SCALE_MODE: tl.constexpr,
                SCALE_DIV: tl.constexpr, KEY_MODE: tl.constexpr, FNUZ: tl.constexpr,
                T_SUB: tl.constexpr, SH_SUB: tl.constexpr, C0F: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # within this launch (X, Y begin at element start)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if SCALE_MODE == 1:
        x = x * scale_f
    if SCALE_MODE == 2:
        sv = tl.load(S + ((start + offs) // s_div) % s_mod, mask=mask, other=1.0)
        if SCALE_DIV:
            x = tl.math.div_rn(x, sv)
        else:
            x = x * sv
    b = x.to(tl.int32, bitcast=True)
    neg = b < 0
    a = b & 0x7FFFFFFF
    r23 = a
    if ROUNDING == 1:
        if KEY_MODE == 2:
            r23 = tl.load(RB + offs, mask=mask, other=0)
        else:
            # the word of gradstats.ops.random at counter c + offs, with k1 = c_lo + (the segment's k1) and k2
            # its second key (one launch never leaves a 2**32 segment)
            r23 = (_word(offs.to(tl.int32), k1, k2) >> 9) & 0x7FFFFF  # noqa: F821 - bound by common.jit
    # the shared rounding, with the quantiser's overflow bits, ties of a mantissa-free format rounded up and
    # float32-subnormal results made by an integer shift
    res = _round(a, r23, M, MSUB, E0F, MAXBITS, C0F, ROUNDING, OVFBITS=OVFBITS, TIES_UP=True,  # noqa: F821
                 T_SUB=T_SUB, SH_SUB=SH_SUB)
    res = tl.where(a > 0x7F800000, 0x7FC00000, res)
    if FNUZ:
        res = tl.where(neg & (res != 0), res | (-2147483648), res)
    else:
        res = tl.where(neg, res | (-2147483648), res)
    y = res.to(tl.float32, bitcast=True)
    if SCALE_MODE == 1:
        y = tl.math.div_rn(y, scale_f)
    if SCALE_MODE == 2:
        if SCALE_DIV:
            y = y * sv
        else:
            y = tl.math.div_rn(y, sv)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):  # the cache key: Triton decides at decoration
    from gradstats.ops.triton.common import jit

    return jit(_kernel_src, interpret, do_not_specialize=["start", "n", "scale_f", "s_div", "s_mod", "k1", "k2"])


def _scale_index(scale: torch.Tensor, shape: torch.Size):
    """``(flat scale, div, mod)`` with ``scale_flat[(i // div) % mod]`` the scale of flat element ``i``."""
    nd = len(shape)
    s = scale.reshape((1,) * (nd - scale.dim()) + tuple(scale.shape))
    dims = [d for d in range(nd) if s.shape[d] != 1]
    if not dims:
        return s.reshape(1).contiguous(), 1, 1
    p, q = dims[0], dims[-1] + 1
    if all(s.shape[d] == shape[d] for d in range(p, q)):
        div = math.prod(shape[q:])
        return s.reshape(-1).contiguous(), div, math.prod(shape[p:q])
    full = s.expand(shape).contiguous().reshape(-1)
    return full, 1, full.numel()


def quantize_triton(
    x: torch.Tensor,
    fmt: FPFormat,
    *,
    scale: Union[float, torch.Tensor, None] = None,
    rounding: str = "nearest",
    overflow: str = "saturate",
    generator=None,
    scale_div: bool = False,
    rbits: Optional[torch.Tensor] = None,
    index_start: int = 0,
) -> torch.Tensor:
    """Quantise ``x`` with the Triton kernel (arguments as :func:`gradstats.ops.quantization.quantize`, validated).

    ``scale_div=True`` divides by a tensor ``scale`` first and multiplies after (block scaling).
    ``rbits`` (int32, one per element, in ``[0, 2**23)``) replaces the hash bits of stochastic rounding;
    ``generator`` is a ``torch.Generator``, None (torch's default generator) or a user seed (int): the
    bits are then those of the rounding stream of :mod:`gradstats.ops.random`, as on the CPU, at
    counters ``index_start + i`` for the flat index ``i`` (``index_start`` is for tests of far counters).

    Example (CUDA, or the CPU with ``TRITON_INTERPRET=1`` set before the first call):
        >>> from gradstats.formats import parse
        >>> quantize_triton(torch.tensor([0.1, 500.0], device="cuda"), parse("e4m3fn")).tolist()  # doctest: +SKIP
        [0.1015625, 448.0]
    """
    from gradstats.ops.consts import consts as _consts
    from gradstats.ops.random import _s32, segment_key
    from gradstats.ops.random import rounding_stream as _round_stream

    c = _consts(fmt)
    xc = x.contiguous()
    y = torch.empty_like(xc)
    n = xc.numel()
    if n == 0:
        return y
    dummy = torch.empty(1, dtype=torch.float32, device=x.device)
    S, s_div, s_mod, scale_f, mode = dummy, 1, 1, 1.0, 0
    if isinstance(scale, torch.Tensor):
        S, s_div, s_mod = _scale_index(scale.to(device=x.device, dtype=torch.float32), xc.shape)
        mode = 2
    elif scale is not None:
        scale_f, mode = float(scale), 1
    key_mode, RB, rseed = 0, dummy, None
    if rounding == "stochastic":
        if rbits is not None:
            RB, key_mode = rbits.reshape(-1).to(device=x.device, dtype=torch.int32).contiguous(), 2
        else:
            rseed = _round_stream(generator)
    ovf = c.MAXBITS if overflow == "saturate" else c.ovf_bits
    sub_exp = fmt.emin - c.Msub  # exponent of the smallest step below 2**emin
    t_sub = 1 << min(-126 - sub_exp, 24) if sub_exp < -126 else 0
    sh_sub = min(max(sub_exp + 149, 0), 30)
    xf, yf = xc.view(-1), y.view(-1)
    pos = 0
    while pos < n:  # one launch per 2**32 segment of the counter (each has its own key)
        ctr = index_start + pos
        m = min(n - pos, (1 << 32) - (ctr & 0xFFFFFFFF))
        k1 = k2 = 0
        if rseed is not None:
            sk1, sk2 = segment_key(rseed, ctr >> 32)
            k1, k2 = _s32(ctr + sk1), _s32(sk2)
        grid = (-(-m // BLOCK),)
        _kernel(interpreting())[grid](
            xf[pos:pos + m], yf[pos:pos + m], S, RB[pos:pos + m] if key_mode == 2 else RB, pos, m, scale_f,
            s_div, s_mod, k1, k2,
            M=c.M, MSUB=c.Msub, E0F=c.E0F, MAXBITS=c.MAXBITS, OVFBITS=ovf, ROUNDING=ROUNDING_CODES[rounding],
            SCALE_MODE=mode, SCALE_DIV=bool(scale_div), KEY_MODE=key_mode, FNUZ=fmt.special == "fnuz",
            T_SUB=t_sub, SH_SUB=sh_sub, C0F=fmt.min_normal, BLOCK=BLOCK,
        )
        pos += m
    return y.view(x.shape)
