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


#: colours told apart at a glance, also by colour-blind readers (Paul Tol's "bright" scheme):
#: one per layer, cycled with :data:`LAYER_MARKERS` when there are more layers
LAYER_COLORS = ("#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377", "#bbbbbb")
#: marker shapes that tell apart layers of the same colour
LAYER_MARKERS = ("o", "s", "D", "^", "v", "P", "X")


def layer_styles(n: int) -> list[tuple[str, str]]:
    """``n`` distinct (colour, marker) pairs, one per layer: the colours of :data:`LAYER_COLORS`
    first, then each again with the next marker shape (7 colours x 7 markers = 49 layers before a
    pair repeats).

    Example:
        >>> layer_styles(8)[0], layer_styles(8)[7]
        (('#4477aa', 'o'), ('#4477aa', 's'))
    """
    k = len(LAYER_COLORS)
    return [(LAYER_COLORS[i % k], LAYER_MARKERS[(i // k) % len(LAYER_MARKERS)]) for i in range(n)]


def legend_columns(n: int, room_in: float, fontsize_pt: float = 8.0) -> int:
    """How many columns a legend of ``n`` one-line entries needs to fit a height of ``room_in``
    inches at ``fontsize_pt`` (an entry takes about 1.75 font heights).

    Example:
        >>> legend_columns(6, 4.0), legend_columns(49, 4.0)
        (1, 3)
    """
    per_col = max(1, int(room_in * 72 / (1.75 * fontsize_pt)))
    return max(1, math.ceil(n / per_col))


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
