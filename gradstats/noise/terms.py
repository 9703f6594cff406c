"""What the noise model reads from a run: per layer, the terms that turn a relative error of its
output gradient into a noise ratio of its weight gradient (:func:`noise_terms`), which layers feed
which (:func:`downstream`), how much noise travels back between them (:func:`gains`), and from
those the first-order cost of a unit of error at each layer (:func:`noise_weights`, the weights
:func:`gradstats.pruning.allocate` spends its budget with). It reads what the trace recorded
(:mod:`gradstats.tracer.noise`) and nothing of a plan: the analysis stage, below
:mod:`gradstats.plan.noise_prediction`, which predicts what a whole plan costs.

Example:
    >>> import tempfile, torch, gradstats
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    >>> with gradstats.trace(m, tempfile.mkdtemp(), sample_every=1) as t:
    ...     for _ in range(2):
    ...         m(torch.randn(64, 8)).logsumexp(1).mean().backward(); t.step()
    >>> sorted(noise_terms(t.path, ["0", "2"]).index), downstream(t.path)
    (['0', '2'], {'0': ['2'], '2': []})
"""
from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

__all__ = ["noise_terms", "downstream", "gains", "noise_weights", "NOISE_BOUND"]

#: the default largest predicted noise ratio per layer (docs/noise.md: every configuration of the
#: study with a measured ratio up to 0.015 kept its accuracy; every one that lost had 0.32 or more)
NOISE_BOUND = 0.02


def noise_terms(run: Any, layers: Sequence[str], steps: Optional[Sequence[int]] = None) -> "pd.DataFrame":
    """Per layer, from the run's ``"noise"`` table (on ``steps``, else all): ``q2`` and
    ``minibatch`` (means over steps, calls added: the smaller of the two estimates of
    :mod:`gradstats.tracer.noise`, ``pair`` and ``signs``, the side on which the ratio is not
    under-stated), ``batch`` and ``steps`` (how many). Layers with no record are absent.

    Example:
        >>> import tempfile, torch, gradstats
        >>> m = torch.nn.Linear(4, 4)
        >>> with gradstats.trace(m, tempfile.mkdtemp(), sample_every=1) as t:
        ...     m(torch.randn(8, 4)).square().sum().backward(); t.step()
        >>> list(noise_terms(t.path, [""]).columns)
        ['q2', 'minibatch', 'pair', 'signs', 'batch', 'steps']
    """
    from gradstats.run import as_run

    return _terms(as_run(run).table("noise"), layers, steps)


def _terms(df: "pd.DataFrame", layers: Sequence[str], steps: Optional[Sequence[int]]) -> "pd.DataFrame":
    """:func:`noise_terms` on a run's ``"noise"`` table already read."""
    import pandas as pd

    cols = ["q2", "minibatch", "pair", "signs", "batch", "steps"]
    if df.empty:
        return pd.DataFrame(columns=cols, dtype=float)
    df = df[df["layer"].isin(list(layers))]
    if "of_step" in df.columns:          # a pair is recorded at the step after the sampled one it is of
        df = df.assign(step=np.where(df["call"] < 0, df["of_step"], df["step"]).astype(np.int64))
    if steps is not None:
        sel = df[df["step"].isin(list(steps))]
        df = sel if len(sel) else df
    if "rank" in df.columns and len(df):
        df = df[df["rank"] == df["rank"].min()]
    pairs = df[df["call"] < 0] if "pair" in df.columns else df.iloc[:0]
    calls = df[df["call"] >= 0]
    per = calls.groupby(["layer", "step"]).agg(q2=("q2", "sum"), s2=("s2", "sum"), batch=("batch", "max"))
    b = per["batch"].astype(float)
    per["signs"] = np.where(b > 1, per["s2"] * b / np.maximum(b - 1.0, 1.0), np.nan)
    out = per.groupby(level="layer").agg(q2=("q2", "mean"), signs=("signs", "mean"),
                                         batch=("batch", "max"), steps=("q2", "size"))
    pair = pairs.groupby("layer")["pair"].mean() if len(pairs) else pd.Series(dtype=float)
    # two estimates: the pair (two batches; right under BatchNorm, whose samples are not independent,
    # but one draw) and the centred signs (every sample of one batch; over-estimates under BatchNorm).
    # The smaller is taken: a minibatch noise under-estimated over-states the ratio, the safe side.
    out["pair"] = [float(pair[n]) if n in pair.index and np.isfinite(pair[n]) else np.nan for n in out.index]
    out["minibatch"] = np.fmin(out["pair"].to_numpy(float), out["signs"].to_numpy(float))
    return out[cols]


def downstream(run: Any) -> dict[str, list[str]]:
    """Per traced layer, the traced layers whose input depends on its output (the run's
    ``"noise_graph"`` table; empty when the trace did not record it).

    Example:
        >>> import tempfile, torch, gradstats
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> with gradstats.trace(m, tempfile.mkdtemp(), sample_every=1) as t:
        ...     m(torch.randn(8, 4)).sum().backward(); t.step()
        >>> downstream(t.path)
        {'0': ['2'], '2': []}
    """
    from gradstats.run import as_run

    df = as_run(run).table("noise_graph")
    if df.empty:
        return {}
    df = df[df["step"] == df["step"].max()]
    return {str(rec["layer"]): list(json.loads(rec["downstream"])) for rec in df.to_dict("records")}


def gains(run: Any) -> dict[tuple[str, str], float]:
    """``{(source, layer): gain}`` from the run's ``"noise_gain"`` table: the relative noise ``layer``
    receives per unit of relative noise added at ``source``'s output gradient, measured once in the
    trace (:class:`gradstats.tracer.noise.Propagation`), as its weight gradient sees it: the noise
    that pass added to ``layer``'s parameter gradient over that layer's ``q2`` of the same step
    (``weight_noise / q2``; :func:`noise_terms`'s ``gain * q2`` is then that added variance). Noise
    sent back from later layers is mixed across the entries of ``layer``'s output gradient, and on a
    ResNet-20 it reached the weight gradient at about half of what the same relative noise
    independent per entry would. A run recorded before ``weight_noise`` (or a layer without
    parameters) gives the relative noise of the output gradient. Empty for a run without gains.

    Example:
        >>> import tempfile, torch, gradstats
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        >>> with gradstats.trace(m, tempfile.mkdtemp(), sample_every=1) as t:
        ...     m(torch.randn(8, 4)).square().sum().backward(); t.step()
        >>> list(gains(t.path))
        [('2', '0')]
    """
    from gradstats.run import as_run

    r = as_run(run)
    df = r.table("noise_gain")
    if df.empty:
        return {}
    step = df["step"].max()
    df = df[df["step"] == step]
    q2 = _q2_of_step(r.table("noise"), int(step)) if "weight_noise" in df.columns else {}
    out = {}
    for rec in df.to_dict("records"):
        layer = str(rec["layer"])
        w, q = float(rec.get("weight_noise", np.nan)), q2.get(layer, 0.0)
        out[(str(rec["source"]), layer)] = w / q if np.isfinite(w) and q > 0 else float(rec["gain"])
    return out


def _q2_of_step(table: "pd.DataFrame", step: int) -> dict[str, float]:
    """Per layer, ``q2`` of its calls on ``step`` added (the first rank's), from a ``"noise"`` table."""
    if table.empty or "q2" not in table.columns:
        return {}
    df = table[(table["step"] == step) & (table["call"] >= 0)]
    if "rank" in df.columns and len(df):
        df = df[df["rank"] == df["rank"].min()]
    return {str(k): float(v) for k, v in df.groupby("layer")["q2"].sum().items()}


def gain_of(gain: dict[tuple[str, str], float], source: str, layer: str) -> float:
    """How much of ``source``'s relative noise reaches ``layer`` (1 when the run measured no gains)."""
    return gain.get((source, layer), 0.0) if gain else 1.0


def noise_weights(run: Any, layers: Optional[Sequence[str]] = None, *, steps: Any = "auto") -> dict[str, float]:
    """Per layer, how much noise ratio a unit of relative error added at its output gradient costs
    the model, to first order: its own conversion ``c = q2 / minibatch`` (the ratio a relative error
    ``e`` at the layer adds to its weight gradient is ``e * c``) plus what flows back to the layers
    upstream, ``sum_l gain[layer, l] * c_l`` (:func:`incoming_noise`'s first-order term). As
    ``weights=`` of :func:`gradstats.pruning.allocate`, whose objective ``sum_i w_i D_i`` then is the
    sum over layers of the noise ratio the pruning adds (``D_i`` the relative added variance): the
    budget is spent where it costs the least noise against SGD's own, with the same model that
    bounds ``recommend`` (what ``allocate(run, 0.85)`` uses by default on a run with noise records).
    ``layers``: default every traced layer (as ``allocate`` reads a run); a layer without a noise
    record gets the largest weight of the others (pruned the least), with a log line.

    Example:
        >>> import tempfile, torch, gradstats
        >>> m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        >>> with gradstats.trace(m, tempfile.mkdtemp(), sample_every=1) as t:
        ...     for _ in range(2):
        ...         m(torch.randn(64, 8)).logsumexp(1).mean().backward(); t.step()
        >>> w = noise_weights(t.path)
        >>> sorted(w), all(v > 0 for v in w.values())
        (['0', '2'], True)
        >>> a = gradstats.pruning.allocate(gradstats.open_run(t.path), 0.5, weights=w, output_layer=None)
    """
    from gradstats.run import as_run
    from gradstats.run.select import calibration_steps

    r = as_run(run)
    table = r.table("noise")
    known = list(dict.fromkeys(str(x) for x in table["layer"])) if not table.empty else []
    names = list(layers) if layers is not None else list(r.layers)
    if not known:
        raise ValueError(f"the run at {r.path} holds no noise records (traced with noise=False, or before gradstats "
                         "recorded them): trace with sample_every= steps to weight an allocation by noise")
    chosen = calibration_steps(r, [n for n in names if n in known], steps=steps)
    terms = _terms(table, names, chosen)      # the table read once
    c = {n: float(terms.loc[n, "q2"] / terms.loc[n, "minibatch"]) for n in names
         if n in terms.index and terms.loc[n, "minibatch"] > 0}
    gain = gains(r)
    out = {n: c[n] + sum(gain_of(gain, n, up) * c.get(up, 0.0) for up in names if up != n and (n, up) in gain)
           for n in c}
    missing = [n for n in names if n not in out]
    if missing:
        top = max(out.values()) if out else 1.0
        log.info("no noise record for %s: weighted as the costliest layer (%.3g)", ", ".join(missing), top)
        out.update({n: top for n in missing})
    return {n: out[n] for n in names}
