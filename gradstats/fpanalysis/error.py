"""Expected quantisation error of lognormal gradients: :func:`expected_error`.

Per tensor scale: the exact sum of lognormal partial moments over the format's cells
(:mod:`._pieces`). Block scaling (a block-scaled scheme, or ``granularity=``): exact as well, by conditioning on the block's
shared scale. With ``B`` elements per block, ``F`` the CDF of one entry's magnitude (zeros
included) and the block scale ``X_j`` chosen when the block maximum lies in ``[A_j, A_{j+1})``,
exchangeability gives, per entry,

    E[err] = sum_j  F(A_{j+1})**(B-1) E[err_j(x) 1{x < A_{j+1}}] - F(A_j)**(B-1) E[err_j(x) 1{x < A_j}]

where ``err_j`` is the error under the fixed scale ``X_j``: one more partial-moment sum, cut at
the block-maximum bounds. MX (E8M0 scales): ``X_j = 2**j``, ``A_j = 2**(j + emax)``
(:func:`gradstats.ops.quantization.mx_shared_exponent`, clamped to ``-127..127`` as there); the series runs
over the shared exponents whose probability under the block maximum (tilted by ``x**2`` for the
MSE) is above about 1e-15.
NVFP4 style (E4M3 scales): ``X_j = w_j t`` over the e4m3fn codes ``w_j``, with the per-tensor
float32 scale ``t = tensor_amax / (fmt.max * 448)`` (:func:`gradstats.ops.quantization.block_scales`);
``tensor_amax`` defaults to the median maximum of ``numel`` draws. Blocks are assumed full and
independent; the float32 rounding of ``w_j t`` is ignored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
from scipy.special import log_ndtr, ndtr, ndtri

from gradstats.formats import FPFormat
from gradstats.fpanalysis import _params as P
from gradstats.fpanalysis._pieces import (
    FRACTIONS,
    PARTS,
    Pieces,
    build,
    build_bias,
    first_moments,
    first_moments_at,
    integrate,
    point,
)
from gradstats.fpanalysis.granularity import BlockViews, analysed_scheme
from gradstats.scheme import Scheme

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["expected_error", "ErrorResult"]


@dataclass(frozen=True)
class ErrorResult(BlockViews):
    """Predicted quantisation error of lognormal gradients (see :func:`expected_error`).

    Array attributes have the broadcast shape of the inputs (floats for one layer).

    Attributes:
        total: the mean squared error: divided by ``E[x**2]`` when ``relative`` (noise-to-signal
            ratio), in units of ``x**2`` otherwise; with ``criterion="elementwise"`` the mean of
            ``((Q(x) - x) / x)**2`` over the non-zero entries. Equals the sum of the four parts.
            Entries that become inf/NaN (``overflow="nonfinite"``) are not counted: see ``nonfinite``.
        overflow, normal, subnormal, underflow: the parts of ``total`` from values above ``max``,
            rounded in the normal range, rounded in the subnormal range, and in the cell that
            rounds to zero (stochastic rounding: ``[0, min_subnormal)``).
        flushed, saturated, nonfinite: fractions of all entries (exact zeros ``p0`` included in
            the denominator) that a non-zero value turns into 0, clips to +-max, or into inf/NaN.
        bias: the signed magnitude bias ``E[|Q(g)| - |g|] / E[|g|]`` (per-tensor scales; NaN
            under block scaling): what rounding to zero and saturation take from every weight
            gradient the tensor feeds, systematically (SGD averages noise away, not bias).
            Negative: shrinkage. Stochastic rounding has none inside the range.
        flushed_mass: the fraction of ``E[|g|]`` carried by values that become zero (with
            stochastic rounding compensated by the values rounded up to the smallest one).
        format, rounding, overflow_mode, relative, criterion: the setting; blocks: the block-scaled
            :class:`~gradstats.scheme.Scheme` (None: one scale per tensor), whose ``block_size`` and
            ``scale_format_name`` the properties of the same names give.
        mu, sigma, p0, scale: the inputs (``scale`` is NaN under block scaling).

    Example:
        >>> r = expected_error("e4m3fn", mu=-9.0, sigma=1.5, scale=2.0 ** 7)
        >>> round(r.total * 1e4, 2), round(r.flushed, 4)  # the MSE hardly cares about tiny values
        (7.15, 0.0318)
        >>> abs(r.total - (r.overflow + r.normal + r.subnormal + r.underflow)) < 1e-15
        True
    """

    format: FPFormat
    total: Any
    overflow: Any
    normal: Any
    subnormal: Any
    underflow: Any
    flushed: Any
    saturated: Any
    nonfinite: Any
    mu: Any
    sigma: Any
    p0: Any
    scale: Any
    rounding: str = "nearest"
    overflow_mode: str = "saturate"
    relative: bool = True
    criterion: str = "mse"
    blocks: Optional[Scheme] = None
    bias: Any = math.nan
    flushed_mass: Any = math.nan
    _fields: tuple = field(default=("total", *PARTS, *FRACTIONS, "bias", "flushed_mass", "mu", "sigma", "p0",
                                    "scale"), repr=False)

    @property
    def parts(self) -> dict[str, Any]:
        """The error parts as a dict (they sum to ``total``)."""
        return {p: getattr(self, p) for p in PARTS}

    @property
    def snr_db(self) -> Any:
        """``-10 log10(total)``: signal-to-noise ratio in dB (for ``relative`` MSE)."""
        return -10 * np.log10(self.total)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (arrays as lists)."""
        d: dict[str, Any] = {"format": str(self.format), "rounding": self.rounding,
                             "overflow_mode": self.overflow_mode, "relative": self.relative,
                             "criterion": self.criterion, "block_size": self.block_size,
                             "scale_format": self.scale_format}
        for f in self._fields:
            v = getattr(self, f)
            d[f] = v.tolist() if isinstance(v, np.ndarray) else v
        return d

    def to_dataframe(self) -> "pd.DataFrame":
        """One row per layer (flattened inputs)."""
        import pandas as pd

        cols = {f: np.ravel(np.asarray(getattr(self, f), dtype=np.float64)) for f in self._fields}
        n = max(len(v) for v in cols.values())
        df = pd.DataFrame({f: np.broadcast_to(v, (n,)) for f, v in cols.items()})
        df.insert(0, "format", str(self.format))
        return df


def _zero_pieces() -> Pieces:
    """One piece ``[0, inf)`` of a block that encodes as zeros: error ``y**2``, flushed."""
    return Pieces(FPFormat(2, 1, special="fn"), "nearest", "saturate", np.array([0.0, math.inf]),
                  np.array([0, 0]), np.array([2, 0]), np.zeros(2), np.ones(2), np.array([PARTS.index("underflow"), 4]))


def _log_cdf_all(ln_t: np.ndarray, mu: np.ndarray, sigma: np.ndarray, p0: np.ndarray,
                 ln_cap: np.ndarray | None = None) -> np.ndarray:
    """``ln F(t)`` of one entry's magnitude, exact zeros included; given ``ln_cap``, of the lognormal
    truncated at ``exp(ln_cap)`` (the tensor's largest magnitude: no entry lies above it)."""
    if ln_cap is None:
        lf = log_ndtr((ln_t - mu) / sigma)
    else:
        lf = log_ndtr((np.minimum(ln_t, ln_cap) - mu) / sigma) - log_ndtr((ln_cap - mu) / sigma)
    with np.errstate(divide="ignore"):
        return np.logaddexp(np.log(p0), np.log1p(-p0) + lf)


def _series(pc: Pieces, mu, sigma, p0, B, log_scale, ln_a_lo, ln_a_hi, up_lo, up_hi, valid, mode, ln_cap=None):
    """Sum over block-scale rows (layers x rows, 2-D arrays) of the conditioned error; ``ln_cap`` (per
    layer): the law truncated there (the caller cuts ``up_lo``, ``up_hi`` and normalises)."""
    n, k = log_scale.shape
    rep = lambda v: np.repeat(v, k)  # noqa: E731
    cap = None if ln_cap is None else ln_cap[:, None]
    w_hi = np.exp((B - 1) * _log_cdf_all(ln_a_hi, mu[:, None], sigma[:, None], p0[:, None], cap))
    w_lo = np.exp((B - 1) * _log_cdf_all(ln_a_lo, mu[:, None], sigma[:, None], p0[:, None], cap))
    w_hi, w_lo = np.where(valid, w_hi, 0.0), np.where(valid, w_lo, 0.0)
    j_hi = integrate(pc, rep(mu), rep(sigma), log_scale.ravel(), mode=mode, upper=up_hi.ravel())
    j_lo = integrate(pc, rep(mu), rep(sigma), log_scale.ravel(), mode=mode, upper=up_lo.ravel())
    res = w_hi.ravel()[:, None] * j_hi - w_lo.ravel()[:, None] * j_lo
    return res.reshape(n, k, -1).sum(axis=1)


def block_integrals(s: Scheme, overflow: str, mu, sigma, p0, tensor_amax, mode: str,
                    n_nonzero=None) -> np.ndarray:
    """``(N, 7)`` integrals (as :func:`._pieces.integrate`) under the block-scaled scheme ``s`` (its element
    format, rounding, block size and block-scale rule).

    Given the tensor's largest magnitude ``tensor_amax`` (always with E4M3 block scales under a tensor scale,
    NVFP4, whose tensor scale it sets; MX where given) the law is conditioned on it, as :func:`integrals`
    conditions a per-tensor scale on ``amax``: the entries follow the lognormal truncated there (no block
    holds a value above the tensor's maximum), and one of the ``n_nonzero`` entries (None: infinitely many)
    is the maximum itself, which sets its block's scale (NVFP4 represents it exactly)."""
    fmt, B = s.element, s.block_size
    pc = build(fmt, s.rounding, overflow)
    tilt = 2 * sigma if mode == "relative" else 0.0
    z_lo = ndtri(1e-16 ** (1.0 / B)) if B > 1 else -8.3
    lo = mu + sigma * z_lo  # ln of a block maximum below which blocks are negligible
    hi = mu + sigma * (tilt + 8.0)
    if s.tensor_scale is None:     # E8M0 (MX): the block maximum in the element's top binade
        emax = fmt.emax
        kmin = np.floor(lo / P.LN2) - emax - 1
        kmax = np.ceil(hi / P.LN2) - emax + 1
        kmin, kmax = np.clip(kmin, -127, 127), np.clip(kmax, -127, 127)
        kk = kmin[:, None] + np.arange(int((kmax - kmin).max()) + 1)[None, :]
        valid = kk <= kmax[:, None]
        up_lo = np.full(kk.shape, math.ldexp(1.0, emax))
        up_hi = 2 * up_lo
        ln_lo, ln_hi = (kk + emax) * P.LN2, (kk + emax + 1) * P.LN2
        # the E8M0 exponent saturates at -127 and 127 (mx_shared_exponent clamps)
        ln_lo = np.where(kk <= -127, -np.inf, ln_lo)
        ln_hi = np.where(kk >= 127, np.inf, ln_hi)
        up_hi = np.where(kk >= 127, np.inf, up_hi)
        up_lo = np.where(kk <= -127, 0.0, up_lo)
        if tensor_amax is None:
            return _series(pc, mu, sigma, p0, B, -kk * P.LN2, ln_lo, ln_hi, up_lo, up_hi, valid, mode)
        ln_cap = np.log(tensor_amax)              # given the tensor's maximum: the law cut there
        cap = np.exp(ln_cap[:, None] - kk * P.LN2)
        valid = valid & (ln_lo < ln_cap[:, None])
        res = _series(pc, mu, sigma, p0, B, -kk * P.LN2, ln_lo, ln_hi, np.minimum(up_lo, cap),
                      np.minimum(up_hi, cap), valid, mode, ln_cap)
        atom = None
        if n_nonzero is not None:                 # the maximum sets its block's scale: its own rounding
            k_max = np.clip(np.floor(ln_cap / P.LN2) - emax, -127, 127)
            atom = _atom(pc, tensor_amax, -k_max * P.LN2, mode)
        return _given_max(res, mu, sigma, ln_cap, mode, n_nonzero, atom)
    # NVFP4 style: e4m3fn block scale times a float32 tensor scale
    e4 = s.scale_format
    w = e4.values().numpy()
    w = w[w > 0]
    mids = np.concatenate([[w[0] / 2], (w[:-1] + w[1:]) / 2, [math.inf]])
    ln_t = np.log(tensor_amax) - math.log(fmt.max * e4.max)
    # block max bounds (x space) of each code: fmt.max * t * [mids_j, mids_{j+1})
    ln_lo = ln_t[:, None] + math.log(fmt.max) + np.log(mids[None, :-1])
    with np.errstate(divide="ignore"):
        ln_hi = ln_t[:, None] + math.log(fmt.max) + np.log(mids[None, 1:])
    ln_cap = np.log(tensor_amax)
    valid = (ln_hi > lo[:, None]) & (ln_lo < np.minimum(hi, ln_cap)[:, None])
    log_scale = -(np.log(w)[None, :] + ln_t[:, None])
    cap = np.exp(ln_cap[:, None] + log_scale)                    # the maximum in each row's scaled units
    up_lo = np.minimum(fmt.max * mids[:-1] / w, cap)
    up_hi = np.minimum(fmt.max * mids[1:] / w, cap)
    res = _series(pc, mu, sigma, p0, B, log_scale, ln_lo, ln_hi, up_lo, up_hi, valid, mode, ln_cap)
    # blocks whose scale rounds to zero encode as zeros
    ln_z = ln_t + math.log(fmt.max) + math.log(mids[0])
    w0 = np.exp((B - 1) * _log_cdf_all(ln_z, mu, sigma, p0, ln_cap))
    zp = integrate(_zero_pieces(), mu, sigma, np.zeros_like(mu), mode=mode,
                   upper=np.exp(np.minimum(ln_z, ln_cap)))
    return _given_max(res + w0[:, None] * zp, mu, sigma, ln_cap, mode, n_nonzero)


def _given_max(res: np.ndarray, mu, sigma, ln_amax, mode: str, n_nonzero, atom=None) -> np.ndarray:
    """Integrals of the lognormal cut at the tensor's maximum ``exp(ln_amax)`` (``res``, per non-zero entry,
    not yet normalised; modified) as those of the law conditioned on it: the entries below it follow the
    truncated lognormal, and one of the ``n_nonzero`` (None: infinitely many) is the maximum, whose error
    parts and fractions are ``atom`` (None: exact, neither flushed nor saturated)."""
    za = (ln_amax - mu) / sigma
    mass = ndtr(za)
    lt2 = log_ndtr(za - 2 * sigma)  # ln E[x^2 1{x < a}] / E[x^2]
    res[:, :4] /= np.exp(lt2)[:, None] if mode == "relative" else mass[:, None]
    res[:, 4:] /= mass[:, None]
    if n_nonzero is None:
        return res
    m = np.maximum(n_nonzero, 1.0)
    if mode == "relative":
        # weight of the maximum in sum(x^2): a^2 / (a^2 + (m - 1) E[x^2 | x < a])
        ln_rest = np.log(m - 1 + 1e-300) + 2 * mu + 2 * sigma * sigma + lt2 - np.log(mass)
        w = 1.0 / (1.0 + np.exp(ln_rest - 2 * ln_amax))
    else:
        w = 1.0 / m
    err_a, frac_a = atom if atom is not None else (0.0, 0.0)
    res[:, :4] = w[:, None] * err_a + (1 - w)[:, None] * res[:, :4]
    res[:, 4:] = frac_a / m[:, None] + (1 - 1 / m)[:, None] * res[:, 4:]
    return res


def _conditioned(pc: Pieces, mu, sigma, log_scale, mode, amax, n_nonzero) -> np.ndarray:
    """Per non-zero entry, given the maximum ``amax``: the truncated lognormal, plus the atom."""
    ya = amax * np.exp(log_scale)
    res = integrate(pc, mu, sigma, log_scale, mode=mode, upper=ya)
    atom = None if n_nonzero is None else _atom(pc, amax, log_scale, mode)
    return _given_max(res, mu, sigma, np.log(amax), mode, n_nonzero, atom)


def _atom(pc: Pieces, amax, log_scale, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """The tensor's maximum ``amax`` quantised at the scale ``exp(log_scale)``: its error parts, in the
    units of ``mode`` (per ``amax**2``; absolute: per unit), and its fractions (:func:`_given_max`'s atom)."""
    ya = amax * np.exp(log_scale)
    pt = point(pc, ya)
    den = np.exp(2 * log_scale) if mode == "absolute" else ya * ya
    return pt[:, :4] / den[:, None], pt[:, 4:]


def magnitude_bias(fmt: FPFormat, mu, sigma, log_scale, *, rounding: str, overflow: str,
                   amax=None, n_nonzero=None) -> np.ndarray:
    """``(N, 2)``: the magnitude bias and the magnitude flushed to zero (:data:`._pieces.BIAS_COLUMNS`)
    per non-zero entry, relative to ``E[|g|]``, for per-tensor scales ``exp(log_scale)``.

    With ``amax`` conditioned as :func:`integrals` (one entry at ``amax``, the others from the
    lognormal truncated there), so that a wide layer's lognormal tail beyond the tensor's maximum
    does not count as saturation that never happens."""
    bounds, coef = build_bias(fmt, rounding, overflow)
    m = mu + log_scale
    ln_ey = m + 0.5 * sigma * sigma                  # ln E[y]
    if amax is None:
        return first_moments(bounds, coef, m, sigma) / np.exp(ln_ey)[:, None]
    ya = amax * np.exp(log_scale)
    za = (np.log(ya) - m) / sigma
    mass = np.maximum(ndtr(za), 1e-300)
    fm = first_moments(bounds, coef, m, sigma, upper=ya) / mass[:, None]
    ey = np.exp(ln_ey) * ndtr(za - sigma) / mass
    if n_nonzero is None:
        return fm / ey[:, None]
    k = np.maximum(n_nonzero, 1.0) - 1
    return (first_moments_at(bounds, coef, ya) + k[:, None] * fm) / (ya + k * ey)[:, None]


def default_tensor_amax(mu, sigma, p0, numel) -> np.ndarray:
    """Median of the largest magnitude among ``numel`` entries (``p0`` of them zero)."""
    n = np.maximum((1 - p0) * numel, 1.0)
    return np.exp(mu + sigma * ndtri(0.5 ** (1.0 / n)))


def integrals(fmt: FPFormat, mu, sigma, p0, log_scale, *, rounding: str, overflow: str, mode: str,
              blocks: Scheme | None = None, tensor_amax=None, amax=None, n_nonzero=None) -> np.ndarray:
    """Flat-array core of :func:`expected_error`: ``(N, 7)``, error parts per non-zero entry; ``blocks``: the
    block-scaled scheme of ``fmt`` at ``rounding`` (None: one scale per tensor, ``log_scale``).

    ``amax`` (per-tensor scales only): condition on the tensor's largest magnitude: one entry
    equals ``amax`` and the other ``n_nonzero - 1`` follow the lognormal truncated at ``amax``
    (``n_nonzero=None``: infinitely many, the truncated lognormal alone)."""
    if blocks is None:
        pc = build(fmt, rounding, overflow)
        if amax is None:
            return integrate(pc, mu, sigma, log_scale, mode=mode)
        return _conditioned(pc, mu, sigma, log_scale, mode, amax, n_nonzero)
    return block_integrals(blocks, overflow, mu, sigma, p0, tensor_amax, mode, n_nonzero)


def expected_error(
    fmt: FPFormat | str,
    *,
    mu: P.ArrayLike,
    sigma: P.ArrayLike,
    scale: P.ArrayLike | None = 1.0,
    rounding: str = "nearest",
    relative: bool = True,
    p0: P.ArrayLike = 0.0,
    granularity: str | int | Scheme | None = None,
    overflow: str = "saturate",
    criterion: str = "mse",
    tensor_amax: P.ArrayLike | None = None,
    numel: P.ArrayLike | None = None,
    amax: P.ArrayLike | None = None,
) -> ErrorResult:
    """Expected error of quantising lognormal gradients, exact (no Monte Carlo), vectorised over layers.

    The non-zero magnitudes have ``ln|g| ~ N(mu, sigma**2)`` (natural log), a fraction ``p0`` of
    the entries is exactly zero; the tensor is quantised as ``quantize(g * scale, fmt) / scale``
    (:func:`gradstats.quantize`).

    Args:
        fmt: an :class:`~gradstats.formats.FPFormat` or a name (any convention, with or without
            subnormals, 3 to 16 bits), or a block-scaled scheme (:class:`~gradstats.scheme.Scheme` or a
            name such as ``"mxfp4"``, ``"nvfp4"``, ``"e2m1fn:block=16:scale=e4m3"``).
        mu, sigma: mean and std of ``ln|g|``; numbers or arrays (one per layer), broadcast together
            with ``p0``, ``scale`` and ``tensor_amax``.
        scale: per-tensor scale ``s`` (quantise ``g*s``); ignored (pass None or 1) with blocks.
        rounding: ``"nearest"`` (ties to even) or ``"stochastic"``.
        relative: divide the MSE by ``E[g**2]`` (the inverse SNR; does not depend on ``p0``).
            ``False``: the MSE in units of ``g**2`` (scales with ``1 - p0``).
        p0: fraction of exact zeros; they quantise exactly and add no error.
        granularity: where a plain format's scales live (:func:`~gradstats.fpanalysis.granularity.analysed_scheme`):
            None or ``"tensor"`` (one scale), ``"mx"`` (blocks of 32, E8M0 scales), ``"nvfp4"`` (blocks
            of 16, E4M3 scales under a float32 one), or an int ``N`` (blocks of ``N``, E8M0); see the module doc.
        overflow: ``"saturate"`` or ``"nonfinite"`` (the format's inf/NaN; entries that become
            non-finite are excluded from ``total`` and reported in ``nonfinite``).
        criterion: ``"mse"``, or ``"elementwise"``: the mean of ``((Q(g) - g)/g)**2`` over the
            non-zero entries (``relative`` must stay True).
        tensor_amax: with block scales, the tensor's largest magnitude: it conditions the law as ``amax``
            does (no entry lies above it, and with ``numel`` one entry is it); for E4M3 (NVFP4) blocks it
            also sets the tensor scale, and defaults to the median maximum of ``numel`` entries (``numel``
            defaulting to 2**20); MX without it: unconditioned.
        amax: the tensor's largest magnitude, if known (per-tensor scales): predict the error of
            *this* tensor, given its maximum: one entry equals ``amax``, the other non-zero ones
            (``(1 - p0) numel - 1`` of them; infinitely many when ``numel`` is None) follow the
            lognormal truncated at ``amax``. Without it the relative MSE of a large-sigma lognormal is
            dominated by values beyond any finite tensor's maximum (the ``g**2``-weighted
            distribution is centred ``2 sigma**2`` above ``mu``); see ``docs/fpanalysis.md``.
        numel: entries per tensor (zeros included), per layer.

    Returns an :class:`ErrorResult`.

    Example:
        >>> r = expected_error("e5m2", mu=[-10.0, -4.0], sigma=[2.0, 1.0], scale=2.0 ** 10)
        >>> [round(float(t) * 1e3, 3) for t in r.total]
        [3.027, 2.78]
        >>> round(expected_error("e2m1fn", mu=0.0, sigma=1.0, granularity=32).total, 4)
        0.022
        >>> expected_error("mxfp4", mu=0.0, sigma=1.0).total == expected_error("e2m1fn", mu=0.0, sigma=1.0, granularity="mx").total
        True
    """
    sch = analysed_scheme(fmt, granularity, what="expected_error")
    fmt = P.check_format(sch.element)
    P.check_choice("rounding", rounding, P.PREDICTED_ROUNDINGS)
    P.check_choice("overflow", overflow, P.OVERFLOWS)
    P.check_choice("criterion", criterion, P.CRITERIA)
    block_size = sch.block_size
    blocks = None if block_size is None else sch.replace(rounding=rounding)
    e4m3 = blocks is not None and blocks.tensor_scale is not None        # NVFP4's two-level scale
    if not isinstance(relative, bool):
        raise ValueError(f"relative must be True or False, got {relative!r}")
    if criterion == "elementwise" and not relative:
        raise ValueError("criterion='elementwise' is a relative measure; use relative=True")
    if block_size is not None and scale is not None and not (np.ndim(scale) == 0 and float(as_float(scale)) == 1.0):
        raise ValueError("pass either scale or a block-scaled format (block scales follow the block maxima), not both")
    if amax is not None and block_size is not None:
        raise ValueError("amax conditions a per-tensor scale; with blocks use tensor_amax (NVFP4 style)")
    if tensor_amax is not None and block_size is None:
        raise ValueError("tensor_amax is the tensor's maximum under block scales; with a per-tensor scale pass amax")
    extra = [("scale", 1.0 if scale is None else scale)]
    if tensor_amax is not None:
        extra.append(("tensor_amax", tensor_amax))
    if amax is not None:
        extra.append(("amax", amax))
    shape, arrs = P.lognormal(mu, sigma, p0, *extra)
    mu_, s_, p0_, sc = arrs[:4]
    am = P.check_amax(arrs[-1]) if amax is not None else None
    nn = P.numel_array(numel, shape)
    if block_size is None:
        P.check_scale(sc)
    tamax = None
    if tensor_amax is not None:
        tamax = arrs[4]
        if not (np.isfinite(tamax) & (tamax > 0)).all():
            raise ValueError("tensor_amax must be positive and finite")
    elif e4m3:
        tamax = default_tensor_amax(mu_, s_, p0_, 2.0 ** 20 if nn is None else nn)
    mode = "elementwise" if criterion == "elementwise" else ("relative" if relative else "absolute")
    res = integrals(fmt, mu_, s_, p0_, np.log(sc), rounding=rounding, overflow=overflow, mode=mode,
                    blocks=blocks, tensor_amax=tamax, amax=am,
                    n_nonzero=None if (nn is None or (am is None and tamax is None)) else (1 - p0_) * nn)
    if block_size is None:
        bias = magnitude_bias(fmt, mu_, s_, np.log(sc), rounding=rounding, overflow=overflow, amax=am,
                              n_nonzero=None if (am is None or nn is None) else (1 - p0_) * nn)
    else:
        bias = np.full((mu_.size, 2), np.nan)
    parts = res[:, :4].copy()
    if mode == "absolute":
        parts *= (1 - p0_)[:, None]
    fr = res[:, 4:] * (1 - p0_)[:, None]
    o = lambda v: P.out(v, shape)  # noqa: E731
    return ErrorResult(
        format=fmt, total=o(parts.sum(axis=1)), overflow=o(parts[:, 0]), normal=o(parts[:, 1]),
        subnormal=o(parts[:, 2]), underflow=o(parts[:, 3]), flushed=o(fr[:, 0]), saturated=o(fr[:, 1]),
        nonfinite=o(fr[:, 2]), mu=o(mu_), sigma=o(s_), p0=o(p0_),
        scale=o(np.full_like(sc, np.nan) if block_size else sc), rounding=rounding, overflow_mode=overflow,
        relative=relative, criterion=criterion, blocks=blocks, bias=o(bias[:, 0]), flushed_mass=o(bias[:, 1]))


def as_float(v: Any) -> float:
    try:
        return float(np.asarray(P.as_array("scale", v)))
    except (TypeError, ValueError):
        raise ValueError(f"scale must be a number, got {v!r}") from None
