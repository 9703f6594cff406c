"""Signed fits with a location (normal: mean, std; Laplace: median, mean absolute deviation)
and the exact median selection they need."""
from __future__ import annotations

import math

import numpy as np
import torch

from gradstats.fitting._parallel import CHUNK, _chunks


def _select(x: torch.Tensor, ks: tuple[int, ...]) -> list[float]:
    """The ``k``-th smallest values (0-based ranks ``ks``, ascending) of ``x``, exactly.

    Large inputs: the ranks of a random sample give a bracket ``[lo, hi]`` that holds the
    answers with overwhelming probability (5 standard deviations each side); one counting
    pass checks it, and only the values inside are selected. A missed bracket falls back to
    a full selection, so the result is always exact."""
    n = x.numel()
    if x.device.type != "cpu":
        return [float(torch.kthvalue(x, k + 1).values) for k in ks]
    if n <= 200_000:
        part = np.partition(x.numpy(), ks)
        return [float(part[k]) for k in ks]
    ns = 20_000
    gen = torch.Generator().manual_seed(n)
    samp = np.sort(x[torch.randint(n, (ns,), generator=gen)].numpy())
    r1, r2, d = ks[0] * ns / n, ks[-1] * ns / n, 2.5 * math.sqrt(ns)
    lo = float(samp[int(r1 - d)]) if r1 - d >= 0 else -math.inf
    hi = float(samp[int(r2 + d) + 1]) if r2 + d + 1 < ns else math.inf
    # counts below lo, equal to lo, strictly inside, equal to hi; ties (zeros!) are not copied.
    # Two passes (count, then copy into one buffer): keeping many small pieces alive between
    # the per-chunk temporaries fragments the heap and costs far more memory than they hold.
    below = at_lo = inside = at_hi = 0
    for s, e in _chunks(0, n):
        ch = x[s:e]
        below += int((ch < lo).sum())
        at_lo += int((ch == lo).sum())
        at_hi += int((ch == hi).sum()) if hi != lo else 0
        inside += int(((ch > lo) & (ch < hi)).sum())
    if not (below <= ks[0] and ks[-1] < below + at_lo + inside + at_hi):
        part = np.partition(x.numpy(), ks)  # pragma: no cover - bracket missed (p < 1e-6)
        return [float(part[k]) for k in ks]
    buf = torch.empty(inside, dtype=x.dtype)
    pos = 0
    if inside:
        for s, e in _chunks(0, n):
            ch = x[s:e]
            sel = ch[(ch > lo) & (ch < hi)]
            buf[pos:pos + sel.numel()] = sel
            pos += sel.numel()
    mid = buf.numpy()
    want = sorted({k - below - at_lo for k in ks if 0 <= k - below - at_lo < inside})
    part = np.partition(mid, want) if want else mid
    out = []
    for k in ks:
        r = k - below
        out.append(lo if r < at_lo else float(part[r - at_lo]) if r < at_lo + inside else hi)
    return out


def _median(x: torch.Tensor) -> float:
    """Median as numpy's ``median`` defines it (mean of the two middle values for even n)."""
    n = x.numel()
    k = n // 2
    if n % 2:
        return _select(x, (k,))[0]
    lo, hi = _select(x, (k - 1, k))
    return 0.5 * (lo + hi)


def _sum64(x: torch.Tensor) -> float:
    """Sum in float64 chunk by chunk (``x.sum(dtype=float64)`` would widen all of ``x`` at once)."""
    return math.fsum(float(x[s:e].sum(dtype=torch.float64)) for s, e in _chunks(0, x.numel()))


def _signed(x: torch.Tensor) -> tuple[dict[str, float], int]:
    """Signed normal (mean, std) and Laplace (median, mean |x - median|) fits on the finite
    values; also returns the number of finite values."""
    total = _sum64(x)
    if not math.isfinite(total):
        x = x[torch.isfinite(x)]
        total = _sum64(x)
    nf = x.numel()
    if nf == 0:
        return {}, 0
    mean = total / nf
    med = _median(x)
    ss = sa = 0.0
    buf = torch.empty(min(CHUNK, nf), dtype=x.dtype, device=x.device)
    for s, e in _chunks(0, nf):
        d = torch.sub(x[s:e], mean, out=buf[:e - s])
        ss += float(d.square().sum())  # cascade sum: BLAS dot accumulates per lane
        d = torch.sub(x[s:e], med, out=buf[:e - s]).abs_()
        sa += float(d.sum())
    return {"normal_loc": mean, "normal_std": math.sqrt(ss / nf),
            "laplace_loc": med, "laplace_b": sa / nf}, nf
