"""Where one more exponent bit pays: :func:`crossover_table`.

For each bit width and split ``E`` (``M = bits - 1 - E``) the error at the best scale is computed
on a grid of sigma (std of log2|g|, step 0.05); the best split per sigma and the sigma where
``E + 1`` exponent bits start to beat ``E`` follow, each crossing refined by regula falsi on the
exact (smooth) log-error difference. With the continuous best scale the error depends on sigma
alone; with power-of-two or block scales it also depends on where ``mu`` sits within a binade, and
the table averages the error over 8 evenly spaced positions.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from gradstats.formats import FPFormat
from gradstats.fpanalysis import _params as P
from gradstats.fpanalysis.choice import candidate_formats
from gradstats.fpanalysis.error import default_tensor_amax, integrals
from gradstats.fpanalysis.granularity import granularity_layout
from gradstats.fpanalysis.scale import _optimal
from gradstats.scheme import Scheme

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["crossover_table", "CrossoverTable", "AUTHORS_TABLE"]

#: The original authors' table (sigma = std of log2|g|): (bits, exp_bits, sigma_lo, sigma_hi).
AUTHORS_TABLE = ((8, 4, 1.4, 3.7), (8, 5, 3.7, 8.1), (6, 3, 0.9, 2.0), (6, 4, 2.0, math.inf))

_OFFSETS = np.arange(8) / 8.0  # binade positions of mu averaged over for power-of-two/block scales


def _curve(fmt: FPFormat, sig2: np.ndarray, cfg: tuple) -> np.ndarray:
    """Error at the best (or rule-given) scale for sigma (log2 units) ``sig2``."""
    rounding, criterion, power_of_two, layout = cfg
    block_size = layout.block_size
    s = sig2 * P.LN2
    # only mu + ln(scale) matters: put mu where the best scale is near 1
    centre = -2 * s * s if (criterion == "mse" and block_size is None) else np.zeros_like(s)
    if block_size is None and not power_of_two:
        return _optimal(fmt, centre, s, power_of_two=False, rounding=rounding, criterion=criterion)[1]
    mu = (np.round(centre / P.LN2)[:, None] * P.LN2 + _OFFSETS[None, :] * P.LN2).ravel()
    ss = np.repeat(s, _OFFSETS.size)
    if block_size is None:
        e = _optimal(fmt, mu, ss, power_of_two=True, rounding=rounding, criterion=criterion)[1]
    else:
        mode = "elementwise" if criterion == "elementwise" else "relative"
        tamax = default_tensor_amax(mu, ss, 0.0, 2 ** 20) if layout.tensor_scale is not None else None
        blocks = layout.replace(element=fmt, rounding=rounding)
        e = integrals(fmt, mu, ss, np.zeros_like(mu), np.zeros_like(mu), rounding=rounding, overflow="saturate",
                      mode=mode, blocks=blocks, tensor_amax=tamax)[:, :4].sum(1)
    return e.reshape(s.size, _OFFSETS.size).mean(axis=1)


def _refine(fa: FPFormat, fb: FPFormat, lo: np.ndarray, hi: np.ndarray, dlo: np.ndarray, dhi: np.ndarray,
            cfg: tuple, steps: int = 4) -> np.ndarray:
    """Roots of ``ln err_b - ln err_a`` bracketed in ``[lo, hi]`` (regula falsi, Illinois)."""
    for _ in range(steps):
        x = lo - dlo * (hi - lo) / (dhi - dlo)
        d = np.log(_curve(fb, x, cfg)) - np.log(_curve(fa, x, cfg))
        right = np.sign(d) == np.sign(dlo)  # the root lies in [x, hi]
        # move the endpoint on the root's far side; halve the kept one's value (Illinois)
        lo, dlo, hi, dhi = (np.where(right, x, lo), np.where(right, d, dlo / 2),
                            np.where(right, hi, x), np.where(right, dhi / 2, d))
    return lo - dlo * (hi - lo) / (dhi - dlo)


@dataclass(frozen=True)
class CrossoverTable:
    """Best exponent/mantissa split per bit width as a function of sigma (see :func:`crossover_table`).

    Attributes:
        ranges: rows ``(bits, exp_bits, format, sigma_lo, sigma_hi)``: the split is the best for
            sigma (std of log2|g|) in ``[sigma_lo, sigma_hi)`` within the computed range.
        crossovers: rows ``(bits, exp_bits, sigma)``: from ``sigma`` on, ``exp_bits + 1`` exponent
            bits beat ``exp_bits`` (NaN: not within the range).
        assumptions: the modelling choices (convention, subnormals, rounding, overflow, scale,
            criterion, block scaling, sigma range).
        sigma: the grid (log2 units); errors: ``{bits: (formats, errors (len(formats), len(sigma)))}``.

    Example:
        >>> t = crossover_table(bits=[6], sigma_max=3.0)
        >>> [(r["exp_bits"], round(r["sigma_lo"], 2)) for r in t.ranges]
        [(1, 0.05), (2, 0.5), (3, 1.05), (4, 2.0)]
    """

    ranges: tuple[dict, ...]
    crossovers: tuple[dict, ...]
    assumptions: dict
    sigma: np.ndarray = field(repr=False)
    errors: dict = field(repr=False)

    def to_dataframe(self) -> "pd.DataFrame":
        """The ranges as a DataFrame."""
        import pandas as pd

        return pd.DataFrame(list(self.ranges))

    def crossovers_dataframe(self) -> "pd.DataFrame":
        """The pairwise crossovers as a DataFrame."""
        import pandas as pd

        return pd.DataFrame(list(self.crossovers))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict: ranges, crossovers, assumptions."""
        return {"ranges": [dict(r) for r in self.ranges], "crossovers": [dict(c) for c in self.crossovers],
                "assumptions": dict(self.assumptions)}

    def best_exp_bits(self, bits: int, sigma_log2: float) -> int:
        """The best exponent bits at ``sigma_log2`` according to the table."""
        for r in self.ranges:
            if r["bits"] == bits and r["sigma_lo"] <= sigma_log2 < r["sigma_hi"]:
                return int(r["exp_bits"])
        raise ValueError(f"sigma {sigma_log2} (log2) is outside the table's range for {bits} bits")

    def compare_authors(self) -> "pd.DataFrame":
        """Our ranges beside :data:`AUTHORS_TABLE` for the splits the authors list (a DataFrame)."""
        import pandas as pd

        rows = []
        for bits, e, lo, hi in AUTHORS_TABLE:
            ours = [r for r in self.ranges if r["bits"] == bits and r["exp_bits"] == e]
            olo = ours[0]["sigma_lo"] if ours else math.nan
            ohi = ours[0]["sigma_hi"] if ours else math.nan
            if ours and ours[0].get("open_end"):
                ohi = math.inf
            rows.append({"bits": bits, "exp_bits": e, "authors_lo": lo, "authors_hi": hi, "ours_lo": olo,
                         "ours_hi": ohi, "diff_lo_%": 100 * (olo - lo) / lo,
                         "diff_hi_%": 100 * (ohi - hi) / hi if math.isfinite(hi) and math.isfinite(ohi) else math.nan})
        return pd.DataFrame(rows)

    def plot(self, *, authors: bool = True, **kw: Any) -> Any:
        """Optimal exponent bits vs sigma (:func:`gradstats.plots.fpanalysis.plot_optimal_exponent_bits`),
        :data:`AUTHORS_TABLE` dashed beside it unless ``authors=False``."""
        from gradstats.plots.fpanalysis import plot_optimal_exponent_bits

        return plot_optimal_exponent_bits(self, authors=AUTHORS_TABLE if authors else None, **kw)


@functools.lru_cache(maxsize=32)
def _table(bits: tuple[int, ...], special: str, subnormals: bool, cfg: tuple, sigma_min: float,
           sigma_max: float, step: float) -> CrossoverTable:
    grid = np.round(np.arange(sigma_min, sigma_max + step / 2, step), 10)
    ranges, cross, errors = [], [], {}
    for b in bits:
        fmts = candidate_formats(b, special, subnormals=subnormals)
        err = np.stack([_curve(f, grid, cfg) for f in fmts])
        errors[b] = (tuple(fmts), err)
        le = np.log(err)
        # pairwise crossovers E -> E+1
        for i in range(len(fmts) - 1):
            d = le[i + 1] - le[i]
            idx = np.nonzero((d[:-1] > 0) & (d[1:] <= 0))[0]
            if idx.size:
                k = idx[0]
                x = float(_refine(fmts[i], fmts[i + 1], grid[k:k + 1], grid[k + 1:k + 2], d[k:k + 1],
                                  d[k + 1:k + 2], cfg)[0])
            else:
                x = 0.0 if (d <= 0).all() else math.nan
            cross.append({"bits": b, "exp_bits": fmts[i].exp_bits, "to_exp_bits": fmts[i + 1].exp_bits,
                          "sigma": x})
        # ranges of the overall best
        best = np.argmin(le, axis=0)
        starts = [0] + [k + 1 for k in range(grid.size - 1) if best[k + 1] != best[k]]
        bounds = [float(grid[0])]
        for s in starts[1:]:
            a, c = best[s - 1], best[s]
            d = le[c] - le[a]
            bounds.append(float(_refine(fmts[a], fmts[c], grid[s - 1:s], grid[s:s + 1], d[s - 1:s], d[s:s + 1],
                                        cfg)[0]))
        bounds.append(float(grid[-1]))
        for n, s in enumerate(starts):
            f = fmts[best[s]]
            ranges.append({"bits": b, "exp_bits": f.exp_bits, "man_bits": f.man_bits, "format": str(f),
                           "sigma_lo": bounds[n], "sigma_hi": bounds[n + 1], "open_end": n == len(starts) - 1})
    rounding, criterion, power_of_two, layout = cfg
    scale_desc = (f"block scaling: {layout.block_size} entries per {layout.scale_format_name} scale" if layout.block_size else
                  "per-tensor power-of-two scale, best for each split (error averaged over mu within a binade)"
                  if power_of_two else "per-tensor scale, best for each split (continuous)")
    assumptions = {
        "sigma": "std of log2|g| (= sigma of ln|g| / ln 2)", "distribution": "lognormal |g|, exact zeros excluded",
        "convention": special, "subnormals": subnormals, "bias": "default (irrelevant once the scale is optimised)",
        "rounding": rounding, "overflow": "saturate to +-max", "scale": scale_desc,
        "criterion": "MSE / E[g^2]" if criterion == "mse" else "mean ((Q(g)-g)/g)^2",
        "sigma_range": (float(grid[0]), float(grid[-1])), "grid_step": step,
    }
    return CrossoverTable(tuple(ranges), tuple(cross), assumptions, grid, errors)


def crossover_table(
    bits: Iterable[int] = range(4, 9),
    *,
    special: str = "fn",
    subnormals: bool = True,
    rounding: str = "nearest",
    criterion: str = "mse",
    power_of_two: bool = False,
    granularity: str | int | Scheme | None = None,
    sigma_min: float = 0.05,
    sigma_max: float = 10.0,
    step: float = 0.05,
) -> CrossoverTable:
    """The sigma (std of log2|g|) at which ``E + 1`` exponent bits beat ``E``, per bit width.

    Keyword arguments are the modelling assumptions, stated again in the result's ``assumptions``:

    Args:
        bits: bit widths (each 3..16).
        special: convention of every split (``"fn"``: finite, saturating, as the OCP formats;
            ``"ieee"``: the top binade is reserved for inf/NaN; ``"fnuz"``; ``"hardware"``).
        subnormals: whether the formats have subnormals (``False``: flush below ``min_normal``).
        rounding: ``"nearest"`` or ``"stochastic"``.
        criterion: ``"mse"`` or ``"elementwise"``; with the continuous best scale both give the same
            table (the error minima are equal, see ``docs/fpanalysis.md``).
        power_of_two: restrict scales to powers of two.
        granularity: block scaling instead of a per-tensor scale (``"mx"``, ``"nvfp4"``, an int block size
            with E8M0 scales: :func:`~gradstats.fpanalysis.granularity.granularity_layout`).
        sigma_min, sigma_max, step: the sigma grid (log2 units).

    Example:
        >>> t = crossover_table(bits=[8], sigma_max=6.0)
        >>> [(r["format"], round(r["sigma_lo"], 2)) for r in t.ranges]
        [('e1m6fn', 0.05), ('e2m5fn', 0.41), ('e3m4fn', 0.89), ('e4m3fn', 1.72), ('e5m2fn', 3.21)]
    """
    bits_t = tuple(P.check_bits(b) for b in bits)
    if not bits_t:
        raise ValueError("bits is empty")
    P.check_choice("rounding", rounding, P.PREDICTED_ROUNDINGS)
    P.check_choice("criterion", criterion, P.CRITERIA)
    layout = granularity_layout("tensor" if granularity is None else granularity)
    if not (0 < sigma_min < sigma_max <= P.SIGMA_MAX / P.LN2) or not 0 < step <= (sigma_max - sigma_min) / 4:
        raise ValueError(f"need 0 < sigma_min < sigma_max <= {P.SIGMA_MAX / P.LN2:.1f} (log2 units) and a step of "
                         f"at most a quarter of the range; got {sigma_min}, {sigma_max}, step {step}")
    cfg = (rounding, criterion, bool(power_of_two), layout)
    return _table(bits_t, special, bool(subnormals), cfg, float(sigma_min), float(sigma_max), float(step))
