"""Figures of where the gradients lie and how well each family follows them: per-layer histograms
of ``log2|x|`` with the fitted densities (gradients beside activations and weights), Q-Q plots of
``ln|g|``, KS distance and Vuong effect size per layer, and location and spread over training.

Each function draws the fits or the table it is given (the tables of :mod:`gradstats.study`);
:mod:`gradstats.figures` computes them from a run.

Example:
    >>> import pandas as pd
    >>> t = pd.DataFrame({"layer": ["a", "a"], "step": [0, 1], "mean_log2": [-9.0, -9.5],
    ...                   "std_log2": [2.0, 2.1], "zero_fraction": [0.1, 0.2]})
    >>> fig = plot_moments_over_steps(t)
    >>> [ax.get_ylabel() for ax in fig.axes[:2]]
    ['mean of log2|g|', 'std of log2|g|  (binades)']
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from gradstats.plots.style import (
    FAMILY_COLORS,
    FAMILY_LABELS,
    KIND_LABELS,
    LAYER_COLORS,
    LN2,
    SYMBOLS,
    layer_styles,
    use_style,
)


def _log2_density(family: str, t: np.ndarray, params: Mapping[str, float]) -> np.ndarray:
    from gradstats.families import log2_density as dens  # the one home of the change of variables

    return dens(family, t, params)


def _grid(n: int, ncols: int) -> tuple[int, int]:
    ncols = max(1, min(ncols, n))
    return int(math.ceil(n / ncols)), ncols


def _name_ticks(ax: Any, names: list[str], span_in: float) -> None:
    """Layer names as x tick labels over ``span_in`` inches: level when few and short, else
    upright, in a font no taller than the spacing of the ticks allows."""
    ax.set_xticks(np.arange(len(names)))
    if len(names) <= 6 and max(map(len, names), default=0) * len(names) <= 60:
        ax.set_xticklabels(names)
        return
    size = min(9.0, 0.75 * span_in * 72 / max(len(names), 1))
    ax.set_xticklabels(names, rotation=90, fontsize=size)


def _hist_panel(ax: Any, res: Any, kind: str) -> None:
    edges = np.asarray(res.log2_edges, dtype=float)
    counts = np.asarray(res.log2_counts, dtype=float)
    dens = counts / max(counts.sum(), 1.0) / np.diff(edges)
    ax.stairs(dens, edges, fill=True, color="0.78", label="data")
    ax.stairs(dens, edges, color="0.45", lw=0.6)
    t = np.linspace(edges[0] - 1.5, edges[-1] + 1.5, 600)
    peak = float(dens.max()) if dens.size else 1.0
    top = peak
    for fam in res.families:
        y = _log2_density(fam, t, res.params[fam])
        top = max(top, min(float(y.max()), 1.6 * peak))
        best = fam == res.best
        ax.plot(t, y, color=FAMILY_COLORS[fam], lw=2.0 if best else 1.3, ls="-" if best else "--",
                label=FAMILY_LABELS[fam])
    ax.set_xlim(t[0], t[-1])
    ax.set_ylim(0, top * 1.12)
    sig = res.params["lognormal"]["sigma"] / LN2
    ks = res.ks.get("lognormal", math.nan)
    ax.text(0.02, 0.97, f"std log2 = {sig:.2f}\nzeros {res.zero_fraction:.0%}\nKS(lognormal) {ks:.3f}\nbest: {res.best}",
            transform=ax.transAxes, va="top", ha="left", fontsize="x-small",
            bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": "0.8", "alpha": 0.85})
    ax.xaxis.set_major_locator(MaxNLocator(nbins=7, integer=True))


def plot_layer_histograms(fits: Mapping[str, Mapping[str, Any]], *, step: int) -> Any:
    """Per layer (rows), the histogram of ``log2|x|`` of the neural gradient with the three fitted
    magnitude densities (lognormal, half-normal, exponential: solid = best by likelihood), and
    beside it the same for the layer's activations and weights, for contrast.

    Densities are per binade on the ``log2`` axis (a lognormal is a Gaussian bump there; the
    half-normal and exponential are skewed bumps with a sharp upper edge). Exact zeros are not in
    the histogram: their fraction is printed in each panel.

    ``fits``: ``{layer: {kind: FitResult}}`` (rows in the mapping's order, columns the kinds in
    order of appearance), as :func:`gradstats.study.layer_fit` gives them at ``step`` (the step
    named in the title; each row's first panel is titled with the layer's name, each column headed
    by the kind); a value that is an exception instead of a fit (nothing could be fitted
    there) leaves its panel with a note.

    Example:
        >>> import torch, gradstats
        >>> r = gradstats.fit(torch.randn(5_000).exp())
        >>> fig = plot_layer_histograms({"fc1": {"grad": r, "act": ValueError("sigma = 0")}}, step=0)
        >>> len(fig.axes), fig.axes[0].get_title(loc="left"), fig.axes[0].texts[-1].get_text()
        (2, 'fc1', 'neural gradient g')
    """
    import matplotlib.pyplot as plt

    names = list(fits)
    kinds = list(dict.fromkeys(k for row in fits.values() for k in row))
    if not names or not kinds:
        raise ValueError("no layer and kind to draw")
    use_style()
    # inches from the top: the title, then the legend, then the column headers, then the panels
    head = 1.0
    fig, axes = plt.subplots(len(names), len(kinds), figsize=(4.2 * len(kinds) + 0.6, 2.75 * len(names) + head),
                             squeeze=False)
    for i, name in enumerate(names):
        for j, kind in enumerate(kinds):
            ax = axes[i][j]
            res = fits[name].get(kind)
            if res is not None and not isinstance(res, BaseException):
                _hist_panel(ax, res, kind)
            else:
                msg = "constant values" if "sigma = 0" in str(res) else "nothing to fit"
                ax.text(0.5, 0.5, f"{msg}\n(no spread in log2|{SYMBOLS.get(kind, 'x')}|)", ha="center",
                        va="center", transform=ax.transAxes, fontsize="small", color="0.35")
                ax.set_yticks([])
            if i == 0:   # column header, above the first row's layer name
                ax.annotate(KIND_LABELS.get(kind, kind), (0.5, 1.0), xycoords="axes fraction", xytext=(0, 20),
                            textcoords="offset points", ha="center", va="bottom", fontsize="medium",
                            fontweight="bold")
            if i == len(names) - 1:
                ax.set_xlabel("log2 |x|  (binades)")
            if j == 0:   # the layer's name reads across its row, however long
                ax.set_title(name, loc="left", fontsize="small", fontweight="bold")
                ax.set_ylabel("density / binade", fontsize="small")
    h = fig.get_figheight()
    fig.suptitle(f"Where the values lie, per layer (step {step}): gradients span many binades, "
                 f"weights and activations few", fontsize="large", y=1 - 0.12 / h, va="top")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(facecolor="0.78", edgecolor="0.45", label="data (non-zero values)")]
    handles += [Line2D([], [], color=FAMILY_COLORS[f], lw=1.6, label=FAMILY_LABELS[f] + " fit")
                for f in ("lognormal", "normal", "laplace")]
    fig.legend(handles=handles, loc="upper center", ncol=4, frameon=False, fontsize="small",
               bbox_to_anchor=(0.5, 1 - 0.5 / h),
               title="solid: best fit by likelihood; dashed: the others", title_fontsize="x-small")
    fig.tight_layout(rect=(0, 0, 1, 1 - head / h))
    return fig


def plot_qq(fits: Mapping[str, Any], *, where: str = "", ncols: int = 3) -> Any:
    """Q-Q plot of ``ln|g|`` against the standard normal, one panel per layer: a lognormal is the
    straight line ``mu + sigma z``; the half-normal and exponential fits are drawn as the curves
    of their ``ln|g|`` quantiles. Points that bend away from the line at the ends show heavier or
    lighter tails than lognormal (printed: skewness and excess kurtosis of ``ln|g|``).

    ``fits``: ``{layer: FitResult}`` (e.g. :func:`gradstats.study.layer_fits`); ``where``: what
    they were fitted on, added to the title (e.g. ``"step 196"``).

    Example:
        >>> import torch, gradstats
        >>> fig = plot_qq({"conv1": gradstats.fit(torch.randn(5_000).exp())}, where="step 0")
        >>> fig.axes[0].get_xlabel()
        'standard normal quantile'
    """
    import matplotlib.pyplot as plt
    from scipy import special

    from gradstats.families import ln_quantile as _ln_quantile

    fits = dict(fits)
    if not fits:
        raise ValueError("no layer could be fitted: nothing to draw")
    use_style()
    nrows, ncols = _grid(len(fits), ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.9 * ncols + 0.4, 3.3 * nrows + 0.8), squeeze=False)
    for k, (name, res) in enumerate(fits.items()):
        ax = axes[k // ncols][k % ncols]
        if res.qq_p is None or not len(res.qq_p):
            ax.text(0.5, 0.5, "no quantiles (fit without sorted values)", ha="center", va="center",
                    transform=ax.transAxes, fontsize="small")
            ax.set_title(name)
            continue
        z = special.ndtri(np.asarray(res.qq_p, dtype=float))
        ax.plot(z, res.qq_ln, "o", ms=2.6, color="0.25", label="data" + (" (binade edges)" if res.source == "stats" else ""),
                zorder=3)
        zz = np.linspace(float(z.min()), float(z.max()), 300)
        qq = special.ndtr(zz)
        for fam in res.families:
            best = fam == res.best
            ax.plot(zz, _ln_quantile(fam, qq, res.params[fam]), color=FAMILY_COLORS[fam], lw=1.8 if best else 1.2,
                    ls="-" if best else "--", label=FAMILY_LABELS[fam])
        note = f"sigma(ln) = {res.params['lognormal']['sigma']:.2f}"
        if res.ln_skew is not None:
            note += f"\nskew {res.ln_skew:+.2f}, ex. kurt {res.ln_exkurt:+.2f}"
        ax.text(0.97, 0.04, note, transform=ax.transAxes, ha="right", va="bottom", fontsize="x-small",
                bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": "0.8", "alpha": 0.85})
        ax.set_title(name)
        if k % ncols == 0:
            ax.set_ylabel("ln |g| quantile")
        if k // ncols == nrows - 1 or k + ncols >= len(fits):
            ax.set_xlabel("standard normal quantile")
        if k == 0:
            ax.legend(fontsize="x-small", loc="upper left")
    for k in range(len(fits), nrows * ncols):
        axes[k // ncols][k % ncols].set_visible(False)
    fig.suptitle("Q-Q plots of ln|g| against the normal (lognormal = straight line)"
                 + (f", {where}" if where else ""), fontsize="large")
    fig.tight_layout()
    return fig


def plot_goodness_of_fit(table: Any) -> Any:
    """Left: KS distance per layer for the three families (log scale; small = close fit), one
    small point per sampled step and a large marker at the median. Right: Vuong's effect size
    ``z/sqrt(n)`` of lognormal against half-normal and against exponential per layer (positive:
    lognormal is the likelier model; at ``n`` of 1e4-1e6 every ``|z|`` is huge, so the effect
    size, not the p-value, says by how much).

    ``table``: the DataFrame of :func:`gradstats.study.goodness_of_fit` (columns ``layer, step,
    ks_<family>``, ``vuong_lognormal_vs_normal``, ``vuong_lognormal_vs_laplace``).

    Example:
        >>> import pandas as pd
        >>> t = pd.DataFrame({"layer": ["a", "b"], "step": [0, 0], "ks_lognormal": [0.01, 0.02],
        ...                   "ks_normal": [0.2, 0.3], "ks_laplace": [0.1, 0.1],
        ...                   "vuong_lognormal_vs_normal": [0.5, 0.4], "vuong_lognormal_vs_laplace": [0.2, 0.1]})
        >>> fig = plot_goodness_of_fit(t)
        >>> fig.axes[0].get_yscale()
        'log'
    """
    import matplotlib.pyplot as plt

    df = table
    if df.empty:
        raise ValueError("no layer could be fitted: nothing to draw")
    names = list(dict.fromkeys(df["layer"]))
    x = np.arange(len(names))
    use_style()
    width = min(max(11.0, 0.4 * len(names) + 4), 20.0)
    longest = max(map(len, names))
    fig, (ax, vx) = plt.subplots(1, 2, figsize=(width, 4.8 + (0.075 * longest if len(names) > 6 else 0.0)))
    fams = [f for f in ("lognormal", "normal", "laplace") if f"ks_{f}" in df]
    off = {f: (i - (len(fams) - 1) / 2) * 0.22 for i, f in enumerate(fams)}
    for fam in fams:
        for i, name in enumerate(names):
            v = df.loc[df["layer"] == name, f"ks_{fam}"].dropna()
            if not len(v):
                continue
            ax.scatter(np.full(len(v), i + off[fam]), v, s=9, color=FAMILY_COLORS[fam], alpha=0.45, lw=0)
        med = df.groupby("layer", sort=False)[f"ks_{fam}"].median().reindex(names)
        ax.scatter(x + off[fam], med, s=46, marker="D", color=FAMILY_COLORS[fam], edgecolor="black", lw=0.5,
                   label=FAMILY_LABELS[fam], zorder=3)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    _name_ticks(ax, names, width / 2 - 1.1)
    ax.set_ylabel("KS distance on |g|  (log scale)")
    ax.set_title("Kolmogorov-Smirnov distance (lower is better)")
    ax.legend(fontsize="small", loc="best")
    pairs = [("normal", "lognormal vs half-normal"), ("laplace", "lognormal vs exponential")]
    has_vuong = any(df[f"vuong_lognormal_vs_{o}"].notna().any() for o, _ in pairs if f"vuong_lognormal_vs_{o}" in df)
    if has_vuong:
        for k, (other, lab) in enumerate(pairs):
            col = f"vuong_lognormal_vs_{other}"
            dx = (k - 0.5) * 0.26
            for i, name in enumerate(names):
                v = df.loc[df["layer"] == name, col].dropna()
                vx.scatter(np.full(len(v), i + dx), v, s=9, color=FAMILY_COLORS[other], alpha=0.45, lw=0)
            med = df.groupby("layer", sort=False)[col].median().reindex(names)
            vx.bar(x + dx, med, width=0.24, color=FAMILY_COLORS[other], alpha=0.75, label=lab)
        vx.axhline(0.0, color="black", lw=0.8)
        vals = df[[f"vuong_lognormal_vs_{o}" for o, _ in pairs]].to_numpy(dtype=float)
        hi, lo = max(float(np.nanmax(vals)), 0.05), min(float(np.nanmin(vals)), 0.0)
        span = hi - lo
        vx.set_ylim(min(lo - 0.12 * span, -0.1 * span), hi + 0.12 * span)
        vx.legend(fontsize="small", loc="best")
    else:
        vx.text(0.5, 0.5, "Vuong's test needs raw samples\n(this run has statistics only)", ha="center",
                va="center", transform=vx.transAxes)
    _name_ticks(vx, names, width / 2 - 1.1)
    vx.set_ylabel("Vuong effect size z/sqrt(n)")
    vx.set_title("Likelihood ratio per value (> 0: lognormal fits better)")
    steps = sorted(df["step"].unique())
    fig.suptitle(f"Goodness of fit of the neural gradients per layer ({len(steps)} step"
                 f"{'s' if len(steps) != 1 else ''}: small points; median: large markers)", fontsize="large")
    fig.tight_layout()
    return fig


def plot_moments_over_steps(table: Any, *, kind: str = "grad") -> Any:
    """Per layer, across training steps: the mean of ``log2|g|`` (where the layer's gradients sit,
    in binades; layers differ by many binades, which is why every layer needs its own scale), the
    std of ``log2|g|`` (their spread in binades: the quantity that picks the exponent bits) and
    the fraction of exact zeros.

    ``table``: the DataFrame of :func:`gradstats.study.moments_over_steps` (columns ``layer, step,
    mean_log2, std_log2, zero_fraction``) of the captured ``kind`` (named on the axes).

    Example:
        >>> import pandas as pd
        >>> t = pd.DataFrame({"layer": ["a"], "step": [0], "mean_log2": [-9.0], "std_log2": [2.0],
        ...                   "zero_fraction": [0.1]})
        >>> len(plot_moments_over_steps(t).axes)
        3
    """
    import matplotlib.pyplot as plt

    df = table
    if df.empty:
        raise ValueError(f"no {kind!r} statistics to draw")
    names = list(dict.fromkeys(df["layer"]))
    # colours that stay apart; past seven layers, each colour again with another dash pattern
    dashes = ("-", "--", "-.", ":")
    styles = [(c, dashes[k // len(LAYER_COLORS) % len(dashes)]) for k, (c, _) in enumerate(layer_styles(len(names)))]
    use_style()
    # the legend below the panels: as many columns of names as fit across the figure
    ncol = max(1, min(len(names), int(15.5 / (0.6 + 0.075 * max(map(len, names))))))
    rows = math.ceil(len(names) / ncol)
    below = 0.45 + 0.2 * rows
    fig, axes = plt.subplots(1, 3, figsize=(15.5, 4.4 + below))
    sym = SYMBOLS.get(kind, "x")
    for name, (c, ls) in zip(names, styles):
        g = df[df["layer"] == name]
        few = len(g) < 30
        for ax, col in zip(axes, ("mean_log2", "std_log2", "zero_fraction")):
            ax.plot(g["step"], g[col], color=c, ls=ls, lw=1.4, marker="o" if few else None, ms=3, label=name)
    axes[0].set_ylabel(f"mean of log2|{sym}|")
    axes[0].set_title("Location (binades): each layer sits elsewhere")
    axes[1].set_ylabel(f"std of log2|{sym}|  (binades)")
    axes[1].set_title("Spread (binades): picks the exponent bits")
    axes[2].set_ylabel("fraction of exact zeros")
    axes[2].set_ylim(-0.02, 1.02)
    axes[2].set_title("Zeros (point mass, not in the fit)")
    for ax in axes:
        ax.set_xlabel("training step")
    fig.suptitle(f"{KIND_LABELS.get(kind, kind).capitalize()} statistics over training", fontsize="large")
    fig.tight_layout(rect=(0, below / fig.get_figheight(), 1, 1))
    handles, labels = axes[2].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize="small", title="layer",
               title_fontsize="small", frameon=False, bbox_to_anchor=(0.5, 0.0))
    return fig


def plot_ks_by_model(fits: Any, *, path: Any = None) -> Any:
    """KS distance of each family per model, one panel per kind (neural gradients, activations,
    weights): one box per model and family over every sampled (layer, step), log axis. ``fits`` is
    :func:`gradstats.fit_run` output with a ``model`` column (several runs concatenated).

    Example:
        >>> import pandas as pd
        >>> f = pd.DataFrame({"model": ["a"] * 3, "kind": ["grad"] * 3, "status": ["ok"] * 3,
        ...                   "family": ["lognormal", "normal", "laplace"], "ks": [0.01, 0.2, 0.1]})
        >>> [ax.get_title() for ax in plot_ks_by_model(f).axes]
        ['neural gradient g']
    """
    import matplotlib.pyplot as plt
    import seaborn as sns

    from gradstats.plots.style import savefig

    use_style()
    ok = fits[fits["status"] == "ok"]
    kinds = [k for k in ("grad", "act", "weight", "wgrad") if k in set(ok["kind"])]
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds) + 0.6, 4.0), sharey=True, squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        d = ok[ok["kind"] == kind]
        sns.boxplot(data=d, x="model", y="ks", hue="family", hue_order=list(FAMILY_COLORS), palette=FAMILY_COLORS,
                    ax=ax, fliersize=2, linewidth=0.8, log_scale=True)
        ax.set_title(KIND_LABELS.get(kind, kind))
        ax.set_xlabel("")
        ax.set_ylabel("KS distance (log scale)")
        if ax is not axes[0][0] and ax.get_legend() is not None:
            ax.get_legend().remove()
    leg = axes[0][0].get_legend()
    if leg is not None:
        leg.set_title("family")
    fig.suptitle("goodness of fit per model: KS distance over every sampled layer and step")
    fig.tight_layout()
    if path is not None:
        savefig(fig, path)
    return fig
