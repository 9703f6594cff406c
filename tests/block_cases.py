"""What the tests of the fused block-scaled kernels (Triton's and the C one) share: the gradients they are
given and how their results are compared with the composed operators'."""
from __future__ import annotations

import math

import torch

from gradstats.ops.fused import CompressCounts


def gradient(shape, seed=0, specials=True):
    """Lognormal magnitudes over many binades, random signs, zeros, and an inf and a NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(shape, generator=g) * 2) * torch.sign(torch.randn(shape, generator=g))
    x.view(-1)[::7] = 0.0
    if specials:
        x.view(-1)[3], x.view(-1)[5] = math.inf, math.nan
    return x


def same_bits(a, b):
    """Equal bit for bit, any NaN equal to any NaN."""
    both_nan = torch.isnan(a) & torch.isnan(b)
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | both_nan).all())


def counts_of(c: CompressCounts):
    return [c.zeros, c.pruned, c.underflow, c.saturated, c.nonfinite]


def sums_of(c: CompressCounts):
    return [c.dot, c.norm2, c.err2, c.noise2, c.abs_out, c.abs_in]


def close_sums(got, want):
    """The float64 sums equal to their summation order (1e-9 relative)."""
    return all((math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-30)
               for a, b in zip(got, want))
