"""What prune-then-round does to a gradient: one model of the composed operator.

:func:`gradstats.apply` runs one operator per planned layer (:func:`gradstats.prune_quantize`):
stochastic pruning at a threshold ``a`` (``|g| >= a`` kept; below, ``sign(g) a`` with probability
``|g|/a``, else 0), then rounding to a format at a per-tensor scale ``s`` (saturating at the
format's maximum). Pruning turns many small values into ``+-a``; where ``a`` lies above the
tensor's own maximum (near-Gaussian layers at high sparsity) every value it keeps is ``+-a``, and a
scale taken from the pre-pruning maximum saturates all of them. So everything a plan predicts is
predicted for the *composed* operator, from one law of the non-zero magnitudes ``x = |g|``:

- pruned: ``E[(1 - x/a) 1{x < a}]``; the values rounded up to ``a`` and those kept (``x >= a``)
  then go through the format's cells at scale ``s``;
- underflow: entries non-zero after pruning that the rounding sets to zero; overflow: entries whose
  scaled magnitude exceeds the format's maximum (saturated);
- error ``E[(Q(T(g)) - g)^2] / E[g^2]``, magnitude bias ``E|Q(T(g))| / E|g| - 1`` and gain
  ``E[Q(T(g)) g] / E[g^2]`` (1 for an unbiased operator: pruning and stochastic rounding are
  unbiased below saturation, so a gain below 1 is flushing or clipping).

Each is a sum of partial moments ``M_k(t) = E[x^k 1{x < t}]`` over the format's cells, so any law
with partial moments serves: the run's own binade histogram with its top magnitudes
(:class:`gradstats.stats.law.HistogramLaw`, the default: no lognormal assumption) or a lognormal.
The apply-time counts of the same quantities are :class:`gradstats.ops.fused.CompressCounts`.

Example:
    >>> import torch
    >>> from gradstats.stats import tensor_stats
    >>> g = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    >>> p = predict_composed(tensor_stats(g), "e2m3fn", threshold=3.0, scale=4.0)   # 3 * 4 above 7.5
    >>> bool(p.overflow > 0.001), bool(p.gain < 0.99)
    (True, True)
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Union

import numpy as np
from scipy.special import ndtr

from gradstats.formats import ROUNDINGS, FPFormat, parse

__all__ = ["ComposedPrediction", "predict_composed", "composed_from_moments", "composed_blocks", "lognormal_moments_fn"]

PartialMoments = Callable[[np.ndarray, int], np.ndarray]


@dataclass(frozen=True)
class ComposedPrediction:
    """What the composed operator (stochastic pruning, then rounding) is predicted to do to a tensor.

    Attributes:
        sparsity: fraction of all entries that are zero afterwards (exact zeros included).
        pruned: fraction of all entries set to zero by pruning.
        underflow: fraction of all entries, non-zero after pruning, that the rounding flushes to zero.
        flushed: ``underflow`` as a share of the non-zero entries of the input (what ``flush_bound`` bounds).
        overflow: fraction of all entries saturated at the format's maximum.
        error: relative error ``E[(out - g)^2] / E[g^2]`` (pruning and rounding together).
        bias: relative magnitude bias ``E|out| / E|g| - 1`` (negative: shrinkage).
        gain: ``E[out g] / E[g^2]`` (1: neither shrunk nor inflated).
    """

    sparsity: float
    pruned: float
    underflow: float
    flushed: float
    overflow: float
    error: float
    bias: float
    gain: float

    def to_dict(self) -> dict[str, float]:
        """Plain dict of the fields."""
        return asdict(self)


def lognormal_moments_fn(mu: float, sigma: float) -> PartialMoments:
    """The partial moments ``E[x^k 1{x < t}]`` of ``ln x ~ N(mu, sigma^2)``.

    Example:
        >>> pm = lognormal_moments_fn(0.0, 1.0)
        >>> float(pm(np.array([np.inf]), 2)[0]) == math.exp(2.0)
        True
    """
    def pm(t: np.ndarray, k: int) -> np.ndarray:
        t = np.asarray(t, dtype=np.float64)
        with np.errstate(divide="ignore"):
            z = (np.log(t) - mu - k * sigma * sigma) / sigma
        return math.exp(k * mu + 0.5 * k * k * sigma * sigma) * ndtr(z)
    return pm


@functools.lru_cache(maxsize=64)
def _grid(fmt: FPFormat) -> np.ndarray:
    """The positive representable values of ``fmt``, ascending (read-only, cached)."""
    v = fmt.values().numpy()
    out = v[v > 0].copy()
    out.setflags(write=False)
    return out


def _pm_capped(pm: PartialMoments, cap: float) -> PartialMoments:
    if not math.isfinite(cap):
        return pm
    return lambda t, k: pm(np.minimum(np.asarray(t, dtype=np.float64), cap), k)


def composed_from_moments(pm: PartialMoments, fmt: Union[FPFormat, str, None], *, threshold: float, scale: float,
                          rounding: str = "nearest", p0: float = 0.0) -> ComposedPrediction:
    """:class:`ComposedPrediction` for the non-zero magnitudes of partial moments ``pm`` (normalised
    to a probability law here) with a fraction ``p0`` of exact zeros; ``threshold`` 0: no pruning;
    ``fmt`` None: no rounding.

    Example:
        >>> p = composed_from_moments(lognormal_moments_fn(0.0, 1.0), None, threshold=1.0, scale=1.0)
        >>> round(p.pruned, 6), round(p.gain, 12)
        (0.238422, 1.0)
    """
    _check_args(threshold, scale, rounding, p0)
    f = parse(fmt) if isinstance(fmt, str) else fmt
    return _assemble(_raw(_normalised(pm), f, float(threshold), float(scale), rounding), p0)


def _check_args(threshold: float, scale: float, rounding: str, p0: float) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {list(ROUNDINGS)}, got {rounding!r}")
    if not (threshold >= 0 and math.isfinite(threshold)):
        raise ValueError(f"threshold must be a finite number >= 0 (0: no pruning), got {threshold!r}")
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a positive finite multiplier, got {scale!r}")
    if not 0.0 <= p0 <= 1.0:
        raise ValueError(f"p0 must be a fraction in [0, 1], got {p0!r}")


def _normalised(pm: PartialMoments) -> PartialMoments:
    mass = float(pm(np.array([np.inf]), 0)[0])
    if not mass > 0:
        raise ValueError("the law has no mass: there are no non-zero magnitudes to predict for")
    return lambda t, k: pm(t, k) / mass


def _raw(pm: PartialMoments, f: FPFormat | None, a: float, scale: Any, rounding: str,
         cap: Any = None) -> np.ndarray:
    """Per non-zero entry of the (normalised) law: P(pruned), P(flushed), P(saturated), E[Q x], E[Q],
    E[Q^2], E[x], E[x^2] of the composed operator (Q the output's magnitude), for each of ``S`` scales
    (an array) and, with ``cap``, the law conditioned below each cap: ``(S, 8)``, or ``(8,)`` for a
    scalar scale. One call of ``pm`` per moment order for all of them."""
    scalar = np.ndim(scale) == 0
    sc = np.atleast_1d(np.asarray(scale, dtype=np.float64))
    S = sc.size
    cp = np.full(S, np.inf) if cap is None else np.broadcast_to(np.asarray(cap, dtype=np.float64), (S,))
    grid = np.zeros(0) if f is None else _grid(f)
    # the points of every row: inf, a, the cell cuts (clipped below at a), max(M, a)
    if f is not None:
        v = grid[None, :] / sc[:, None]                             # (S, K) representable magnitudes, unscaled
        M = v[:, -1]
        edges0 = np.concatenate([np.zeros((S, 1)), v], axis=1)      # (S, K+1)
        if rounding == "nearest":
            cut = np.concatenate([np.zeros((S, 1)), (edges0[:, :-1] + edges0[:, 1:]) / 2], axis=1)
        else:
            cut = edges0
        pts = np.concatenate([np.maximum(cut, a), np.maximum(M, a)[:, None]], axis=1)     # (S, K+2)
    else:
        pts = np.zeros((S, 0))
    allp = np.concatenate([np.full((S, 1), np.inf), np.full((S, 1), a), pts], axis=1)
    capped = np.minimum(allp, cp[:, None])
    mom = [pm(capped.reshape(-1), k).reshape(S, -1) for k in (0, 1, 2)]
    mass = mom[0][:, 0:1]
    mom = [m / np.where(mass > 0, mass, 1.0) for m in mom]
    tot = [m[:, 0] for m in mom]
    if a > 0:
        lo = [m[:, 1] for m in mom]
        pruned = lo[0] - lo[1] / a
        up_mass = lo[1] / a                         # P(T = a)
    else:
        lo = [np.zeros(S)] * 3
        pruned, up_mass = np.zeros(S), np.zeros(S)
    if f is None:
        # no rounding: out = T(g); E[T x] = E[x^2] (unbiased), E[T^2] = E[x^2 1{x>=a}] + a E[x 1{x<a}]
        out = np.stack([pruned, np.zeros(S), np.zeros(S), tot[2], tot[1], tot[2] - lo[2] + a * lo[1],
                        tot[1], tot[2]], axis=1)
        return out[0] if scalar else out
    P = [m[:, 2:] for m in mom]
    D = [np.diff(p_, axis=1) for p_ in P]                           # (S, K+1)
    sat = [tot[k] - P[k][:, -1] for k in (0, 1, 2)]                 # x > M
    if rounding in ("nearest", "toward_zero"):                      # deterministic cells
        vals = edges0
        eqx = np.sum(vals * D[1], axis=1) + M * sat[1]
        eq1 = np.sum(vals * D[0], axis=1) + M * sat[0]
        eq2 = np.sum(vals * vals * D[0], axis=1) + M * M * sat[0]
        under = D[0][:, 0].copy()
    else:                                           # stochastic: E[Q|x] = x inside the range
        lo_v, hi_v = edges0[:, :-1], edges0[:, 1:]
        D = [d[:, :-1] for d in D]                  # the last piece, [M, M], is empty
        eqx = D[2].sum(axis=1) + M * sat[1]
        eq1 = D[1].sum(axis=1) + M * sat[0]
        eq2 = np.sum((lo_v + hi_v) * D[1], axis=1) - np.sum(lo_v * hi_v * D[0], axis=1) + M * M * sat[0]
        under = D[0][:, 0] - D[1][:, 0] / hi_v[:, 0]
    over = sat[0].copy()
    if a > 0:                                       # the values rounded up to a: one point
        for i in range(S):
            qm, q2, q0, qs = _point(a, v[i], float(M[i]), rounding)
            eqx[i] += qm / a * lo[2][i]
            eq1[i] += qm * up_mass[i]
            eq2[i] += q2 * up_mass[i]
            under[i] += q0 * up_mass[i]
            over[i] += qs * up_mass[i]
    out = np.stack([pruned, under, over, eqx, eq1, eq2, tot[1], tot[2]], axis=1)
    return out[0] if scalar else out


def _assemble(raw: np.ndarray, p0: float) -> ComposedPrediction:
    pruned, under, over, eqx, eq1, eq2, ex1, ex2 = (float(v) for v in raw)
    nz = 1.0 - p0
    gain = eqx / ex2 if ex2 > 0 else math.nan
    err = (eq2 - 2 * eqx + ex2) / ex2 if ex2 > 0 else math.nan
    bias = eq1 / ex1 - 1.0 if ex1 > 0 else math.nan
    return ComposedPrediction(sparsity=p0 + nz * (pruned + under), pruned=nz * pruned, underflow=nz * under,
                              flushed=under, overflow=nz * over, error=max(err, 0.0), bias=bias, gain=gain)


def composed_blocks(pm: PartialMoments, fmt: Union[FPFormat, str], *, threshold: float, block_size: int,
                    scale_format: str = "e8m0", scale_rounding: str = "floor", rounding: str = "nearest",
                    p0: float = 0.0, amax: float | None = None, per_binade: int = 16) -> ComposedPrediction:
    """:class:`ComposedPrediction` of the composed operator with shared block scales (MX ``e8m0``,
    NVFP4 ``e4m3``), for blocks of ``block_size`` *exchangeable* entries of the law: the block's
    maximum ``m`` (distributed as the maximum of ``block_size`` draws) sets its scale as
    :func:`gradstats.ops.quantization.block_scales` does (from ``max(m, threshold)``, since pruning
    rounds small values up to the threshold); the other entries are draws below ``m``. Real tensors
    whose rows differ in magnitude have more uniform blocks than exchangeable entries, so this
    over-predicts their flushing; ``amax`` (the tensor's maximum) sets NVFP4's per-tensor scale.

    Example:
        >>> p = composed_blocks(lognormal_moments_fn(-10.0, 2.0), "e2m1fn", threshold=0.0, block_size=16,
        ...                     scale_format="e4m3", rounding="stochastic")
        >>> round(p.overflow, 2), bool(0.0 < p.flushed < 1.0)     # a block maximum rounded down: clipped
        (0.03, True)
    """
    import torch

    from gradstats.ops.quantization import block_scales

    _check_args(threshold, 1.0, rounding, p0)
    f = parse(fmt)
    pm = _normalised(pm)
    a = float(threshold)
    top = float(amax) if amax is not None and math.isfinite(amax) and amax > 0 else None
    if top is None:                                 # the law's own top: where its CDF reaches 1 - 1e-12
        lo_t, hi_t = 1e-38, 1e38
        for _ in range(200):
            mid = math.sqrt(lo_t * hi_t)
            lo_t, hi_t = (mid, hi_t) if float(pm(np.array([mid]), 0)[0]) < 1 - 1e-12 else (lo_t, mid)
        top = hi_t
    # the grid of block maxima: per_binade points per binade down to where P(max below) is negligible
    n_bin = 60 * per_binade
    t = top * np.exp2(-np.arange(n_bin, -1, -1) / per_binade)
    G = p0 + (1 - p0) * np.clip(pm(t, 0), 0.0, 1.0)
    prob = np.diff(np.concatenate([[0.0], G ** block_size]))         # P(block max in (t_{i-1}, t_i])
    mid = np.concatenate([[t[0]], np.sqrt(t[1:] * t[:-1])])        # each interval by its geometric middle
    keep = prob > 1e-9
    m_i, p_i = mid[keep], prob[keep] / prob[keep].sum()
    post = np.maximum(m_i, a)
    x = torch.zeros((len(m_i) + 1, block_size), dtype=torch.float32)
    x[:-1, 0] = torch.from_numpy(post.astype(np.float32))
    x[-1, 0] = float(max(top, a))                   # NVFP4's per-tensor scale comes from the tensor's max
    dec = block_scales(x, f, block_size=block_size, scale_format=scale_format, scale_rounding=scale_rounding)
    dec = dec.reshape(-1)[:-1].double().numpy()
    ok = dec > 0
    m_i, p_i, dec = m_i[ok], p_i[ok], dec[ok]
    mass = np.clip(pm(m_i, 0), 0.0, 1.0)
    ok = mass > 0
    m_i, p_i, dec, mass = m_i[ok], p_i[ok], dec[ok], mass[ok]
    nz_below = (1 - p0) * mass / (p0 + (1 - p0) * mass)            # P(non-zero | an entry below m)
    others = _raw(pm, f, a, 1.0 / dec, rounding, cap=m_i)           # (S, 8), the law below each m
    raw = others * (nz_below * (block_size - 1) / block_size)[:, None]
    for i, (m, d) in enumerate(zip(m_i, dec)):      # the block's maximum itself
        if m >= a:                                  # kept: rounded at its block's scale
            qm, q2, q0, qs = _point(float(m) / d, _grid(f), float(f.max), rounding)
            raw[i] += np.array([0.0, q0, qs, qm * d * m, qm * d, q2 * d * d, m, m * m]) / block_size
        else:                                       # pruned like the others
            raw[i] += others[i] / block_size
    total = (p_i[:, None] * raw).sum(axis=0)
    nz_total = 1 - p0
    return _assemble(total / nz_total, p0)


def _point(y: float, v: np.ndarray, M: float, rounding: str) -> tuple[float, float, float, float]:
    """``E[Q(y)]``, ``E[Q(y)^2]``, ``P(Q(y) = 0)``, ``1{y > M}`` of one magnitude ``y`` (unscaled grid ``v``)."""
    if y > M:
        return M, M * M, 0.0, 1.0
    g = np.concatenate([[0.0], v])
    j = int(np.searchsorted(g, y, side="right") - 1)
    if g[j] == y:
        return y, y * y, float(y == 0), 0.0
    lo, hi = float(g[j]), float(g[j + 1])
    if rounding == "stochastic":
        p = (y - lo) / (hi - lo)
        return y, p * hi * hi + (1 - p) * lo * lo, (1 - p) if lo == 0 else 0.0, 0.0
    if rounding == "toward_zero":
        q = lo
    else:
        mid = (lo + hi) / 2
        q = lo if y < mid else hi if y > mid else (lo if j % 2 == 0 else hi)   # ties to the even code
    return q, q * q, float(q == 0), 0.0


def predict_composed(stats: Union[Mapping[str, Any], Any], fmt: Union[FPFormat, str, None], *, threshold: float = 0.0,
                     scale: float = 1.0, rounding: str = "nearest", law: str = "histogram",
                     block_size: int | None = None, scale_format: str = "e8m0",
                     scale_rounding: str | None = None) -> ComposedPrediction:
    """The composed operator's :class:`ComposedPrediction` for one tensor from its statistics row
    (:func:`gradstats.tensor_stats`, a row of a run's ``stats()``): ``law="histogram"`` (the row's
    binade histogram and top magnitudes, :class:`gradstats.stats.law.HistogramLaw`) or ``"lognormal"``
    (the row's mu and sigma of ``ln|g|``, the tail capped at the row's maximum). With ``block_size``
    the scales are shared per block (``scale`` is then not used; :func:`composed_blocks`).

    Example:
        >>> import torch
        >>> from gradstats.stats import tensor_stats
        >>> row = tensor_stats(torch.randn(10000, generator=torch.Generator().manual_seed(1)))
        >>> p = predict_composed(row, "e4m3fn", scale=64.0, rounding="stochastic")
        >>> p.overflow, abs(p.gain - 1) < 1e-9
        (0.0, True)
    """
    from gradstats.stats import lognormal_moments

    n = float(stats["n"])
    nz = n - float(stats["n_zero"]) - float(stats.get("n_nonfinite", 0) or 0)
    if not (n > 0 and nz > 0):
        raise ValueError("the statistics hold no non-zero finite entry: there is nothing to predict")
    p0 = float(stats["n_zero"]) / n
    if law == "histogram":
        from gradstats.stats.law import HistogramLaw

        h = HistogramLaw.from_stats(stats)
        zero = np.zeros(1)

        def pm(t: np.ndarray, k: int) -> np.ndarray:
            return h.partial_moments(np.asarray(t, dtype=np.float64), k, zero)[0]
    elif law == "lognormal":
        mu, sigma = lognormal_moments(stats)
        if not (math.isfinite(mu) and math.isfinite(sigma) and sigma > 0):
            raise ValueError("the statistics have no spread of ln|g|: the lognormal law does not apply")
        cap = float(stats.get("max_abs", math.inf))
        base = lognormal_moments_fn(mu, sigma)
        mass = float(base(np.array([cap]), 0)[0]) if math.isfinite(cap) else 1.0
        capped = _pm_capped(base, cap)

        def pm(t: np.ndarray, k: int) -> np.ndarray:
            return capped(t, k) / mass
    else:
        raise ValueError(f"law must be 'histogram' or 'lognormal', got {law!r}")
    if block_size is not None and fmt is not None:
        return composed_blocks(pm, fmt, threshold=threshold, block_size=block_size, scale_format=scale_format,
                               scale_rounding=scale_rounding or "floor", rounding=rounding, p0=p0,
                               amax=float(stats.get("max_abs", math.nan)))
    return composed_from_moments(pm, fmt, threshold=threshold, scale=scale, rounding=rounding, p0=p0)
