"""The tensor operators: quantisation to any small floating-point format, stochastic and hard pruning,
and the fused prune + quantise of the apply stage, each on every engine.

Engines, one behaviour: the torch reference path (any device), the C kernels of
:mod:`gradstats.ops.native` (CPU, float32), the numpy engine of :mod:`gradstats.ops.cpu`, and the Triton
kernels of :mod:`gradstats.ops.triton` (CUDA, or Triton's interpreter on the CPU). The random bits of
stochastic rounding and pruning come from :mod:`gradstats.ops.random`.

Example:
    >>> import torch
    >>> from gradstats import ops
    >>> ops.quantize(torch.tensor([1.3, 300.0]), "e4m3fn").tolist()
    [1.25, 288.0]
"""
from __future__ import annotations

from gradstats.ops.fused import CompressCounts, prune_quantize
from gradstats.ops.prune import hard_prune, stochastic_prune
from gradstats.ops.quantization import block_scales, mx_shared_exponent, quantize

__all__ = ["quantize", "block_scales", "mx_shared_exponent", "stochastic_prune", "hard_prune", "prune_quantize",
           "CompressCounts"]
