"""What the monitoring integrations (TensorBoard, W&B) log, computed once from statistics rows:
per step and layer (calls and ranks merged), the mean and std of ``log2|g|``, the zero fraction,
the largest ``|g|``, what-if fractions for chosen formats, and the ``log2|g|`` histogram."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence, Union

import numpy as np
import pandas as pd

from gradstats.stats import HIST_MIN_EXP, lognormal_moments, merge_stats

if TYPE_CHECKING:
    from gradstats.scheme import Scheme

LN2 = math.log(2.0)
#: the section every logged key is under (``gradstats/<layer>/<name>``), apart from the user's own keys
PREFIX = "gradstats"
#: W&B's step metric of gradstats' keys: gradstats' step, not the run's ``_step``
STEP_KEY = f"{PREFIX}/step"


def tag(kind: str, layer: str, name: str) -> str:
    """The key a statistic is logged under: ``gradstats/<layer>/<name>`` for the neural gradient,
    ``gradstats/<kind>/<layer>/<name>`` for other kinds.

    Example:
        >>> tag("grad", "fc1", "amax"), tag("wgrad", "fc1", "underflow/e4m3fn")
        ('gradstats/fc1/amax', 'gradstats/wgrad/fc1/underflow/e4m3fn')
    """
    return f"{PREFIX}/{layer}/{name}" if kind == "grad" else f"{PREFIX}/{kind}/{layer}/{name}"


def merged_rows(stats: pd.DataFrame) -> list[tuple[int, str, dict[str, Any]]]:
    """``(step, layer, merged statistics row)`` per step and layer, in step then first-seen order."""
    order = {n: i for i, n in enumerate(dict.fromkeys(stats["layer"]))}
    out = []
    for (step, layer), g in sorted(stats.groupby(["step", "layer"]), key=lambda kv: (kv[0][0], order[kv[0][1]])):
        recs = g.to_dict("records")
        out.append((int(step), str(layer), merge_stats(recs) if len(recs) > 1 else recs[0]))
    return out


def scalars(stats: pd.DataFrame, *, formats: Sequence[Any] = (), granularity: Union[str, int, Scheme, None] = None,
            rounding: str = "nearest") -> pd.DataFrame:
    """Long table ``step, layer, tag, value``: ``mean_log2``, ``std_log2``, ``zero_fraction``,
    ``amax``, and for each format ``underflow/<fmt>`` and ``overflow/<fmt>``
    (:func:`gradstats.fpanalysis.what_if_stats`).

    Example:
        >>> import torch
        >>> from gradstats.stats import tensor_stats
        >>> row = dict(tensor_stats(torch.tensor([0.0, 0.5, 2.0])), step=3, layer="fc", call=0, rank=0)
        >>> [(t, round(v, 4)) for t, v in scalars(pd.DataFrame([row]))[["tag", "value"]].values]
        [('mean_log2', 0.0), ('std_log2', 1.0), ('zero_fraction', 0.3333), ('amax', 2.0)]
    """
    rows = []
    for step, layer, m in merged_rows(stats):
        mu, sigma = lognormal_moments(m)
        n = max(int(m["n"]), 1)
        for tag, v in (("mean_log2", mu / LN2), ("std_log2", sigma / LN2), ("zero_fraction", int(m["n_zero"]) / n),
                       ("amax", float(m["max_abs"]))):
            rows.append((step, layer, tag, float(v)))
    if formats:
        from gradstats.fpanalysis.what_if import what_if_stats

        w = what_if_stats(stats, formats, granularity=granularity, rounding=rounding)
        for r in w.itertuples():
            rows.append((int(r.step), r.layer, f"underflow/{r.format}", float(r.underflow)))
            rows.append((int(r.step), r.layer, f"overflow/{r.format}", float(r.overflow)))
    df = pd.DataFrame(rows, columns=["step", "layer", "tag", "value"])
    return df[np.isfinite(df["value"].to_numpy(float))].reset_index(drop=True)


def log2_histogram(m: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The ``log2|g|`` histogram of a statistics row (its binades: bucket ``j`` holds the entries
    with ``floor(log2|g|) == j``, up to ``j + 1``) in the fields of TensorBoard's
    ``add_histogram_raw``; None without non-zero entries."""
    counts = np.asarray(m["hist"], dtype=np.int64)
    nz = np.flatnonzero(counts)
    if nz.size == 0:
        return None
    lo, hi = int(nz[0]), int(nz[-1])
    exps = np.arange(lo, hi + 1) + HIST_MIN_EXP
    return {"min": float(exps[0]), "max": float(exps[-1] + 1), "num": int(counts.sum()),
            "sum": float(m["sum_ln_abs"]) / LN2, "sum_squares": float(m["sum_ln_abs_sq"]) / LN2 ** 2,
            "bucket_limits": [float(e + 1) for e in exps], "bucket_counts": [int(c) for c in counts[lo:hi + 1]]}


def run_stats(run: Any, kinds: Sequence[str], layers: Any) -> tuple[Any, pd.DataFrame]:
    """The run (opened from a path if need be) and its statistics of ``kinds`` for ``layers``
    (:func:`gradstats.run.select.layer_stats`); a ``ValueError`` when there are none."""
    from gradstats.run import Run, open_run
    from gradstats.run.select import layer_stats

    r = run if isinstance(run, Run) else open_run(run)
    st = layer_stats(r, kinds, layers)
    if not len(st):
        raise ValueError(f"no statistics of kinds {list(kinds)} for layers={layers!r} in the run at {r.path} "
                         f"(its layers: {r.layers})")
    return r, st


def check_formats(formats: Iterable[Any] | str | None) -> list[str]:
    """The formats to watch, as names (:func:`gradstats.formats.parse_list`)."""
    from gradstats.formats import parse_list

    return [str(f) for f in parse_list(formats)]
