"""The study's figures drawn from a run: where each layer's gradients lie, how well each family
follows them, how they move over training, and the formats recommended for them.

Every function takes a run (a :class:`gradstats.Run` or the path of a run directory) or result
objects, and returns a matplotlib Figure in the one style of :mod:`gradstats.plots.style`. Values
that span binades are drawn on ``log2`` axes. Figures of other topics live beside this module
(:mod:`.fit`, :mod:`.pruning`, :mod:`.fpanalysis`); :func:`write_figures` writes all of them for
one run. What each figure shows and how to read it: ``docs/figures.md``.

Example:
    >>> import gradstats
    >>> from gradstats.plots import study
    >>> run = gradstats.open_run(gradstats.data.data_dir() / "sample-run")
    >>> fig = study.plot_moments_over_steps(run)
    >>> [ax.get_ylabel() for ax in fig.axes[:2]]
    ['mean of log2|g|', 'std of log2|g|  (binades)']
"""
from __future__ import annotations

import logging
import math
import os
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from .style import FAMILY_COLORS, use_style

log = logging.getLogger(__name__)

_LN2 = math.log(2.0)
#: what each captured kind is called on axes and titles
KIND_LABELS = {"grad": "neural gradient g", "act": "activation (layer output)", "weight": "weights",
               "wgrad": "weight gradient"}
_SYMBOL = {"grad": "g", "act": "a", "weight": "w", "wgrad": "dW"}
_FAMILY_LABELS = {"lognormal": "lognormal", "normal": "half-normal (normal)",
                  "laplace": "exponential (Laplace)"}
#: layers drawn by default in the per-layer grids (evenly spaced over the model beyond this)
MAX_GRID_LAYERS = 12


# ----------------------------------------------------------------------------- helpers
def _open(run: Any) -> Any:
    from ..run import Run, open_run

    if isinstance(run, Run):
        return run
    if isinstance(run, (str, os.PathLike)):
        return open_run(run)
    raise ValueError(f"expected a gradstats Run or the path of a run directory, got {type(run).__name__}")


def _layers(run: Any, layers: str | Sequence[str] | None, *, cap: int | None = MAX_GRID_LAYERS) -> list[str]:
    """The run's layers selected by ``layers`` (None: all, evenly thinned to ``cap``)."""
    from ..fitting._run import select_layers

    names = select_layers(list(run.layers), layers)
    if layers is None and cap is not None and len(names) > cap:
        keep = np.unique(np.round(np.linspace(0, len(names) - 1, cap)).astype(int))
        log.info("drawing %d of the run's %d layers (evenly spaced); pass layers= to choose", len(keep), len(names))
        names = [names[i] for i in keep]
    return names


def sampled_steps(run: Any, kind: str = "grad") -> list[int]:
    """Steps at which the run kept raw samples of ``kind``.

    Example:
        >>> import gradstats
        >>> sampled_steps(gradstats.data.data_dir() / "sample-run")[:1]
        [0]
    """
    run = _open(run)
    idx = run.sample_index()
    return sorted(int(s) for s in idx[idx["kind"] == kind]["step"].unique()) if len(idx) else []


def _pick_step(run: Any, step: int | None, kind: str = "grad") -> int:
    have = sampled_steps(run, kind)
    if step is None:
        if have:
            return have[-1]
        if not run.steps:
            raise ValueError(f"the run at {run.path} has no committed steps yet")
        return int(run.steps[-1])
    if step not in run.steps and step not in have:
        raise ValueError(f"step {step} is not in the run; it has steps {run.steps[:5]}...{run.steps[-3:]} "
                         f"(raw samples at {have})")
    return int(step)


def layer_values(run: Any, layer: str, step: int, kind: str = "grad") -> Any:
    """The raw sampled values of one layer at one step, all calls and ranks concatenated (a 1-D
    float32 tensor), or ``None`` when the run kept no samples there.

    Example:
        >>> import gradstats
        >>> run = gradstats.open_run(gradstats.data.data_dir() / "sample-run")
        >>> layer_values(run, "fc2", 0).ndim
        1
    """
    import torch

    run = _open(run)
    idx = run.sample_index()
    if not len(idx):
        return None
    idx = idx[(idx["layer"] == layer) & (idx["step"] == step) & (idx["kind"] == kind)]
    if not len(idx):
        return None
    parts = [run.samples(layer, step, kind=kind, call=int(c)) for c in sorted(idx["call"].unique())]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def layer_fit(run: Any, layer: str, step: int, kind: str = "grad") -> Any:
    """The three-family fit of one layer at one step: exact on its raw samples when the run has
    them (:func:`gradstats.fit`), else from the step's streamed statistics
    (:func:`gradstats.fit_stats`). Raises ``ValueError`` when nothing can be fitted there
    (e.g. all values equal, as BatchNorm weights at initialisation).

    Example:
        >>> import gradstats
        >>> r = layer_fit(gradstats.data.data_dir() / "sample-run", "conv2", 0)
        >>> r.source, r.best
        ('samples', 'lognormal')
    """
    from ..fitting import fit, fit_stats

    run = _open(run)
    x = layer_values(run, layer, step, kind)
    if x is not None:
        return fit(x)
    st = run.stats(kinds=[kind])
    st = st[(st["layer"] == layer) & (st["step"] == step)]
    if not len(st):
        raise ValueError(f"the run has neither samples nor statistics of {kind!r} for layer {layer!r} at step {step}")
    return fit_stats(st)


def layer_fits(run: Any, *, step: int | None = None, kind: str = "grad",
               layers: str | Sequence[str] | None = None) -> dict[str, Any]:
    """``{layer: FitResult}`` at one step (default: the latest step with raw samples), see
    :func:`layer_fit`; layers that cannot be fitted are left out (logged).

    Example:
        >>> import gradstats
        >>> fits = layer_fits(gradstats.data.data_dir() / "sample-run")
        >>> list(fits)[:2]
        ['conv1', 'bn1']
    """
    run = _open(run)
    step = _pick_step(run, step, kind)
    out = {}
    for name in _layers(run, layers, cap=None):
        try:
            out[name] = layer_fit(run, name, step, kind)
        except ValueError as exc:
            log.info("no %s fit of layer %s at step %d: %s", kind, name, step, exc)
    return out


def _fits_or_run(run_or_fits: Any, step: int | None, kind: str, layers: Any) -> tuple[dict[str, Any], str]:
    if isinstance(run_or_fits, Mapping):
        return dict(run_or_fits), ""
    run = _open(run_or_fits)
    st = _pick_step(run, step, kind)
    return layer_fits(run, step=st, kind=kind, layers=_layers(run, layers)), f"step {st}"


def _log2_density(family: str, t: np.ndarray, params: Mapping[str, float]) -> np.ndarray:
    from .fit import _log2_density as dens  # the one home of the change of variables

    return dens(family, t, params)


def _grid(n: int, ncols: int) -> tuple[int, int]:
    ncols = max(1, min(ncols, n))
    return int(math.ceil(n / ncols)), ncols


def _layer_palette(n: int) -> list[Any]:
    import seaborn as sns

    return sns.color_palette("colorblind" if n <= 10 else "husl", n)


def _binades(x: float) -> str:
    return f"2^{x:.1f}" if math.isfinite(x) else "-"


# ----------------------------------------------------------------------------- distributions
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
                label=_FAMILY_LABELS[fam])
    ax.set_xlim(t[0], t[-1])
    ax.set_ylim(0, top * 1.12)
    sig = res.params["lognormal"]["sigma"] / _LN2
    ks = res.ks.get("lognormal", math.nan)
    ax.text(0.02, 0.97, f"std log2 = {sig:.2f}\nzeros {res.zero_fraction:.0%}\nKS(lognormal) {ks:.3f}\nbest: {res.best}",
            transform=ax.transAxes, va="top", ha="left", fontsize="x-small",
            bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": "0.8", "alpha": 0.85})
    ax.xaxis.set_major_locator(MaxNLocator(nbins=7, integer=True))


def plot_layer_histograms(run: Any, *, step: int | None = None, layers: str | Sequence[str] | None = None,
                          kinds: Sequence[str] = ("grad", "act", "weight")) -> Any:
    """Per layer (rows), the histogram of ``log2|x|`` of the neural gradient with the three fitted
    magnitude densities (lognormal, half-normal, exponential: solid = best by likelihood), and
    beside it the same for the layer's activations and weights, for contrast.

    Densities are per binade on the ``log2`` axis (a lognormal is a Gaussian bump there; the
    half-normal and exponential are skewed bumps with a sharp upper edge). Exact zeros are not in
    the histogram: their fraction is printed in each panel. ``step``: default the latest step with
    raw samples; without samples the streamed binade histograms are drawn instead.

    Example:
        >>> import gradstats
        >>> fig = plot_layer_histograms(gradstats.data.data_dir() / "sample-run", layers=["conv2", "fc1"])
        >>> len(fig.axes)
        6
    """
    import matplotlib.pyplot as plt

    run = _open(run)
    step = _pick_step(run, step)
    names = _layers(run, layers)
    stats = run.stats()
    have = set(stats["kind"].unique()) if len(stats) else set()
    idx = run.sample_index()
    have |= set(idx["kind"].unique()) if len(idx) else set()
    kinds = [k for k in kinds if k in have]
    if "grad" not in kinds:
        raise ValueError(f"the run at {run.path} has no neural-gradient ('grad') captures to draw")
    use_style()
    fig, axes = plt.subplots(len(names), len(kinds), figsize=(4.2 * len(kinds) + 0.6, 2.55 * len(names) + 0.9),
                             squeeze=False)
    for i, name in enumerate(names):
        for j, kind in enumerate(kinds):
            ax = axes[i][j]
            try:
                res = layer_fit(run, name, step, kind)
                _hist_panel(ax, res, kind)
            except ValueError as exc:
                msg = "constant values" if "sigma = 0" in str(exc) else "nothing to fit"
                ax.text(0.5, 0.5, f"{msg}\n(no spread in log2|{_SYMBOL.get(kind, 'x')}|)", ha="center",
                        va="center", transform=ax.transAxes, fontsize="small", color="0.35")
                ax.set_yticks([])
            if i == 0:
                ax.set_title(KIND_LABELS.get(kind, kind), fontsize="medium", fontweight="bold")
            if i == len(names) - 1:
                ax.set_xlabel(f"log2 |x|  (binades)")
            if j == 0:
                ax.set_ylabel(f"{name}\ndensity / binade", fontsize="small")
    fig.suptitle(f"Where the values lie, per layer (step {step}): gradients span many binades, "
                 f"weights and activations few", fontsize="large")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(facecolor="0.78", edgecolor="0.45", label="data (non-zero values)")]
    handles += [Line2D([], [], color=FAMILY_COLORS[f], lw=1.6, label=_FAMILY_LABELS[f] + " fit")
                for f in ("lognormal", "normal", "laplace")]
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.75 / fig.get_figheight()))
    fig.legend(handles=handles, loc="upper center", ncol=4, frameon=False, fontsize="small",
               bbox_to_anchor=(0.5, 1 - 0.42 / fig.get_figheight()),
               title="solid: best fit by likelihood; dashed: the others", title_fontsize="x-small")
    return fig


def plot_qq(run_or_fits: Any, *, step: int | None = None, layers: str | Sequence[str] | None = None,
            ncols: int = 3) -> Any:
    """Q-Q plot of ``ln|g|`` against the standard normal, one panel per layer: a lognormal is the
    straight line ``mu + sigma z``; the half-normal and exponential fits are drawn as the curves
    of their ``ln|g|`` quantiles. Points that bend away from the line at the ends show heavier or
    lighter tails than lognormal (printed: skewness and excess kurtosis of ``ln|g|``).

    ``run_or_fits``: a run (fitted at ``step``, default the latest sampled step) or a mapping
    ``{layer: FitResult}``.

    Example:
        >>> import gradstats
        >>> fig = plot_qq(gradstats.data.data_dir() / "sample-run", layers="conv*")
        >>> fig.axes[0].get_xlabel()
        'standard normal quantile'
    """
    import matplotlib.pyplot as plt
    from scipy import special

    from .fit import _ln_quantile

    fits, where = _fits_or_run(run_or_fits, step, "grad", layers)
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
                    ls="-" if best else "--", label=_FAMILY_LABELS[fam])
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


# ----------------------------------------------------------------------------- goodness of fit
def goodness_of_fit(run: Any, *, steps: Sequence[int] | None = None, kind: str = "grad",
                    layers: str | Sequence[str] | None = None) -> Any:
    """Per layer and step (default: every step with raw samples, else the last step): the KS
    distance of each family and Vuong's effect size ``z/sqrt(n)`` of lognormal against normal
    and against Laplace (positive favours lognormal), as a DataFrame.

    Example:
        >>> import gradstats
        >>> df = goodness_of_fit(gradstats.data.data_dir() / "sample-run", steps=[0], layers="fc2")
        >>> sorted(df.columns)[:3], len(df)
        (['best', 'ks_laplace', 'ks_lognormal'], 1)
    """
    import pandas as pd

    run = _open(run)
    if steps is None:
        steps = sampled_steps(run, kind) or [_pick_step(run, None, kind)]
    rows = []
    for name in _layers(run, layers, cap=None):
        for s in steps:
            try:
                res = layer_fit(run, name, int(s), kind)
            except ValueError as exc:
                log.info("layer %s step %s not fitted: %s", name, s, exc)
                continue
            row = {"layer": name, "step": int(s), "source": res.source, "best": res.best,
                   "sigma_log2": res.params["lognormal"]["sigma"] / _LN2}
            for fam in res.families:
                row[f"ks_{fam}"] = res.ks.get(fam, math.nan)
            for other in ("normal", "laplace"):
                t = res.vuong.get(("lognormal", other))
                row[f"vuong_lognormal_vs_{other}"] = math.nan if t is None else t["effect"]
            rows.append(row)
    return pd.DataFrame(rows)


def plot_goodness_of_fit(run_or_table: Any, *, kind: str = "grad", layers: str | Sequence[str] | None = None) -> Any:
    """Left: KS distance per layer for the three families (log scale; small = close fit), one
    small point per sampled step and a large marker at the median. Right: Vuong's effect size
    ``z/sqrt(n)`` of lognormal against half-normal and against exponential per layer (positive:
    lognormal is the likelier model; at ``n`` of 1e4-1e6 every ``|z|`` is huge, so the effect
    size, not the p-value, says by how much).

    ``run_or_table``: a run, or the DataFrame of :func:`goodness_of_fit`.

    Example:
        >>> import gradstats
        >>> fig = plot_goodness_of_fit(gradstats.data.data_dir() / "sample-run")
        >>> fig.axes[0].get_yscale()
        'log'
    """
    import matplotlib.pyplot as plt
    import pandas as pd

    df = run_or_table if isinstance(run_or_table, pd.DataFrame) else goodness_of_fit(run_or_table, kind=kind,
                                                                                         layers=layers)
    if df.empty:
        raise ValueError("no layer could be fitted: nothing to draw")
    names = list(dict.fromkeys(df["layer"]))
    x = np.arange(len(names))
    use_style()
    fig, (ax, vx) = plt.subplots(1, 2, figsize=(min(max(11.0, 1.6 * len(names) + 4), 20.0), 4.8))
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
                   label=_FAMILY_LABELS[fam], zorder=3)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(x)
    ax.set_xticklabels(names, rotation=30 if len(names) > 6 else 0, ha="right" if len(names) > 6 else "center")
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
    vx.set_xticks(x)
    vx.set_xticklabels(names, rotation=30 if len(names) > 6 else 0, ha="right" if len(names) > 6 else "center")
    vx.set_ylabel("Vuong effect size z/sqrt(n)")
    vx.set_title("Likelihood ratio per value (> 0: lognormal fits better)")
    steps = sorted(df["step"].unique())
    fig.suptitle(f"Goodness of fit of the neural gradients per layer ({len(steps)} step"
                 f"{'s' if len(steps) != 1 else ''}: small points; median: large markers)", fontsize="large")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- over training
def moments_over_steps(run: Any, *, kind: str = "grad", layers: str | Sequence[str] | None = None) -> Any:
    """Per layer and step (calls and ranks merged): the mean and std of ``log2|x|`` over the
    non-zero entries and the zero fraction, from the streamed statistics, as a DataFrame.

    Example:
        >>> import gradstats
        >>> df = moments_over_steps(gradstats.data.data_dir() / "sample-run", layers="fc2")
        >>> list(df.columns)
        ['layer', 'step', 'mean_log2', 'std_log2', 'zero_fraction']
    """
    import pandas as pd

    from ..stats import lognormal_moments, merge_stats

    run = _open(run)
    names = _layers(run, layers, cap=None)
    st = run.stats(kinds=[kind])
    st = st[st["layer"].isin(names)]
    rows = []
    for (layer, step), g in st.groupby(["layer", "step"], sort=False):
        m = merge_stats(g.to_dict("records")) if len(g) > 1 else g.iloc[0].to_dict()
        mu, sigma = lognormal_moments(m)
        rows.append({"layer": layer, "step": int(step), "mean_log2": mu / _LN2, "std_log2": sigma / _LN2,
                     "zero_fraction": int(m["n_zero"]) / max(int(m["n"]), 1)})
    df = pd.DataFrame(rows, columns=["layer", "step", "mean_log2", "std_log2", "zero_fraction"])
    order = {n: i for i, n in enumerate(names)}
    return df.sort_values(["layer", "step"], key=lambda c: c.map(order) if c.name == "layer" else c,
                          kind="stable").reset_index(drop=True)


def plot_moments_over_steps(run: Any, *, kind: str = "grad", layers: str | Sequence[str] | None = None) -> Any:
    """Per layer, across training steps: the mean of ``log2|g|`` (where the layer's gradients sit,
    in binades; layers differ by many binades, which is why every layer needs its own scale), the
    std of ``log2|g|`` (their spread in binades: the quantity that picks the exponent bits) and
    the fraction of exact zeros.

    Example:
        >>> import gradstats
        >>> len(plot_moments_over_steps(gradstats.data.data_dir() / "sample-run").axes)
        3
    """
    import matplotlib.pyplot as plt

    run = _open(run)
    df = moments_over_steps(run, kind=kind, layers=layers)
    if df.empty:
        raise ValueError(f"the run at {run.path} has no {kind!r} statistics")
    names = list(dict.fromkeys(df["layer"]))
    colors = _layer_palette(len(names))
    use_style()
    fig, axes = plt.subplots(1, 3, figsize=(15.5, 4.4))
    sym = _SYMBOL.get(kind, "x")
    for name, c in zip(names, colors):
        g = df[df["layer"] == name]
        few = len(g) < 30
        for ax, col in zip(axes, ("mean_log2", "std_log2", "zero_fraction")):
            ax.plot(g["step"], g[col], color=c, lw=1.4, marker="o" if few else None, ms=3, label=name)
    axes[0].set_ylabel(f"mean of log2|{sym}|")
    axes[0].set_title("Location (binades): each layer sits elsewhere")
    axes[1].set_ylabel(f"std of log2|{sym}|  (binades)")
    axes[1].set_title("Spread (binades): picks the exponent bits")
    axes[2].set_ylabel("fraction of exact zeros")
    axes[2].set_ylim(-0.02, 1.02)
    axes[2].set_title("Zeros (point mass, not in the fit)")
    for ax in axes:
        ax.set_xlabel("training step")
    axes[2].legend(fontsize="small", loc="center left", bbox_to_anchor=(1.02, 0.5), title="layer")
    fig.suptitle(f"{KIND_LABELS.get(kind, kind).capitalize()} statistics over training", fontsize="large")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- formats
def plot_format_map(plans: Any, *, title: str | None = None) -> Any:
    """A per-layer map of the recommended formats: one row per layer, one column per bit width;
    each cell names the chosen ``ExMy`` format and its power-of-two scale, coloured by its
    exponent bits, with the predicted signal-to-quantisation-noise ratio
    (``-10 log10(MSE / E[g^2])``). The row labels give each layer's std of ``log2|g|``: wider
    layers need more exponent bits.

    ``plans``: ``{bits: Plan}`` as :func:`gradstats.recommend` returns for a list of widths, or one
    :class:`~gradstats.plan.Plan`.

    Example:
        >>> import gradstats
        >>> plans = gradstats.recommend(gradstats.data.data_dir() / "sample-run", bits=[8, 6, 4])
        >>> fig = plot_format_map(plans)
        >>> [t.get_text() for t in fig.axes[0].get_xticklabels()]
        ['FP8', 'FP6', 'FP4']
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import BoundaryNorm, ListedColormap

    from ..formats import FPFormat
    from ..plan import Plan, Prediction

    if isinstance(plans, Plan):
        widths = sorted({e.format.bits for e in plans.entries if isinstance(e.format, FPFormat)}, reverse=True)
        if len(widths) != 1:
            raise ValueError("a single plan must hold formats of one width; pass {bits: plan} for several")
        plans = {widths[0]: plans}
    if not isinstance(plans, Mapping) or not plans:
        raise ValueError("plans must be {bits: Plan} (as recommend(run, bits=[8, 6, 4]) returns) or one Plan")
    widths = list(plans)
    layers: list[str] = []
    for p in plans.values():
        layers += [e.layer for e in p.entries if e.layer not in layers]
    cell: dict[tuple[str, int], Any] = {}
    sigma: dict[str, float] = {}
    for b, p in plans.items():
        for e in p.entries:
            cell[(e.layer, b)] = e
            pr = e.predicted if isinstance(e.predicted, Prediction) else None
            if pr is not None and pr.sigma is not None:
                sigma.setdefault(e.layer, pr.sigma / _LN2)
    ebits = np.full((len(layers), len(widths)), np.nan)
    for i, name in enumerate(layers):
        for j, b in enumerate(widths):
            e = cell.get((name, b))
            if e is not None and isinstance(e.format, FPFormat):
                ebits[i, j] = e.format.exp_bits
    emax = int(np.nanmax(ebits)) if np.isfinite(ebits).any() else 5
    import seaborn as sns

    cols = sns.color_palette("YlGnBu", emax + 2)[1:]
    cmap = ListedColormap(cols[:emax])
    norm = BoundaryNorm(np.arange(0.5, emax + 1.5), cmap.N)
    use_style()
    fig, ax = plt.subplots(figsize=(2.3 * len(widths) + 3.2, 0.62 * len(layers) + 1.6))
    im = ax.imshow(np.ma.masked_invalid(ebits), cmap=cmap, norm=norm, aspect="auto")
    for i, name in enumerate(layers):
        for j, b in enumerate(widths):
            e = cell.get((name, b))
            if e is None or not isinstance(e.format, FPFormat):
                ax.text(j, i, "-", ha="center", va="center")
                continue
            pr = e.predicted if isinstance(e.predicted, Prediction) else None
            txt = str(e.format)
            if pr is not None and pr.scale:
                txt += f"  x2^{int(round(math.log2(pr.scale)))}"
            if pr is not None and pr.error:
                txt += f"\nSNR {-10 * math.log10(pr.error):.1f} dB"
            dark = np.isfinite(ebits[i, j]) and ebits[i, j] >= 0.6 * emax
            ax.text(j, i, txt, ha="center", va="center", fontsize="small", color="white" if dark else "black")
    ax.set_xticks(range(len(widths)))
    ax.set_xticklabels([f"FP{b}" for b in widths])
    ax.set_yticks(range(len(layers)))
    ax.set_yticklabels([f"{n}  (std log2 {sigma[n]:.2f})" if n in sigma else n for n in layers])
    ax.xaxis.tick_top()
    ax.grid(False)
    cb = fig.colorbar(im, ax=ax, ticks=range(1, emax + 1), fraction=0.05, pad=0.02)
    cb.set_label("exponent bits")
    ax.set_title(title or "Recommended gradient formats per layer (predicted SNR; scale = power of two)",
                 pad=28, fontsize="medium")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- pruning on the run
#: threshold rules checked on the run's samples (the pruning module's rules plus the sort oracle)
SPARSITY_RULES = ("lognormal", "naive_lognormal", "normal", "laplace", "exact_stochastic")
SPARSITY_TARGETS = (0.5, 0.7, 0.8, 0.85, 0.9, 0.95)


def sparsity_check(run: Any, *, targets: Sequence[float] = SPARSITY_TARGETS, rules: Sequence[str] = SPARSITY_RULES,
                   steps: Sequence[int] | None = None, layers: str | Sequence[str] | None = None,
                   seed: int = 0) -> Any:
    """Achieved sparsity of stochastic pruning per threshold rule on the run's raw gradient samples.

    For each sampled layer and step, every rule sets its threshold from the sample's own
    statistics (:func:`gradstats.pruning.threshold`; ``exact_stochastic``: the sort oracle
    :func:`gradstats.pruning.exact_threshold`), :func:`gradstats.pruning.stochastic_prune`
    prunes the sample, and the fraction of zeros is measured. Also the measured cosine
    similarity between the sample and its pruned copy, and the one the lognormal model predicts
    at that threshold (:func:`gradstats.pruning.predicted_cosine`). Returns a DataFrame with
    columns ``layer, step, rule, target, threshold, achieved, cosine, predicted_cosine, p0, sigma``
    (``sigma`` of ``ln|g|``).

    Example:
        >>> import gradstats
        >>> t = sparsity_check(gradstats.data.data_dir() / "sample-run", targets=[0.9], rules=["lognormal"],
        ...                    steps=[0], layers="conv2")
        >>> abs(float(t["achieved"][0]) - 0.9) < 0.02
        True
    """
    import pandas as pd
    import torch

    from .. import pruning
    from ..stats import lognormal_moments, tensor_stats

    run = _open(run)
    if steps is None:
        steps = sampled_steps(run, "grad")
    if not steps:
        raise ValueError(f"the run at {run.path} kept no raw gradient samples: pruning cannot be measured")
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for name in _layers(run, layers, cap=None):
        for s in steps:
            x = layer_values(run, name, int(s), "grad")
            if x is None:
                continue
            st = tensor_stats(x)
            mu, sigma = lognormal_moments(st)
            if not (math.isfinite(sigma) and sigma > 0):
                continue
            p0 = int(st["n_zero"]) / max(int(st["n"]), 1)
            norm = float(x.double().square().sum().sqrt())
            for rule in rules:
                for S in targets:
                    if rule == "exact_stochastic":
                        a = pruning.exact_threshold(x, S, stochastic=True)
                    else:
                        a = float(pruning.threshold(S, st, model=rule))
                    y = pruning.stochastic_prune(x, a, generator=gen) if a > 0 else x
                    cos = float((x.double() * y.double()).sum()) / (norm * float(y.double().square().sum().sqrt()))
                    rows.append({"layer": name, "step": int(s), "rule": rule, "target": float(S), "threshold": a,
                                 "achieved": float((y == 0).double().mean()), "cosine": cos,
                                 "predicted_cosine": float(pruning.predicted_cosine(a, mu=mu, sigma=sigma)),
                                 "p0": p0, "sigma": sigma})
    return pd.DataFrame(rows, columns=["layer", "step", "rule", "target", "threshold", "achieved", "cosine",
                                       "predicted_cosine", "p0", "sigma"])


def plot_sparsity_check(run_or_table: Any, **kw: Any) -> Any:
    """Achieved against target sparsity per threshold rule on the run's gradients
    (:func:`gradstats.plots.pruning.plot_achieved_vs_target` of :func:`sparsity_check`).

    Example:
        >>> import gradstats
        >>> fig = plot_sparsity_check(gradstats.data.data_dir() / "sample-run", steps=[0], targets=[0.5, 0.9])
        >>> fig.axes[0].get_xlabel()
        'target sparsity'
    """
    import pandas as pd

    from .pruning import plot_achieved_vs_target

    table = run_or_table if isinstance(run_or_table, pd.DataFrame) else sparsity_check(run_or_table, **kw)
    if table.empty:
        raise ValueError("no layer with raw gradient samples: nothing to draw")
    # where the exact zeros alone reach the target no rule has anything to do (achieved = p0)
    t = table[table["p0"] < table["target"]]
    if t.empty:
        raise ValueError("the exact zeros exceed every target sparsity: nothing to prune")
    nl, ns = t["layer"].nunique(), t["step"].nunique()
    left = len(table.drop_duplicates(["layer", "step", "target"])) - len(t.drop_duplicates(["layer", "step", "target"]))
    fig = plot_achieved_vs_target(t, title=f"Achieved vs target sparsity per threshold rule\n"
                                           f"({nl} layers x {ns} sampled steps of the run; points: layers, "
                                           f"lines: means)")
    if left:
        fig.axes[0].text(0.98, 0.02, f"{left} (layer, step, target) cases left out:\n"
                         "the exact zeros alone exceed the target",
                         transform=fig.axes[0].transAxes, ha="right", va="bottom", fontsize="x-small", color="0.3")
    return fig


def plot_cosine_check(run_or_table: Any, *, rule: str = "lognormal", **kw: Any) -> Any:
    """What pruning costs, predicted against measured: ``1 - cos(g, T(g))`` between each sampled
    gradient and its stochastic pruning at the ``rule``'s threshold for each target sparsity, as
    the lognormal closed form predicts it (:func:`gradstats.pruning.predicted_cosine`, x) and as
    measured on the run's samples (y), log-log. Points on the diagonal: the model predicts the
    cost; above it: pruning costs more than predicted (typically a layer whose largest gradients
    are bounded, so the upper tail is lighter than lognormal). One colour per layer; larger
    markers for higher targets.

    Example:
        >>> import gradstats
        >>> fig = plot_cosine_check(gradstats.data.data_dir() / "sample-run", steps=[0], layers=["conv2"])
        >>> fig.axes[0].get_xscale(), fig.axes[0].get_yscale()
        ('log', 'log')
    """
    import matplotlib.pyplot as plt
    import pandas as pd

    table = run_or_table if isinstance(run_or_table, pd.DataFrame) else sparsity_check(
        run_or_table, rules=[rule], **kw)
    t = table[(table["rule"] == rule) & (table["threshold"] > 0)].copy()
    if t.empty:
        raise ValueError(f"no pruned case of rule {rule!r}: nothing to draw")
    floor = 1e-9  # below this the cost is nil for training purposes; clipped points are marked
    t["pred"] = (1.0 - t["predicted_cosine"]).clip(lower=floor)
    t["meas"] = (1.0 - t["cosine"]).clip(lower=floor)
    clipped = (1.0 - t["predicted_cosine"]) < floor
    names = list(dict.fromkeys(t["layer"]))
    colors = dict(zip(names, _layer_palette(len(names))))
    targets = sorted(t["target"].unique())
    size = {S: 14 + 46 * i / max(len(targets) - 1, 1) for i, S in enumerate(targets)}
    use_style()
    fig, ax = plt.subplots(figsize=(8.2, 5.6))
    for name in names:
        for clip, marker in ((False, "o"), (True, "<")):
            g = t[(t["layer"] == name) & (clipped == clip)]
            if len(g):
                ax.scatter(g["pred"], g["meas"], s=g["target"].map(size), marker=marker, color=colors[name],
                           edgecolor="black", lw=0.4, alpha=0.85, label=None if clip else name, zorder=3)
    lo, hi = floor / 3, 3.0
    ax.plot([lo, hi], [lo, hi], color="black", lw=0.8, ls="--", label="measured = predicted")
    ax.plot([lo, hi], [lo * 10, hi * 10], color="0.55", lw=0.7, ls=":", label="x10 and x0.1")
    ax.plot([lo, hi], [lo / 10, hi / 10], color="0.55", lw=0.7, ls=":")
    if clipped.any():
        ax.scatter([], [], marker="<", color="0.6", edgecolor="black", lw=0.4,
                   label=f"predicted < {floor:g} (drawn at {floor:g})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted 1 - cosine (lognormal model)")
    ax.set_ylabel("measured 1 - cosine on the run's samples")
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.02, 1.0),
              title=f"layer\n(marker size: target\nsparsity {targets[0]:g}..{targets[-1]:g})", title_fontsize="x-small")
    ax.set_title(f"Cost of stochastic pruning ({rule} thresholds):\npredicted vs measured "
                 f"({t['step'].nunique()} sampled steps)", fontsize="medium")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- all figures
def write_figures(run: Any, out_dir: str | os.PathLike[str], *, plans: Mapping[int, Any] | None = None,
                  only: Iterable[str] | None = None, progress: bool = False) -> dict[str, Any]:
    """Write every figure of a run as PNG files into ``out_dir``; returns ``{name: path}``.

    ``plans``: ``{bits: Plan}`` for the format figures (default: ``recommend(run, bits=[8, 6, 4])``).
    ``only``: names of :data:`FIGURES` to write (default all). A figure that cannot be drawn for
    this run (e.g. the pruning checks of a run without raw samples) is skipped with a warning.

    Example:
        >>> import tempfile, gradstats
        >>> out = write_figures(gradstats.data.data_dir() / "sample-run", tempfile.mkdtemp(), only=["moments"])
        >>> out["moments"].name, out["moments"].stat().st_size > 10_000
        ('moments.png', True)
    """
    from pathlib import Path

    from tqdm.auto import tqdm

    from .style import savefig

    run = _open(run)
    names = list(FIGURES) if only is None else list(only)
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        raise ValueError(f"unknown figure names {unknown}; the figures are {list(FIGURES)}")
    ctx: dict[str, Any] = {"run": run, "plans": plans}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Any] = {}
    for name in tqdm(names, desc="figures", unit="fig", disable=not progress):
        try:
            fig = FIGURES[name][0](ctx)
        except ValueError as exc:
            log.warning("figure %s skipped: %s", name, exc)
            continue
        written[name] = savefig(fig, out_dir / f"{name}.png")
    return written


def _ctx_plans(ctx: dict[str, Any]) -> Any:
    if ctx.get("plans") is None:
        from ..recommendation import recommend

        ctx["plans"] = recommend(ctx["run"], bits=[8, 6, 4])
    return ctx["plans"]


def _ctx_sparsity(ctx: dict[str, Any]) -> Any:
    if "sparsity" not in ctx:
        ctx["sparsity"] = sparsity_check(ctx["run"])
    return ctx["sparsity"]


#: every figure :func:`write_figures` writes: name -> (function of a context, one-line caption)
FIGURES: dict[str, tuple[Any, str]] = {
    "distributions": (lambda c: plot_layer_histograms(c["run"]),
                      "histogram of log2|x| per layer: neural gradients with the three fitted densities, "
                      "activations and weights beside"),
    "qq": (lambda c: plot_qq(c["run"]), "Q-Q plot of ln|g| against the normal per layer"),
    "goodness_of_fit": (lambda c: plot_goodness_of_fit(c["run"]),
                        "KS distance per family and Vuong effect size per layer"),
    "moments": (lambda c: plot_moments_over_steps(c["run"]),
                "mean and std of log2|g| and zero fraction per layer over training"),
    "sparsity": (lambda c: plot_sparsity_check(_ctx_sparsity(c)),
                 "achieved vs target sparsity per threshold rule on the run's gradients"),
    "cosine": (lambda c: plot_cosine_check(_ctx_sparsity(c)),
               "cost of stochastic pruning (1 - cosine similarity): lognormal prediction vs measured"),
    "format_map": (lambda c: plot_format_map(_ctx_plans(c)), "recommended FP8/FP6/FP4 format per layer"),
}
