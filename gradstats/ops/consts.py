"""Per-format constants of the float32 bit algorithms of :mod:`gradstats.ops.quantization`, shared by its
CPU path and the Triton kernel (:mod:`gradstats.ops.triton.quantize`)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from gradstats.formats import FPFormat

_EXP = 0x7F800000
_QNAN = 0x7FC00000
_BF16 = FPFormat(8, 7)
_FP16 = FPFormat(5, 10)
_FP32 = FPFormat(8, 23)


@dataclass(frozen=True)
class Consts:
    """Per-format constants of the float32 bit algorithms."""

    fmt: FPFormat
    M: int
    Msub: int
    E0F: int  # exponent field of 2**emin
    E0: int  # bit pattern of 2**emin
    MAXBITS: int
    maxv: float
    ovf_bits: int  # bit pattern written on overflow in "nonfinite" mode
    fast: bool  # the float32 fast paths apply
    fast_nearest: bool  # ... and the magic constant of nearest-even stays finite
    near_hi: int  # upper clamp of the exponent field used for the magic constant
    ieee_f1: float
    ieee_f2: float
    nan_g: float  # y * nan_g overflows to inf exactly when y > max (has_nan formats)


def _f32_bits(v: float) -> int:
    return int(torch.tensor(v, dtype=torch.float32).view(torch.int32))


@functools.lru_cache(maxsize=None)
def consts(fmt: FPFormat) -> Consts:
    M = fmt.man_bits
    Msub = M if fmt.subnormals else 0
    e0f = fmt.emin + 127
    maxv = fmt.max
    maxbits = _f32_bits(maxv)
    if fmt.has_inf:
        ovf = _EXP
    elif fmt.has_nan:
        ovf = _QNAN
    else:
        ovf = maxbits
    nxt = maxv + math.ldexp(1.0, fmt.emax - M)  # next value of the unbounded grid above max
    g = math.ldexp(1.0, 128) / ((maxv + nxt) / 2)
    g32 = float(torch.tensor(g, dtype=torch.float32))
    ok_g = (math.isfinite(g32) and g32 > 0 and math.isfinite(float(torch.tensor(maxv) * g32))
            and math.isinf(float(torch.tensor(nxt) * g32)))
    fast = (fmt.has_zero and M <= 22 and (fmt.subnormals or M == 0) and e0f >= 1
            and (not fmt.has_inf or fmt.emax >= 0) and (fmt.has_inf or not fmt.has_nan or ok_g))
    near_hi = min(fmt.emax + 1 + 127, 254 - (23 - M)) << 23
    return Consts(fmt, M, Msub, e0f, max(e0f, 0) << 23, maxbits, maxv, ovf, fast,
                   fast and fmt.emax <= 104 + M, near_hi,
                   math.ldexp(1.0, 127 - fmt.emax), math.ldexp(1.0, fmt.emax - 127), g32 if ok_g else 0.0)


def fused_covers(fmt: Optional[FPFormat], scale: float) -> bool:
    """Whether the fused kernels (C and Triton) cover ``fmt`` at a per-tensor ``scale``: signed, with
    a zero, steps not below float32's subnormal range (every format of up to 8 exponent bits with the
    usual bias); they saturate.

    Example:
        >>> fused_covers(FPFormat.parse("e4m3fn"), 1.0), fused_covers(FPFormat.parse("e8m0fnu"), 1.0)
        (True, False)
    """
    if fmt is None:
        return True
    return (fmt.signed and fmt.has_zero and fmt.man_bits <= 23 and fmt.emin - fmt.man_bits >= -126
            and fmt.emin <= 104 and scale > 0)
