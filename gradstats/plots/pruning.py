"""Figures of gradient pruning: achieved vs target sparsity per threshold rule, the threshold
(in units of the layer's median |g|) against sigma, cosine similarity against sparsity, and a
heterogeneous allocation. Each function draws the table or result it is given; the tables of
the threshold and cosine curves are :func:`gradstats.figures.threshold_vs_sigma` and
:func:`gradstats.figures.cosine_vs_sparsity`.

Example:
    >>> import os, tempfile
    >>> import pandas as pd
    >>> t = pd.DataFrame({"sigma": [1.0, 2.0] * 3, "target": [0.5, 0.5, 0.85, 0.85, 0.95, 0.95],
    ...                   "lognormal": [1.0, 1.5, 2.0, 4.0, 4.0, 9.0]})
    >>> fig = plot_threshold_vs_sigma(t, path=os.path.join(tempfile.mkdtemp(), "t.png"))
    >>> len(fig.axes)  # one panel per target sparsity
    3
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from gradstats.plots.style import FAMILY_COLORS, savefig, use_style

#: one colour per threshold rule (the families keep the shared colours)
RULE_COLORS = {**FAMILY_COLORS, "lognormal_free": "#a6dba0", "histogram": "#762a83", "histogram4": "#c2a5cf",
               "naive_lognormal": "#7fbf7b", "exact": "#444444", "exact_stochastic": "#999999"}
RULE_LABELS = {"lognormal": "lognormal (analytic, given amax)",
               "lognormal_free": "lognormal from (mu, sigma) alone", "histogram": "log2 histogram (binade)",
               "histogram4": "log2 histogram (1/4 binade)",
               "naive_lognormal": "naive lognormal quantile",
               "normal": "normal (half-normal)", "laplace": "Laplace (exponential)",
               "exact": "exact quantile, hard operator",
               "exact_stochastic": "exact quantile, stochastic operator"}


#: the curves of :func:`plot_threshold_vs_sigma`: column -> (label, line style)
THRESHOLD_CURVES = {"lognormal": (RULE_LABELS["lognormal"], {"lw": 2}),
                    "naive_lognormal": (RULE_LABELS["naive_lognormal"], {"ls": "--"}),
                    "normal": ("normal fit to the layer", {"ls": "-."}),
                    "laplace": ("Laplace fit to the layer", {"ls": ":", "lw": 2})}


def _is_table(x: Any) -> bool:
    return hasattr(x, "columns") and hasattr(x, "loc")


def _not_a_table(name: str, x: Any) -> str:
    return (f"{name} draws the DataFrame it is given, got {type(x).__name__}; to compute it from sigmas and "
            f"draw it, call gradstats.figures.{name}(sigmas)")


def _finish(fig: Any, path: str | os.PathLike[str] | None) -> Any:
    if path is not None:
        savefig(fig, path)  # closes the figure; the returned object stays inspectable
    return fig


def plot_achieved_vs_target(table: Any, *, path: str | os.PathLike[str] | None = None,
                            title: str | None = None) -> Any:
    """Left: achieved sparsity against target, one colour per rule, per-layer points (small)
    and the mean over layers (line); the dashed diagonal is a perfect rule. Right: the error
    ``achieved - target`` of every (layer, target) case per rule as a box plot on a symmetric
    log axis (linear within +-1e-3), so both the large misses of the bell-shaped and naive
    rules and the small ones of the good rules are visible. ``table`` has columns ``rule``,
    ``target``, ``achieved`` (and optionally ``layer``).

    Example:
        >>> import pandas as pd
        >>> t = pd.DataFrame({"rule": ["lognormal"] * 2, "target": [0.5, 0.9], "achieved": [0.5, 0.9]})
        >>> plot_achieved_vs_target(t).axes[0].get_xlabel()
        'target sparsity'
    """
    import matplotlib.pyplot as plt

    use_style()
    rules = [r for r in RULE_COLORS if r in set(table["rule"])] + \
        sorted(set(table["rule"]) - set(RULE_COLORS))
    fig, (ax, axe) = plt.subplots(1, 2, figsize=(13.0, 5.6),
                                  gridspec_kw={"width_ratios": [1.1, 1.0]})
    lo = float(min(table["target"].min(), table["achieved"].min()))
    ax.plot([lo, 1], [lo, 1], color="black", lw=0.8, ls="--", label="achieved = target")
    errors = []
    for i, rule in enumerate(rules):
        sub = table[table["rule"] == rule]
        c = RULE_COLORS.get(rule, f"C{i}")
        jitter = (i - (len(rules) - 1) / 2) * 0.003
        ax.scatter(sub["target"] + jitter, sub["achieved"], s=6, alpha=0.35, color=c, lw=0)
        mean = sub.groupby("target")["achieved"].mean()
        ax.plot(mean.index, mean.values, marker="o", ms=4, color=c, label=RULE_LABELS.get(rule, rule))
        errors.append((sub["achieved"] - sub["target"]).to_numpy())
    ax.set_xlabel("target sparsity")
    ax.set_ylabel("achieved sparsity (fraction of zeros)")
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize="small", loc="lower center", ncol=5,
               bbox_to_anchor=(0.5, -0.01), frameon=False)
    pos = np.arange(len(rules))[::-1]
    bp = axe.boxplot(errors, positions=pos, orientation="horizontal", widths=0.6, patch_artist=True,
                     showfliers=True, flierprops={"markersize": 2, "alpha": 0.4})
    for patch, rule, i in zip(bp["boxes"], rules, range(len(rules))):
        patch.set_facecolor(RULE_COLORS.get(rule, f"C{i}"))
        patch.set_alpha(0.6)
    axe.axvline(0.0, color="black", lw=0.8)
    for v in (-0.01, 0.01):
        axe.axvline(v, color="grey", lw=0.8, ls=":")
    axe.set_xscale("symlog", linthresh=1e-3)
    axe.set_yticks(pos)
    axe.set_yticklabels([RULE_LABELS.get(r, r) for r in rules], fontsize="small")
    axe.yaxis.tick_right()
    axe.set_xlabel("achieved - target (symmetric log scale; dotted: +-0.01)")
    fig.suptitle(title or "Achieved vs target sparsity per threshold rule")
    fig.subplots_adjust(bottom=0.2, wspace=0.08)
    return _finish(fig, path)


def plot_threshold_vs_sigma(table: Any, targets: Sequence[float] | None = None, *,
                            path: str | os.PathLike[str] | None = None) -> Any:
    """Threshold for a target sparsity, in units of the layer's median ``|g|`` (``e^mu``), as a
    function of sigma for an exactly lognormal layer: the analytic rule, the naive lognormal
    quantile, and the normal and Laplace rules fitted to the same layer (log2 y axis), one panel
    per target.

    ``table``: a DataFrame with columns ``sigma`` (of ln|g|), ``target`` and one threshold column
    per rule drawn (``lognormal``, ``naive_lognormal``, ``normal``, ``laplace``; see
    :func:`gradstats.figures.threshold_vs_sigma`); ``targets``: the panels (default: the table's
    targets). :func:`gradstats.figures.plot_threshold_vs_sigma` computes the table from sigmas and
    draws it.

    Example:
        >>> import pandas as pd
        >>> t = pd.DataFrame({"sigma": [0.5, 1.0, 2.0], "target": [0.9] * 3, "lognormal": [1.5, 2.5, 6.0],
        ...                   "normal": [2.0, 4.0, 50.0]})
        >>> fig = plot_threshold_vs_sigma(t)
        >>> fig.axes[0].get_yscale(), len(fig.axes[0].lines)
        ('log', 2)
    """
    import matplotlib.pyplot as plt

    if not _is_table(table):
        raise TypeError(_not_a_table("plot_threshold_vs_sigma", table))
    use_style()
    targets = list(dict.fromkeys(table["target"])) if targets is None else list(targets)
    fig, axes = plt.subplots(1, len(targets), figsize=(3.4 * len(targets) + 0.8, 4.2),
                             sharey=True, squeeze=False)
    for ax, S in zip(axes[0], targets):
        sub = table[np.isclose(table["target"], S)]
        s = sub["sigma"].to_numpy(dtype=np.float64)
        for col, (label, style) in THRESHOLD_CURVES.items():
            if col in sub:
                ax.plot(s, sub[col].to_numpy(dtype=np.float64), color=RULE_COLORS[col], label=label, **style)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("sigma of ln|g|")
        ax.set_title(f"target sparsity {S:g}")
    axes[0][0].set_ylabel("threshold / median |g|  (log2 scale)")
    axes[0][0].legend(fontsize="x-small", loc="upper left")
    fig.suptitle("Threshold rules on an exactly lognormal layer")
    return _finish(fig, path)


def plot_cosine_vs_sparsity(curves: Any, *, measured: Any = None,
                            path: str | os.PathLike[str] | None = None) -> Any:
    """Predicted cosine similarity between ``g`` and its stochastic pruning against the target
    sparsity, one curve per sigma (lognormal closed form). ``curves``: a DataFrame with columns
    ``sigma``, ``sparsity``, ``one_minus_cosine`` (``1 - cos``, accurate when tiny; see
    :func:`gradstats.figures.cosine_vs_sparsity`). ``measured``: optional DataFrame with columns
    ``sigma``, ``sparsity``, ``cosine`` drawn as points (e.g. Monte Carlo or real layers).
    :func:`gradstats.figures.plot_cosine_vs_sparsity` computes the curves from sigmas and draws them.

    Example:
        >>> import pandas as pd
        >>> c = pd.DataFrame({"sigma": [1.0] * 3, "sparsity": [0.1, 0.5, 0.9],
        ...                   "one_minus_cosine": [1e-4, 1e-2, 0.2]})
        >>> fig = plot_cosine_vs_sparsity(c)
        >>> fig.axes[0].get_xlabel()
        'sparsity (fraction of zeros)'
    """
    import matplotlib.pyplot as plt

    if not _is_table(curves):
        raise TypeError(_not_a_table("plot_cosine_vs_sparsity", curves))
    use_style()
    sigmas = list(dict.fromkeys(curves["sigma"]))
    fig, (ax, axl) = plt.subplots(1, 2, figsize=(10.0, 4.4))
    cmap = plt.get_cmap("viridis")
    for i, sg in enumerate(sigmas):
        c = cmap(i / max(1, len(sigmas) - 1))
        sub = curves[curves["sigma"] == sg]
        S = sub["sparsity"].to_numpy(dtype=np.float64)
        one_minus = sub["one_minus_cosine"].to_numpy(dtype=np.float64)
        ax.plot(S, 1.0 - one_minus, color=c, label=f"sigma = {sg:g}")
        axl.plot(S, one_minus, color=c)
        if measured is not None:
            sub = measured[np.isclose(measured["sigma"], sg)]
            if len(sub):
                for a_, y in ((ax, sub["cosine"]), (axl, 1.0 - sub["cosine"])):
                    a_.scatter(sub["sparsity"], y, color=c, s=14, edgecolor="black", lw=0.4,
                               zorder=3)
    for a_ in (ax, axl):
        a_.axvline(0.85, color="grey", lw=0.8, ls=":")
        a_.set_xlabel("sparsity (fraction of zeros)")
    ax.set_ylabel("cosine similarity of g and T(g)")
    axl.set_yscale("log")
    axl.set_ylabel("1 - cosine similarity (log scale)")
    ax.legend(fontsize="small", loc="lower left")
    fig.suptitle("Cost of stochastic pruning on a lognormal layer"
                 + ("; points: measured" if measured is not None else ""))
    return _finish(fig, path)


def plot_allocation(allocation: Any, path: str | os.PathLike[str] | None = None) -> Any:
    """Per-layer targets of a heterogeneous allocation (bars, width-agnostic) with the global
    budget and the per-layer cap, layers left unpruned (the output layer, ``exclude``) hatched,
    and the predicted cosine similarity of each layer (points, right axis).

    Example:
        >>> from gradstats.pruning import allocate
        >>> a = allocate({"a": {"mu": -9.0, "sigma": 1.0, "n": 100},
        ...               "b": {"mu": -9.0, "sigma": 3.0, "n": 300}}, 0.8)
        >>> len(plot_allocation(a).axes)
        2
    """
    import matplotlib.pyplot as plt

    use_style()
    L = len(allocation.layers)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.45 * L + 2.5), 4.2))
    x = np.arange(L)
    excluded = np.asarray(getattr(allocation, "excluded", np.zeros(0, dtype=bool)), dtype=bool)
    if excluded.shape != (L,):
        excluded = np.zeros(L, dtype=bool)
    targets = np.asarray(allocation.targets)
    ax.bar(x[~excluded], targets[~excluded], color=RULE_COLORS["lognormal"], alpha=0.7, label="layer target")
    if excluded.any():
        ax.bar(x[excluded], np.maximum(targets[excluded], 0.02), color="none", edgecolor="#777777",
               hatch="//", label="unpruned (output layer, excluded)")
    ax.axhline(allocation.budget, color="black", ls="--", lw=0.8,
               label=f"global budget {allocation.budget:g}")
    caps = np.asarray(getattr(allocation, "caps", np.zeros(0)), dtype=float)
    if caps.shape == (L,) and (caps[~excluded] < 1).any():
        c = caps[~excluded]
        if np.all(c == c[0]):
            ax.axhline(c[0], color="#b2182b", ls=":", lw=1.0, label=f"cap {c[0]:g}")
        else:
            ax.plot(x[~excluded], c, "_", color="#b2182b", ms=12, mew=1.5, label="cap")
    ax.set_xticks(x)
    ax.set_xticklabels(allocation.layers, rotation=60, ha="right", fontsize="small")
    ax.set_ylabel("sparsity")
    ax.set_ylim(0, 1)
    ax2 = ax.twinx()
    ax2.plot(x, allocation.cosine, "o", color="#2166ac", ms=4, label="predicted cosine")
    fl = np.asarray(allocation.floors)
    if np.isfinite(fl).any():
        ax2.plot(x, fl, "_", color="#b2182b", ms=12, mew=2, label="cosine floor")
    ax2.set_ylabel("cosine similarity")
    ax2.set_ylim(min(0.5, float(np.nanmin(allocation.cosine)) - 0.02), 1.005)
    ax2.grid(False)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize="small", loc="lower center", ncol=2,
              bbox_to_anchor=(0.5, 1.0), frameon=False)
    ax.set_title(f"Heterogeneous sparsity allocation (achieved {allocation.achieved:.3f})",
                 pad=58 if len(h1 + h2) > 4 else 44)
    return _finish(fig, path)
