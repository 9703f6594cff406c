"""Figures of training accuracy under a plan: accuracy against gradient sparsity, and accuracy
per low-precision gradient format and scaling, each against the plain baseline's band.

The tables are those of the accuracy experiments (mean and standard deviation of the test
accuracy over seeds, in %): columns ``acc_mean``, ``acc_std`` and the configuration's keys.

Example:
    >>> import pandas as pd
    >>> t = pd.DataFrame({"target_sparsity": [0.0, 0.9], "threshold_rule": ["none", "lognormal"],
    ...                   "acc_mean": [90.0, 89.5], "acc_std": [0.3, 0.4]})
    >>> plot_accuracy_vs_sparsity(t).axes[0].get_xlabel()
    'target sparsity of the neural gradients'
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from gradstats.plots.pruning import RULE_COLORS
from gradstats.plots.style import savefig, use_style

#: one colour per way of scaling a format
SCALING_COLORS = {"global": "#b2182b", "per-layer": "#2166ac", "recommended": "#1b7837",
                  "block MX": "#762a83", "block NVFP4": "#e08214", "none": "#444444"}


def _finish(fig: Any, path: str | os.PathLike[str] | None) -> Any:
    if path is not None:
        savefig(fig, path)
    return fig


def _baseline_band(ax: Any, base: Any, *, vertical: bool) -> None:
    m, s = float(base["acc_mean"]), float(np.nan_to_num(base["acc_std"]))
    span = ax.axvspan if vertical else ax.axhspan
    line = ax.axvline if vertical else ax.axhline
    span(m - s, m + s, color="#bbbbbb", alpha=0.35, lw=0, label="baseline mean ± std")
    line(m, color="#666666", lw=1)


def plot_accuracy_vs_sparsity(table: Any, *, path: str | os.PathLike[str] | None = None,
                              title: str | None = None) -> Any:
    """Test accuracy (mean ± std over seeds) against the target sparsity of stochastic gradient
    pruning: the lognormal threshold as a line, other threshold rules as offset markers, the
    unpruned baseline as a grey band. ``table`` has ``target_sparsity``, ``threshold_rule``,
    ``acc_mean``, ``acc_std``.

    Example:
        >>> import pandas as pd
        >>> t = pd.DataFrame({"target_sparsity": [0.0, 0.5], "threshold_rule": ["none", "lognormal"],
        ...                   "acc_mean": [90.0, 90.1], "acc_std": [0.2, 0.3]})
        >>> len(plot_accuracy_vs_sparsity(t).axes)
        1
    """
    import matplotlib.pyplot as plt
    import pandas as pd

    use_style()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    base = table[table["target_sparsity"] == 0]
    if len(base):
        _baseline_band(ax, base.iloc[0], vertical=False)
    rules = [r for r in table["threshold_rule"].unique() if r != "none"]
    offsets = {r: 0.006 * (i - (len(rules) - 1) / 2) for i, r in enumerate(rules)}
    for rule in rules:
        t = table[table["threshold_rule"] == rule].sort_values("target_sparsity")
        if rule == "lognormal" and len(base):
            t = pd.concat([base.iloc[[0]].assign(threshold_rule=rule), t])   # the line starts at 0
        x = t["target_sparsity"].to_numpy(float) + offsets[rule]
        ax.errorbar(x, t["acc_mean"], yerr=np.nan_to_num(t["acc_std"].to_numpy(float)), marker="o", ms=5,
                    capsize=3, color=RULE_COLORS.get(rule, None), lw=1.5 if rule == "lognormal" else 0,
                    elinewidth=1.2, label=f"{rule} threshold")
    ax.set_xlabel("target sparsity of the neural gradients")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title or "accuracy under stochastic gradient pruning (mean ± std over seeds)")
    ax.legend(loc="lower left", fontsize="small")
    return _finish(fig, path)


def plot_accuracy_by_format(table: Any, *, path: str | os.PathLike[str] | None = None,
                            title: str | None = None) -> Any:
    """Test accuracy (mean ± std over seeds) per gradient format configuration, one row each,
    grouped by width, coloured by the scaling (``global``, ``per-layer``, ``recommended``, block
    scaling), hollow markers for stochastic rounding; the float32 baseline as a grey band.
    ``table`` has ``label``, ``bits``, ``scaling``, ``rounding``, ``acc_mean``, ``acc_std``.

    Example:
        >>> import pandas as pd
        >>> t = pd.DataFrame({"label": ["baseline", "e4m3fn per-layer"], "bits": [32, 8],
        ...                   "scaling": ["none", "per-layer"], "rounding": ["-", "nearest"],
        ...                   "acc_mean": [90.0, 89.8], "acc_std": [0.2, 0.3]})
        >>> plot_accuracy_by_format(t).axes[0].get_xlabel()
        'test accuracy (%)'
    """
    import matplotlib.pyplot as plt

    use_style()
    rows = table[table["label"] != "baseline"].sort_values(["bits", "scaling", "label"], ascending=[False, True, True])
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(rows) + 1.6))
    base = table[table["label"] == "baseline"]
    if len(base):
        _baseline_band(ax, base.iloc[0], vertical=True)
    y = np.arange(len(rows))[::-1]
    lo = float(np.nanmin(rows["acc_mean"])) if len(rows) else 0.0
    seen = set()
    for yi, (_, r) in zip(y, rows.iterrows()):
        color = SCALING_COLORS.get(r["scaling"], "#444444")
        hollow = r["rounding"] == "stochastic"
        label = r["scaling"] if r["scaling"] not in seen else None
        seen.add(r["scaling"])
        ax.errorbar(r["acc_mean"], yi, xerr=float(np.nan_to_num(r["acc_std"])), fmt="o", ms=6, capsize=2,
                    color=color, mfc="white" if hollow else color, label=label)
    ax.set_yticks(y)
    ax.set_yticklabels([f"FP{int(b)}  {lab}" for b, lab in zip(rows["bits"], rows["label"])], fontsize="small")
    ax.set_xlabel("test accuracy (%)")
    ax.set_title(title or "accuracy with low-precision neural gradients (mean ± std over seeds; hollow: stochastic rounding)",
                 fontsize="small")
    if len(rows) and lo < 0.5 * float(rows["acc_mean"].max()):
        ax.set_xscale("function", functions=(lambda v: np.sqrt(np.maximum(v, 0)), lambda v: np.square(v)))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=True)
    return _finish(fig, path)
