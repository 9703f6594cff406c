"""The study's figures of a run: each function here computes what its figure shows (the tables of
:mod:`gradstats.study`, the plans of :func:`gradstats.recommend`, the results of
:mod:`gradstats.fpanalysis` and :mod:`gradstats.pruning`) and hands it to the drawing functions of
:mod:`gradstats.plots`, which draw what they are given.

Every ``plot_*`` function takes a run (a :class:`gradstats.Run` or the path of a run directory),
or the plans or table it would otherwise compute, and returns a matplotlib Figure.
:func:`write_figures` writes every figure of :data:`FIGURES` for a run (``gradstats figures RUN -o
DIR``). What each figure shows and how to read it: ``docs/figures.md``.

Example:
    >>> import tempfile, gradstats
    >>> from gradstats import figures
    >>> out = figures.write_figures(gradstats.zoo.data.data_dir() / "sample-run", tempfile.mkdtemp(), only=["moments"])
    >>> out["moments"].name, out["moments"].stat().st_size > 10_000
    ('moments.png', True)
"""
from __future__ import annotations

import logging
import math
import os
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

log = logging.getLogger(__name__)

__all__ = ["write_figures", "FIGURES", "plot_layer_histograms", "plot_qq", "plot_goodness_of_fit",
           "plot_moments_over_steps", "plot_sparsity_check", "plot_cosine_check", "plot_format_map",
           "plot_layer_format_ranges", "plot_error_vs_bits_for_layers", "plot_optimal_split", "plot_error_check",
           "plot_error_vs_exponent_bits", "plot_threshold_vs_sigma", "plot_cosine_vs_sparsity",
           "threshold_vs_sigma", "cosine_vs_sparsity", "layer_format_choices", "crossovers_for",
           "format_bands"]

_LN2 = math.log(2.0)
#: the widths and setting of the error-against-exponent-bits panels
_ERROR_BITS = range(4, 9)


# ----------------------------------------------------------------------------- distributions
def plot_layer_histograms(run: Any, *, step: int | None = None, layers: str | Sequence[str] | None = None,
                          kinds: Sequence[str] = ("grad", "act", "weight")) -> Any:
    """Per layer (rows), the histogram of ``log2|x|`` with the three fitted densities, gradients
    beside activations and weights (:func:`gradstats.plots.study.distributions.plot_layer_histograms`
    of :func:`gradstats.study.layer_fit` at ``step``, default the latest step with raw samples;
    without samples the streamed binade histograms are fitted instead).

    Example:
        >>> import gradstats
        >>> fig = plot_layer_histograms(gradstats.zoo.data.data_dir() / "sample-run", layers=["conv2", "fc1"])
        >>> len(fig.axes)
        6
    """
    from gradstats.plots.study.distributions import plot_layer_histograms as draw
    from gradstats.run import as_run
    from gradstats.study import grid_layers, layer_fit, pick_step

    run = as_run(run)
    step = pick_step(run, step)
    names = grid_layers(run, layers)
    stats = run.stats()
    have = set(stats["kind"].unique()) if len(stats) else set()
    idx = run.sample_index()
    have |= set(idx["kind"].unique()) if len(idx) else set()
    kinds = [k for k in kinds if k in have]
    if "grad" not in kinds:
        raise ValueError(f"the run at {run.path} has no neural-gradient ('grad') captures to draw")
    fits: dict[str, dict[str, Any]] = {}
    for name in names:
        fits[name] = {}
        for kind in kinds:
            try:
                fits[name][kind] = layer_fit(run, name, step, kind)
            except ValueError as exc:      # drawn as a note in its panel
                fits[name][kind] = exc
    return draw(fits, step=step)


def plot_qq(run_or_fits: Any, *, step: int | None = None, layers: str | Sequence[str] | None = None,
            ncols: int = 3) -> Any:
    """Q-Q plot of ``ln|g|`` against the standard normal, one panel per layer
    (:func:`gradstats.plots.study.distributions.plot_qq`). ``run_or_fits``: a run (fitted at
    ``step``, default the latest sampled step) or a mapping ``{layer: FitResult}``.

    Example:
        >>> import gradstats
        >>> fig = plot_qq(gradstats.zoo.data.data_dir() / "sample-run", layers="conv*")
        >>> fig.axes[0].get_xlabel()
        'standard normal quantile'
    """
    from gradstats.plots.study.distributions import plot_qq as draw
    from gradstats.study import fits_at

    fits, where = fits_at(run_or_fits, step, "grad", layers)
    return draw(fits, where=where, ncols=ncols)


def plot_goodness_of_fit(run_or_table: Any, *, kind: str = "grad", layers: str | Sequence[str] | None = None) -> Any:
    """KS distance per family and Vuong effect size per layer
    (:func:`gradstats.plots.study.distributions.plot_goodness_of_fit`). ``run_or_table``: a run, or
    the DataFrame of :func:`gradstats.study.goodness_of_fit`.

    Example:
        >>> import gradstats
        >>> fig = plot_goodness_of_fit(gradstats.zoo.data.data_dir() / "sample-run")
        >>> fig.axes[0].get_yscale()
        'log'
    """
    import pandas as pd

    from gradstats.plots.study.distributions import plot_goodness_of_fit as draw
    from gradstats.study import goodness_of_fit

    df = run_or_table if isinstance(run_or_table, pd.DataFrame) else goodness_of_fit(run_or_table, kind=kind,
                                                                                         layers=layers)
    if df.empty:
        raise ValueError("no layer could be fitted: nothing to draw")
    return draw(df)


def plot_moments_over_steps(run: Any, *, kind: str = "grad", layers: str | Sequence[str] | None = None) -> Any:
    """Per layer over training: mean and std of ``log2|x|`` and the zero fraction
    (:func:`gradstats.plots.study.distributions.plot_moments_over_steps` of
    :func:`gradstats.study.moments_over_steps`).

    Example:
        >>> import gradstats
        >>> fig = plot_moments_over_steps(gradstats.zoo.data.data_dir() / "sample-run")
        >>> [ax.get_ylabel() for ax in fig.axes[:2]]
        ['mean of log2|g|', 'std of log2|g|  (binades)']
    """
    from gradstats.plots.study.distributions import plot_moments_over_steps as draw
    from gradstats.run import as_run
    from gradstats.study import moments_over_steps

    run = as_run(run)
    df = moments_over_steps(run, kind=kind, layers=layers)
    if df.empty:
        raise ValueError(f"the run at {run.path} has no {kind!r} statistics")
    return draw(df, kind=kind)


# ----------------------------------------------------------------------------- pruning checks
def plot_sparsity_check(run_or_table: Any, **kw: Any) -> Any:
    """Achieved against target sparsity per threshold rule on the run's gradients
    (:func:`gradstats.plots.study.recommended.plot_sparsity_check` of
    :func:`gradstats.study.sparsity_check`, which ``kw`` go to).

    Example:
        >>> import gradstats
        >>> fig = plot_sparsity_check(gradstats.zoo.data.data_dir() / "sample-run", steps=[0], targets=[0.5, 0.9])
        >>> fig.axes[0].get_xlabel()
        'target sparsity'
    """
    import pandas as pd

    from gradstats.plots.study.recommended import plot_sparsity_check as draw
    from gradstats.study import sparsity_check

    table = run_or_table if isinstance(run_or_table, pd.DataFrame) else sparsity_check(run_or_table, **kw)
    return draw(table)


def plot_cosine_check(run_or_table: Any, *, rule: str = "lognormal", **kw: Any) -> Any:
    """The cost of stochastic pruning (``1 - cos``) at the ``rule``'s thresholds, predicted against
    measured (:func:`gradstats.plots.study.recommended.plot_cosine_check` of
    :func:`gradstats.study.sparsity_check`, which ``kw`` go to).

    Example:
        >>> import gradstats
        >>> fig = plot_cosine_check(gradstats.zoo.data.data_dir() / "sample-run", steps=[0], layers=["conv2"])
        >>> fig.axes[0].get_xscale(), fig.axes[0].get_yscale()
        ('log', 'log')
    """
    import pandas as pd

    from gradstats.plots.study.recommended import plot_cosine_check as draw
    from gradstats.study import sparsity_check

    table = run_or_table if isinstance(run_or_table, pd.DataFrame) else sparsity_check(
        run_or_table, rules=[rule], **kw)
    return draw(table, rule=rule)


# ----------------------------------------------------------------------------- formats
def plot_format_map(plans: Any, *, measured: Any = None, title: str | None = None) -> Any:
    """The per-layer map of recommended formats (:func:`gradstats.plots.study.recommended.plot_format_map`).
    ``plans``: ``{bits: Plan}`` (:func:`gradstats.recommend` for a list of widths) or one Plan;
    ``measured``: optional table of :func:`gradstats.study.error_check`.

    Example:
        >>> import gradstats
        >>> plans = gradstats.recommend_each(gradstats.zoo.data.data_dir() / "sample-run", bits=[8, 6, 4])
        >>> [t.get_text() for t in plot_format_map(plans).axes[0].get_xticklabels()]
        ['FP8', 'FP6', 'FP4']
    """
    from gradstats.plots.study.recommended import plot_format_map as draw

    return draw(plans, measured=measured, title=title)


def crossovers_for(best: Any) -> Any:
    """The :func:`gradstats.fpanalysis.crossover_table` of one width behind a
    :class:`~gradstats.fpanalysis.BestFormat`'s layers (their sigma range), or None under block
    scaling (the bands are for a per-tensor scale).

    Example:
        >>> from gradstats.fpanalysis import best_format
        >>> t = crossovers_for(best_format(8, mu=[-9.0], sigma=[2.0]))
        >>> sorted({r["bits"] for r in t.ranges})
        [8]
    """
    from gradstats.fpanalysis import crossover_table

    if best.block_size is not None:
        return None
    sig = np.atleast_1d(np.asarray(best.sigma, dtype=np.float64)) / _LN2
    xmax = max(float(sig.max()) * 1.15, 1.0)
    return crossover_table(bits=[best.bits], special=best.candidates[0].special, sigma_max=max(xmax, 1.0),
                           step=0.05 if xmax < 8 else 0.1)


def format_bands(best: Any) -> Any:
    """The sigma ranges where each of a :class:`~gradstats.fpanalysis.BestFormat`'s candidates is
    the best of them for an unbounded lognormal, at its setting (rounding, scale rule), over the
    layers' sigma range: the bands against which :func:`plot_layer_format_ranges` draws each
    layer's choice (every split's bands: :func:`crossovers_for`). A
    :class:`~gradstats.fpanalysis.CrossoverTable` holding ``ranges`` only, or None under block
    scaling. A layer whose choice lies outside its band was moved there by what the bands leave
    out: its observed maximum (``best.amax``), which bounds the upper tail.

    Example:
        >>> from gradstats.fpanalysis import best_format
        >>> b = best_format(6, mu=[-9.0], sigma=[2.0], candidates=["e2m3fn", "e3m2fn"])
        >>> [r["format"] for r in format_bands(b).ranges]
        ['e2m3fn', 'e3m2fn']
    """
    from gradstats.fpanalysis import CrossoverTable, best_format

    if best.block_size is not None:
        return None
    sig = np.atleast_1d(np.asarray(best.sigma, dtype=np.float64)) / _LN2
    xmax = max(float(sig.max()) * 1.15, 1.0) * 1.15     # the drawing's right edge
    grid = np.arange(0.05, xmax + 0.05, 0.025)
    # the choice depends on sigma alone (up to the power-of-two rounding of the scale); mu puts
    # the values' energy, at exp(mu + 2 sigma^2), at 1, where every scale is representable
    s_ln = grid * _LN2
    on = best_format(int(best.bits), mu=-2.0 * s_ln ** 2, sigma=s_ln, candidates=list(best.candidates),
                     rounding=best.rounding, criterion=best.criterion, power_of_two=best.power_of_two)
    fmts = [str(f) for f in on.format]
    starts = [0] + [k for k in range(1, len(fmts)) if fmts[k] != fmts[k - 1]]
    ranges = tuple({"bits": int(best.bits), "exp_bits": on.format[a].exp_bits, "man_bits": on.format[a].man_bits,
                    "format": fmts[a], "sigma_lo": float(grid[a]) if a else float(grid[0]),
                    "sigma_hi": float(grid[starts[n + 1]]) if n + 1 < len(starts) else float(grid[-1]),
                    "open_end": n + 1 == len(starts)} for n, a in enumerate(starts))
    return CrossoverTable(ranges, (), {"sigma_range": (float(grid[0]), float(grid[-1])),
                                       "candidates": [str(c) for c in best.candidates],
                                       "rounding": best.rounding, "power_of_two": best.power_of_two},
                          grid, {})


def layer_format_choices(plans: Mapping[int, Any]) -> dict[int, Any]:
    """``{bits: BestFormat}``: each planned layer's format ranked at the plans' ``mu``, ``sigma``,
    ``p0`` (and observed maximum, per-tensor scales), among the formats the plan of that width
    holds, as :func:`gradstats.recommend` chose them.

    Example:
        >>> import gradstats
        >>> plans = gradstats.recommend_each(gradstats.zoo.data.data_dir() / "sample-run", bits=[8])
        >>> str(layer_format_choices(plans)[8].format[1])
        'e4m3fn'
    """
    from gradstats.fpanalysis import best_format
    from gradstats.study import plan_moments

    names, mu, sigma, p0 = plan_moments(plans)
    first = next(iter(plans.values()))
    pred = {e.layer: e.predicted for e in first.entries}
    amax = np.array([pred[n].amax if pred[n].amax else np.nan for n in names])
    cond = {"amax": amax} if np.isfinite(amax).all() and first.defaults.block_size is None else {}
    out = {}
    for b in plans:     # the formats of the width (a bounded plan may hold wider ones, or none)
        cands = sorted({e.format for e in plans[b].entries if e.format is not None and e.format.bits == int(b)},
                       key=lambda f: (f.special != "fn", str(f)))
        if cands:
            out[b] = best_format(int(b), mu=mu, sigma=sigma, p0=p0, names=names, **cond, candidates=cands)
    return out


def plot_layer_format_ranges(plans: Mapping[int, Any]) -> Any:
    """Per bit width, each planned layer's std of ``log2|g|`` with its chosen format over the
    sigma ranges where each of the plan's formats is best for an unbounded lognormal
    (:func:`gradstats.plots.study.recommended.plot_layer_format_ranges` of
    :func:`layer_format_choices` and :func:`format_bands`). A layer outside the band of its own
    format is ringed: its observed maximum moved the choice.

    Example:
        >>> import gradstats
        >>> plans = gradstats.recommend_each(gradstats.zoo.data.data_dir() / "sample-run", bits=[8, 4])
        >>> len(plot_layer_format_ranges(plans).axes)
        2
    """
    from gradstats.plots.study.recommended import plot_layer_format_ranges as draw

    best = layer_format_choices(plans)
    return draw(best, crossovers={b: format_bands(r) for b, r in best.items()})


def _error_vs_bits(sigma: float, *, bits: Iterable[int] = _ERROR_BITS, special: str = "fn",
                   rounding: str = "nearest", power_of_two: bool = False) -> list[Any]:
    from gradstats.fpanalysis import best_format

    # the relative error at the best scale depends on sigma alone: any mu draws the same curves. The
    # error weighs LN(mu + 2 sigma^2, sigma) (the energy), so mu = -2 sigma^2 keeps each best scale near
    # 2^0; mu = 0 put the narrow splits' best scales below 2^-126 (float32's range) from sigma ~ 6.6 on
    mu = -2.0 * sigma * sigma
    return [best_format(b, mu=mu, sigma=sigma, candidates=special, rounding=rounding, power_of_two=power_of_two)
            for b in bits]


def plot_error_vs_exponent_bits(sigma: float, *, bits: Iterable[int] = _ERROR_BITS, special: str = "fn",
                                rounding: str = "nearest", power_of_two: bool = False, ax: Any = None,
                                path: str | os.PathLike[str] | None = None) -> Any:
    """Predicted relative MSE of every split of each bit width, each at its best scale, at one
    layer's ``sigma`` (std of ln|g|) (:func:`gradstats.plots.fpanalysis.plot_error_vs_exponent_bits`
    of :func:`gradstats.fpanalysis.best_format`).

    Example:
        >>> fig = plot_error_vs_exponent_bits(1.5, bits=[8])
        >>> fig.axes[0].get_yscale()
        'log'
    """
    from gradstats.plots.fpanalysis import plot_error_vs_exponent_bits as draw

    return draw(_error_vs_bits(sigma, bits=bits, special=special, rounding=rounding, power_of_two=power_of_two),
                ax=ax, path=path)


def plot_error_vs_bits_for_layers(plans: Mapping[int, Any]) -> Any:
    """Predicted error of every split, FP4 to FP8, at the sigma of the planned layer with the
    narrowest and of the one with the widest gradients
    (:func:`gradstats.plots.study.recommended.plot_error_vs_bits_for_layers`).

    Example:
        >>> import gradstats
        >>> plans = gradstats.recommend_each(gradstats.zoo.data.data_dir() / "sample-run", bits=[8])
        >>> len(plot_error_vs_bits_for_layers(plans).axes)
        2
    """
    from gradstats.plots.study.recommended import plot_error_vs_bits_for_layers as draw
    from gradstats.study import plan_moments

    names, _, sigma, _ = plan_moments(plans)
    pick = [int(np.argmin(sigma)), int(np.argmax(sigma))] if len(sigma) > 1 else [0]
    return draw([(names[k], _error_vs_bits(float(sigma[k]))) for k in pick])


def plot_optimal_split(table: Any = None, *, authors: bool = True) -> Any:
    """Best exponent bits against sigma per width with the crossovers, beside the authors' table
    (:func:`gradstats.plots.fpanalysis.plot_optimal_exponent_bits` of ``table``, default
    :func:`gradstats.fpanalysis.crossover_table`).

    Example:
        >>> from gradstats.fpanalysis import crossover_table
        >>> fig = plot_optimal_split(crossover_table(bits=[6], sigma_max=4.0))
        >>> fig.axes[-1].get_xlabel()
        'σ = std of log2|g| (binades)'
    """
    from gradstats.fpanalysis import AUTHORS_TABLE, crossover_table
    from gradstats.plots.fpanalysis import plot_optimal_exponent_bits as draw

    fig = draw(crossover_table() if table is None else table, authors=AUTHORS_TABLE if authors else None)
    fig.tight_layout()
    return fig


def plot_error_check(run_or_table: Any, *, bits: Sequence[int] = (8, 6, 4)) -> Any:
    """Predicted against measured quantisation error of the recommended formats on the run's raw
    samples (:func:`gradstats.plots.fpanalysis.plot_predicted_vs_measured` of
    :func:`gradstats.study.error_check`, or of its table).

    Example:
        >>> import gradstats
        >>> fig = plot_error_check(gradstats.zoo.data.data_dir() / "sample-run", bits=[8])
        >>> fig.axes[0].get_xscale()
        'log'
    """
    import pandas as pd

    from gradstats.plots.fpanalysis import plot_predicted_vs_measured
    from gradstats.study import error_check

    t = run_or_table if isinstance(run_or_table, pd.DataFrame) or run_or_table is None else \
        error_check(run_or_table, bits=bits)
    if t is None or t.empty:
        raise ValueError("the run kept no raw gradient samples at a step with statistics: nothing measured")
    t = t.assign(width=[f"FP{b}" for b in t["bits"]])
    step = ", ".join(str(s) for s in sorted(t["step"].unique()))
    return plot_predicted_vs_measured(t, hue="width", predicted="predicted", measured="measured",
                                      title=f"Predicted vs measured error of the recommended formats\n"
                                            f"(each planned layer, step {step})")


# ----------------------------------------------------------------------------- pruning on a lognormal layer
def threshold_vs_sigma(sigmas: Sequence[float] | None = None,
                       targets: Sequence[float] = (0.5, 0.85, 0.95)) -> Any:
    """Thresholds for each target sparsity on an exactly lognormal layer (``mu = 0``, so in units of
    its median ``|g|``) per sigma of ln|g| (default 60 from 0.25 to 4): the analytic rule
    (``lognormal``), the naive quantile, and the normal and Laplace rules fitted to the same layer
    (``E g^2 = exp(2 sigma^2)``, ``E|g| = exp(sigma^2 / 2)``), as a DataFrame with columns
    ``sigma, target, lognormal, naive_lognormal, normal, laplace``.

    Example:
        >>> t = threshold_vs_sigma([1.0], [0.9])
        >>> bool(t["lognormal"].item() < t["normal"].item())
        True
    """
    import pandas as pd

    from gradstats.pruning import threshold

    s = np.linspace(0.25, 4.0, 60) if sigmas is None else np.asarray(sigmas, dtype=np.float64)
    parts = []
    for S in targets:
        parts.append(pd.DataFrame({
            "sigma": s, "target": float(S),
            "lognormal": threshold(S, mu=0.0, sigma=s),
            "naive_lognormal": threshold(S, mu=0.0, sigma=s, threshold_rule="naive_lognormal"),
            "normal": threshold(S, scale=np.exp(s ** 2), threshold_rule="normal"),
            "laplace": threshold(S, scale=np.exp(s ** 2 / 2), threshold_rule="laplace")}))
    return pd.concat(parts, ignore_index=True)


def plot_threshold_vs_sigma(sigmas: Sequence[float] | None = None, targets: Sequence[float] = (0.5, 0.85, 0.95),
                            *, path: str | os.PathLike[str] | None = None) -> Any:
    """:func:`gradstats.plots.pruning.plot_threshold_vs_sigma` of :func:`threshold_vs_sigma`.

    Example:
        >>> len(plot_threshold_vs_sigma([0.5, 1.0, 2.0], [0.9]).axes)
        1
    """
    from gradstats.plots.pruning import plot_threshold_vs_sigma as draw

    return draw(threshold_vs_sigma(sigmas, targets), targets=list(targets), path=path)


def cosine_vs_sparsity(sigmas: Sequence[float] = (0.5, 1.0, 2.0, 3.0, 4.0)) -> Any:
    """Predicted cosine between ``g`` and its stochastic pruning at the lognormal threshold, per
    sigma of ln|g| and target sparsity (200 from 0.01 to 0.995), as a DataFrame with columns
    ``sigma, sparsity, one_minus_cosine`` (``1 - 1/sqrt(1 + added variance)``, accurate when tiny).

    Example:
        >>> c = cosine_vs_sparsity([1.0])
        >>> bool(c["one_minus_cosine"].is_monotonic_increasing)
        True
    """
    import pandas as pd

    from gradstats.pruning import added_variance, threshold

    S = np.linspace(0.01, 0.995, 200)
    parts = []
    for sg in sigmas:
        d = added_variance(threshold(S, mu=0.0, sigma=sg), mu=0.0, sigma=sg, relative=True)
        parts.append(pd.DataFrame({"sigma": sg, "sparsity": S, "one_minus_cosine": -np.expm1(-0.5 * np.log1p(d))}))
    return pd.concat(parts, ignore_index=True)


def plot_cosine_vs_sparsity(sigmas: Sequence[float] = (0.5, 1.0, 2.0, 3.0, 4.0), *, measured: Any = None,
                            path: str | os.PathLike[str] | None = None) -> Any:
    """:func:`gradstats.plots.pruning.plot_cosine_vs_sparsity` of :func:`cosine_vs_sparsity`.

    Example:
        >>> plot_cosine_vs_sparsity([1.0, 2.0]).axes[0].get_xlabel()
        'sparsity (fraction of zeros)'
    """
    from gradstats.plots.pruning import plot_cosine_vs_sparsity as draw

    return draw(cosine_vs_sparsity(sigmas), measured=measured, path=path)


# ----------------------------------------------------------------------------- every figure of a run
def write_figures(run: Any, out_dir: str | os.PathLike[str], *, plans: Mapping[int, Any] | None = None,
                  errors: Any = None, only: Iterable[str] | None = None, progress: bool = False) -> dict[str, Any]:
    """Write every figure of a run as PNG files into ``out_dir``; returns ``{name: path}``.

    ``plans``: ``{bits: Plan}`` for the format figures (default: ``recommend_each(run, bits=[8, 6, 4],
    noise_bound=None)``: each width's choice on every layer, which the noise bound would widen in places);
    ``errors``: the table of :func:`gradstats.study.error_check` (default: computed).
    ``only``: names of :data:`FIGURES` to write (default all). A figure that cannot be drawn for
    this run (e.g. the pruning checks of a run without raw samples) is skipped with a warning.

    Example:
        >>> import tempfile, gradstats
        >>> out = write_figures(gradstats.zoo.data.data_dir() / "sample-run", tempfile.mkdtemp(), only=["moments"])
        >>> out["moments"].name, out["moments"].stat().st_size > 10_000
        ('moments.png', True)
    """
    from pathlib import Path

    from gradstats._progress import progress_bar
    from gradstats.plots.style import savefig
    from gradstats.run import as_run

    run = as_run(run)
    names = list(FIGURES) if only is None else list(only)
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        raise ValueError(f"unknown figure names {unknown}; the figures are {list(FIGURES)}")
    ctx: dict[str, Any] = {"run": run, "plans": plans, "errors": errors}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Any] = {}
    for name in progress_bar(names, desc="figures", unit="figure", progress=progress, logger=log,
                             note=f"drawing {len(names)} figure(s) into {out_dir}"):
        try:
            fig = FIGURES[name][0](ctx)
        except ValueError as exc:
            log.warning("figure %s skipped: %s", name, exc)
            continue
        written[name] = savefig(fig, out_dir / f"{name}.png")
    return written


def _ctx_plans(ctx: dict[str, Any]) -> Any:
    if ctx.get("plans") is None:
        from gradstats.plan.recommend import recommend_each

        ctx["plans"] = recommend_each(ctx["run"], bits=[8, 6, 4], noise_bound=None)   # each width's own choice
    return ctx["plans"]


def _ctx_sparsity(ctx: dict[str, Any]) -> Any:
    if "sparsity" not in ctx:
        from gradstats.study import sparsity_check

        ctx["sparsity"] = sparsity_check(ctx["run"])
    return ctx["sparsity"]


def _ctx_errors(ctx: dict[str, Any]) -> Any:
    if ctx.get("errors") is None:
        from gradstats.study import error_check

        ctx["errors"] = error_check(ctx["run"], bits=sorted(_ctx_plans(ctx), reverse=True))
    return ctx["errors"]


#: every figure :func:`write_figures` writes: name -> (function of a context, one-line caption)
FIGURES: dict[str, tuple[Any, str]] = {
    "distributions": (lambda c: plot_layer_histograms(c["run"]),
                      "histogram of log2|x| per layer: neural gradients with the three fitted densities, "
                      "activations and weights beside"),
    "qq": (lambda c: plot_qq(c["run"]), "Q-Q plot of ln|g| against the normal per layer"),
    "goodness_of_fit": (lambda c: plot_goodness_of_fit(c["run"]),
                        "KS distance per family and Vuong effect size per layer"),
    "moments": (lambda c: plot_moments_over_steps(c["run"]),
                "mean and std of log2|g| and zero fraction per layer over training"),
    "sparsity": (lambda c: plot_sparsity_check(_ctx_sparsity(c)),
                 "achieved vs target sparsity per threshold rule on the run's gradients"),
    "cosine": (lambda c: plot_cosine_check(_ctx_sparsity(c)),
               "cost of stochastic pruning (1 - cosine similarity): lognormal prediction vs measured"),
    "format_map": (lambda c: plot_format_map(_ctx_plans(c), measured=_ctx_errors(c)),
                   "recommended FP8/FP6/FP4 format per layer, predicted and measured SNR"),
    "format_ranges": (lambda c: plot_layer_format_ranges(_ctx_plans(c)),
                      "each layer's std of log2|g| and chosen format against the sigma ranges where each of "
                      "the plan's formats is best"),
    "error_vs_exponent_bits": (lambda c: plot_error_vs_bits_for_layers(_ctx_plans(c)),
                               "predicted error vs exponent bits, FP4 to FP8, at the narrowest and widest "
                               "layer's sigma"),
    "optimal_split": (lambda c: plot_optimal_split(),
                      "best exponent bits vs sigma with the crossovers, beside the authors' table"),
    "predicted_vs_measured": (lambda c: plot_error_check(_ctx_errors(c)),
                              "predicted vs measured quantisation error of the recommended formats"),
}
