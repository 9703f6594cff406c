"""Tables of a run behind the study's figures: raw values and fits per layer and step, goodness of
fit, location and spread over training, pruning checks and quantisation-error checks on the run's
raw samples. Each takes a run (a :class:`gradstats.Run` or a path) and returns plain objects or a
pandas DataFrame; :mod:`gradstats.figures` computes them for the figures, which the drawing
functions of :mod:`gradstats.plots.study` draw.

Example:
    >>> import gradstats
    >>> from gradstats.study import moments_over_steps
    >>> df = moments_over_steps(gradstats.zoo.data.data_dir() / "sample-run", layers="conv2")
    >>> round(float(df["std_log2"].median()), 1) > 1
    True
"""
from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Sequence

import numpy as np

from gradstats.run import as_run

log = logging.getLogger(__name__)

_LN2 = math.log(2.0)
#: layers drawn by default in the per-layer grids (evenly spaced over the model beyond this)
MAX_GRID_LAYERS = 12


def grid_layers(run: Any, layers: str | Sequence[str] | None, *, cap: int | None = MAX_GRID_LAYERS) -> list[str]:
    """The run's layers selected by ``layers`` (None: all, evenly thinned to ``cap``).

    Example:
        >>> import gradstats
        >>> grid_layers(as_run(gradstats.zoo.data.data_dir() / "sample-run"), "conv*")
        ['conv1', 'conv2']
    """
    from gradstats.run.select import select_layers

    names = select_layers(list(run.layers), layers)
    if layers is None and cap is not None and len(names) > cap:
        keep = np.unique(np.round(np.linspace(0, len(names) - 1, cap)).astype(int))
        log.info("drawing %d of the run's %d layers (evenly spaced); pass layers= to choose", len(keep), len(names))
        names = [names[i] for i in keep]
    return names


def sampled_steps(run: Any, kind: str = "grad") -> list[int]:
    """Steps at which the run kept raw samples of ``kind``.

    Example:
        >>> import gradstats
        >>> sampled_steps(gradstats.zoo.data.data_dir() / "sample-run")[:1]
        [0]
    """
    run = as_run(run)
    idx = run.sample_index()
    return sorted(int(s) for s in idx[idx["kind"] == kind]["step"].unique()) if len(idx) else []


def pick_step(run: Any, step: int | None, kind: str = "grad") -> int:
    """``step`` checked against the run, or (None) the latest step with raw samples of ``kind``,
    else the latest committed step.

    Example:
        >>> import gradstats
        >>> run = as_run(gradstats.zoo.data.data_dir() / "sample-run")
        >>> pick_step(run, None) == sampled_steps(run)[-1]
        True
    """
    have = sampled_steps(run, kind)
    if step is None:
        if have:
            return have[-1]
        if not run.steps:
            raise ValueError(f"the run at {run.path} has no committed steps yet")
        return int(run.steps[-1])
    if step not in run.steps and step not in have:
        raise ValueError(f"step {step} is not in the run; it has steps {run.steps[:5]}...{run.steps[-3:]} "
                         f"(raw samples at {have})")
    return int(step)


def layer_values(run: Any, layer: str, step: int, kind: str = "grad") -> Any:
    """The raw sampled values of one layer at one step, all calls and ranks concatenated (a 1-D
    float32 tensor), or ``None`` when the run kept no samples there.

    Example:
        >>> import gradstats
        >>> run = gradstats.open_run(gradstats.zoo.data.data_dir() / "sample-run")
        >>> layer_values(run, "fc2", 0).ndim
        1
    """
    import torch

    run = as_run(run)
    idx = run.sample_index()
    if not len(idx):
        return None
    idx = idx[(idx["layer"] == layer) & (idx["step"] == step) & (idx["kind"] == kind)]
    if not len(idx):
        return None
    parts = [run.samples(layer, step, kind=kind, call=int(c)) for c in sorted(idx["call"].unique())]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def layer_fit(run: Any, layer: str, step: int, kind: str = "grad") -> Any:
    """The three-family fit of one layer at one step: exact on its raw samples when the run has
    them (:func:`gradstats.fit`), else from the step's streamed statistics
    (:func:`gradstats.fit_stats`). Raises ``ValueError`` when nothing can be fitted there
    (e.g. all values equal, as BatchNorm weights at initialisation).

    Example:
        >>> import gradstats
        >>> r = layer_fit(gradstats.zoo.data.data_dir() / "sample-run", "conv2", 0)
        >>> r.source, r.best
        ('samples', 'lognormal')
    """
    from gradstats.fitting import fit, fit_stats

    run = as_run(run)
    x = layer_values(run, layer, step, kind)
    if x is not None:
        return fit(x)
    st = run.stats(kinds=[kind])
    st = st[(st["layer"] == layer) & (st["step"] == step)]
    if not len(st):
        raise ValueError(f"the run has neither samples nor statistics of {kind!r} for layer {layer!r} at step {step}")
    return fit_stats(st)


def layer_fits(run: Any, *, step: int | None = None, kind: str = "grad",
               layers: str | Sequence[str] | None = None) -> dict[str, Any]:
    """``{layer: FitResult}`` at one step (default: the latest step with raw samples), see
    :func:`layer_fit`; layers that cannot be fitted are left out (logged).

    Example:
        >>> import gradstats
        >>> fits = layer_fits(gradstats.zoo.data.data_dir() / "sample-run")
        >>> list(fits)[:2]
        ['conv1', 'bn1']
    """
    run = as_run(run)
    step = pick_step(run, step, kind)
    out = {}
    for name in grid_layers(run, layers, cap=None):
        try:
            out[name] = layer_fit(run, name, step, kind)
        except ValueError as exc:
            log.info("no %s fit of layer %s at step %d: %s", kind, name, step, exc)
    return out


def fits_at(run_or_fits: Any, step: int | None = None, kind: str = "grad",
            layers: Any = None) -> tuple[dict[str, Any], str]:
    """``({layer: FitResult}, where)``: the fits of a run at ``step`` (default the latest sampled
    step; ``where`` names it, ``"step N"``) of the layers drawn in a grid, or a given mapping of
    fits as it is (``where`` empty).

    Example:
        >>> import gradstats
        >>> fits, where = fits_at(gradstats.zoo.data.data_dir() / "sample-run", 0, layers="fc*")
        >>> list(fits), where
        (['fc1', 'fc2'], 'step 0')
    """
    if isinstance(run_or_fits, Mapping):
        return dict(run_or_fits), ""
    run = as_run(run_or_fits)
    st = pick_step(run, step, kind)
    return layer_fits(run, step=st, kind=kind, layers=grid_layers(run, layers)), f"step {st}"


def goodness_of_fit(run: Any, *, steps: Sequence[int] | None = None, kind: str = "grad",
                    layers: str | Sequence[str] | None = None) -> Any:
    """Per layer and step (default: every step with raw samples, else the last step): the KS
    distance of each family and Vuong's effect size ``z/sqrt(n)`` of lognormal against normal
    and against Laplace (positive favours lognormal), as a DataFrame.

    Example:
        >>> import gradstats
        >>> df = goodness_of_fit(gradstats.zoo.data.data_dir() / "sample-run", steps=[0], layers="fc2")
        >>> sorted(df.columns)[:3], len(df)
        (['best', 'ks_laplace', 'ks_lognormal'], 1)
    """
    import pandas as pd

    run = as_run(run)
    if steps is None:
        steps = sampled_steps(run, kind) or [pick_step(run, None, kind)]
    rows = []
    for name in grid_layers(run, layers, cap=None):
        for s in steps:
            try:
                res = layer_fit(run, name, int(s), kind)
            except ValueError as exc:
                log.info("layer %s step %s not fitted: %s", name, s, exc)
                continue
            row = {"layer": name, "step": int(s), "source": res.source, "best": res.best,
                   "sigma_log2": res.params["lognormal"]["sigma"] / _LN2}
            for fam in res.families:
                row[f"ks_{fam}"] = res.ks.get(fam, math.nan)
            for other in ("normal", "laplace"):
                t = res.vuong.get(("lognormal", other))
                row[f"vuong_lognormal_vs_{other}"] = math.nan if t is None else t["effect"]
            rows.append(row)
    return pd.DataFrame(rows)


def moments_over_steps(run: Any, *, kind: str = "grad", layers: str | Sequence[str] | None = None) -> Any:
    """Per layer and step (calls and ranks merged): the mean and std of ``log2|x|`` over the
    non-zero entries and the zero fraction, from the streamed statistics, as a DataFrame.

    Example:
        >>> import gradstats
        >>> df = moments_over_steps(gradstats.zoo.data.data_dir() / "sample-run", layers="fc2")
        >>> list(df.columns)
        ['layer', 'step', 'mean_log2', 'std_log2', 'zero_fraction']
    """
    import pandas as pd

    from gradstats.stats import lognormal_moments, merge_stats

    run = as_run(run)
    names = grid_layers(run, layers, cap=None)
    st = run.stats(kinds=[kind])
    st = st[st["layer"].isin(names)]
    rows = []
    for (layer, step), g in st.groupby(["layer", "step"], sort=False):
        m = merge_stats(g.to_dict("records")) if len(g) > 1 else g.iloc[0].to_dict()
        mu, sigma = lognormal_moments(m)
        rows.append({"layer": layer, "step": int(step), "mean_log2": mu / _LN2, "std_log2": sigma / _LN2,
                     "zero_fraction": int(m["n_zero"]) / max(int(m["n"]), 1)})
    df = pd.DataFrame(rows, columns=["layer", "step", "mean_log2", "std_log2", "zero_fraction"])
    order = {n: i for i, n in enumerate(names)}
    return df.sort_values(["layer", "step"], key=lambda c: c.map(order) if c.name == "layer" else c,
                          kind="stable").reset_index(drop=True)


#: threshold rules checked on the run's samples (the pruning module's rules plus the sort oracle)
SPARSITY_RULES = ("lognormal", "naive_lognormal", "normal", "laplace", "exact_stochastic")
SPARSITY_TARGETS = (0.5, 0.7, 0.8, 0.85, 0.9, 0.95)


def sparsity_check(run: Any, *, targets: Sequence[float] = SPARSITY_TARGETS, rules: Sequence[str] = SPARSITY_RULES,
                   steps: Sequence[int] | None = None, layers: str | Sequence[str] | None = None,
                   seed: int = 0) -> Any:
    """Achieved sparsity of stochastic pruning per threshold rule on the run's raw gradient samples.

    For each sampled layer and step, every rule sets its threshold from the sample's own
    statistics (:func:`gradstats.pruning.threshold`; ``exact_stochastic``: the sort oracle
    :func:`gradstats.pruning.exact_threshold`), :func:`gradstats.pruning.stochastic_prune`
    prunes the sample, and the fraction of zeros is measured. Also the measured cosine
    similarity between the sample and its pruned copy, and the one the lognormal model predicts
    at that threshold (:func:`gradstats.pruning.predicted_cosine`). Returns a DataFrame with
    columns ``layer, step, rule, target, threshold, achieved, cosine, predicted_cosine, p0, sigma``
    (``sigma`` of ``ln|g|``).

    Example:
        >>> import gradstats
        >>> t = sparsity_check(gradstats.zoo.data.data_dir() / "sample-run", targets=[0.9],
        ...                    rules=["lognormal", "exact_stochastic"], steps=[0], layers="conv2")
        >>> t[["rule", "target"]].values.tolist()
        [['lognormal', 0.9], ['exact_stochastic', 0.9]]
        >>> abs(float(t["achieved"][1]) - 0.9) < 0.02  # the sort oracle on the sample itself
        True
    """
    import pandas as pd
    import torch

    from gradstats import pruning
    from gradstats.stats import lognormal_moments, tensor_stats

    run = as_run(run)
    if steps is None:
        steps = sampled_steps(run, "grad")
    if not steps:
        raise ValueError(f"the run at {run.path} kept no raw gradient samples: pruning cannot be measured")
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for name in grid_layers(run, layers, cap=None):
        for s in steps:
            x = layer_values(run, name, int(s), "grad")
            if x is None:
                continue
            st = tensor_stats(x)
            mu, sigma = lognormal_moments(st)
            if not (math.isfinite(sigma) and sigma > 0):
                continue
            p0 = int(st["n_zero"]) / max(int(st["n"]), 1)
            norm = float(x.double().square().sum().sqrt())
            for rule in rules:
                for S in targets:
                    if rule == "exact_stochastic":
                        a = pruning.exact_threshold(x, S, stochastic=True)
                    else:
                        a = float(pruning.threshold(S, st, threshold_rule=rule))
                    y = pruning.stochastic_prune(x, a, generator=gen) if a > 0 else x
                    ynorm = float(y.double().square().sum().sqrt())
                    # every value pruned away (a small layer at a high target): no direction left
                    cos = float((x.double() * y.double()).sum()) / (norm * ynorm) if ynorm > 0 else math.nan
                    rows.append({"layer": name, "step": int(s), "rule": rule, "target": float(S), "threshold": a,
                                 "achieved": float((y == 0).double().mean()), "cosine": cos,
                                 "predicted_cosine": float(pruning.predicted_cosine(a, mu=mu, sigma=sigma)),
                                 "p0": p0, "sigma": sigma})
    return pd.DataFrame(rows, columns=["layer", "step", "rule", "target", "threshold", "achieved", "cosine",
                                       "predicted_cosine", "p0", "sigma"])


def error_check(run: Any, *, steps: Sequence[int] | None = None, bits: Sequence[int] = (8, 6, 4)) -> Any:
    """Predicted against measured quantisation error on the run's raw gradient samples: at each
    sampled step (default: the latest one that also has statistics), :func:`gradstats.recommend`
    chooses each planned layer's format of each width (not bounded: the width's own choice) and
    power-of-two scale from that step's statistics, and
    :func:`gradstats.fpanalysis.measured_error` quantises the step's samples with them. Returns a
    DataFrame with columns ``layer, step, bits, format, log2_scale, sigma_log2, predicted, measured``
    (relative MSE, ``MSE / E[g^2]``).

    Example:
        >>> import gradstats
        >>> t = error_check(gradstats.zoo.data.data_dir() / "sample-run", bits=[8])
        >>> t.loc[t["layer"] == "conv2", "format"].item()
        'e4m3fn'
    """
    import pandas as pd

    from gradstats.plan.recommend import recommend_each

    run = as_run(run)
    if steps is None:
        st = run.stats(kinds=["grad"])
        have = set(int(s) for s in st["step"].unique()) if len(st) else set()
        both = [s for s in sampled_steps(run, "grad") if s in have]
        steps = both[-1:]
    tables = []
    for s in steps:
        try:
            plans = recommend_each(run, bits=list(bits), steps=int(s), noise_bound=None)   # each width's choice
        except ValueError as exc:
            log.info("no recommendation at step %s: %s", s, exc)
            continue
        tables.append(plan_errors(run, plans, int(s)))
    if tables:
        return pd.concat(tables, ignore_index=True)
    return pd.DataFrame([], columns=ERROR_COLUMNS)


#: the columns of :func:`error_check` and :func:`plan_errors`
ERROR_COLUMNS = ["layer", "step", "bits", "format", "log2_scale", "sigma_log2", "predicted", "measured"]


def plan_errors(run: Any, plans: Mapping[int, Any], step: int) -> Any:
    """Predicted against measured quantisation error of each entry of ``plans`` (``{bits: Plan}``) at
    ``step``: the planned format at its predicted scale, with the plan's own rounding (the prediction is
    for it), applied to the step's raw samples. Layers without intact samples there are left out.

    Example:
        >>> import gradstats
        >>> run = gradstats.open_run(gradstats.zoo.data.data_dir() / "sample-run")
        >>> step = sampled_steps(run, "grad")[-1]
        >>> t = plan_errors(run, gradstats.recommend_each(run, bits=[8], steps=step), step)
        >>> list(t.columns[:4]), bool((t["measured"] > 0).all())
        (['layer', 'step', 'bits', 'format'], True)
    """
    import pandas as pd
    import torch

    from gradstats.fpanalysis import measured_error
    from gradstats.run import RunCorruptError

    run = as_run(run)
    rows = []
    for b, plan in plans.items():
        rules = plan.resolve([e.layer for e in plan.entries])
        for e in plan.entries:
            pr = e.predicted
            if pr is None or pr.scale is None:
                continue
            try:
                x = layer_values(run, e.layer, int(step), "grad")
                if x is None:
                    continue
                meas = measured_error(x, e.format, scale=pr.scale, rounding=rules[e.layer].rounding,
                                      generator=torch.Generator().manual_seed(0))
            except (RunCorruptError, ValueError) as exc:
                log.info("no measured error for %s at step %s: %s", e.layer, step, exc)
                continue
            rows.append({"layer": e.layer, "step": int(step), "bits": int(b), "format": str(e.format),
                         "log2_scale": math.log2(pr.scale), "sigma_log2": pr.sigma / _LN2,
                         "predicted": pr.error, "measured": meas})
    return pd.DataFrame(rows, columns=ERROR_COLUMNS)


def plan_moments(plans: Mapping[int, Any]) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """``(layers, mu, sigma, p0)`` of the planned layers with a predicted ``mu`` and ``sigma`` (of
    ``ln|g|``), read from the first plan of ``{bits: Plan}``.

    Example:
        >>> import gradstats
        >>> names, mu, sigma, p0 = plan_moments(gradstats.recommend_each(gradstats.zoo.data.data_dir() / "sample-run",
        ...                                                              bits=[8]))
        >>> names
        ['conv1', 'conv2', 'fc1']
    """
    from gradstats.plan import Prediction

    first = next(iter(plans.values()))
    es = [e for e in first.entries if isinstance(e.predicted, Prediction) and e.predicted.sigma]
    if not es:
        raise ValueError("the plans carry no predicted mu and sigma (recommend them from a run)")
    return ([e.layer for e in es], np.array([e.predicted.mu for e in es]), np.array([e.predicted.sigma for e in es]),
            np.array([e.predicted.p0 or 0.0 for e in es]))
