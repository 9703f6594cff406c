"""The figure of a :class:`gradstats.FitResult`: where the magnitudes lie and which family
follows them.

Left: histogram of ``log2|g|`` as a density per binade, with the three fitted magnitude
models drawn as densities of ``log2|g|`` (a density ``f(a)`` of ``a = |g|`` becomes
``f(2^t) 2^t ln 2`` on the ``t = log2 a`` axis, so all three share the axis). Right: Q-Q plot
of ``ln|g|`` against the standard normal; a lognormal is the straight line
``mu + sigma z``, and the other families appear as the curves of their ``ln|g|`` quantiles.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from scipy import special

from gradstats.families import ln_quantile as _ln_quantile
from gradstats.families import log2_density as _log2_density
from gradstats.plots.style import FAMILY_COLORS, use_style


def plot_fit(result: Any, *, title: str | None = None) -> Any:
    """Two panels for one fit (see the module docstring); returns the Figure.

    Example:
        >>> import torch, gradstats
        >>> fig = gradstats.fit(torch.randn(10_000).exp()).plot()
        >>> len(fig.axes)
        2
    """
    import matplotlib.pyplot as plt

    use_style()
    fig, (ax, qx) = plt.subplots(1, 2, figsize=(11, 4.2))
    edges = np.asarray(result.log2_edges, dtype=float)
    counts = np.asarray(result.log2_counts, dtype=float)
    width = np.diff(edges)
    dens = counts / max(counts.sum(), 1.0) / width
    ax.stairs(dens, edges, fill=True, color="0.75", label=f"data ({result.n_nonzero:,} non-zero)")
    pad = 2.0
    t = np.linspace(edges[0] - pad, edges[-1] + pad, 800)
    peak = dens.max() if dens.size else 1.0
    top = peak
    for fam in result.families:
        y = _log2_density(fam, t, result.params[fam])
        top = max(top, min(float(y.max()), 2.5 * peak))
        lab = {"lognormal": "lognormal", "normal": "half-normal (normal)",
               "laplace": "exponential (laplace)"}[fam]
        if fam in result.ks:
            lab += f", KS {result.ks[fam]:.3g}"
        ax.plot(t, y, color=FAMILY_COLORS[fam], lw=2 if fam == result.best else 1.4,
                ls="-" if fam == result.best else "--", label=lab)
    ax.set_ylim(0, top * 1.15)
    ax.set_xlim(t[0], t[-1])
    ax.set_xlabel("log2 |g|  (binades)")
    ax.set_ylabel("density per binade")
    ax.legend(fontsize="small", loc="upper left")
    ax.set_title(f"magnitudes; zero fraction {result.zero_fraction:.3g}, best: {result.best}")
    if result.qq_p is not None and len(result.qq_p):
        qp = np.asarray(result.qq_p, dtype=float)
        z = special.ndtri(qp)
        qx.plot(z, result.qq_ln, "o", ms=3, color="0.3",
                label="data" + (" (at binade edges)" if result.source == "stats" else ""))
        zz = np.linspace(z.min(), z.max(), 400)
        qq = special.ndtr(zz)
        for fam in result.families:
            qx.plot(zz, _ln_quantile(fam, qq, result.params[fam]), color=FAMILY_COLORS[fam],
                    lw=2 if fam == result.best else 1.4, ls="-" if fam == result.best else "--", label=fam)
        qx.legend(fontsize="small", loc="upper left")
    else:
        qx.text(0.5, 0.5, "no quantiles (fit without sorted values)", ha="center", va="center",
                transform=qx.transAxes)
    qx.set_xlabel("standard normal quantile")
    qx.set_ylabel("ln |g| quantile")
    qx.set_title("Q-Q of ln|g| (lognormal = straight line)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
