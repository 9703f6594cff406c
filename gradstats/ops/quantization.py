"""Exact emulation of low-precision floating point: :func:`quantize` (quantise-dequantise).

``quantize(x, fmt)`` returns a tensor of ``x``'s shape and dtype holding values of ``fmt`` (an
:class:`~gradstats.formats.FPFormat` or a name). Rounding is nearest-even (subnormals included),
stochastic (unbiased, reproducible with a ``torch.Generator``) or toward zero; overflow saturates or
follows the format's own convention; scales are per tensor, per channel (a broadcastable tensor) or
per block (OCP MX: shared E8M0 power of two; NVFP4: E4M3 block scale times a float32 tensor scale).

How it works (``docs/formats.md``): all arithmetic is on float32 and its int32 bit pattern, no search
over values: nearest-even adds a per-element power of two so that float32's own rounding happens at the
format's spacing, stochastic rounding adds random bits below the kept mantissa bits and truncates, and rare
cases take an exact integer path. On CUDA (and on the CPU under ``TRITON_INTERPRET=1``) a Triton kernel
(:mod:`gradstats.ops.triton.quantize`) does the same in one pass; the CPU path works on cache-sized chunks.

Example:
    >>> import torch
    >>> from gradstats.ops.quantization import quantize
    >>> x = torch.tensor([0.1, 1.0, 300.0, 1e6, -2.5e-5])
    >>> quantize(x, "e4m3fn").tolist()
    [0.1015625, 1.0, 288.0, 448.0, -0.0]
    >>> quantize(x, "e5m2", overflow="nonfinite").tolist()
    [0.09375, 1.0, 320.0, inf, -3.0517578125e-05]
"""
from __future__ import annotations

import logging
import math
import warnings
from typing import Optional, Union

import torch

from gradstats import _threads
from gradstats.formats import OVERFLOWS, ROUNDINGS, FPFormat, amax_scale
from gradstats.ops import cpu_blocks
from gradstats.ops.block_scales import _scales_of_blocks, mx_shared_exponent
from gradstats.ops.consts import _BF16, _EXP, _FP16, _FP32
from gradstats.ops.consts import consts as _consts
from gradstats.ops.engine import use_triton
from gradstats.ops.hadamard import resolve_orientation, rotate, unrotate
from gradstats.ops.layout import check_orientation, from_blocks, from_gemm_matrix, to_blocks
from gradstats.ops.random import draw_seed as _draw_seed
from gradstats.ops.random import hash_bits as _hash_bits
from gradstats.ops.random import iota as _iota
from gradstats.ops.random import resolve_seed as _resolve_seed
from gradstats.ops.random import rounding_stream as _round_stream
from gradstats.scheme import SCALE_FORMATS, SCALE_ROUNDINGS, Scheme, names_scheme

__all__ = ["quantize", "block_scales", "mx_shared_exponent", "ROUNDINGS", "OVERFLOWS", "SCALE_FORMATS",
           "SCALE_ROUNDINGS"]

log = logging.getLogger(__name__)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: elements per chunk of the CPU path (buffers of this size stay in cache between passes; at most
#: torch's grain size, so each operation runs on one thread)
CHUNK = 1 << 15
#: worker threads of the CPU path for large tensors (0: ``torch.get_num_threads()``)
THREADS = 0

# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------
def quantize(
    x: torch.Tensor,
    fmt: Union[FPFormat, Scheme, str],
    *,
    scale: Union[float, torch.Tensor, str, None] = None,
    rounding: Optional[str] = None,
    overflow: str = "saturate",
    generator: Optional[torch.Generator] = None,
    block_size: Optional[int] = None,
    block_dim: int = -1,
    scale_format: Optional[str] = None,
    scale_rounding: Optional[str] = None,
    seed: Optional[int] = None,
    orientation: Optional[str] = None,
    tensor_amax: Optional[float] = None,
    hadamard: Optional[int] = None,
) -> torch.Tensor:
    """Round ``x`` to the values of ``fmt`` and return them in ``x``'s dtype (quantise-dequantise).

    Args:
        x: float32, float16 or bfloat16 tensor of any shape, contiguous or not, on CPU or CUDA.
            float16/bfloat16 are computed in float32 and cast back, which rounds again where ``fmt``
            is not a subset of the dtype (``e8m3`` on float16): pass float32 for exact emulation.
        fmt: an :class:`FPFormat` or a name accepted by :func:`gradstats.formats.parse`; or a
            :class:`~gradstats.scheme.Scheme` or a scheme's name (a preset such as ``"nvfp4"`` or
            ``"mxfp8_e4m3"``), which sets ``rounding``, ``block_size``, ``scale_format``,
            ``scale_rounding`` and ``hadamard``: those given here replace the scheme's.
        scale: ``None`` (1), ``"amax"`` (:func:`gradstats.formats.amax_scale`, what_if's default), a
            positive float, or a positive tensor broadcastable to ``x`` (per tensor or channel): quantise
            ``x * scale``, divide by ``scale``. None warns where it flushes most of ``x`` (a gradient).
        rounding: ``"nearest"`` (ties to even; None: the scheme's, else nearest), ``"stochastic"`` (rounds up with probability equal
            to the fractional distance between the two neighbours; unbiased), ``"toward_zero"``.
        overflow: ``"saturate"`` (to +-max; +-inf too) or ``"nonfinite"`` (the format's own rule:
            ieee -> +-inf; 8-bit fn, fnuz and fnu -> NaN; 6/4-bit fn have neither and saturate).
            NaN in gives NaN out (also for formats that have no NaN code: see ``docs/formats.md``);
            fnuz maps -0 to +0. The unsigned fnu formats map x < 0 to NaN (there is no code for
            it, even when it would round to 0) and +-0 to +0, or to NaN in ``e8m0fnu``, which has no zero.
        generator: random source of stochastic rounding (default: torch's global generator): one
            seed is drawn from it per call.
        block_size: shared-scale blocks of this many elements (OCP MX uses 32, NVFP4 16), laid out as
            a GEMM reads them (:mod:`gradstats.ops.layout`): on the channels-last matrix of ``x``, along
            the channels (``orientation="rows"``), along the tokens (``"columns"``) or in tiles of
            ``block_size x block_size`` (``"2d"``); the last block of a row or column may be partial.
        block_dim: the dimension that holds the channels (the GEMM's reduction over output features):
            -1 for a linear layer's gradient, 1 for a convolution's ``(N, C, H, W)``
            (:func:`gradstats.ops.layout.channel_dim` says which). Rows-oriented blocks run along it.
        scale_format: None (the scheme's, else ``"e8m0"``), ``"e8m0"`` (MX: power-of-two scale ``2**(floor(log2 amax) - fmt.emax)``) or
            ``"e4m3"`` (NVFP4 style: per-block scale rounded to e4m3fn times a float32 per-tensor
            scale); see :func:`block_scales`.
        scale_rounding: how an ``"e8m0"`` block scale is rounded (None: the scheme's; :data:`SCALE_ROUNDINGS`:
            ``"floor"``, the OCP rule and the default; ``"ceil"``, ``"even"``, ``"rceil"``), bit for bit
            torchao's ``ScaleCalculationMode`` of the same name.
        seed: the seed of stochastic rounding (an int in ``[0, 2**64)``) instead of ``generator``;
            the random bits are the :data:`~gradstats.ops.random.ROUND` stream of
            :mod:`gradstats.ops.random` at each element's flat index (of the blocked layout with
            ``block_size``), so one seed gives bit-identical results on the CPU and in the Triton
            kernel, and :func:`gradstats.ops.fused.prune_quantize` with the same seed rounds alike.
        orientation: where blocks run (:data:`gradstats.ops.layout.ORIENTATIONS`): ``"rows"`` (the
            data-gradient GEMM's, the default), ``"columns"`` (the weight-gradient GEMM's), ``"2d"``;
            with ``hadamard``, ``"columns"`` (the default then, and the only choice).
        tensor_amax: with ``"e4m3"`` block scales, the largest magnitude of the whole tensor that ``x``
            is a part of: its float32 tensor scale is taken from it (None: from ``x``), so that a
            stored part of a gradient is quantised exactly as it was within the whole (with
            ``hadamard``: of the whole rotated tensor).
        hadamard: None, or ``n`` of a random Hadamard transform (:mod:`gradstats.ops.hadamard`; 16 in
            the ``"nvfp4_training"`` preset): the result is ``R^T Q(R x)``, ``R`` rotating each group of
            ``n`` tokens and ``Q`` quantising in blocks along the tokens, so ``quantize(g)^T x`` is the
            recipe's weight gradient ``Q(R g)^T (R x)`` with ``x`` in high precision. This one gradient
            feeds the data-gradient GEMM too (``quantize(g) W``), where the recipe quantises ``g`` along
            the channels without the rotation: its error there differs (spread over 16 tokens, not
            confined to a block of channels); its expectation with stochastic rounding is ``g`` in both.

    Returns:
        A new tensor, same shape, dtype and device as ``x``.

    Example:
        >>> import torch
        >>> quantize(torch.tensor([1.0625, 1.1875, 3e-3]), "e4m3").tolist()  # ties to even; a subnormal
        [1.0, 1.25, 0.00390625]
        >>> g = torch.Generator().manual_seed(0)
        >>> y = quantize(torch.full((100_000,), 1.1), "e2m1fn", rounding="stochastic", generator=g)
        >>> sorted(y.unique().tolist()), round(y.mean().item(), 2)  # 1.5 with probability 0.2
        ([1.0, 1.5], 1.1)
        >>> quantize(torch.tensor([[1.0, 100.0], [0.01, 0.02]]), "e2m1fn", block_size=2).tolist()
        [[0.0, 96.0], [0.01171875, 0.0234375]]
        >>> x = torch.linspace(-3, 3, 32)
        >>> torch.equal(quantize(x, "nvfp4"), quantize(x, "e2m1fn", block_size=16, scale_format="e4m3"))
        True
    """
    s = Scheme.of(fmt, rounding=rounding, block_size=block_size, scale_format=scale_format,
                  scale_rounding=scale_rounding, hadamard=hadamard, what="quantize")
    orientation = resolve_orientation(orientation, s.hadamard)
    unscaled = scale is None and s.block_size is None
    if isinstance(scale, str) and scale == "amax" and s.block_size is None:   # else _check says what is wrong
        scale = amax_scale(s.element, float(x.detach().abs().max()) if x.numel() else 0.0)
    scale = _check(x, s, scale, overflow, generator, block_dim, orientation)
    if tensor_amax is not None and not (isinstance(tensor_amax, (int, float)) and math.isfinite(tensor_amax)
                                        and tensor_amax >= 0):
        raise ValueError(f"quantize: tensor_amax must be a finite number >= 0 (the whole tensor's largest "
                         f"magnitude), got {tensor_amax!r}")
    rng = generator
    if seed is not None:
        rng = _resolve_seed(seed, generator, "quantize")
    with torch.no_grad():  # quantise-dequantise is not differentiable; results never track gradients
        if s.hadamard is not None:      # R^T Q(R x): the rotated channels-last matrix, blocks along its tokens
            m, hctx = rotate(x.detach(), s.hadamard, block_dim)
            y = _quantize(m, s, None, overflow, rng, -1, "columns", tensor_amax)
            return unrotate(y, hctx).to(x.dtype)
        y = _quantize(x.detach(), s, scale, overflow, rng, block_dim, orientation, tensor_amax)
        if unscaled:
            _warn_if_flushed(x, y, s.element)
        return y


def _warn_if_flushed(x: torch.Tensor, y: torch.Tensor, fmt: FPFormat) -> None:
    step = max(1, x.numel() // 4096)    # a glance at <= 8192 evenly spaced entries, not a pass
    xs, ys = x.detach().reshape(-1)[::step], y.reshape(-1)[::step]
    nonzero, flushed = int((xs != 0).sum()), int(((xs != 0) & (ys == 0)).sum())
    if 2 * flushed > nonzero:           # an unscaled gradient lies below a narrow format's range
        warnings.warn(f"quantize(x, {str(fmt)!r}) without a scale flushed about {flushed / nonzero:.0%} of x's "
                      "non-zero entries to zero (its values lie below the format's range): pass scale='amax' (the "
                      "rule of what_if and the plans) or a block_size, or scale=1.0 to keep this on purpose",
                      UserWarning, stacklevel=3)


def _quantize(x: torch.Tensor, s: Scheme, scale: Union[float, torch.Tensor, None], overflow: str,
              generator: Union[torch.Generator, int, None], block_dim: int = -1, orientation: str = "rows",
              tensor_amax: Optional[float] = None) -> torch.Tensor:
    """Quantise ``x`` (validated) as the resolved scheme ``s`` says, at ``scale`` without blocks."""
    if x.numel() == 0:
        return x.clone()
    if s.block_size is not None:
        return _quantize_blocks(x, s, overflow, generator, block_dim, orientation, tensor_amax)
    fmt = s.element
    if use_triton(x.device.type):
        from gradstats.ops.triton import quantize as kq

        if kq.supports(fmt):
            return kq.quantize_triton(x, fmt, scale=scale, rounding=s.rounding, overflow=overflow,
                                      generator=generator)
    return _quantize_eager(x, fmt, scale, s.rounding, overflow, generator)


def block_scales(
    x: torch.Tensor,
    fmt: Union[FPFormat, Scheme, str],
    *,
    block_size: Optional[int] = None,
    block_dim: int = -1,
    orientation: Optional[str] = None,
    tensor_amax: Optional[float] = None,
) -> torch.Tensor:
    """Per-block decode scales ``X`` of ``x`` (float32): a block is stored as ``Q(x / X) * X``.

    With ``orientation="rows"`` (the default) the result has ``x``'s shape with ``block_dim`` replaced
    by the number of blocks along it; otherwise it is 1-D, in the order of
    :func:`gradstats.ops.layout.to_blocks`. The block amax
    is taken over finite values. ``"e8m0"``: ``X = 2**mx_shared_exponent(amax)``. ``"e4m3"``
    (NVFP4 style): a float32 tensor scale ``t = amax(x) / (fmt.max * 448)`` (1 if ``x`` is all zero)
    and ``X = e4m3fn(amax_block / (fmt.max * t)) * t`` rounded to float32; ``X == 0`` marks blocks
    that encode as zeros. ``fmt``: a scheme or its name (``"nvfp4"``, ``"mxfp8_e4m3:scale_rounding=rceil"``),
    or a plain format in MX blocks (E8M0 scales, the OCP rule); ``block_size`` None is the scheme's, or
    32 (MX) for a plain format. A scheme with a Hadamard transform gives the
    scales of the rotated matrix (:func:`gradstats.ops.hadamard.rotate`), blocks along its tokens.

    Example:
        >>> import torch
        >>> block_scales(torch.tensor([[1.0, 3.0, 0.5, 0.25]]), "e2m1fn", block_size=2).tolist()
        [[0.5, 0.125]]
    """
    if block_size is None and not (names_scheme(fmt) and Scheme.parse(fmt).block_size is not None):
        block_size = 32                 # MX's, where neither the call nor its scheme sets one
    s = Scheme.of(fmt, block_size=block_size, what="block_scales")
    block_size = s.block_size
    orientation = resolve_orientation(orientation, s.hadamard)
    if s.hadamard is not None:
        x, block_dim = rotate(x, s.hadamard, block_dim)[0], -1
    _check_block(x, block_dim, orientation)
    xb, ctx = to_blocks(x, block_size, orientation, block_dim)
    X = _scales_of_blocks(xb, s, tensor_amax)[:, 0]
    if orientation != "rows":
        return X
    shape = list(x.shape) if x.dim() else [1]
    d = _norm_dim(block_dim, len(shape))
    shape[d] = -(-shape[d] // block_size)
    return from_gemm_matrix(X.reshape(ctx.M, -1), tuple(shape), block_dim).contiguous()


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------
#: the range of a scale that float32 holds together with its reciprocal (the E8M0 range)
_SCALE_MIN, _SCALE_MAX = 2.0 ** -127, 2.0 ** 127


def _check(x: torch.Tensor, s: Scheme, scale: Union[float, torch.Tensor, str, None], overflow: str,
           generator: Optional[torch.Generator], block_dim: int, orientation: str = "rows"
           ) -> Union[float, torch.Tensor, None]:
    """The call's arguments beyond its scheme (resolved at the door) checked; the scale as the passes take it."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"quantize: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"quantize: x must be float32, float16 or bfloat16, got {x.dtype} (cast it first)")
    block_size = s.block_size
    if overflow not in OVERFLOWS:
        raise ValueError(f"quantize: overflow must be one of {OVERFLOWS}, got {overflow!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"quantize: generator must be a torch.Generator, got {type(generator).__name__}")
    if scale is not None:
        if block_size is not None:
            raise ValueError("quantize: pass either scale or block_size (block scales are computed), not both")
        if isinstance(scale, torch.Tensor):
            if not scale.is_floating_point():
                raise ValueError(f"quantize: a scale tensor must be floating point, got {scale.dtype}")
            try:
                shape = torch.broadcast_shapes(scale.shape, x.shape)
            except RuntimeError:
                shape = None
            if shape != x.shape:
                raise ValueError(f"quantize: scale of shape {tuple(scale.shape)} does not broadcast to x's {tuple(x.shape)}")
            if scale.device.type == "cpu" and scale.numel():     # checked as given, before float32
                if not bool(((scale > 0) & scale.isfinite()).all()):
                    raise ValueError("quantize: scale must be positive and finite")
                if not bool(((scale >= _SCALE_MIN) & (scale <= _SCALE_MAX)).all()):
                    raise ValueError(f"quantize: every scale must lie in [2**-127, 2**127] (got values from "
                                     f"{float(scale.min()):.3g} to {float(scale.max()):.3g}): x * scale and its "
                                     "division by scale are computed in float32 and would overflow or flush "
                                     "to zero; choose a power of two near fmt.max / amax(x)")
            scale = scale.to(device=x.device, dtype=torch.float32)
        elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
            scale = float(scale)
            if not (math.isfinite(scale) and scale > 0):
                raise ValueError(f"quantize: scale must be positive and finite, got {scale}")
            if not (_SCALE_MIN <= scale <= _SCALE_MAX):
                raise ValueError(f"quantize: scale={scale:.3g} is outside [2**-127, 2**127]: x * scale and "
                                 "its division by scale are computed in float32 and would overflow or "
                                 "flush to zero; choose a power of two near fmt.max / amax(x)")
            if scale == 1.0:
                scale = None
        else:
            raise ValueError(f"quantize: scale must be None, 'amax', a float or a tensor, got {scale!r}")
    if block_size is not None:
        _check_block(x, block_dim, orientation)
    return scale


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _check_block(x: torch.Tensor, block_dim: int, orientation: str = "rows") -> None:
    if x.dim() == 0:
        raise ValueError("quantize: block scaling needs a tensor with at least one dimension")
    if not isinstance(block_dim, int) or not -x.dim() <= block_dim < x.dim():
        raise ValueError(f"quantize: block_dim must be in [{-x.dim()}, {x.dim() - 1}], got {block_dim!r}")
    check_orientation(orientation)


# ---------------------------------------------------------------------------------------------
# eager torch path
# ---------------------------------------------------------------------------------------------
def _quantize_eager(x, fmt, scale, rounding, overflow, generator, rbits=None):
    """The torch reference path; ``rbits`` (int32, x's numel, values in [0, 2**23)) replaces the random
    bits of stochastic rounding (tests feed the same bits to the Triton kernel)."""
    dtype, shape = x.dtype, x.shape
    if isinstance(scale, torch.Tensor):
        v = (x.float() * scale).reshape(-1)
        y = _round_flat(v, fmt, None, rounding, overflow, generator, rbits, torch.float32).view(shape)
        y = y.div_(scale)
        if fmt.special == "fnuz":
            y.add_(0.0)
        return y.to(dtype)
    v = x.reshape(-1)
    if not v.is_contiguous():
        v = v.contiguous()
    return _round_flat(v, fmt, scale, rounding, overflow, generator, rbits, dtype).view(shape)


def _round_flat(v, fmt, s, rounding, overflow, generator, rbits, out_dtype):
    """Quantise the contiguous 1-D ``v`` (times the float ``s``), divide by ``s``; ``out_dtype`` result."""
    c = _consts(fmt)
    if rounding == "nearest" and fmt in (_BF16, _FP16, _FP32) and rbits is None:
        y = v.float() * s if s is not None else v.float().clone()
        if fmt != _FP32:
            y = y.to(torch.bfloat16 if fmt == _BF16 else torch.float16).float()
        if overflow == "saturate":
            y.clamp_(-c.maxv, c.maxv)
        return (y.div_(s) if s is not None else y).to(out_dtype)
    n = v.numel()
    cpu = v.device.type == "cpu"
    chunk = CHUNK if cpu else n
    key = None
    if rounding == "stochastic" and rbits is None:
        key = _round_stream(generator)
    if rounding == "toward_zero" or not (c.fast_nearest if rounding == "nearest" else c.fast):
        out = torch.empty(n, dtype=out_dtype, device=v.device)
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            out[lo:hi] = _round_generic(v[lo:hi].float(), c, s, rounding, overflow, None,
                                        None if rbits is None else rbits[lo:hi], key=key, lo=lo)
        return out
    out = torch.empty(n, dtype=out_dtype, device=v.device)
    args = (v, out, c, s, rounding == "nearest", overflow == "saturate", rbits, key, chunk, not cpu)
    nchunks = -(-n // chunk)
    workers = min(THREADS if THREADS else torch.get_num_threads(), nchunks // 4) if cpu and not _threads.in_worker() else 1
    if workers <= 1:
        _fast_chunks(0, n, *args)
        return out
    per = -(-nchunks // workers) * chunk
    futures = [_threads.pool().submit(_fast_chunks, k * per, min((k + 1) * per, n), *args) for k in range(1, workers)]
    _fast_chunks(0, min(per, n), *args)
    for f in futures:
        f.result()
    return out



def _fast_chunks(start, stop, v, out, c, s, nearest, sat, rbits, key, chunk, fix_nan_always):
    """The float32 fast paths on ``v[start:stop]`` into ``out``, chunk by chunk (own scratch buffers)."""
    fmt = c.fmt
    m0 = min(chunk, stop - start)
    t = torch.empty(m0, dtype=torch.int32, device=v.device)
    tf = t.view(torch.float32)
    direct = out.dtype == torch.float32  # else rounded in a float32 buffer, cast on the way out
    ybuf = None if direct else torch.empty(m0, dtype=torch.float32, device=v.device)
    if not nearest:
        r = torch.empty_like(t)
        iota = _iota(m0, v.device) if rbits is None else None
    for lo in range(start, stop, chunk):
        hi = min(lo + chunk, stop)
        m = hi - lo
        xs = v[lo:hi]
        y = out[lo:hi] if direct else ybuf[:m]
        ti, tt = t[:m], tf[:m]
        yi = y.view(torch.int32)
        if not direct or xs.dtype != torch.float32:
            y.copy_(xs)
            if s is not None:
                y.mul_(s)
            y.abs_()
        elif s is None:
            torch.abs(xs, out=y)
        else:
            torch.mul(xs, s, out=y).abs_()
        if sat:
            y.clamp_(max=c.maxv)
        if nearest:
            # magic constant C = 2**(max(e, emin) + 23 - M): float32 rounds x + C at the format spacing
            torch.bitwise_and(yi, _EXP, out=ti).clamp_(c.E0, c.near_hi).add_((23 - c.M) << 23)
            y.add_(tt).sub_(tt)
            has_nan = False
        else:
            # below 2**emin offset by 2**emin (float32 then rounds to the fixed grid 2**(emin-23)),
            # add random bits under the kept mantissa bits, truncate, remove the offset
            has_nan = fix_nan_always or bool(torch.isnan(y.sum()))
            rr = r[:m]
            if rbits is not None:
                torch.bitwise_right_shift(rbits[lo:hi], c.M, out=rr)
            else:
                _hash_bits(lo, key, iota[:m], rr, ti, 23 - c.M)
            torch.sub(yi, c.E0, out=ti).bitwise_right_shift_(31).bitwise_and_(c.E0)
            y.add_(tt)
            yi.add_(rr).bitwise_and_(~((1 << (23 - c.M)) - 1))
            y.sub_(tt)
        if not sat:
            _overflow_fast(y, tt, c)
        if has_nan:
            y.masked_fill_(torch.isnan(xs), float("nan"))
        if fmt.signed:
            torch.copysign(y, xs, out=y)
        else:  # unsigned (fnu with a zero): negative values have no code; y is >= 0 here
            y.masked_fill_(xs < 0, float("nan"))
        if s is not None:
            y.div_(s)
        if fmt.special == "fnuz":
            y.add_(0.0)
        if not direct:
            out[lo:hi].copy_(y)


def _overflow_fast(y, tmp, c):
    """"nonfinite" overflow of the non-negative rounded ``y`` in place (``tmp``: float scratch)."""
    fmt = c.fmt
    if fmt.has_inf:  # y >= 2**(emax+1) -> inf, others unchanged (powers of two, 0 <= emax: exact)
        y.mul_(c.ieee_f1).mul_(c.ieee_f2)
    elif fmt.has_nan:  # y > max -> y * g overflows -> inf - inf = NaN
        torch.mul(y, c.nan_g, out=tmp)
        tmp.sub_(tmp)
        y.add_(tmp)
    else:
        y.clamp_(max=c.maxv)


def _round_generic(v, c, s, rounding, overflow, generator, rbits, *, key=None, lo=0):
    """Exact integer algorithm for every case (int64 on the float32 bit pattern, float64 rebuild) on
    float32 ``v``; ``lo`` is the flat index of ``v[0]`` (the counter of the random bits); ``key`` the
    rounding stream's seed (else one is drawn from ``generator``: a generator, None or a user seed)."""
    fmt = c.fmt
    w = v * s if s is not None else v
    b = w.view(torch.int32).to(torch.int64)
    neg = b < 0
    a = b & 0x7FFFFFFF
    isnan = a > _EXP
    isinf = a == _EXP
    ex = a >> 23
    eff = ex.clamp(min=1)
    sig = (a & 0x7FFFFF) | ((ex > 0).to(torch.int64) << 23)
    if rounding == "stochastic":
        if rbits is None:
            rbits = torch.empty(a.shape, dtype=torch.int32, device=a.device)
            key = _round_stream(generator) if key is None else key
            _hash_bits(lo, key, _iota(a.numel(), a.device), rbits, torch.empty_like(rbits), 23)
        R = rbits.to(torch.int64)
    if not fmt.has_zero:
        # mantissa-free fnu (e8m0fnu): powers of two 2**emin .. 2**emax; x <= 0 has no code (NaN);
        # below 2**emin -> 2**emin
        frac = sig & 0x7FFFFF
        e = eff - 127
        # float32 subnormals: renormalise in float64 (exact)
        small = ex == 0
        m, e2 = torch.frexp(torch.where(small, w, 1.0).double().abs())
        e = torch.where(small, e2.to(torch.int64) - 1, e)
        frac = torch.where(small, ((m * 2 - 1) * 2.0 ** 23).to(torch.int64), frac)
        if rounding == "nearest":
            up = (frac >= 0x400000).to(torch.int64)  # ties: the significand 1 is odd, so up
        elif rounding == "toward_zero":
            up = torch.zeros_like(frac)
        else:
            up = (frac + R) >> 23
        e = (e + up).clamp(min=fmt.emin)
        val = torch.ldexp(torch.ones_like(e, dtype=torch.float64), e)
        ovf = (e > fmt.emax) | isinf
        bad = isnan | neg | (a == 0)
    else:
        sub = a < c.E0
        meff = torch.where(sub, c.Msub, c.M)
        e = eff - 127
        spacing = torch.where(sub, fmt.emin, e) - meff
        if rounding == "stochastic":
            pre = torch.where(sub, c.E0F - eff, 0).clamp(0, 62)
            half = (1 << pre) >> 1
            q0 = sig >> pre
            rem = sig - (q0 << pre)
            n = q0 + ((rem > half) | ((rem == half) & (q0 & 1 == 1))).to(torch.int64) * (pre > 0)
            sp = 23 - meff
            q = (n + (R >> (23 - sp))) >> sp
        else:
            sh = (spacing - (eff - 150)).clamp(0, 62)
            q0 = sig >> sh
            if rounding == "nearest":
                rem = sig - (q0 << sh)
                half = (1 << sh) >> 1
                up = ((rem > half) | ((rem == half) & (q0 & 1 == 1))) & (sh > 0)
                q = q0 + up.to(torch.int64)
            else:
                q = q0
        val = torch.ldexp(q.to(torch.float64), spacing)
        ovf = (val > c.maxv) | isinf
        # unsigned formats with a zero (e5m3fnu): x < 0 has no code (NaN), -0 is +0
        bad = isnan if fmt.signed else isnan | (neg & (a != 0))
    if overflow == "saturate" or not (fmt.has_inf or fmt.has_nan):
        val = torch.where(ovf, c.maxv, val)
    else:
        val = torch.where(ovf, math.inf if fmt.has_inf else math.nan, val)
    if fmt.signed:
        val = torch.where(neg, -val, val)
    val = torch.where(bad, math.nan, val)
    y = val.float()
    if s is not None:
        y.div_(s)
    if fmt.special == "fnuz":
        y.add_(0.0)
    return y


# ---------------------------------------------------------------------------------------------
# block scaling (the layout of the blocks: gradstats.ops.layout)
# ---------------------------------------------------------------------------------------------
def _quantize_blocks(x: torch.Tensor, s: Scheme, overflow: str, generator: Union[torch.Generator, int, None],
                     block_dim: int = -1, orientation: str = "rows", tensor_amax: Optional[float] = None
                     ) -> torch.Tensor:
    fmt, rounding = s.element, s.rounding
    if orientation == "rows" and overflow == "saturate" and cpu_blocks.takes(s, x, block_dim):   # one C pass
        seed = (generator if isinstance(generator, int) else _draw_seed(generator)) if rounding == "stochastic" else 0
        return cpu_blocks.prune_quantize_blocks_cpu(x, 0.0, s, seed=seed, block_dim=block_dim,
                                                    tensor_amax=tensor_amax)[0]
    xb, ctx = to_blocks(x, s.block_size, orientation, block_dim)
    X = _scales_of_blocks(xb, s, tensor_amax)
    Xs = torch.where(X > 0, X, 1.0)
    if use_triton(x.device.type):
        from gradstats.ops.triton import quantize as kq

        if kq.supports(fmt):  # one pass: x / X, round, * X
            y = kq.quantize_triton(xb.contiguous(), fmt, scale=Xs, rounding=rounding, overflow=overflow,
                                   generator=generator, scale_div=True)
        else:
            y = _quantize_eager(xb / Xs, fmt, None, rounding, overflow, generator) * Xs
    else:
        y = _quantize_eager(xb / Xs, fmt, None, rounding, overflow, generator) * Xs
    if s.tensor_scale is not None:      # E4M3 scales: X == 0 marks a block that encodes as zeros
        y = torch.where(X > 0, y, y * 0.0)
    if fmt.special == "fnuz":
        y = y + 0.0
    return from_blocks(y, ctx).to(x.dtype)
