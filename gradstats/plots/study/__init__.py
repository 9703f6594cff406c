"""The study's figures drawn from a run: where each layer's gradients lie, how well each family
follows them, how they move over training, and what the analysis recommends for them, checked
against the run.

Every ``plot_*`` function takes a run (a :class:`gradstats.Run` or the path of a run directory) or
result objects and returns a matplotlib Figure in the one style of :mod:`gradstats.plots.style`;
values that span binades are drawn on ``log2`` axes. The tables behind them (``goodness_of_fit``,
``moments_over_steps``, ``sparsity_check``, ``error_check``, ...) are public too. Figures of other
topics live beside this package (:mod:`gradstats.plots.fit`, :mod:`.pruning`, :mod:`.fpanalysis`);
:func:`write_figures` writes every figure of a run (``gradstats figures RUN -o DIR``). What each
figure shows and how to read it: ``docs/figures.md``.

Example:
    >>> import tempfile, gradstats
    >>> from gradstats.plots import study
    >>> out = study.write_figures(gradstats.zoo.data.data_dir() / "sample-run", tempfile.mkdtemp(), only=["moments"])
    >>> out["moments"].name, out["moments"].stat().st_size > 10_000
    ('moments.png', True)
"""
from __future__ import annotations

import logging
import os
from typing import Any, Iterable, Mapping

from gradstats.study import (KIND_LABELS, MAX_GRID_LAYERS, SPARSITY_RULES, SPARSITY_TARGETS, _open, error_check,
                    goodness_of_fit, layer_fit, layer_fits, layer_values, moments_over_steps, sampled_steps,
                    sparsity_check)
from gradstats.plots.study.distributions import (plot_goodness_of_fit, plot_ks_by_model, plot_layer_histograms, plot_moments_over_steps,
                            plot_qq)
from gradstats.plots.study.recommended import (plot_cosine_check, plot_error_vs_bits_for_layers, plot_format_map,
                          plot_layer_format_ranges, plot_sparsity_check)

log = logging.getLogger(__name__)

__all__ = ["plot_layer_histograms", "plot_ks_by_model", "plot_qq", "plot_goodness_of_fit", "plot_moments_over_steps", "plot_format_map",
           "plot_layer_format_ranges", "plot_error_vs_bits_for_layers", "plot_sparsity_check", "plot_cosine_check",
           "write_figures", "FIGURES", "sampled_steps", "layer_values", "layer_fit", "layer_fits", "goodness_of_fit",
           "moments_over_steps", "sparsity_check", "error_check", "KIND_LABELS", "MAX_GRID_LAYERS",
           "SPARSITY_RULES", "SPARSITY_TARGETS"]

def write_figures(run: Any, out_dir: str | os.PathLike[str], *, plans: Mapping[int, Any] | None = None,
                  errors: Any = None, only: Iterable[str] | None = None, progress: bool = False) -> dict[str, Any]:
    """Write every figure of a run as PNG files into ``out_dir``; returns ``{name: path}``.

    ``plans``: ``{bits: Plan}`` for the format figures (default: ``recommend(run, bits=[8, 6, 4])``);
    ``errors``: the table of :func:`error_check` (default: computed).
    ``only``: names of :data:`FIGURES` to write (default all). A figure that cannot be drawn for
    this run (e.g. the pruning checks of a run without raw samples) is skipped with a warning.

    Example:
        >>> import tempfile, gradstats
        >>> out = write_figures(gradstats.zoo.data.data_dir() / "sample-run", tempfile.mkdtemp(), only=["moments"])
        >>> out["moments"].name, out["moments"].stat().st_size > 10_000
        ('moments.png', True)
    """
    from pathlib import Path

    from tqdm.auto import tqdm

    from gradstats.plots.style import savefig

    run = _open(run)
    names = list(FIGURES) if only is None else list(only)
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        raise ValueError(f"unknown figure names {unknown}; the figures are {list(FIGURES)}")
    ctx: dict[str, Any] = {"run": run, "plans": plans, "errors": errors}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Any] = {}
    for name in tqdm(names, desc="figures", unit="fig", disable=not progress):
        try:
            fig = FIGURES[name][0](ctx)
        except ValueError as exc:
            log.warning("figure %s skipped: %s", name, exc)
            continue
        written[name] = savefig(fig, out_dir / f"{name}.png")
    return written


def _ctx_plans(ctx: dict[str, Any]) -> Any:
    if ctx.get("plans") is None:
        from gradstats.plan.recommend import recommend

        ctx["plans"] = recommend(ctx["run"], bits=[8, 6, 4])
    return ctx["plans"]


def _ctx_sparsity(ctx: dict[str, Any]) -> Any:
    if "sparsity" not in ctx:
        ctx["sparsity"] = sparsity_check(ctx["run"])
    return ctx["sparsity"]


def _fig_optimal_split() -> Any:
    from gradstats.fpanalysis import crossover_table
    from gradstats.plots.fpanalysis import plot_optimal_exponent_bits

    fig = plot_optimal_exponent_bits(crossover_table())
    fig.tight_layout()
    return fig


def _ctx_errors(ctx: dict[str, Any]) -> Any:
    if ctx.get("errors") is None:
        ctx["errors"] = error_check(ctx["run"], bits=sorted(_ctx_plans(ctx), reverse=True))
    return ctx["errors"]


def _fig_predicted_vs_measured(ctx: dict[str, Any]) -> Any:
    from gradstats.plots.fpanalysis import plot_predicted_vs_measured

    t = _ctx_errors(ctx)
    if t is None or t.empty:
        raise ValueError("the run kept no raw gradient samples at a step with statistics: nothing measured")
    t = t.assign(width=[f"FP{b}" for b in t["bits"]])
    step = ", ".join(str(s) for s in sorted(t["step"].unique()))
    return plot_predicted_vs_measured(t, hue="width", predicted="predicted", measured="measured",
                                      title=f"Predicted vs measured error of the recommended formats\n"
                                            f"(each planned layer, step {step})")


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
                      "each layer's std of log2|g| against the sigma ranges where each split is best"),
    "error_vs_exponent_bits": (lambda c: plot_error_vs_bits_for_layers(_ctx_plans(c)),
                               "predicted error vs exponent bits, FP4 to FP8, at the narrowest and widest "
                               "layer's sigma"),
    "optimal_split": (lambda c: _fig_optimal_split(),
                      "best exponent bits vs sigma with the crossovers, beside the authors' table"),
    "predicted_vs_measured": (lambda c: _fig_predicted_vs_measured(c),
                              "predicted vs measured quantisation error of the recommended formats"),
}
