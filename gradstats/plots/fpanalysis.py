"""Figures of the floating-point format analysis: error against exponent bits at a layer's sigma,
the best exponent bits against sigma with the crossovers (beside the authors' table), per-layer
sigma with the chosen format, and predicted against measured error.

Sigma is shown as the std of log2|g| (binades); the results carry it as the API does, the std of
ln|g|. Each function draws the results it is given (:func:`gradstats.fpanalysis.best_format`,
:func:`gradstats.fpanalysis.crossover_table`, ...); the results' ``plot()`` methods and
:mod:`gradstats.figures` compute them.

Example:
    >>> import os, tempfile
    >>> from gradstats.fpanalysis import best_format
    >>> rs = [best_format(b, mu=0.0, sigma=2.0, candidates="fn", power_of_two=False) for b in (6, 8)]
    >>> fig = plot_error_vs_exponent_bits(rs, path=os.path.join(tempfile.mkdtemp(), "e.png"))
    >>> fig.axes[0].get_xlabel()
    'exponent bits E (mantissa bits M = bits - 1 - E)'
"""
from __future__ import annotations

import math
import os
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from gradstats.plots.style import LN2, savefig, use_style


def _finish(fig: Any, path: str | os.PathLike[str] | None) -> Any:
    if path is not None:
        savefig(fig, path)
    return fig


def _bit_colors(bits: Iterable[int]) -> dict[int, Any]:
    import seaborn as sns

    bits = sorted(set(bits))
    pal = sns.color_palette("viridis", max(len(bits), 2))
    return {b: pal[i] for i, b in enumerate(bits)}


def plot_error_vs_exponent_bits(results: Any, *, ax: Any = None,
                                path: str | os.PathLike[str] | None = None) -> Any:
    """Predicted relative MSE of every split of each bit width, each at its best scale, at one
    layer's sigma; the best split of each width is starred.

    ``results``: one :class:`~gradstats.fpanalysis.BestFormat` per width, all at the same single
    sigma with every split a candidate (``best_format(bits, mu=0.0, sigma=sigma, candidates="fn",
    power_of_two=False)``); the title reads the sigma, convention, rounding and scale from them.
    :func:`gradstats.figures.plot_error_vs_exponent_bits` computes them from a sigma and draws them.

    Example:
        >>> from gradstats.fpanalysis import best_format
        >>> fig = plot_error_vs_exponent_bits([best_format(8, mu=0.0, sigma=1.5, candidates="fn")])
        >>> fig.axes[0].get_yscale()
        'log'
    """
    import matplotlib.pyplot as plt

    if isinstance(results, (int, float)):
        raise TypeError(f"plot_error_vs_exponent_bits draws best_format results, got the number {results!r}; "
                        f"to compute them from a sigma and draw them, call "
                        f"gradstats.figures.plot_error_vs_exponent_bits({results!r})")
    results = list(results)
    if not results:
        raise ValueError("no best-format result to draw")
    use_style()
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.0, 4.4))
    else:
        fig = ax.figure
    bits = [int(r.bits) for r in results]
    colors = _bit_colors(bits)
    for b, r in zip(bits, results):
        e = [c.exp_bits for c in r.candidates]
        ax.plot(e, r.errors, marker="o", ms=4, color=colors[b], label=f"FP{b}")
        best = r.order[0]
        ax.plot([e[best]], [r.errors[best]], marker="*", ms=14, color=colors[b], mec="black", mew=0.6,
                ls="none")
    first = results[0]
    sigma = float(np.ravel(first.sigma)[0])
    special, rounding, power_of_two = first.candidates[0].special, first.rounding, first.power_of_two
    ax.set_yscale("log")
    ax.set_xlabel("exponent bits E (mantissa bits M = bits - 1 - E)")
    ax.set_ylabel("relative MSE = MSE / E[g²] (log scale)")
    ax.set_xticks(range(1, max(bits) - 1))
    scale = "power-of-two" if power_of_two else "best"
    ax.set_title(f"Lognormal gradients, σ = {sigma / LN2:.2f} (std of log2|g|, binades)\n"
                 f"{special} formats, {rounding} rounding, {scale} scale per split; ★ = best split",
                 fontsize="medium")
    ax.legend(title="width", fontsize="small")
    return _finish(fig, path)


def plot_optimal_exponent_bits(table: Any, *, authors: Optional[Sequence[Sequence[float]]] = None,
                               path: str | os.PathLike[str] | None = None) -> Any:
    """Best exponent bits against sigma (std of log2|g|), one panel per bit width, as a step function
    with the crossovers marked; a reference table (dashed, e.g. the authors') beside ours where it
    has that width. ``table``: a :class:`~gradstats.fpanalysis.CrossoverTable` (its ``ranges`` and
    ``assumptions``); ``authors``: rows ``(bits, exp_bits, sigma_lo, sigma_hi)`` such as
    :data:`gradstats.fpanalysis.AUTHORS_TABLE` (``CrossoverTable.plot()`` passes it), or None.

    Example:
        >>> from gradstats.fpanalysis import AUTHORS_TABLE, crossover_table
        >>> fig = plot_optimal_exponent_bits(crossover_table(bits=[6], sigma_max=4.0), authors=AUTHORS_TABLE)
        >>> fig.axes[-1].get_xlabel()
        'σ = std of log2|g| (binades)'
    """
    import matplotlib.pyplot as plt

    if authors is True:
        raise ValueError("authors: pass the rows (gradstats.fpanalysis.AUTHORS_TABLE), or draw with table.plot()")
    reference = list(authors) if authors else []
    use_style()
    rows = list(table.ranges)
    bits = sorted({r["bits"] for r in rows}, reverse=True)
    colors = _bit_colors(bits)
    _, hi_s = table.assumptions["sigma_range"]
    fig, axes = plt.subplots(len(bits), 1, figsize=(7.0, 0.6 + 1.45 * len(bits)), sharex=True, squeeze=False)
    for ax, b in zip(axes[:, 0], bits):
        mine = [r for r in rows if r["bits"] == b]
        xs, ys = [], []
        for r in mine:
            xs += [r["sigma_lo"], r["sigma_hi"]]
            ys += [r["exp_bits"]] * 2
        ax.plot(xs, ys, color=colors[b], lw=2.4, label="ours")
        for r in mine[1:]:
            ax.axvline(r["sigma_lo"], color=colors[b], lw=0.7, ls=":")
            ax.annotate(f"{r['sigma_lo']:.2f}", (r["sigma_lo"], r["exp_bits"] - 0.5), fontsize=7,
                        color="0.25", ha="left", va="center", xytext=(3, 0), textcoords="offset points")
        theirs = [t for t in reference if t[0] == b]
        if theirs:
            for k, (_, e, lo, hi) in enumerate(theirs):
                ax.plot([lo, min(hi, hi_s)], [e + 0.25] * 2, color="black", lw=1.4, ls="--",
                        label="authors' table" if k == 0 else None)
                ax.annotate(f"{lo:g}", (lo, e + 0.25), fontsize=7, ha="right", va="bottom",
                            xytext=(-2, 1), textcoords="offset points")
            ax.legend(fontsize="x-small", loc="lower right")
        es = [r["exp_bits"] for r in mine]
        ax.set_ylim(min(es) - 0.8, max(es) + 0.7)
        ax.set_yticks(range(min(es), max(es) + 1))
        ax.set_ylabel(f"FP{b}: E", fontsize="small")
    axes[-1, 0].set_xlim(0, hi_s)
    axes[-1, 0].set_xlabel("σ = std of log2|g| (binades)")
    a = table.assumptions
    axes[0, 0].set_title(f"Best exponent bits E vs σ ({a['convention']}, "
                         f"{'subnormals' if a['subnormals'] else 'no subnormals'}, {a['rounding']} rounding,\n"
                         f"{a['scale']})", fontsize="small")
    return _finish(fig, path)


def plot_layer_formats(best: Any, *, crossovers: Any = None, ax: Any = None,
                       path: str | os.PathLike[str] | None = None) -> Any:
    """Per-layer sigma (std of log2|g|) with the format :func:`~gradstats.fpanalysis.best_format`
    chose, one row per layer; the sigma ranges where each split is best (continuous scale, this
    width: the ``ranges`` of the :class:`~gradstats.fpanalysis.CrossoverTable` ``crossovers``) are
    shaded behind. Layers far to the right are where low precision struggles. A layer whose
    format is not that of the band at its sigma is ringed in red, and the title says why when the
    result was ranked given the layers' observed maximum (``best.amax``): the maximum bounds the
    upper tail that the bands, drawn for an unbounded lognormal, assume.
    ``BestFormat.plot()`` computes the table for the layers' sigma range.

    Example:
        >>> from gradstats.fpanalysis import best_format, crossover_table
        >>> b = best_format(8, mu=[-9.0, -12.0], sigma=[1.0, 2.5], names=["fc1", "conv1"])
        >>> fig = plot_layer_formats(b, crossovers=crossover_table(bits=[8], sigma_max=4.2))
        >>> [t.get_text() for t in fig.axes[0].get_yticklabels()]
        ['fc1', 'conv1']
    """
    import matplotlib.pyplot as plt
    import seaborn as sns

    if crossovers is True:
        raise ValueError("crossovers: pass the CrossoverTable to shade (gradstats.figures.crossovers_for(best) makes the one over the layers' sigma range)")
    use_style()
    sig = np.atleast_1d(np.asarray(best.sigma, dtype=np.float64)) / LN2
    n = sig.size
    names = list(best.names) if best.names else [str(i) for i in range(n)]
    fmts = best.format if isinstance(best.format, list) else [best.format]
    errs = np.atleast_1d(np.asarray(best.error, dtype=np.float64))
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.6 + 0.075 * max(map(len, names)), 0.9 + 0.28 * n))
    else:
        fig = ax.figure
    cand = [str(c) for c in best.candidates]
    pal = dict(zip(cand, sns.color_palette("colorblind", len(cand))))
    xmax = max(float(sig.max()) * 1.15, 1.0)
    if crossovers is not None and crossovers is not False:
        for r in crossovers.ranges:
            c = pal.get(r["format"], (0.9, 0.9, 0.9))
            right = xmax * 1.15 if r["open_end"] else r["sigma_hi"]
            ax.axvspan(r["sigma_lo"], right, color=c, alpha=0.12, lw=0)
            if right - r["sigma_lo"] > 0.09 * xmax:
                ax.text(0.5 * (r["sigma_lo"] + right), -0.9, r["format"], ha="center", va="bottom",
                        fontsize=7, color="0.3")
    bands = list(crossovers.ranges) if crossovers is not None and crossovers is not False else []

    def band_of(x: float) -> str | None:
        for r in bands:
            if r["sigma_lo"] <= x < r["sigma_hi"] or (r["open_end"] and x >= r["sigma_lo"]):
                return str(r["format"])
        return None

    y = np.arange(n)
    ringed = 0
    for i in range(n):
        f = str(fmts[i])
        ax.plot([sig[i]], [y[i]], "o", ms=7, color=pal.get(f, "black"), mec="black", mew=0.4)
        if bands and band_of(sig[i]) not in (None, f):   # outside the band of its own format
            ax.plot([sig[i]], [y[i]], "o", ms=12, mfc="none", mec="#d7301f", mew=1.4)
            ringed += 1
        ax.annotate(f"{f}  {-10 * math.log10(errs[i]):.0f} dB", (sig[i], y[i]), xytext=(8, 0),
                    textcoords="offset points", va="center", fontsize=7)
    ax.set_yticks(y, names)
    ax.set_ylim(n - 0.5, -1.2)
    ax.set_xlim(0, xmax * 1.15)
    ax.set_xlabel("σ = std of log2|g| (binades)")
    scale = f"blocks of {best.block_size}, {best.scale_format} scales" if best.block_size else \
        ("power-of-two scale" if best.power_of_two else "best scale")
    title = f"FP{best.bits}: each layer's σ and chosen format ({scale}; dB: SNR = -10 log10 rel. MSE)"
    if ringed:
        why = ":\nthe observed maximum bounds the upper tail that the bands assume" if getattr(best, "amax", None) is not None else ""
        title += f"\nringed ({ringed}): outside the band of the layer's own format{why}"
    ax.set_title(title, fontsize="small")
    return _finish(fig, path)


def plot_predicted_vs_measured(table: Any, *, hue: str = "model", style: Optional[str] = None,
                               predicted: str = "predicted_error",
                               measured: str = "measured_at_predicted", ax: Any = None,
                               title: Optional[str] = None, path: str | os.PathLike[str] | None = None) -> Any:
    """Predicted against measured error per layer (log-log), the diagonal and a factor-2 band;
    ``table``: a DataFrame with the two error columns, ``hue`` (colour, e.g. the model) and
    optionally ``style`` (marker, e.g. the prediction variant).

    Example:
        >>> import pandas as pd
        >>> t = pd.DataFrame({"model": ["cnn", "mlp"], "predicted_error": [1e-3, 2e-4],
        ...                   "measured_at_predicted": [1.1e-3, 2e-4]})
        >>> plot_predicted_vs_measured(t).axes[0].get_xscale()
        'log'
    """
    import matplotlib.pyplot as plt
    import seaborn as sns

    use_style()
    if ax is None:
        fig, ax = plt.subplots(figsize=(5.4, 5.0))
    else:
        fig = ax.figure
    p = np.asarray(table[predicted], dtype=np.float64)
    m = np.asarray(table[measured], dtype=np.float64)
    ok = np.isfinite(p) & np.isfinite(m) & (p > 0) & (m > 0)
    lo, hi = float(min(p[ok].min(), m[ok].min())) / 2, float(max(p[ok].max(), m[ok].max())) * 2
    xs = np.array([lo, hi])
    ax.plot(xs, xs, color="black", lw=0.8, label="predicted = measured")
    ax.fill_between(xs, xs / 2, xs * 2, color="0.85", alpha=0.6, lw=0, label="within a factor 2")
    cols = getattr(table, "columns", ())
    groups = list(dict.fromkeys(table[hue])) if hue in cols else [None]
    styles = list(dict.fromkeys(table[style])) if style is not None and style in cols else [None]
    pal = sns.color_palette("colorblind", max(len(groups), 1))
    markers = ["o", "^", "s", "D", "v", "P"]
    for k, st in enumerate(styles):
        for i, g in enumerate(groups):
            sel = ok.copy()
            if g is not None:
                sel &= np.asarray(table[hue]) == g
            if st is not None:
                sel &= np.asarray(table[style]) == st
            if not sel.any():
                continue
            label = " ".join(str(v) for v in (g, st) if v is not None) or None
            ax.scatter(m[sel], p[sel], s=18, alpha=0.8, color=pal[i], marker=markers[k % len(markers)],
                       lw=0.3 if k else 0, edgecolors="black" if k else "none", label=label,
                       zorder=3 + len(styles) - k)   # the first style on top
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured relative MSE (quantize on the layer's gradient)")
    ax.set_ylabel("predicted relative MSE")
    ax.set_title(title or "Predicted vs measured quantisation error per layer", fontsize="medium")
    ax.legend(fontsize="x-small" if len(groups) * len(styles) > 6 else "small", loc="upper left")
    return _finish(fig, path)


__all__ = ["plot_error_vs_exponent_bits", "plot_optimal_exponent_bits", "plot_layer_formats",
           "plot_predicted_vs_measured"]


def plot_weight_alignment(results: Any, *, path: str | os.PathLike[str] | None = None) -> Any:
    """``|cos(w_c, dL/dw_c)|`` per layer: each channel a point, the layer's mean a bar; 0 is the
    exact gradient of a layer that feeds a BatchNorm. ``results``: one
    :class:`~gradstats.fpanalysis.AlignmentResult`, or a dict ``label -> result`` (one group of
    bars per label, e.g. the baseline beside plans).

    Example:
        >>> import torch
        >>> from gradstats.fpanalysis import weight_gradient_alignment
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4))
        >>> net(torch.ones(2, 3)).sum().backward()
        >>> plot_weight_alignment(weight_gradient_alignment(net)).axes[0].get_ylabel()
        '|cos(w_c, dL/dw_c)| per channel'
    """
    import matplotlib.pyplot as plt

    use_style()
    groups = results if isinstance(results, dict) else {"": results}
    layers = list(dict.fromkeys(n for r in groups.values() for n in r.layers))
    k = len(groups)
    width = 0.8 / k
    colors = plt.get_cmap("tab10").colors
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(layers) * max(k, 1) ** 0.5 + 2.5), 3.6))
    for j, (label, r) in enumerate(groups.items()):
        for i, n in enumerate(layers):
            if n not in r.cos:
                continue
            c = np.asarray(r.cos[n], float)
            c = c[np.isfinite(c)]
            x = i - 0.4 + width * (j + 0.5)
            ax.bar(x, float(c.mean()) if c.size else 0.0, width=width * 0.9, color=colors[j % 10], alpha=0.35,
                   label=label if (label and i == 0) else None)
            jitter = np.linspace(-0.3, 0.3, c.size) * width if c.size > 1 else np.zeros(c.size)
            ax.scatter(x + jitter, c, s=7, color=colors[j % 10], zorder=3)
    ax.set_xticks(range(len(layers)), layers, rotation=30, ha="right")
    ax.set_ylabel("|cos(w_c, dL/dw_c)| per channel")
    ax.set_ylim(0, 1)
    ax.set_title("Weight-gradient alignment (0: exact, for layers feeding a BatchNorm)")
    if any(groups):
        ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    if path is not None:
        savefig(fig, path)
    return fig


def plot_what_if(table: Any, *, value: str = "underflow", path: str | os.PathLike[str] | None = None) -> Any:
    """Heat maps of a :func:`gradstats.what_if` table: one panel per format, layers (rows, in the
    table's order) over training steps (columns), coloured by ``value`` (``"underflow"``,
    ``"overflow"``, ``"rel_mse"`` on a log scale, or ``"bias"``, diverging around 0).

    Example:
        >>> import gradstats
        >>> df = gradstats.what_if(gradstats.zoo.data.data_dir() / "sample-run", ["e4m3fn", "e2m1fn"], layers="conv*")
        >>> [a.get_title() for a in plot_what_if(df).axes if a.get_title()]
        ['e4m3fn', 'e2m1fn']
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm, TwoSlopeNorm

    use_style()
    labels = {"underflow": "non-zero entries flushed to zero", "overflow": "entries saturated",
              "rel_mse": "relative MSE", "bias": "magnitude bias"}
    if value not in labels:
        raise ValueError(f"value must be one of {list(labels)}, got {value!r}")
    if not len(table):
        raise ValueError("the what_if table is empty: nothing to draw")
    formats = list(dict.fromkeys(table["format"]))
    layers = list(dict.fromkeys(table["layer"]))
    steps = sorted(table["step"].unique())
    grids = []
    for f in formats:
        sub = table[table["format"] == f].pivot_table(index="layer", columns="step", values=value, aggfunc="mean")
        grids.append(sub.reindex(index=layers, columns=steps).to_numpy(float))
    allv = np.concatenate([g[np.isfinite(g)] for g in grids]) if grids else np.zeros(0)
    if value == "rel_mse":
        pos = allv[allv > 0]
        norm, cmap = LogNorm(vmin=float(pos.min()) if pos.size else 1e-6, vmax=float(pos.max()) if pos.size else 1.0), "viridis"
    elif value == "bias":
        m = float(np.max(np.abs(allv))) if allv.size else 1.0
        norm, cmap = TwoSlopeNorm(vcenter=0.0, vmin=-max(m, 1e-9), vmax=max(m, 1e-9)), "RdBu"
    else:
        norm, cmap = plt.Normalize(0.0, max(float(allv.max()) if allv.size else 1.0, 1e-9)), "magma_r"
    k = len(formats)
    fig, axes = plt.subplots(1, k, figsize=(min(4.0 + 3.2 * k, 18), 0.9 + 0.32 * len(layers) + 1.2),
                             sharey=True, squeeze=False)
    im = None
    for ax, f, g in zip(axes[0], formats, grids):
        im = ax.imshow(np.where(np.isfinite(g), g, np.nan), aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
        ax.set_title(f)
        ax.grid(False)
        tick = max(1, len(steps) // 6)
        ax.set_xticks(range(0, len(steps), tick), [str(s) for s in steps[::tick]])
        ax.set_xlabel("step")
    axes[0][0].set_yticks(range(len(layers)), layers)
    blocks = table["block_size"].dropna().unique() if "block_size" in table else []
    how = f"blocks of {int(blocks[0])}" if len(blocks) else "per tensor"
    rounding = table["rounding"].iloc[0] if "rounding" in table else ""
    fig.suptitle(f"What if: {labels[value]} ({how}, {rounding} rounding; from the run's statistics)", fontsize=10)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.9, label=labels[value])
    if path is not None:
        savefig(fig, path)
    return fig
