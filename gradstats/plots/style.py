"""The one plotting style of gradstats, and a safe way to save figures."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import matplotlib

if not os.environ.get("DISPLAY") and "MPLBACKEND" not in os.environ:
    matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

#: colours per distribution family, used by every figure
FAMILY_COLORS = {"lognormal": "#1b7837", "normal": "#2166ac", "laplace": "#b2182b"}


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
