"""The drawing modules on their own: each ``plot_*`` of gradstats.plots draws the small hand-made
table or result it is given (no run, no analysis), and the drawing package imports nothing of the
analysis."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure

from gradstats.formats import FPFormat

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _close():
    import matplotlib.pyplot as plt

    yield
    plt.close("all")


def _fit(best: str = "lognormal", qq: bool = True) -> SimpleNamespace:
    """A FitResult-like object: what the histogram and Q-Q panels read."""
    edges = np.arange(-14.0, -4.0)
    counts = np.exp(-0.5 * ((edges[:-1] + 9.0) / 2.0) ** 2) * 1000
    p = np.linspace(0.01, 0.99, 30)
    return SimpleNamespace(
        log2_edges=edges, log2_counts=counts, families=("lognormal", "normal", "laplace"), best=best,
        params={"lognormal": {"mu": -6.2, "sigma": 1.4}, "normal": {"scale": 0.005}, "laplace": {"scale": 0.003}},
        ks={"lognormal": 0.01, "normal": 0.2, "laplace": 0.1}, zero_fraction=0.05, source="samples",
        qq_p=p if qq else None, qq_ln=-6.2 + 1.4 * np.sort(np.random.default_rng(0).normal(size=30)),
        ln_skew=0.1, ln_exkurt=-0.2, n_nonzero=1000)


def _best(bits: int, sigma: float | list[float], names=None, block_size=None) -> SimpleNamespace:
    """A BestFormat-like object at one or several sigmas (every split of ``bits`` a candidate)."""
    cands = tuple(FPFormat(e, bits - 1 - e, special="fn") for e in range(1, bits - 1))
    sig = np.atleast_1d(np.asarray(sigma, dtype=float))
    errs = np.array([[10.0 ** -(1 + abs(c.exp_bits - s)) for c in cands] for s in sig])
    order = np.argsort(errs, axis=1)
    single = np.ndim(sigma) == 0
    top = [cands[o[0]] for o in order]
    return SimpleNamespace(
        bits=bits, candidates=cands, errors=errs[0] if single else errs, order=order[0] if single else order,
        sigma=float(sigma) if single else sig, names=tuple(names) if names else None, rounding="nearest",
        power_of_two=False, block_size=block_size, scale_format=None,
        format=top[0] if single else top, error=errs[np.arange(len(sig)), order[:, 0]])


def _crossovers(bits: int) -> SimpleNamespace:
    return SimpleNamespace(
        ranges=({"bits": bits, "exp_bits": 2, "format": f"e2m{bits - 3}fn", "sigma_lo": 0.05, "sigma_hi": 1.0,
                 "open_end": False},
                {"bits": bits, "exp_bits": 3, "format": f"e3m{bits - 4}fn", "sigma_lo": 1.0, "sigma_hi": 4.0,
                 "open_end": True}),
        assumptions={"sigma_range": (0.05, 4.0), "convention": "fn", "subnormals": True, "rounding": "nearest",
                     "scale": "best scale"})


# ----------------------------------------------------------------------------- plots.study.distributions
def test_layer_histograms_draw_the_fits_given():
    from gradstats.plots.study.distributions import plot_layer_histograms

    fig = plot_layer_histograms({"conv1": {"grad": _fit(), "act": _fit("normal")},
                                 "fc1": {"grad": _fit(), "act": ValueError("sigma = 0 of the values")}}, step=3)
    assert isinstance(fig, Figure) and len(fig.axes) == 4
    assert [ax.texts[-1].get_text() for ax in fig.axes[:2]] == ["neural gradient g", "activation (layer output)"]
    assert [ax.get_title(loc="left") for ax in fig.axes[::2]] == ["conv1", "fc1"]
    assert fig.axes[0].get_ylabel() == "density / binade"
    assert fig.axes[2].get_xlabel() == "log2 |x|  (binades)"
    assert "step 3" in fig._suptitle.get_text()
    assert len(fig.axes[0].lines) == 3                     # the three densities
    assert "constant values" in fig.axes[3].texts[0].get_text() and not fig.axes[3].lines
    with pytest.raises(ValueError, match="no layer"):
        plot_layer_histograms({}, step=0)


def test_qq_one_panel_per_fit():
    from gradstats.plots.study.distributions import plot_qq

    fig = plot_qq({"a": _fit(), "b": _fit(qq=False), "c": _fit()}, where="step 7", ncols=2)
    assert isinstance(fig, Figure) and len(fig.axes) == 4 and not fig.axes[3].get_visible()
    assert [ax.get_title() for ax in fig.axes[:3]] == ["a", "b", "c"]
    assert len(fig.axes[0].lines) == 4                     # the data and three families
    assert "no quantiles" in fig.axes[1].texts[0].get_text()
    assert fig._suptitle.get_text().endswith(", step 7")
    with pytest.raises(ValueError, match="nothing to draw"):
        plot_qq({})


def test_goodness_of_fit_draws_the_table():
    from gradstats.plots.study.distributions import plot_goodness_of_fit

    t = pd.DataFrame({"layer": ["a", "a", "b"], "step": [0, 1, 0], "ks_lognormal": [0.01, 0.02, 0.03],
                      "ks_normal": [0.2, 0.3, 0.2], "ks_laplace": [0.1, 0.1, 0.1],
                      "vuong_lognormal_vs_normal": [0.5, 0.4, 0.3], "vuong_lognormal_vs_laplace": [0.2, 0.1, 0.1]})
    fig = plot_goodness_of_fit(t)
    ks, vx = fig.axes
    assert ks.get_yscale() == "log" and ks.get_ylabel() == "KS distance on |g|  (log scale)"
    assert [t.get_text() for t in ks.get_xticklabels()] == ["a", "b"]
    assert vx.get_ylabel() == "Vuong effect size z/sqrt(n)" and len(vx.patches) == 4   # 2 layers x 2 pairs
    assert "2 steps" in fig._suptitle.get_text()
    no_vuong = plot_goodness_of_fit(t.assign(vuong_lognormal_vs_normal=np.nan, vuong_lognormal_vs_laplace=np.nan))
    assert "raw samples" in no_vuong.axes[1].texts[0].get_text()


def test_moments_one_line_per_layer_and_panel():
    from gradstats.plots.study.distributions import plot_moments_over_steps

    t = pd.DataFrame({"layer": ["a", "a", "b", "b"], "step": [0, 1, 0, 1], "mean_log2": [-9.0, -9.5, -12, -12],
                      "std_log2": [2.0, 2.1, 3.0, 3.1], "zero_fraction": [0.1, 0.2, 0.0, 0.0]})
    fig = plot_moments_over_steps(t, kind="act")
    assert [ax.get_ylabel() for ax in fig.axes] == ["mean of log2|a|", "std of log2|a|  (binades)",
                                                    "fraction of exact zeros"]
    assert all(len(ax.lines) == 2 for ax in fig.axes)
    assert fig._suptitle.get_text() == "Activation (layer output) statistics over training"
    with pytest.raises(ValueError, match="no 'grad' statistics"):
        plot_moments_over_steps(t.iloc[:0])


def test_ks_by_model_one_panel_per_kind():
    from gradstats.plots.study.distributions import plot_ks_by_model

    f = pd.DataFrame({"model": ["m"] * 6, "kind": ["grad"] * 3 + ["act"] * 3, "status": ["ok"] * 6,
                      "family": ["lognormal", "normal", "laplace"] * 2, "ks": [0.01, 0.2, 0.1, 0.05, 0.1, 0.2]})
    assert [ax.get_title() for ax in plot_ks_by_model(f).axes] == ["neural gradient g", "activation (layer output)"]


# ----------------------------------------------------------------------------- plots.study.recommended
def _plans():
    def entry(layer, fmt, sigma):
        pred = SimpleNamespace(error=10 ** -3.2, sigma=sigma, scale=2.0 ** -10, mu=-9.0, p0=0.0, amax=None)
        return SimpleNamespace(layer=layer, format=FPFormat.parse(fmt), predicted=pred)

    return {8: SimpleNamespace(entries=[entry("conv1", "e4m3fn", 1.5), entry("fc1", "e5m2fn", 3.0)]),
            4: SimpleNamespace(entries=[entry("conv1", "e2m1fn", 1.5), entry("fc1", "e2m1fn", 3.0)])}


def test_format_map_reads_plan_like_objects():
    from gradstats.plots.study.recommended import plot_format_map

    measured = pd.DataFrame({"layer": ["conv1", "fc1"], "bits": [8, 8], "step": [0, 0], "measured": [1e-3, 0.5]})
    fig = plot_format_map(_plans(), measured=measured)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["FP8", "FP4"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["conv1  (std log2 2.16)", "fc1  (std log2 4.33)"]
    assert len(ax.texts) == 4 and "measured" in ax.texts[0].get_text()
    assert len(ax.patches) == 1                             # fc1 at FP8: measured over twice the prediction
    assert fig.axes[1].get_ylabel() == "exponent bits"     # the colour bar
    one = plot_format_map(_plans()[8])                     # one plan of one width
    assert [t.get_text() for t in one.axes[0].get_xticklabels()] == ["FP8"]
    with pytest.raises(ValueError, match="plans must be"):
        plot_format_map({})


def test_layer_format_ranges_one_row_per_width():
    from gradstats.plots.study.recommended import plot_layer_format_ranges

    best = {8: _best(8, [1.0, 2.5], names=["fc1", "conv1"]), 4: _best(4, [1.0, 2.5], names=["fc1", "conv1"])}
    fig = plot_layer_format_ranges(best, crossovers={8: _crossovers(8)})
    assert len(fig.axes) == 2
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["fc1", "conv1"]
    assert len(fig.axes[0].patches) == 2 and not fig.axes[1].patches      # bands only where given
    assert fig.axes[0].get_xlabel() == "" and fig.axes[1].get_xlabel() == "σ = std of log2|g| (binades)"


def test_error_vs_bits_for_layers_two_panels():
    from gradstats.plots.study.recommended import plot_error_vs_bits_for_layers

    fig = plot_error_vs_bits_for_layers([("conv2", [_best(b, 1.7) for b in (6, 8)]),
                                         ("fc1", [_best(b, 6.2) for b in (6, 8)])])
    assert len(fig.axes) == 2
    assert fig.axes[0].get_title().startswith("conv2 (narrowest gradients of the plan)\n")
    assert fig.axes[1].get_title().startswith("fc1 (widest gradients of the plan)\n")
    assert len(fig.axes[0].lines) == 4                     # per width: the curve and its star


def _sparsity_table():
    rows = []
    for rule, bias in (("lognormal", 0.0), ("normal", 0.05)):
        for layer, p0 in (("a", 0.1), ("b", 0.95)):
            for S in (0.5, 0.9):
                rows.append({"layer": layer, "step": 0, "rule": rule, "target": S, "threshold": 1e-3 * S,
                             "achieved": min(S + bias, 1.0), "cosine": 1 - S / 10, "predicted_cosine": 1 - S / 12,
                             "p0": p0, "sigma": 2.0})
    return pd.DataFrame(rows)


def test_sparsity_check_leaves_out_what_the_zeros_reach():
    from gradstats.plots.study.recommended import plot_sparsity_check

    fig = plot_sparsity_check(_sparsity_table())
    ax = fig.axes[0]
    assert ax.get_xlabel() == "target sparsity" and len(fig.axes) == 2
    assert len(ax.lines) == 3                              # the diagonal, one mean line per rule
    assert "2 (layer, step, target) cases left out" in ax.texts[0].get_text()
    with pytest.raises(ValueError, match="exact zeros exceed every target"):
        plot_sparsity_check(_sparsity_table().assign(p0=0.99))


def test_cosine_check_log_log_one_colour_per_layer():
    from gradstats.plots.study.recommended import plot_cosine_check

    fig = plot_cosine_check(_sparsity_table())
    ax = fig.axes[0]
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
    assert ax.get_xlabel() == "predicted 1 - cosine (lognormal model)"
    assert len(ax.collections) == 2 and len(ax.lines) == 3  # two layers; the diagonal and the x10 band
    with pytest.raises(ValueError, match="no pruned case of rule 'laplace'"):
        plot_cosine_check(_sparsity_table(), rule="laplace")


# ----------------------------------------------------------------------------- plots.fpanalysis
def test_error_vs_exponent_bits_reads_the_setting_from_the_results():
    from gradstats.plots.fpanalysis import plot_error_vs_exponent_bits

    fig = plot_error_vs_exponent_bits([_best(b, 2.0) for b in (4, 6, 8)])
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and len(ax.lines) == 6
    assert "σ = 2.89" in ax.get_title() and "fn formats, nearest rounding, best scale" in ax.get_title()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["FP4", "FP6", "FP8"]


def test_optimal_exponent_bits_draws_the_reference_rows_given():
    from gradstats.plots.fpanalysis import plot_optimal_exponent_bits

    t = _crossovers(6)
    plain = plot_optimal_exponent_bits(t)
    assert len(plain.axes) == 1 and plain.axes[0].get_legend() is None
    ref = plot_optimal_exponent_bits(t, authors=[(6, 3, 0.9, 2.0), (8, 4, 1.4, 3.7)])
    assert [x.get_text() for x in ref.axes[0].get_legend().get_texts()] == ["ours", "authors' table"]
    assert ref.axes[0].get_xlim() == (0.0, 4.0) and ref.axes[0].get_ylabel() == "FP6: E"
    with pytest.raises(ValueError, match="pass the rows"):
        plot_optimal_exponent_bits(t, authors=True)


def test_layer_formats_shades_only_the_table_given():
    from gradstats.plots.fpanalysis import plot_layer_formats

    b = _best(8, [1.0, 2.5], names=["fc1", "conv1"])
    bare = plot_layer_formats(b)
    assert not bare.axes[0].patches and len(bare.axes[0].lines) == 2
    shaded = plot_layer_formats(b, crossovers=_crossovers(8))
    assert len(shaded.axes[0].patches) == 2
    assert "FP8: each layer's σ and chosen format (best scale" in shaded.axes[0].get_title()


def test_layer_formats_rings_a_layer_outside_the_band_of_its_format_and_says_why():
    from gradstats.plots.fpanalysis import plot_layer_formats

    # sigma of log2|g| 1.44 and 3.6: e1m6fn and e2m5fn chosen, both in the e3m4fn band (from 1.0 on)
    b = _best(8, [1.0, 2.5], names=["fc1", "conv1"])
    ax = plot_layer_formats(b, crossovers=_crossovers(8)).axes[0]
    rings = [ln for ln in ax.lines if ln.get_markerfacecolor() == "none"]
    assert len(rings) == 2 and "ringed (2)" in ax.get_title() and "maximum" not in ax.get_title()
    b.amax = np.array([1.0, 2.0])            # ranked given the observed maximum: the title says so
    b.format = [b.format[0], FPFormat(3, 4, special="fn")]   # conv1 now in its band
    ax = plot_layer_formats(b, crossovers=_crossovers(8)).axes[0]
    assert len([ln for ln in ax.lines if ln.get_markerfacecolor() == "none"]) == 1
    assert "ringed (1)" in ax.get_title() and "observed maximum bounds the upper tail" in ax.get_title()


def test_predicted_vs_measured_one_group_per_hue():
    from gradstats.plots.fpanalysis import plot_predicted_vs_measured

    t = pd.DataFrame({"w": ["FP8", "FP8", "FP4"], "p": [1e-3, 2e-3, 0.1], "m": [1.2e-3, 2e-3, 0.2]})
    ax = plot_predicted_vs_measured(t, hue="w", predicted="p", measured="m", title="t").axes[0]
    assert ax.get_title() == "t" and (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
    assert len(ax.collections) == 3                        # the factor-2 band and two groups


# ----------------------------------------------------------------------------- plots.pruning
def test_threshold_vs_sigma_one_panel_per_target():
    from gradstats.plots.pruning import plot_threshold_vs_sigma

    s = [0.5, 1.0, 2.0]
    t = pd.DataFrame({"sigma": s * 2, "target": [0.5] * 3 + [0.9] * 3, "lognormal": [1.0, 1.1, 1.3, 2.0, 3.0, 6.0],
                      "naive_lognormal": [0.9, 1.0, 1.2, 1.9, 2.5, 5.0], "normal": [1.0, 2.0, 9.0, 2.0, 4.0, 50.0],
                      "laplace": [1.0, 1.5, 4.0, 2.0, 3.0, 20.0]})
    fig = plot_threshold_vs_sigma(t)
    assert [ax.get_title() for ax in fig.axes] == ["target sparsity 0.5", "target sparsity 0.9"]
    assert all(len(ax.lines) == 4 and ax.get_yscale() == "log" for ax in fig.axes)
    assert len(plot_threshold_vs_sigma(t, targets=[0.9]).axes) == 1


def test_cosine_vs_sparsity_draws_the_curves_and_points():
    from gradstats.plots.pruning import plot_cosine_vs_sparsity

    c = pd.DataFrame({"sigma": [1.0] * 3 + [2.0] * 3, "sparsity": [0.1, 0.5, 0.9] * 2,
                      "one_minus_cosine": [1e-4, 1e-2, 0.1, 1e-3, 3e-2, 0.3]})
    fig = plot_cosine_vs_sparsity(c, measured=pd.DataFrame({"sigma": [2.0], "sparsity": [0.8], "cosine": [0.7]}))
    ax, axl = fig.axes
    assert len(ax.lines) == 3 and axl.get_yscale() == "log"    # two curves and the 0.85 marker
    assert len(ax.collections) == 1 and "points: measured" in fig._suptitle.get_text()


@pytest.mark.parametrize("module, name, old", [("fpanalysis", "plot_error_vs_exponent_bits", 2.0),
                                               ("pruning", "plot_threshold_vs_sigma", [0.5, 1.0]),
                                               ("pruning", "plot_cosine_vs_sparsity", [1.0, 2.0])])
def test_a_drawing_given_numbers_names_the_function_that_computes_them(module, name, old):
    """The old form (numbers the drawing computed from) is gone: the error names the computing twin in
    gradstats.figures, and nothing is drawn."""
    import importlib

    import matplotlib.pyplot as plt

    draw = getattr(importlib.import_module(f"gradstats.plots.{module}"), name)
    before = plt.get_fignums()
    with pytest.raises(TypeError, match=rf"call gradstats\.figures\.{name}\("):
        draw(old)
    assert plt.get_fignums() == before


def test_allocation_reads_an_allocation_like_object():
    from gradstats.plots.pruning import plot_allocation

    a = SimpleNamespace(layers=["a", "b", "out"], targets=[0.8, 0.9, 0.0], excluded=[False, False, True],
                        budget=0.85, caps=[0.99, 0.99, 1.0], cosine=[0.95, 0.9, 1.0], floors=[np.nan] * 3,
                        achieved=0.86)
    fig = plot_allocation(a)
    assert len(fig.axes) == 2 and [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["a", "b", "out"]
    assert "achieved 0.860" in fig.axes[0].get_title()


# ----------------------------------------------------------------------------- the package's dependencies
def test_plots_imports_nothing_of_the_analysis():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import imports
    finally:
        sys.path.remove(str(ROOT / "tools"))
    mods = imports.scan()
    assert any(m.startswith("gradstats.plots.") for m in mods)
    assert [b for b in imports.backward_imports(mods) if b.startswith("gradstats.plots")] == []
    assert not [c for c in imports.cycles(mods) if any(m.startswith("gradstats.plots") for m in c)]
    for name, mod in mods.items():
        if name.startswith("gradstats.plots"):
            assert {t for t in mod.imports if not t.startswith("gradstats.plots")} <= {
                "gradstats.formats", "gradstats.stats", "gradstats.ops", "gradstats.families"}, name
