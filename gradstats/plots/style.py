"""The one plotting style of gradstats, and a safe way to save figures."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import matplotlib

if not os.environ.get("DISPLAY") and "MPLBACKEND" not in os.environ:
    matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

#: colours per distribution family, used by every figure
FAMILY_COLORS = {"lognormal": "#1b7837", "normal": "#2166ac", "laplace": "#b2182b"}
#: how each distribution family is named in legends
FAMILY_LABELS = {"lognormal": "lognormal", "normal": "half-normal (normal)",
                 "laplace": "exponential (Laplace)"}
#: what each captured kind is called on axes and titles
KIND_LABELS = {"grad": "neural gradient g", "act": "activation (layer output)", "weight": "weights",
               "wgrad": "weight gradient"}
#: the symbol of each captured kind in axis labels (``log2|g|``)
SYMBOLS = {"grad": "g", "act": "a", "weight": "w", "wgrad": "dW"}
#: ln 2: sigma of ln|g| over LN2 is the std of log2|g| (binades), the unit every figure shows
LN2 = math.log(2.0)


def use_style() -> None:
    """Apply the gradstats figure style (seaborn 'whitegrid', readable sizes).

    Example:
        >>> from gradstats.plots import use_style
        >>> use_style()
    """
    import seaborn as sns

    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")
    plt.rcParams.update({"figure.dpi": 100, "savefig.dpi": 150, "savefig.bbox": "tight",
                         "axes.titlesize": "medium", "axes.labelsize": "medium"})


def savefig(fig: Any, path: str | os.PathLike[str]) -> Path:
    """Save ``fig`` to ``path`` (atomically: temporary name, then rename) and close it.

    Example:
        >>> import matplotlib.pyplot as plt, tempfile, os
        >>> fig, ax = plt.subplots(); _ = ax.plot([1, 2])
        >>> p = savefig(fig, os.path.join(tempfile.mkdtemp(), "a.png"))
        >>> p.stat().st_size > 0
        True
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
    fig.savefig(tmp)
    os.replace(tmp, path)
    plt.close(fig)
    return path
