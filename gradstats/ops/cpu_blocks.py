"""The C kernel of block-scaled prune + quantise on the CPU (``gs_prune_quantize_blocks_f32`` of
``gradstats/ops/native/prune_quant.c``), as the operators call it: whether it takes a call, and the call.

MX (E8M0 block scales, every scale rounding) and NVFP4 (E4M3 block scales under a float32 tensor scale) in
one pass over a float32 tensor: stochastic pruning, the block maxima along the channels (``block_dim``, the
``"rows"`` blocks of :mod:`gradstats.ops.layout`, read in place), the scales, the rounding (nearest,
stochastic, toward zero; saturating), and the counts and float64 sums of
:class:`gradstats.ops.fused.CompressCounts`. NVFP4's tensor scale comes from ``tensor_amax``, or from a
first pass over the tensor that finds its largest finite magnitude after pruning. The random bits are those
of :mod:`gradstats.ops.random` at the indices the composed operators use, so the result equals
``quantize(stochastic_prune(x, a, seed=s), scheme, seed=s)`` bit for bit, and the Triton block kernel's.
:func:`gradstats.ops.fused.prune_quantize` and :func:`gradstats.quantize` (threshold 0) run it where
:func:`takes` says so; the Hadamard recipe, other dtypes and devices, and machines without a C compiler take
the composed operators.

Example:
    >>> import torch
    >>> from gradstats.scheme import Scheme
    >>> x = torch.tensor([[0.001, -0.3, 0.6, 5.0], [1.0, 2.0, 3.0, 100.0]])
    >>> s = Scheme("e2m1fn", block_size=2)
    >>> if takes(s, x, -1):
    ...     y, counts, sums = prune_quantize_blocks_cpu(x, 0.0, s)
    ...     assert y.tolist() == [[0.0, -0.25, 0.5, 4.0], [1.0, 2.0, 0.0, 96.0]]
    ...     assert counts.tolist() == [2, 0, 2, 1, 0]
"""
from __future__ import annotations

from typing import Optional

import torch

from gradstats.formats import ROUNDING_CODES
from gradstats.ops import random as _rng
from gradstats.ops.consts import fused_covers
from gradstats.ops.engine import use_native
from gradstats.ops.layout import geometry
from gradstats.ops.native import addressable, prune_quant_blocks
from gradstats.scheme import E4M3, SCALE_ROUNDINGS, Scheme

__all__ = ["takes", "prune_quantize_blocks_cpu"]


def takes(s: Scheme, x: torch.Tensor, block_dim: int) -> bool:
    """Whether the kernel takes a call of the resolved block-scaled scheme ``s`` on ``x``: a float32 CPU tensor
    (a plain one or a parameter: a subclass such as torchao's weight wrappers goes to the operators) on the
    native engine, ``block_dim`` one of its dims, an element format the fused kernels cover, no
    Hadamard transform, element and blocked-layout indices below ``2**32`` (one segment of the random
    streams), and the kernel compiled here.

    Example:
        >>> import torch
        >>> from gradstats.scheme import Scheme
        >>> takes(Scheme.parse("nvfp4_training"), torch.ones(4, 32), -1)     # the Hadamard recipe: composed
        False
    """
    if s.block_size is None or s.hadamard is not None or x.dtype != torch.float32 or x.dim() == 0:
        return False
    if not addressable(x):             # a subclass (torchao's weight wrappers) may hold no memory of its own
        return False
    if not use_native(x.device.type) or not fused_covers(s.element, 1.0):
        return False
    if not isinstance(block_dim, int) or not -x.dim() <= block_dim < x.dim():
        return False
    P, K, Q = geometry(tuple(x.shape), block_dim)
    if P * Q * -(-K // s.block_size) * s.block_size >= 1 << 32:
        return False
    return prune_quant_blocks() is not None


def prune_quantize_blocks_cpu(x: torch.Tensor, threshold: float, s: Scheme, *, seed: Optional[int] = None,
                              block_dim: int = -1, tensor_amax: Optional[float] = None,
                              out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prune at ``threshold`` (0: none) and round ``x`` to the block-scaled scheme ``s`` in one pass of the C
    kernel (a call :func:`takes` takes): ``(result, counts, sums)``, the counts (int64: zeros, pruned,
    underflow, saturated, non-finite) and sums (float64: dot, norm2, err2, noise2, abs_out, abs_in) in host
    tensors. ``seed``: the pruning and rounding streams' seed (None: 0); ``out``: where the result goes
    (any tensor of ``x``'s shape; ``x`` itself too).

    Example:
        >>> import torch
        >>> from gradstats.scheme import Scheme
        >>> x = torch.tensor([1.0, 3.0, 0.5, 0.25])
        >>> if takes(Scheme("e2m1fn", block_size=2), x, -1):
        ...     y, counts, _ = prune_quantize_blocks_cpu(x, 0.0, Scheme("e2m1fn", block_size=2))
        ...     assert y.tolist() == [1.0, 3.0, 0.5, 0.25]
    """
    el = s.element
    xc = x.contiguous()
    P, K, Q = geometry(tuple(xc.shape), block_dim)
    own = out is not None and out.is_contiguous() and out.data_ptr() != xc.data_ptr()
    res = out if own else torch.empty_like(xc)
    counts = torch.zeros(5, dtype=torch.int64)
    sums = torch.zeros(6, dtype=torch.float64)
    e4m3 = s.tensor_scale is not None
    rc = prune_quant_blocks()(
        xc.data_ptr(), res.data_ptr(), P, K, Q, s.block_size, float(threshold), el.man_bits, el.emin, el.max,
        int(el.subnormals), ROUNDING_CODES[s.rounding], int(el.has_negative_zero), int(e4m3),
        SCALE_ROUNDINGS.index(s.scale_rounding or "floor"), el.emax, el.man_bits, el.max,
        el.max * E4M3.max,                        # NVFP4's tensor-scale divisor, rounded to float32 by ctypes
        -1.0 if tensor_amax is None or not e4m3 else float(tensor_amax), _rng.stream(seed or 0, _rng.PRUNE),
        _rng.stream(seed or 0, _rng.ROUND), torch.get_num_threads(), counts.data_ptr(), sums.data_ptr())
    if rc != 0:  # pragma: no cover - arguments are validated by the operators; -3: out of memory
        raise RuntimeError(f"the fused block kernel rejected its arguments (code {rc})")
    result = res.view_as(x)
    if out is not None:
        if not own:
            out.copy_(result)
        result = out
    return result, counts, sums
