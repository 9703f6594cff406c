"""The result of checking a plan (:func:`gradstats.plan.checks.verify`): predicted against replayed, per
layer and calibration step (:class:`Verification`), and per layer over the steps (:func:`layer_summary`).

Example:
    >>> v = Verification([], bias_bound=0.01, flush_bound=0.01, overflow_bound=0.001)
    >>> v.ok, len(v.per_layer())
    (True, 0)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from gradstats.plan.check_table import format_checks

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Verification", "QUANTITIES", "layer_summary", "step_weights"]

#: what is predicted and replayed, per layer and step (fractions of all entries, except ``flushed``:
#: of the non-zero input entries; ``error`` relative to ``E g^2``)
QUANTITIES = ("sparsity", "underflow", "flushed", "overflow", "gain", "bias", "error")


def step_weights(steps: Sequence[int]) -> np.ndarray:
    """Weights of the calibration steps in a plan's predictions: proportional to their rank, so the
    later steps count more (``[1, 2, 3, 4] / 10`` for four).

    Example:
        >>> step_weights([10, 20, 30, 40]).tolist()
        [0.1, 0.2, 0.3, 0.4]
    """
    w = np.arange(1, len(steps) + 1, dtype=np.float64)
    return w / w.sum()


@dataclass
class Verification:
    """Predicted against replayed, per layer and calibration step (:func:`gradstats.plan.checks.verify`).

    Attributes:
        rows: one dict per (layer, step): ``layer``, ``step``, ``rule``, ``threshold``, ``scale``,
            ``samples`` (replayed values; 0: not replayed), ``predicted_<q>`` and ``replayed_<q>`` for
            each quantity of :data:`QUANTITIES`, ``ok`` and ``problems``.
        bias_bound, flush_bound, overflow_bound: the bounds checked.
    """

    rows: list[dict[str, Any]]
    bias_bound: float
    flush_bound: Optional[float]
    overflow_bound: float
    steps: list[int] = field(default_factory=list)
    #: per layer, the noise ratio the whole plan is predicted to add to its weight gradient
    #: (:func:`gradstats.predicted_noise`, filled by ``Plan.verify``; NaN where the run holds
    #: no noise records)
    noise: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether every layer passed at every step."""
        return all(r["ok"] for r in self.rows)

    @property
    def failures(self) -> dict[str, str]:
        """Per failing layer, what failed (at the step where it first did)."""
        out: dict[str, str] = {}
        for r in self.rows:
            if not r["ok"] and r["layer"] not in out:
                out[r["layer"]] = f"step {r['step']}: " + "; ".join(r["problems"])
        return out

    def to_dataframe(self) -> "pd.DataFrame":
        """One row per (layer, step)."""
        import pandas as pd

        df = pd.DataFrame(self.rows)
        if len(df):
            df["problems"] = ["; ".join(p) for p in df["problems"]]
        return df

    def per_layer(self) -> "pd.DataFrame":
        """One row per layer: the predictions and replays averaged over the steps with the weights of
        :func:`step_weights` (the later steps count more), ``predicted_from`` (what predicted them:
        ``"blocks"``, the replay on whole blocks; ``"lognormal"``; or the exchangeable-block model), ``worst_*`` the extreme over steps of the
        replayed overflow, flushed share and gain, ``ok`` (every step passed) and ``problems`` (those of the
        first step that failed, named with its numbers: ``"step 4: replayed: ..."``)."""
        import pandas as pd

        by_layer: dict[str, list[dict[str, Any]]] = {}
        for r in self.rows:
            by_layer.setdefault(r["layer"], []).append(r)
        return pd.DataFrame([layer_summary(rows, self.noise.get(layer, math.nan)) for layer, rows in by_layer.items()])

    def to_dict(self) -> dict[str, Any]:
        """Plain data: the bounds, the steps and the rows."""
        return {"bias_bound": self.bias_bound, "flush_bound": self.flush_bound,
                "overflow_bound": self.overflow_bound, "steps": list(self.steps),
                "rows": [dict(r) for r in self.rows], "noise": dict(self.noise)}

    def table(self) -> str:
        """The per-layer table as text: predicted / replayed for each quantity, and what failed."""
        return format_checks(self.per_layer().to_dict("records"))

    def __str__(self) -> str:
        return self.table()


def layer_summary(rows: Sequence[dict[str, Any]], noise: float = math.nan) -> dict[str, Any]:
    """One layer's row of :meth:`Verification.per_layer` from its rows of :attr:`Verification.rows`
    (one per step; ``noise``: its ``predicted_noise``).

    Example:
        >>> q = {f"{side}_{k}": 0.0 for k in QUANTITIES for side in ("predicted", "replayed")}
        >>> rows = [{"layer": "fc", "step": s, "rule": "r", "samples": 10, "predicted_from": "lognormal",
        ...          **q, "predicted_gain": 1.0, "replayed_gain": g, "ok": True, "problems": []}
        ...         for s, g in ((1, 1.0), (2, 0.97))]
        >>> row = layer_summary(rows)
        >>> row["replayed_gain"], row["worst_gain"], row["samples"]
        (0.98, 0.97, 20)
    """
    g = sorted(rows, key=lambda r: r["step"])
    w = step_weights([r["step"] for r in g])
    samples = sum(int(r["samples"]) for r in g)
    row: dict[str, Any] = {"layer": g[0]["layer"], "rule": g[-1]["rule"], "steps": len(g), "samples": samples,
                           "predicted_from": ", ".join(dict.fromkeys(r["predicted_from"] for r in g))
                           if all("predicted_from" in r for r in g) else None}
    for q in QUANTITIES:
        for side in ("predicted", "replayed"):
            v = np.array([r[f"{side}_{q}"] for r in g], dtype=np.float64)
            m = np.isfinite(v)
            row[f"{side}_{q}"] = float(np.dot(w[m], v[m]) / w[m].sum()) if m.any() else math.nan
    rep = np.array([r["replayed_gain"] for r in g], dtype=np.float64)
    for worst, q in (("worst_overflow", "replayed_overflow"), ("worst_flushed", "replayed_flushed")):
        v = np.array([r[q] for r in g], dtype=np.float64)
        row[worst] = float(v[~np.isnan(v)].max()) if samples and not np.isnan(v).all() else math.nan
    row["worst_gain"] = float(rep[np.nanargmax(np.abs(rep - 1))]) if np.isfinite(rep).any() else math.nan
    row["predicted_noise"] = noise
    row["ok"] = all(bool(r["ok"]) for r in g)
    row["problems"] = _layer_problems([(int(r["step"]), "; ".join(r["problems"])) for r in g])
    return row


def _layer_problems(steps: Sequence[tuple[int, str]]) -> str:
    """The problems of a layer's row of :meth:`Verification.per_layer`, whose numbers are means over
    the steps: those of the first step that failed, which they quote, named by that step (and the
    other steps that failed); ``steps``: ``(step, its problems joined)`` in step order."""
    bad = [(s, p) for s, p in steps if p]
    if not bad:
        return ""
    (first, text), more = bad[0], [s for s, _ in bad[1:]]
    also = f" (also failed at step{'s' if len(more) > 1 else ''} {', '.join(map(str, more))})" if more else ""
    return f"step {first}: {text}{also}"
