"""Prune then quantise a gradient tensor in one pass: the operator that :func:`gradstats.apply`
runs in the backward pass.

``prune_quantize(x, threshold, fmt, ...)`` is ``quantize(stochastic_prune(x, threshold), fmt)``
with the counts a training log needs (zeros, entries pruned, entries flushed to zero by
rounding, entries saturated, non-finite inputs) and, over the finite entries, the sums that give
the call's magnitude gain ``<out, g> / <g, g>``, its relative error and magnitude bias. On the CPU fused C
kernels (:mod:`gradstats.ops.native`) do it in a single pass over the data, for per-tensor scales and for
block scales (MX, NVFP4; a first pass finds NVFP4's tensor maximum unless ``tensor_amax`` is given); the
Hadamard recipe, other devices, and machines without a C compiler go through
:func:`gradstats.ops.stochastic_prune` and :func:`gradstats.quantize`;
on the Triton engine (CUDA) one kernel does it for per-tensor scales (:mod:`gradstats.ops.triton.fused`)
and one for block scales, MX and NVFP4 with its Hadamard recipe (:mod:`gradstats.ops.triton.blocks`).
All draw their random bits from the one stream of
:mod:`gradstats.ops.random` (pruning and rounding streams of one seed), so for the same seed the
fused kernel equals ``quantize(stochastic_prune(x, a, seed=s), fmt, seed=s)`` bit for bit, for
every rounding.

Example:
    >>> import torch
    >>> from gradstats.ops.fused import prune_quantize
    >>> x = torch.tensor([0.001, -0.3, 0.6, 5.0])
    >>> out, counts = prune_quantize(x, 0.5, "e3m2fn", generator=torch.Generator().manual_seed(0))
    >>> out.tolist()[2:], counts.saturated
    ([0.625, 5.0], 0)
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

import numpy as np
import torch

from gradstats.formats import ROUNDING_CODES, FPFormat
from gradstats.ops import cpu_blocks
from gradstats.ops import random as _rng
from gradstats.ops.consts import fused_covers
from gradstats.ops.engine import triton_available, use_native, use_triton
from gradstats.ops.native import addressable, reads_in_place
from gradstats.scheme import Scheme


@dataclass(frozen=True)
class CompressCounts:
    """What one call of :func:`prune_quantize` did to a tensor of ``n`` elements. Equality compares
    the counts; the float64 sums depend on the order of summation (threads, engine) and are left out."""

    n: int
    zeros: int          #: zeros in the result (pruned, underflowed, or zero already)
    pruned: int         #: non-zero entries set to zero by pruning
    underflow: int      #: non-zero entries flushed to zero by rounding
    saturated: int      #: entries whose scaled magnitude exceeded the format's max
    nonfinite: int = 0  #: entries of the input that are NaN or inf (left out of the sums below)
    dot: float = field(default=math.nan, compare=False)  #: ``sum g * out`` over the finite entries
    norm2: float = field(default=math.nan, compare=False)  #: ``sum g**2``
    err2: float = field(default=math.nan, compare=False)  #: ``sum (out - g)**2``
    noise2: float = field(default=math.nan, compare=False)  #: ``sum g**2 (out - g)**2``: the plug-in variance of ``dot - norm2``
    abs_out: float = field(default=math.nan, compare=False)  #: ``sum |out|``
    abs_in: float = field(default=math.nan, compare=False)  #: ``sum |g|``

    @property
    def sparsity(self) -> float:
        """Fraction of zeros in the result."""
        return self.zeros / self.n if self.n else 0.0

    @property
    def gain(self) -> float:
        """The magnitude gain ``<out, g> / <g, g>``: 1 for an operator that neither shrinks nor
        inflates the gradient (unbiased pruning and rounding), below 1 where values are flushed or
        saturated (NaN for a zero gradient)."""
        return self.dot / self.norm2 if self.norm2 > 0 else math.nan

    @property
    def gain_se(self) -> float:
        """The standard error of :attr:`gain` from the call's own random draws (pruning and
        stochastic rounding act on each entry independently): ``sqrt(noise2) / norm2``."""
        return math.sqrt(max(self.noise2, 0.0)) / self.norm2 if self.norm2 > 0 else math.nan

    @property
    def error(self) -> float:
        """The relative error ``|out - g|^2 / |g|^2`` (pruning and rounding together)."""
        return self.err2 / self.norm2 if self.norm2 > 0 else math.nan

    @property
    def bias(self) -> float:
        """The relative magnitude bias ``(sum |out| - sum |g|) / sum |g|`` (negative: shrinkage)."""
        return self.abs_out / self.abs_in - 1.0 if self.abs_in > 0 else math.nan

    def to_dict(self) -> dict[str, float]:
        """Plain dict: the counts, the sums, and the sparsity, gain, error and bias they give."""
        return {**asdict(self), "sparsity": self.sparsity, "gain": self.gain, "gain_se": self.gain_se,
                "error": self.error, "bias": self.bias}

    def to_dataframe(self) -> Any:
        """pandas view: one row."""
        import pandas as pd

        return pd.DataFrame([self.to_dict()])


def _native():
    """The fused C kernel (:func:`gradstats.ops.native.prune_quant`), or None without a compiler."""
    from gradstats.ops.native import prune_quant

    return prune_quant()


def _unquantized(rounding: Optional[str]) -> None:
    """Check the rounding of a call without a format (it rounds nothing: no scheme is resolved)."""
    if rounding is not None and rounding not in ROUNDING_CODES:
        raise ValueError(f"rounding must be one of {sorted(ROUNDING_CODES)}, got {rounding!r}")


def prune_quantize(x: torch.Tensor, threshold: float, fmt: Union[FPFormat, Scheme, str, None], *,
                   scale: float = 1.0, rounding: Optional[str] = None,
                   generator: Optional[torch.Generator] = None, block_size: Optional[int] = None,
                   out: Optional[torch.Tensor] = None,
                   seed: Optional[int] = None, block_dim: int = -1,
                   tensor_amax: Optional[float] = None,
                   hadamard: Optional[int] = None) -> tuple[torch.Tensor, CompressCounts]:
    """Stochastic pruning at ``threshold`` (0 = none), then rounding to ``fmt`` (None = none)
    at ``scale`` with ``rounding``, saturating at the format's max. Returns ``(result, counts)``.

    ``scale`` multiplies before rounding and divides after (exact for powers of two);
    block scales are used instead with a block-scaled ``fmt`` (``scale`` is then ignored): a
    :class:`~gradstats.scheme.Scheme` or its name (``"nvfp4"``, ``"mxfp8_e4m3"``,
    ``"e4m3fn:block=32:scale_rounding=rceil"``), which sets the rounding, blocks, block scale format and
    its rounding, or a plain format with ``block_size`` (MX: E8M0 scales rounded by the OCP rule);
    ``rounding``, ``block_size`` and ``hadamard`` given here replace the scheme's, resolved once as
    :func:`gradstats.quantize` does (:meth:`~gradstats.scheme.Scheme.of`).
    ``seed`` (an int in ``[0, 2**64)``) or ``generator`` (one seed drawn from it) seeds both the
    pruning and the rounding streams. Blocks run along the channels, ``block_dim`` (1 for a
    convolution's output, :func:`gradstats.ops.layout.channel_dim`), as the data-gradient GEMM reads
    them; ``tensor_amax``: NVFP4's tensor scale from the whole tensor's maximum (see :func:`gradstats.quantize`).
    ``hadamard`` (or a scheme's, ``"nvfp4_training"``): quantise ``R^T Q(R y)`` of the pruned ``y`` as
    :func:`gradstats.quantize` does (blocks along the tokens); ``saturated`` then is the fraction of
    the entries of ``R y`` clipped (padding tokens included) times ``n``, ``underflow`` the non-zero
    entries of ``y`` that come out zero.

    Example:
        >>> import torch
        >>> y, c = prune_quantize(torch.tensor([1.0, 1000.0]), 0.0, "e2m1fn")
        >>> y.tolist(), c.saturated
        ([1.0, 6.0], 1)
        >>> x = torch.linspace(-3, 3, 32)
        >>> torch.equal(prune_quantize(x, 0.0, "nvfp4")[0],
        ...             prune_quantize(x, 0.0, "e2m1fn:block=16:scale=e4m3")[0])
        True
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"prune_quantize expects a floating-point tensor, got {type(x).__name__}")
    if not (threshold >= 0):
        raise ValueError(f"threshold must be >= 0 (0 = no pruning), got {threshold}")
    s = None if fmt is None else Scheme.of(fmt, rounding=rounding, block_size=block_size, hadamard=hadamard,
                                           what="prune_quantize")
    if s is None:
        _unquantized(rounding)
    if not (scale > 0):
        raise ValueError(f"scale must be a positive number, got {scale}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    seed = _call_seed(seed, generator, threshold > 0 or (s is not None and s.rounding == "stochastic"),
                      "prune_quantize")
    y, c, sums = _PATHS[_path(x, s, scale, block_dim)](x, threshold, s, scale, seed, block_dim, tensor_amax, out, None)
    return y, CompressCounts(x.numel(), *c.tolist(), *sums.tolist())


def _call_seed(seed: Optional[int], generator: Optional[torch.Generator], random: bool, what: str) -> Optional[int]:
    """The seed of one call: ``seed`` checked (:func:`gradstats.ops.random.resolve_seed`), else one draw from
    ``generator`` where the call draws random numbers (pruning, stochastic rounding), else None."""
    if seed is not None:
        return _rng.resolve_seed(seed, generator, what)
    return _rng.draw_seed(generator) if random else None


def _path(x: torch.Tensor, s: Optional[Scheme], scale: Any, block_dim: int) -> str:
    """The one place where a call of :func:`prune_quantize` or :func:`prune_quantize_into` is given its engine's
    path (a key of :data:`_PATHS`): one Triton pass over ``x`` (block scales: :mod:`gradstats.ops.triton.blocks`;
    a per-tensor scale: :mod:`gradstats.ops.triton.fused`) where the engine is Triton and the kernel covers
    the call, the fused C kernels (``"native"``, per-tensor scales; ``"native_blocks"``, block scales without
    a Hadamard transform; float32) where it is native, and the operators one after the other
    (``"composed"``) elsewhere. A scale on the device is not read back to be checked (the caller made it
    positive)."""
    if x.numel() == 0:
        return "composed"
    if s is not None and s.block_size is not None:       # block scales: a fused kernel, where one covers the call
        if use_triton(x.device.type):
            from gradstats.ops.triton import blocks as kblocks

            if kblocks.covers(s, x, block_dim):
                return "triton_blocks"
        elif cpu_blocks.takes(s, x, block_dim):
            return "native_blocks"
        return "composed"
    if not fused_covers(None if s is None else s.element, 1.0 if isinstance(scale, torch.Tensor) else scale):
        return "composed"
    if use_triton(x.device.type):
        return "triton_tensor" if triton_available() else "composed"
    return "native" if use_native(x.device.type) and x.dtype == torch.float32 and addressable(x) \
        and _native() is not None else "composed"


def _triton_blocks(x: torch.Tensor, threshold: Any, s: Scheme, scale: Any, seed: Optional[int], block_dim: int,
                   tensor_amax: Optional[float], out: Optional[torch.Tensor], stats: Optional[torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from gradstats.ops.triton import blocks as kblocks

    y, c, sums = kblocks.prune_quantize_blocks_triton(
        x, threshold, s, seed=seed or 0, block_dim=block_dim, tensor_amax=tensor_amax, stats=stats,
        out=out if out is not None and out.is_contiguous() else None)
    if out is not None and y is not out:
        out.copy_(y)
        y = out
    return y, c, sums


def _triton_tensor(x: torch.Tensor, threshold: Any, s: Optional[Scheme], scale: Any, seed: Optional[int],
                   block_dim: int, tensor_amax: Optional[float], out: Optional[torch.Tensor],
                   stats: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from gradstats.ops.triton import fused as kfused

    return kfused.prune_quantize_triton(x, threshold, None if s is None else s.element, scale=scale,
                                        rounding="nearest" if s is None else s.rounding, seed=seed or 0, out=out)


def _format_args(s: Optional[Scheme]) -> tuple:
    """The C kernel's arguments that a scheme fixes (see :func:`gradstats.ops.native.prune_quant`): ``quant``,
    ``man_bits``, ``emin``, ``maxv``, ``subnormals``, ``rounding``, ``neg_zero``."""
    el = None if s is None else s.element
    q = el is not None
    return (int(q), el.man_bits if q else 0, el.emin if q else 0, el.max if q else 0.0,
            int(el.subnormals) if q else 1, ROUNDING_CODES["nearest" if s is None else s.rounding],
            int(el.has_negative_zero) if q else 1)


def _native_call(fn: Any, x: torch.Tensor, res: torch.Tensor, threshold: float, scale: float, fargs: tuple,
                 seed: Optional[int], counts: int, sums: int) -> None:
    """One call of the fused C kernel on contiguous ``x`` into ``res`` (addresses of int64[5] counts and
    float64[6] sums)."""
    if fn(x.data_ptr(), res.data_ptr(), x.numel(), threshold, scale, *fargs, _rng.stream(seed or 0, _rng.PRUNE),
          _rng.stream(seed or 0, _rng.ROUND), torch.get_num_threads(), counts, sums) != 0:
        raise RuntimeError("the fused prune/quantise kernel rejected its arguments")  # pragma: no cover


def _native_pass(x: torch.Tensor, threshold: Any, s: Optional[Scheme], scale: Any, seed: Optional[int],
                 block_dim: int, tensor_amax: Optional[float], out: Optional[torch.Tensor],
                 stats: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused C kernel: one pass, its counts and sums in host tensors."""
    xc = x.contiguous()
    res = out if out is not None and out.is_contiguous() else torch.empty_like(xc)
    counts = torch.zeros(5, dtype=torch.int64)
    sums = torch.zeros(6, dtype=torch.float64)
    _native_call(_native(), xc, res, float(threshold), float(scale), _format_args(s), seed, counts.data_ptr(),
                 sums.data_ptr())
    result = res.view_as(x)
    if out is not None:
        if res is not out:
            out.copy_(result)
        result = out
    return result, counts, sums


class NativeCall:
    """:func:`prune_quantize` of one scheme on the fused C kernel, prepared once: what a hook calls on every
    gradient of a layer (:func:`gradstats.apply`). Between a backward pass's own kernels each torch operation
    costs tens of microseconds (its code and data out of the caches), so the call makes only the seed's draw
    and the result's allocation: the format's arguments are resolved here, the counts and sums land in arrays it keeps, and
    nothing is checked but whether the kernel takes ``x`` as it is (:meth:`takes`; else
    :func:`prune_quantize`, the same result). The same seed gives the same bits as :func:`prune_quantize`.

    Example:
        >>> import torch
        >>> call = NativeCall("e4m3fn")
        >>> x = torch.linspace(-1, 1, 64)
        >>> if call.takes(x):
        ...     y, c = call(x, 0.1, 1.0, seed=3)     # or generator=: one seed drawn, as prune_quantize draws it
        ...     y2, c2 = prune_quantize(x, 0.1, "e4m3fn", seed=3)
        ...     assert torch.equal(y, y2) and c == c2
    """

    def __init__(self, fmt: Union[FPFormat, Scheme, str, None], **scheme: Any) -> None:
        self.scheme = None if fmt is None else Scheme.of(fmt, what="NativeCall", **scheme)
        self._fn = _native()
        self._fargs = _format_args(self.scheme)
        self._element = None if self.scheme is None else self.scheme.element
        self._stochastic = self.scheme is not None and self.scheme.rounding == "stochastic"
        self._blocks = self.scheme is not None and self.scheme.block_size is not None
        self._counts = np.zeros(5, dtype=np.int64)
        self._sums = np.zeros(6, dtype=np.float64)
        self._at = (self._counts.ctypes.data, self._sums.ctypes.data)    # (each .ctypes makes an object)

    def covers(self, scale: float = 1.0) -> bool:
        """Whether the C kernel takes the scheme at ``scale`` (built, a per-tensor scheme it covers)."""
        return self._fn is not None and not self._blocks and fused_covers(self._element, scale)

    def takes(self, x: torch.Tensor, scale: float = 1.0) -> bool:
        """Whether a call on ``x`` runs the C kernel directly (:func:`prune_quantize`'s ``"native"`` path: a
        non-empty contiguous float32 CPU tensor, and :meth:`covers`) when the CPU's engine is the native one
        (the caller's check)."""
        return reads_in_place(x) and self.covers(scale)

    def __call__(self, x: torch.Tensor, threshold: float, scale: float, *, seed: Optional[int] = None,
                 generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, CompressCounts]:
        """``prune_quantize(x, threshold, scheme, scale=scale, seed=seed, generator=generator)`` where
        :meth:`takes` holds (a seed drawn from ``generator`` only where the call is random, as there)."""
        if not threshold >= 0:
            raise ValueError(f"threshold must be >= 0 (0 = no pruning), got {threshold}")
        seed = _call_seed(seed, generator, threshold > 0 or self._stochastic, "NativeCall")
        res = torch.empty_like(x)
        _native_call(self._fn, x, res, float(threshold), float(scale), self._fargs, seed, *self._at)
        return res, CompressCounts(x.numel(), *self._counts.tolist(), *self._sums.tolist())


def _native_blocks(x: torch.Tensor, threshold: Any, s: Scheme, scale: Any, seed: Optional[int],
                   block_dim: int, tensor_amax: Optional[float], out: Optional[torch.Tensor],
                   stats: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The C block kernel (:func:`gradstats.ops.cpu_blocks.prune_quantize_blocks_cpu`); ``scale`` and ``stats``
    are not read (block scales replace the one, ``tensor_amax`` or the kernel's own pass the other)."""
    return cpu_blocks.prune_quantize_blocks_cpu(x, threshold, s, seed=seed, block_dim=block_dim,
                                                tensor_amax=tensor_amax, out=out)


def _composed_pass(x: torch.Tensor, threshold: Any, s: Optional[Scheme], scale: Any, seed: Optional[int],
                   block_dim: int, tensor_amax: Optional[float], out: Optional[torch.Tensor],
                   stats: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The operators one after the other; host numbers where the engine is not Triton (a threshold solved
    on the device stays there for Triton's pruning kernel; block scales ignore ``scale``)."""
    if isinstance(threshold, torch.Tensor) and not use_triton(x.device.type):
        threshold = float(threshold)
    scale = float(scale) if isinstance(scale, torch.Tensor) else scale
    return _composed_on_device(x, threshold, s, scale, seed, out, block_dim, tensor_amax)


#: the engines' paths by the names :func:`_path` gives: ``(x, threshold, s, scale, seed, block_dim,
#: tensor_amax, out, stats) -> (result, counts, sums)``, the counts and sums left on ``x``'s device
_PATHS = {"triton_blocks": _triton_blocks, "triton_tensor": _triton_tensor, "native": _native_pass,
          "native_blocks": _native_blocks, "composed": _composed_pass}


def _composed_on_device(x: torch.Tensor, threshold: Any, s: Optional[Scheme], scale: Any, seed: Optional[int],
                        out: Optional[torch.Tensor] = None, block_dim: int = -1, tensor_amax: Optional[float] = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference path: the pruning and quantisation operators one after the other, with one seed; ``s`` the
    resolved scheme (None: no quantisation); the counts (int64[5]) and sums (float64[6]) left as tensors
    on ``x``'s device (nothing read back)."""
    from gradstats.ops.prune import stochastic_prune
    from gradstats.ops.quantization import quantize

    nonzero_in = x != 0
    if isinstance(threshold, torch.Tensor):       # solved on the device (the Triton engine): kept there
        from gradstats.ops.triton import prune as kprune

        y = kprune.stochastic_prune(x, threshold, seed=seed)
    else:
        y = stochastic_prune(x, threshold, seed=seed) if threshold > 0 else x
    pruned = (nonzero_in & (y == 0)).sum()
    saturated = underflow = torch.zeros((), dtype=torch.int64, device=x.device)
    if s is not None:
        if s.block_size is not None:
            z = quantize(y, s, seed=seed, block_dim=block_dim, tensor_amax=tensor_amax)
            saturated = _block_saturated(y, s, block_dim, tensor_amax)
        else:
            z = quantize(y, s, scale=scale, seed=seed)
            saturated = ((y.abs() * scale) > s.element.max).sum()
        underflow = ((y != 0) & (z == 0)).sum()
        y = z
    zeros = (y == 0).sum()
    fin = torch.isfinite(x)
    xd = torch.where(fin, x, 0).double().reshape(-1)
    od = torch.where(fin, y, 0).double().reshape(-1)
    d = od - xd
    sums = torch.stack([torch.dot(xd, od), torch.dot(xd, xd), torch.dot(d, d), torch.dot(xd * xd, d * d),
                        od.abs().sum(), xd.abs().sum()])
    nonfinite = x.numel() - fin.sum()
    counts = torch.stack([zeros, pruned, underflow, saturated, nonfinite]).to(torch.int64)
    if out is not None:
        out.copy_(y)
        y = out
    elif y is x:
        y = x.clone()
    return y, counts, sums


def prune_quantize_into(x: torch.Tensor, threshold: Union[float, torch.Tensor],
                        fmt: Union[FPFormat, Scheme, str, None], *, scale: Union[float, torch.Tensor] = 1.0, rounding: Optional[str] = None, seed: int = 0,
                        block_size: Optional[int] = None, block_dim: int = -1,
                        hadamard: Optional[int] = None, tensor_amax: Optional[float] = None,
                        stats: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`prune_quantize` for the device path: ``(result, counts, sums)`` with the counts
    (int64: zeros, pruned, underflow, saturated, nonfinite) and the sums (float64: dot, norm2, err2,
    noise2, abs_out, abs_in; :class:`CompressCounts`) left on ``x``'s device, so that nothing is
    read back. On the Triton engine one fused kernel makes all three in one pass over ``x``
    (per-tensor scales: :mod:`gradstats.ops.triton.fused`; block scales, MX and NVFP4:
    :mod:`gradstats.ops.triton.blocks`), and ``threshold`` and ``scale`` may be one-element tensors
    on ``x``'s device (solved there). ``tensor_amax`` (a host float) or ``stats`` (``x``'s float64
    statistics vector on its device) give NVFP4's tensor scale without a pass of its own (a Hadamard
    transform's rotated maximum always takes one: two launches). On the CPU the C kernels of
    :func:`prune_quantize` run (counts and sums in host tensors; ``stats`` is not read there);
    elsewhere the operators run one after the other.

    Example:
        >>> import torch
        >>> y, c, s = prune_quantize_into(torch.tensor([1.0, 1000.0]), 0.0, "e2m1fn")
        >>> y.tolist(), c.tolist()
        ([1.0, 6.0], [0, 0, 0, 1, 0])
    """
    s = None if fmt is None else Scheme.of(fmt, rounding=rounding, block_size=block_size, hadamard=hadamard,
                                           what="prune_quantize")
    if s is None:
        _unquantized(rounding)
    return _PATHS[_path(x, s, scale, block_dim)](x, threshold, s, scale, seed, block_dim, tensor_amax, None, stats)


def _block_saturated(y: torch.Tensor, s: Scheme, block_dim: int = -1,
                     tensor_amax: Optional[float] = None) -> torch.Tensor:
    """Entries whose magnitude over their block's decode scale exceeds the format's max (clipped):
    MX's floor scale leaves a block's largest value up to ``2**(emax + 1)`` (above e2m1fn's 6, for one),
    and NVFP4's e4m3 scale may round down. With ``hadamard``: those of the rotated matrix, in blocks
    along its tokens (what :func:`gradstats.quantize` rounds), as a fraction of its entries times
    ``y.numel()`` (rounded down), so that ``saturated / n`` is the fraction clipped."""
    from gradstats.ops.block_scales import _scales_of_blocks
    from gradstats.ops.hadamard import rotate
    from gradstats.ops.layout import to_blocks

    rotated = 0
    if s.hadamard is not None:
        r = rotate(y, s.hadamard, block_dim)[0]
        xb, _ = to_blocks(r, s.block_size, "columns", -1)
        rotated = r.numel()
    else:
        xb, _ = to_blocks(y, s.block_size, "rows", block_dim)
    X = _scales_of_blocks(xb, s, tensor_amax)
    clipped = ((xb.abs() / torch.where(X > 0, X, 1.0) > s.element.max) & (X > 0)).sum()
    if rotated:          # clipped entries of the rotated matrix (its padding tokens too) as a share of y's
        return clipped * y.numel() // rotated
    return clipped
