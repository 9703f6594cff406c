"""Block scales: the rule of the decode scale each block of a gradient shares (OCP MX's E8M0 power of two,
NVFP4's E4M3 scale under a float32 tensor scale), for :func:`gradstats.quantize` and the analysis.
The blocks themselves are laid out by :mod:`gradstats.ops.layout`.

Example:
    >>> import torch
    >>> mx_shared_exponent(torch.tensor([1.0, 448.0]), "e4m3fn").tolist()
    [-8, 0]
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from gradstats.formats import FPFormat, parse
from gradstats.scheme import SCALE_ROUNDINGS, Scheme

__all__ = ["mx_shared_exponent", "block_decode_scales"]


def mx_shared_exponent(amax: torch.Tensor, fmt: Union[FPFormat, str], rounding: str = "floor") -> torch.Tensor:
    """The OCP MX shared exponent of blocks whose largest magnitude is ``amax`` (int32 tensor).

    ``rounding`` (:data:`SCALE_ROUNDINGS`): ``"floor"`` (default, the OCP rule):
    ``floor(log2(amax)) - fmt.emax``; ``"ceil"``: ``ceil(log2(amax)) - fmt.emax``; ``"even"``: ``amax``
    rounded half up to ``fmt.man_bits`` mantissa bits first, then floor; ``"rceil"``:
    ``ceil(log2(amax / fmt.max))`` (float32 division), so that no element saturates, exactly (on the
    quotient's bits, as the hardware's round-up conversion to E8M0: a float ``log2`` may round a quotient
    just above a power of two down to it). Computed on the float32 bit pattern as torchao's ``to_mx``
    does (bit for bit its ``ScaleCalculationMode`` of the same name, but for such quotients with rceil);
    clamped to the E8M0 range ``[-127, 127]``; ``amax == 0`` (and NaN) gives ``-127``. The Triton kernels
    (:mod:`gradstats.ops.triton.blocks`) compute the same rule on the same bits. A block is encoded as ``quantize(x / 2**e, fmt, overflow="saturate") * 2**e``. This is the single
    home of the rule: the format analysis uses it on model amaxes.

    Example:
        >>> import torch
        >>> mx_shared_exponent(torch.tensor([1.0, 448.0, 500.0, 0.0]), "e4m3fn").tolist()
        [-8, 0, 0, -127]
        >>> mx_shared_exponent(torch.tensor([1.0, 448.0, 500.0, 0.0]), "e4m3fn", "rceil").tolist()
        [-8, 0, 1, -127]
    """
    fmt = parse(fmt)
    if rounding not in SCALE_ROUNDINGS:
        raise ValueError(f"scale_rounding must be one of {SCALE_ROUNDINGS}, got {rounding!r}")
    return _shared_exponent(amax, fmt, rounding)


def _shared_exponent(amax: torch.Tensor, fmt: FPFormat, rounding: str) -> torch.Tensor:
    """:func:`mx_shared_exponent` of a parsed format and a checked rounding (what a resolved scheme holds)."""
    a = torch.nan_to_num(amax.float().abs(), nan=0.0, posinf=torch.finfo(torch.float32).max)
    if rounding == "rceil":     # ceil(log2(a / fmax)) of the float32 quotient, exactly: on its bits
        with torch.no_grad():
            vb = (a / fmt.max).view(torch.int32)
        ex = vb >> 23
        e = torch.where(ex > 0, ex - 127 + ((vb & 0x7FFFFF) != 0).to(torch.int32),
                        torch.where(vb > 0x400000, -126, -127).to(torch.int32))
        e = torch.where(a > 0, e, torch.full_like(e, -127))
        return e.clamp_(-127, 127).to(torch.int32)
    bits = a.view(torch.int32)
    if rounding == "even":
        bits = (bits + (1 << (22 - fmt.man_bits))) & 0x7F800000
    e = ((bits >> 23) & 0xFF) - 127
    if rounding == "ceil":
        e = e + ((bits & 0x7FFFFF) > 0).to(e.dtype)
    e = torch.where(a > 0, e - fmt.emax, torch.full_like(e, -127))
    return e.clamp_(-127, 127).to(torch.int32)


def block_decode_scales(amax: torch.Tensor, s: Scheme, tensor_amax: Optional[float] = None) -> torch.Tensor:
    """The block-scale rule, the one home of it on tensors: the float32 decode scale of blocks whose largest
    finite magnitude is ``amax`` under the block-scaled scheme ``s``. E8M0 (MX): ``2**e`` with ``e`` of
    :func:`mx_shared_exponent` at the scheme's scale rounding. E4M3 (NVFP4): a float32 tensor scale
    ``t = tmax / (fmt.max * 448)`` (1 for ``tmax == 0``), ``tmax`` the tensor's largest magnitude
    (``tensor_amax`` where given, else the largest ``amax``), and ``e4m3fn(amax / (fmt.max * t)) * t``;
    ``0`` marks a block that encodes as zeros. The Triton block kernel computes the same on the same bits.

    Example:
        >>> import torch
        >>> from gradstats.scheme import Scheme
        >>> block_decode_scales(torch.tensor([1.0, 6.0, 0.0]), Scheme.parse("mxfp4")).tolist()
        [0.25, 1.0, 5.877471754111438e-39]
        >>> block_decode_scales(torch.tensor([1.0, 6.0, 0.0]), Scheme.parse("nvfp4")).tolist()
        [0.1607142984867096, 1.0, 0.0]
    """
    if s.block_size is None:
        raise ValueError(f"block_decode_scales: scheme {s} has one scale per tensor: set block_size")
    if s.tensor_scale is None:          # E8M0 (MX)
        return torch.ldexp(torch.ones_like(amax), _shared_exponent(amax, s.element, s.scale_rounding or "floor"))
    fmt, e4m3 = s.element, s.scale_format
    if tensor_amax is not None:
        tmax = torch.tensor(float(tensor_amax), dtype=torch.float32, device=amax.device)
    else:
        tmax = amax.amax() if amax.numel() else amax.new_zeros(())
    t = torch.where(tmax > 0, tmax / (fmt.max * e4m3.max), 1.0)
    # e4m3fn, nearest-even, saturating: torch's cast, bit for bit gradstats.quantize's (checked in the tests)
    sb = (amax / (fmt.max * t)).clamp(max=e4m3.max).to(torch.float8_e4m3fn).float()
    return sb * t


def _scales_of_blocks(xb: torch.Tensor, s: Scheme, tensor_amax: Optional[float] = None) -> torch.Tensor:
    """Decode scale per block of ``xb`` ``(..., n_blocks, B)`` (:func:`block_decode_scales` of each block's
    largest finite magnitude), shape ``(..., n_blocks, 1)``."""
    ab = xb.abs()
    amax = torch.where(torch.isfinite(ab), ab, 0.0).amax(dim=-1, keepdim=True)
    return block_decode_scales(amax, s, tensor_amax)
