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
from typing import Any, Callable, Mapping, Optional, Union

import numpy as np
from scipy.special import ndtr

from gradstats import _special as S
from gradstats.formats import ROUNDINGS, FPFormat, parse
from gradstats.fpanalysis._pieces import _N_ERR, Pieces, build, build_bias, first_moments_at, integrate, point
from gradstats.fpanalysis.granularity import analysed_scheme
from gradstats.scheme import Scheme

__all__ = ["ComposedPrediction", "predict_composed", "composed_from_moments", "composed_blocks", "lognormal_moments_fn",
           "predict_one"]

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
    return _assemble(_raw(pm, f, float(threshold), float(scale), rounding, whole=True), p0)


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

    def normed(t: np.ndarray, k: int) -> np.ndarray:
        return pm(t, k) / mass
    many = getattr(pm, "many", None)
    if many is not None:
        normed.many = lambda t, ks: many(t, ks) / mass  # type: ignore[attr-defined]
    return normed


def _moments(pm: PartialMoments, t: np.ndarray, ks: tuple[int, ...]) -> list[np.ndarray]:
    """``[pm(t, k) for k in ks]``, in one call where ``pm`` offers one (a ``many(t, ks)`` attribute: a law
    that locates the points once for every order, :meth:`gradstats.stats.law.HistogramLaw.partial_moments`)."""
    many = getattr(pm, "many", None)
    return list(many(t, ks)) if many is not None else [pm(t, k) for k in ks]


def _raw(pm: PartialMoments, f: FPFormat | None, a: float, scale: Any, rounding: str,
         cap: Any = None, whole: bool = False) -> np.ndarray:
    """Per non-zero entry of the law: P(pruned), P(flushed), P(saturated), E[Q x], E[Q],
    E[Q^2], E[x], E[x^2] of the composed operator (Q the output's magnitude), for each of ``S`` scales
    (an array) and, with ``cap``, the law conditioned below each cap: ``(S, 8)``, or ``(8,)`` for a
    scalar scale. One call of ``pm`` per moment order for all of them; each row's moments are divided by its
    mass (``pm``'s at ``inf``, below the cap), so ``pm`` need not be normalised. ``whole``: ``pm`` is a whole
    law (no cap), whose mass must be positive (else ``ValueError``)."""
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
    mom = [m.reshape(S, -1) for m in _moments(pm, capped.reshape(-1), (0, 1, 2))]
    mass = mom[0][:, 0:1]
    if whole and not np.all(mass > 0):     # (pm a law's own moments, not normalised: its mass is read here)
        raise ValueError("the law has no mass: there are no non-zero magnitudes to predict for")
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


def composed_blocks(pm: PartialMoments, scheme: Union[Scheme, str], *, threshold: float, p0: float = 0.0,
                    amax: float | None = None, per_binade: int = 16) -> ComposedPrediction:
    """:class:`ComposedPrediction` of the composed operator with shared block scales, for a block-scaled
    ``scheme`` (a :class:`~gradstats.scheme.Scheme` or its name: MX E8M0 scales rounded as its
    ``scale_rounding`` says, NVFP4 E4M3 ones; its element rounding), for blocks of ``B`` *exchangeable*
    entries of the law: the block's maximum ``m`` (distributed as the maximum of ``B`` draws) sets its scale as
    :func:`gradstats.ops.quantization.block_scales` does (from ``max(m, threshold)``, since pruning
    rounds small values up to the threshold); the other entries are draws below ``m``. Real tensors
    whose rows differ in magnitude have more uniform blocks than exchangeable entries, so this
    over-predicts their flushing; ``amax`` (the tensor's maximum) sets NVFP4's per-tensor scale.

    Example:
        >>> p = composed_blocks(lognormal_moments_fn(-10.0, 2.0), "nvfp4:rounding=stochastic", threshold=0.0)
        >>> round(p.overflow, 2), bool(0.0 < p.flushed < 1.0)     # a block maximum rounded down: clipped
        (0.03, True)
    """
    import torch

    from gradstats.ops.quantization import block_scales

    s = Scheme.parse(scheme)
    if s.block_size is None:
        raise ValueError(f"composed_blocks: scheme {str(s)!r} has one scale per tensor: use composed_from_moments, "
                         "or a block-scaled scheme such as 'mxfp8_e4m3' or 'nvfp4'")
    f, block_size, rounding = s.element, s.block_size, s.rounding
    _check_args(threshold, 1.0, rounding, p0)
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
    dec = block_scales(x, s)
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


def predict_composed(stats: Union[Mapping[str, Any], Any], fmt: Union[FPFormat, Scheme, str, None], *,
                     threshold: float = 0.0, scale: float = 1.0, rounding: str | None = None, law: Any = "histogram",
                     granularity: Union[str, int, Scheme, None] = None) -> ComposedPrediction:
    """The composed operator's :class:`ComposedPrediction` for one tensor from its statistics row
    (:func:`gradstats.tensor_stats`, a row of a run's ``stats()``): ``law="histogram"`` (the row's
    binade histogram and top magnitudes, :class:`gradstats.stats.law.HistogramLaw`) or ``"lognormal"``
    (the row's mu and sigma of ``ln|g|``, the tail capped at the row's maximum), or the row's
    :class:`~gradstats.stats.law.HistogramLaw` already made (``HistogramLaw.from_stats(stats)``: a
    caller predicting many operators on one row makes it once). ``fmt``: a format (with ``granularity``'s
    blocks: :func:`~gradstats.fpanalysis.granularity.analysed_scheme`), a scheme (its blocks and rounding), or
    None (pruning alone); ``rounding`` None: the scheme's. With blocks the scales are shared per block
    (``scale`` is then not used; :func:`composed_blocks`).

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
    from gradstats.stats.law import HistogramLaw

    if isinstance(law, HistogramLaw) or (isinstance(law, str) and law == "histogram"):
        h = law if isinstance(law, HistogramLaw) else HistogramLaw.from_stats(stats)
        zero = np.zeros(1)

        def pm(t: np.ndarray, k: int) -> np.ndarray:
            return h.partial_moments(np.asarray(t, dtype=np.float64), k, zero)[0]
        pm.many = lambda t, ks: h.partial_moments(np.asarray(t, dtype=np.float64), ks, zero)[:, 0]  # type: ignore[attr-defined]
    elif isinstance(law, str) and law == "lognormal":
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
        raise ValueError(f"law must be 'histogram', 'lognormal' or the row's HistogramLaw, got {law!r}")
    if fmt is None:
        return composed_from_moments(pm, None, threshold=threshold, scale=scale, rounding=rounding or "nearest", p0=p0)
    s = analysed_scheme(fmt, granularity, what="predict_composed", exact_scales=True)
    s = s if rounding is None else s.replace(rounding=rounding)
    if s.block_size is not None:
        return composed_blocks(pm, s, threshold=threshold, p0=p0, amax=float(stats.get("max_abs", math.nan)))
    return composed_from_moments(pm, s.element, threshold=threshold, scale=scale, rounding=s.rounding, p0=p0)


# ----------------------------------------------------------------------------- the lognormal, given amax
def predict_one(fmt: Optional[FPFormat], rounding: str, mu: Any, sigma: Any, p0: Any, threshold: Any, scale: Any,
                amax: Any = None, numel: Any = None) -> tuple[Any, Any, Any]:
    """What the lognormal model ``ln|g| ~ N(mu, sigma^2)`` (non-zero entries, a fraction ``p0``
    exactly zero) predicts for stochastic pruning at ``threshold`` (0: none) followed by rounding
    to ``fmt`` at ``scale`` (saturating): ``(underflow, saturated, error)``, the fractions of all
    entries that are non-zero after pruning and flushed to zero by the rounding, and that
    saturate at the format's max, and the relative error ``E[(out - g)^2] / E[g^2]`` of the
    output (pruning and rounding together; without pruning the rounding's alone, which is
    :func:`gradstats.fpanalysis.expected_error`'s ``total``, ``flushed`` and ``saturated``).

    One layer's floats give floats, arrays (one entry per layer, broadcast together) give arrays:
    one formula, on the engine of :func:`~gradstats.fpanalysis.expected_error`
    (:func:`gradstats.fpanalysis._pieces.integrate` over the cells between the threshold and the
    maximum, :func:`~gradstats.fpanalysis._pieces.point` at single values).

    Given the tensor's largest magnitude ``amax`` (and its ``numel`` entries), conditioned on it
    as :func:`~gradstats.fpanalysis.expected_error` is: one entry at ``amax``, the other non-zero
    ones from the lognormal truncated there (infinitely many without ``numel``), so that a tail
    beyond the data does not count as saturation or error that never happen. ``amax`` None, NaN or
    not positive: unconditioned.

    Kept entries (``|g| >= a``) are summed over the format's cells from ``a`` up; those below are
    output as ``a`` with probability ``|g|/a``: a point mass at ``a`` whose rounding is exact. With
    ``x = |g|`` and ``Q = Q(a)`` the squared error below ``a`` is
    ``E[(x/a) (Q - x)^2 + (1 - x/a) x^2] = E[Q^2] M1/a - 2 E[Q] M2/a + M2`` in the partial
    moments ``Mk = E[x^k 1{x<a}]``. ``fmt=None``: no rounding (the pruning's error alone).
    Stochastic rounding takes ``rounding="stochastic"``; other roundings are modelled as nearest.
    What apply's refresh records every step; :func:`predict_composed` with
    :func:`lognormal_moments_fn` is the same model for any law and any operator setting.

    Example:
        >>> u, s, e = predict_one(FPFormat.parse("e4m3fn"), "nearest", -9.0, 1.5, 0.0, 0.0, 2.0 ** 7)
        >>> round(e * 1e4, 2), round(s, 9)
        (7.15, 0.0)
        >>> u, s, e = predict_one(FPFormat.parse("e4m3fn"), "nearest", np.array([-9.0, -20.0]), 1.5, 0.0, 0.0, 2.0 ** 7)
        >>> [round(v * 1e4, 2) for v in e.tolist()]
        [7.15, 9953.09]
    """
    one = all(v is None or type(v) is float or S.is_float(v) for v in (mu, sigma, p0, threshold, scale, amax, numel))
    am = math.nan if amax is None else amax
    nn = math.nan if numel is None else numel
    if one:
        B, args = S.MATH, tuple([float(v) for v in (mu, sigma, p0, threshold, scale, am, nn)])
    else:
        B, args = S.NUMPY, tuple(np.ravel(v) for v in np.broadcast_arrays(
            *(np.asarray(v, dtype=np.float64) for v in (mu, sigma, p0, threshold, scale, am, nn))))
    mu_, s, p0_, a_, sc = args[:5]
    ok = (B.isfinite(mu_) & B.isfinite(s) & (s > 0) & (p0_ >= 0) & (p0_ < 1) & (a_ >= 0) & (a_ < math.inf)
          & (sc > 0) & (sc < math.inf))
    if not B.all_(ok):
        raise ValueError(f"predict_one needs finite mu, sigma > 0, p0 in [0, 1), a threshold in [0, inf) and a "
                         f"scale in (0, inf); got mu={B.shown(mu_, ok)!r}, sigma={B.shown(s, ok)!r}, "
                         f"p0={B.shown(p0_, ok)!r}, threshold={B.shown(a_, ok)!r}, scale={B.shown(sc, ok)!r}")
    rounding = "stochastic" if rounding == "stochastic" else "nearest"
    if fmt is None and one:                      # floats in math alone: nothing to warn about
        return _predict_lognormal(B, fmt, rounding, *args)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        return _predict_lognormal(B, fmt, rounding, *args)


def _predict_lognormal(B: S.Backend, fmt: Optional[FPFormat], rounding: str, mu: Any, s: Any, p0: Any,
                       threshold: Any, scale: Any, amax: Any, numel: Any) -> tuple[Any, Any, Any]:
    """:func:`predict_one` on floats (``B`` :data:`gradstats._special.MATH`) or flat arrays of one length
    (``B`` :data:`~gradstats._special.NUMPY`; ``amax``, ``numel`` NaN where not given): the moments in
    ``B``, the cells on the engine (one layer as arrays of one entry). The terms of the maximum and of
    the threshold are computed where some layer has them; elsewhere they take the values their
    selections give where they are absent."""
    ls = B.log(scale)
    m = mu + ls                                  # ln of the scaled magnitudes y = |g| s
    ln_e2 = 2 * m + 2 * s * s                    # ln E[y^2] of the lognormal
    A = threshold * scale
    cond = (amax > 0) & (amax < math.inf)
    if B.any_(cond):
        ym = B.where(cond, amax * scale, math.inf)   # the tensor's largest scaled magnitude
        atom = cond & B.isfinite(numel)
        w = B.where(atom, 1.0 / B.maximum((1 - p0) * B.where(atom, numel, 0.0), 1.0), 0.0)   # its weight
        z_m = (B.log(ym) - m) / s
        ln_mass = B.where(cond, B.log_ndtr(z_m), 0.0)                      # P(y < ym)
        e2 = B.exp(ln_e2 + B.where(cond, B.log_ndtr(z_m - 2 * s) - ln_mass, 0.0))
        y_a = B.where(atom, ym, 0.0)
    else:
        ym, atom, w, ln_mass, e2, y_a = math.inf, False, 0.0, 0.0, B.exp(ln_e2), 0.0
    den = (1 - w) * e2 + w * y_a * y_a
    pruned = A > 0
    if B.any_(pruned):
        zb = (B.log(B.minimum(A, ym)) - m) / s                             # -inf without pruning
        m1 = B.exp(m + 0.5 * s * s + B.log_ndtr(zb - s) - ln_mass)         # E[y 1{y<A}], truncated at ym
        m2 = B.exp(ln_e2 + B.log_ndtr(zb - 2 * s) - ln_mass)               # E[y^2 1{y<A}]
        A1 = B.where(pruned, A, 1.0)
        below = atom & (y_a < A)                 # the maximum below A: rounded up to A with prob y_a / A
    else:
        m1, m2, A1, below = 0.0, 0.0, 1.0, False
    if fmt is None:
        err_t = B.where(pruned, A * m1 - m2, 0.0)                # E[(x/A)(A - x)^2 + (1 - x/A) x^2]
        err_a = B.where(below, y_a * (A - y_a), 0.0)
        return 0.0 * m, 0.0 * m, B.maximum(((1 - w) * err_t + w * err_a) / den, 0.0)
    one = B is S.MATH
    if one:                                      # the engine's arrays of one entry
        v = np.array([mu, s, ls, ym, A])
        mu_, s_, ls_, ym_, A_ = v[0:1], v[1:2], v[2:3], v[3:4], v[4:5]
    else:
        mu_, s_, ls_, ym_, A_ = mu, s, ls, ym, A
    pc = build(fmt, rounding, "saturate")
    # relative to the whole E[y^2]; cut at the maximum and at the threshold where they cut
    res = integrate(pc, mu_, s_, ls_, upper=ym_ if B.any_(cond) else None, lower=A_ if B.any_(pruned) else None)
    # the single values: the threshold (values below it rounded up to it) and the maximum
    if one:
        kept, (uf_t, sat_t) = float(np.add.reduce(res[0, :_N_ERR])), res[0, _N_ERR:_N_ERR + 2].tolist()
    else:
        kept, uf_t, sat_t = np.add.reduce(res[:, :_N_ERR], axis=-1), res[:, _N_ERR], res[:, _N_ERR + 1]
    e_a = eq_a = fl_a = sa_a = e_m = fl_m = sa_m = 0.0
    if B.any_(pruned):
        (e_a, fl_a, sa_a), eq_a = _at(pc, A), _mean_q(fmt, rounding, A)
    if B.any_(atom):
        e_m, fl_m, sa_m = _at(pc, y_a)
    eq2_a = e_a + 2 * A * eq_a - A * A                                      # E[Q(A)^2]
    mass = B.exp(ln_mass)
    err_t = kept * B.exp(ln_e2) / mass                                      # kept, E[err 1{A<=y<ym}]
    uf_t, sat_t = uf_t / mass, sat_t / mass
    q_up = m1 / A1                                                          # P(rounded up to A)
    err_t = err_t + B.where(pruned, (eq2_a / A1) * m1 - 2 * (eq_a / A1) * m2 + m2, 0.0)
    uf_t = uf_t + B.where(pruned, q_up * fl_a, 0.0)
    sat_t = sat_t + B.where(pruned, q_up * sa_a, 0.0)
    q = y_a / A1
    err_a = B.where(below, q * (eq2_a - 2 * eq_a * y_a + y_a * y_a) + (1 - q) * y_a * y_a, e_m)
    uf_a = B.where(below, q * fl_a, fl_m)
    sat_a = B.where(below, q * sa_a, sa_m)
    err = ((1 - w) * err_t + B.where(atom, w * err_a, 0.0)) / den
    uf = (1 - w) * uf_t + B.where(atom, w * uf_a, 0.0)
    sat = (1 - w) * sat_t + B.where(atom, w * sat_a, 0.0)
    return (1 - p0) * uf, (1 - p0) * sat, B.maximum(err, 0.0)


def _at(pc: Pieces, y: Any) -> tuple[Any, Any, Any]:
    """``E[(Q(y) - y)^2]``, ``P(flushed)``, ``P(saturated)`` of single scaled values ``y`` (saturating;
    a float gives floats)."""
    pt = point(pc, y)
    if isinstance(y, float):
        return sum(pt[:_N_ERR]), pt[_N_ERR], pt[_N_ERR + 1]
    return np.add.reduce(pt[:, :_N_ERR], axis=1), pt[:, _N_ERR], pt[:, _N_ERR + 1]


def _mean_q(fmt: FPFormat, rounding: str, y: Any) -> Any:
    """``E[Q(y)]`` of single scaled values ``y`` (saturating; a float gives a float)."""
    bounds, coef = build_bias(fmt, rounding, "saturate")
    if isinstance(y, float):
        return y + first_moments_at(bounds, coef, y)[0]
    return y + first_moments_at(bounds, coef, y)[:, 0]
