"""Figures of what the analysis recommends for a run, checked against the run: the per-layer map of
recommended formats, each layer against the sigma ranges where each split is best, error against
exponent bits at the narrowest and widest layer, achieved against target sparsity per threshold
rule, and the cost of pruning predicted against measured.

Each function draws the plans, results or table it is given; :mod:`gradstats.figures` computes
them from a run (the plans of :func:`gradstats.recommend`, the tables of :mod:`gradstats.study`).

Example:
    >>> import gradstats
    >>> fig = plot_format_map(gradstats.recommend_each(gradstats.zoo.data.data_dir() / "sample-run", bits=[8, 4]))
    >>> [t.get_text() for t in fig.axes[0].get_xticklabels()]
    ['FP8', 'FP4']
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from gradstats.plots.style import LN2, layer_styles, legend_columns, use_style


def _prediction(entry: Any) -> Any:
    """The entry's prediction (an object with ``error``, ``sigma``, ``scale``...), or None."""
    pr = getattr(entry, "predicted", None)
    return pr if pr is not None and hasattr(pr, "error") and hasattr(pr, "sigma") else None


def plot_format_map(plans: Any, *, measured: Any = None, title: str | None = None) -> Any:
    """A per-layer map of the recommended formats: one row per layer, one column per bit width;
    each cell names the chosen ``ExMy`` format and its power-of-two scale, coloured by its
    exponent bits, with the predicted signal-to-quantisation-noise ratio
    (``-10 log10(MSE / E[g^2])``), one short line each, so that a cell's text stays in its cell. The row labels give each layer's std of ``log2|g|``: wider
    layers need more exponent bits.

    ``plans``: ``{bits: Plan}`` as :func:`gradstats.recommend` returns for a list of widths, or one
    :class:`~gradstats.plan.Plan` (any object with ``entries`` of ``layer``, ``format``,
    ``predicted``). ``measured``: optional table of :func:`gradstats.study.error_check` (columns
    ``layer, bits, measured``): each cell then also gives, on a third line, the SNR measured on the run's samples,
    and a cell whose measured error is over twice the prediction (or whose values are all lost) is
    outlined in red.

    Example:
        >>> import gradstats
        >>> plans = gradstats.recommend_each(gradstats.zoo.data.data_dir() / "sample-run", bits=[8, 6, 4])
        >>> fig = plot_format_map(plans)
        >>> [t.get_text() for t in fig.axes[0].get_xticklabels()]
        ['FP8', 'FP6', 'FP4']
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Rectangle

    from gradstats.formats import FPFormat

    if not isinstance(plans, Mapping) and hasattr(plans, "entries"):
        widths = sorted({e.format.bits for e in plans.entries if isinstance(e.format, FPFormat)}, reverse=True)
        if len(widths) != 1:
            raise ValueError("a single plan must hold formats of one width; pass {bits: plan} for several")
        plans = {widths[0]: plans}
    if not isinstance(plans, Mapping) or not plans:
        raise ValueError("plans must be {bits: Plan} (as recommend_each(run, bits=[8, 6, 4]) returns) or one Plan")
    widths = list(plans)
    meas: dict[tuple[str, int], float] = {}
    if measured is not None and len(measured):
        last = measured[measured["step"] == measured["step"].max()] if "step" in measured else measured
        meas = {(str(r["layer"]), int(r["bits"])): float(r["measured"]) for r in last.to_dict("records")}
    layers: list[str] = []
    for p in plans.values():
        layers += [e.layer for e in p.entries if e.layer not in layers]
    cell: dict[tuple[str, int], Any] = {}
    sigma: dict[str, float] = {}
    for b, p in plans.items():
        for e in p.entries:
            cell[(e.layer, b)] = e
            pr = _prediction(e)
            if pr is not None and pr.sigma is not None:
                sigma.setdefault(e.layer, pr.sigma / LN2)
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
    longest = max(map(len, layers)) + (18 if sigma else 0)
    fig, ax = plt.subplots(figsize=(2.0 * len(widths) + 1.6 + 0.075 * longest, (0.72 if meas else 0.56) * len(layers) + 1.6))
    im = ax.imshow(np.ma.masked_invalid(ebits), cmap=cmap, norm=norm, aspect="auto")
    for i, name in enumerate(layers):
        for j, b in enumerate(widths):
            e = cell.get((name, b))
            if e is None or not isinstance(e.format, FPFormat):
                ax.text(j, i, "-", ha="center", va="center")
                continue
            pr = _prediction(e)
            txt = str(e.format)
            if pr is not None and pr.scale:
                txt += f"  x2^{int(round(math.log2(pr.scale)))}"
            # one short line each (format and scale, predicted, measured): a cell's text stays in its cell
            if pr is not None and pr.error:
                txt += f"\npredicted {-10 * math.log10(pr.error):.1f} dB"
            m = meas.get((name, int(b)))
            if m is not None:
                snr = -10 * math.log10(m) if m > 0 else math.inf
                txt += "\nmeasured exact" if m == 0 else f"\nmeasured {0.0 if abs(snr) < 0.05 else snr:.1f} dB"
                if m >= 0.99 or (pr is not None and pr.error and m > 2 * pr.error):
                    ax.add_patch(Rectangle((j - 0.47, i - 0.45), 0.94, 0.9, fill=False, ec="#d7301f", lw=2.5))
            dark = np.isfinite(ebits[i, j]) and ebits[i, j] >= 0.6 * emax
            ax.text(j, i, txt, ha="center", va="center", fontsize="x-small", color="white" if dark else "black",
                    linespacing=1.15)
    ax.set_xticks(range(len(widths)))
    ax.set_xticklabels([f"FP{b}" for b in widths])
    ax.set_yticks(range(len(layers)))
    ax.set_yticklabels([f"{n}  (std log2 {sigma[n]:.2f})" if n in sigma else n for n in layers])
    ax.xaxis.tick_top()
    ax.grid(False)
    cb = fig.colorbar(im, ax=ax, ticks=range(1, emax + 1), fraction=0.05, pad=0.02)
    cb.set_label("exponent bits")
    what = "predicted" + (" and measured" if meas else "")
    ax.set_title(title or f"Recommended gradient formats per layer ({what} SNR; scale = power of two)"
                 + ("\nred outline: measured error over twice the prediction, or every value lost" if meas else ""),
                 pad=28, fontsize="medium")
    fig.tight_layout()
    return fig


def plot_layer_format_ranges(best: Mapping[int, Any], *, crossovers: Mapping[int, Any] | None = None) -> Any:
    """Per bit width (rows), each planned layer's std of ``log2|g|`` with its chosen format, over the
    sigma ranges where each split is best (:func:`gradstats.plots.fpanalysis.plot_layer_formats`
    per width).

    ``best``: ``{bits: BestFormat}`` (:func:`gradstats.fpanalysis.best_format` at the plans' ``mu``,
    ``sigma``, ``p0``); ``crossovers``: ``{bits: CrossoverTable}`` of the bands behind each row
    (a width without one is drawn without bands): where each of the candidates is best for an
    unbounded lognormal (:func:`gradstats.figures.format_bands`), as the caption says. A layer
    outside the band of its own format is ringed.

    Example:
        >>> from gradstats.fpanalysis import best_format
        >>> b = {w: best_format(w, mu=[-9.0, -12.0], sigma=[1.0, 2.5], names=["fc1", "conv1"]) for w in (8, 4)}
        >>> len(plot_layer_format_ranges(b).axes)
        2
    """
    import matplotlib.pyplot as plt

    from gradstats.plots.fpanalysis import plot_layer_formats

    if not best:
        raise ValueError("no best-format result to draw")
    crossovers = crossovers or {}
    first = next(iter(best.values()))
    n = np.atleast_1d(np.asarray(first.sigma)).size
    use_style()
    import textwrap

    names = first.names or [str(i) for i in range(n)]
    width = 7.4 + 0.075 * max(map(len, names))
    caption = textwrap.fill("Shaded bands: where each of the plan's formats is the best of them for an unbounded "
                            "lognormal of that σ. Dots: each layer's choice as recommend makes it, given its "
                            "observed maximum (a bounded upper tail needs fewer exponent bits).",
                            int(width * 11)) if any(crossovers.values()) else ""
    foot = 0.12 + 0.17 * (caption.count("\n") + 1) if caption else 0.0
    fig, axes = plt.subplots(len(best), 1, figsize=(width,
                                                    len(best) * (1.5 + 0.3 * n) + 0.4 + foot),
                             squeeze=False, sharex=True)
    for ax, b in zip(axes[:, 0], best):
        # the dots: each layer's choice given its observed maximum, as recommend makes it (ranked
        # among the formats the plan's layers hold: its candidates, e.g. only formats that exist);
        # the bands: the sigma ranges where each split is best for an unbounded lognormal
        plot_layer_formats(best[b], crossovers=crossovers.get(b), ax=ax)
        if ax is not axes[-1, 0]:
            ax.set_xlabel("")
    if caption:   # below the last axis label, inside the layout
        axes[-1, 0].annotate(caption, (0.5, 0.0), xycoords="axes fraction", xytext=(0, -40), textcoords="offset points",
                             ha="center", va="top", fontsize="x-small", color="0.25")
    fig.tight_layout()
    return fig


def plot_error_vs_bits_for_layers(panels: Any) -> Any:
    """Predicted error of every exponent/mantissa split, FP4 to FP8, at the sigma of the planned
    layer with the narrowest and of the one with the widest gradients (two panels of
    :func:`gradstats.plots.fpanalysis.plot_error_vs_exponent_bits`).

    ``panels``: ``[(layer, [BestFormat per width])]`` (or a mapping ``{layer: [...]}``), the
    narrowest layer first, then the widest; each result at that layer's sigma, every split ranked.

    Example:
        >>> from gradstats.fpanalysis import best_format
        >>> at = lambda s: [best_format(b, mu=0.0, sigma=s, candidates="fn", power_of_two=False) for b in (6, 8)]
        >>> len(plot_error_vs_bits_for_layers([("fc1", at(1.0)), ("conv1", at(2.0))]).axes)
        2
    """
    import matplotlib.pyplot as plt

    from gradstats.plots.fpanalysis import plot_error_vs_exponent_bits

    panels = list(panels.items()) if isinstance(panels, Mapping) else list(panels)
    if not panels:
        raise ValueError("no layer to draw")
    use_style()
    fig, axes = plt.subplots(1, len(panels), figsize=(6.6 * len(panels), 4.8), squeeze=False, sharey=True)
    for ax, (name, results), what in zip(axes[0], panels, ("narrowest", "widest")):
        plot_error_vs_exponent_bits(results, ax=ax)
        ax.set_title(f"{name} ({what} gradients of the plan)\n" + ax.get_title(), fontsize="small")
    fig.tight_layout()
    return fig


def plot_sparsity_check(table: Any) -> Any:
    """Achieved against target sparsity per threshold rule on the run's gradients
    (:func:`gradstats.plots.pruning.plot_achieved_vs_target` of the table of
    :func:`gradstats.study.sparsity_check`: columns ``layer, step, rule, target, achieved, p0``).

    Example:
        >>> import pandas as pd
        >>> t = pd.DataFrame({"layer": ["a", "a"], "step": [0, 0], "rule": ["lognormal"] * 2,
        ...                   "target": [0.5, 0.9], "achieved": [0.5, 0.89], "p0": [0.1, 0.1]})
        >>> fig = plot_sparsity_check(t)
        >>> fig.axes[0].get_xlabel()
        'target sparsity'
    """
    from gradstats.plots.pruning import plot_achieved_vs_target

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


def plot_cosine_check(table: Any, *, rule: str = "lognormal") -> Any:
    """What pruning costs, predicted against measured: ``1 - cos(g, T(g))`` between each sampled
    gradient and its stochastic pruning at the ``rule``'s threshold for each target sparsity, as
    the lognormal closed form predicts it (:func:`gradstats.pruning.predicted_cosine`, x) and as
    measured on the run's samples (y), log-log. Points on the diagonal: the model predicts the
    cost; above it: pruning costs more than predicted (typically a layer whose largest gradients
    are bounded, so the upper tail is lighter than lognormal). One colour and marker per layer; larger
    markers for higher targets. ``table``: the DataFrame of :func:`gradstats.study.sparsity_check`
    (columns ``layer, step, rule, target, threshold, cosine, predicted_cosine``).

    Example:
        >>> import pandas as pd
        >>> t = pd.DataFrame({"layer": ["a", "a"], "step": [0, 0], "rule": ["lognormal"] * 2, "target": [0.5, 0.9],
        ...                   "threshold": [1e-3, 2e-3], "cosine": [0.99, 0.9], "predicted_cosine": [0.995, 0.92]})
        >>> fig = plot_cosine_check(t)
        >>> fig.axes[0].get_xscale(), fig.axes[0].get_yscale()
        ('log', 'log')
    """
    import matplotlib.pyplot as plt

    t = table[(table["rule"] == rule) & (table["threshold"] > 0)].copy()
    if t.empty:
        raise ValueError(f"no pruned case of rule {rule!r}: nothing to draw")
    floor = 1e-9  # below this the cost is nil for training purposes; clipped points are marked
    t["pred"] = (1.0 - t["predicted_cosine"]).clip(lower=floor)
    t["meas"] = (1.0 - t["cosine"]).clip(lower=floor)
    clipped = (1.0 - t["predicted_cosine"]) < floor
    names = list(dict.fromkeys(t["layer"]))
    styles = dict(zip(names, layer_styles(len(names))))
    targets = sorted(t["target"].unique())
    size = {S: 14 + 46 * i / max(len(targets) - 1, 1) for i, S in enumerate(targets)}
    use_style()
    # the legend beside the axes, in as many columns as its height needs
    ncol = legend_columns(len(names) + 3, 4.4, 7.0)
    col_in = 0.5 + 0.068 * max(max(map(len, names)), 22)
    note = _unpredicted_note(t[clipped], floor) if clipped.any() else ""
    width = 6.3 + ncol * col_in
    if note:
        import textwrap

        note = textwrap.fill(note, int(width * 15))
    lines = note.count("\n") + 1 if note else 0
    fig, ax = plt.subplots(figsize=(width, 5.6 + 0.16 * lines))
    lo, hi = floor / 3, 3.0
    if clipped.any():   # the cases the model gives no cost: a grey strip at the left edge
        ax.axvspan(lo, floor * 1.6, color="0.88", lw=0, zorder=0)
    for name in names:
        color, marker = styles[name]
        g = t[t["layer"] == name]
        ax.scatter(g["pred"], g["meas"], s=g["target"].map(size), marker=marker, color=color,
                   edgecolor="black", lw=0.4, alpha=0.85, label=name, zorder=3)
    ax.plot([lo, hi], [lo, hi], color="black", lw=0.8, ls="--", label="measured = predicted")
    ax.plot([lo, hi], [lo * 10, hi * 10], color="0.55", lw=0.7, ls=":", label="x10 and x0.1")
    ax.plot([lo, hi], [lo / 10, hi / 10], color="0.55", lw=0.7, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted 1 - cosine (lognormal model)")
    ax.set_ylabel("measured 1 - cosine on the run's samples")
    handles, labels = ax.get_legend_handles_labels()
    if clipped.any():
        from matplotlib.patches import Patch

        handles.append(Patch(color="0.88"))
        labels.append(f"predicted < {floor:g} (drawn at {floor:g})")
    ax.legend(handles, labels, fontsize="x-small", loc="upper left", bbox_to_anchor=(1.02, 1.0), ncol=ncol,
              title=f"layer (marker size: target sparsity {targets[0]:g}..{targets[-1]:g})", title_fontsize="x-small")
    ax.set_title(f"Cost of stochastic pruning ({rule} thresholds):\npredicted vs measured "
                 f"({t['step'].nunique()} sampled steps)", fontsize="medium")
    if note:
        fig.text(0.01, 0.01, note, ha="left", va="bottom", fontsize="x-small", color="0.25")
    fig.tight_layout(rect=(0, (0.06 + 0.16 * lines) / fig.get_figheight(), 1, 1))
    return fig


def _unpredicted_note(cases: Any, floor: float) -> str:
    """What the clipped cases (``pred`` < ``floor``) measured, and why the model misses them."""
    worst = cases.loc[cases["meas"].idxmax()]
    text = (f"Grey strip: {len(cases)} cases the lognormal model gives no cost (predicted < {floor:g}); "
            f"measured up to {float(worst['meas']):.2g} ({worst['layer']}).")
    big = cases[cases["meas"] > 1e-3]
    if len(big) and "sigma" in cases:
        s = float((big["sigma"] / LN2).min())
        text += (f" At std of log2|g| >= {s:.1f} binades the lognormal puts nearly all of E[g²] in an upper"
                 " tail these gradients lack (their largest values are bounded), so it cannot predict what"
                 " pruning them costs.")
    return text
