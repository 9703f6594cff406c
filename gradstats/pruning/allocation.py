"""Heterogeneous mode: per-layer sparsity targets under one global, element-weighted budget.

Problem. Layers ``i`` with ``n_i`` elements and a model of their gradient magnitudes. Choose
thresholds ``a_i`` to

    minimise   sum_i w_i * D_i(a_i)          D_i = E[(T(g) - g)^2] / E[g^2] = 1/cos_i^2 - 1
    subject to sum_i n_i S_i(a_i) = budget * sum_i n_i,   cos_i >= floor_i,   S_i <= cap_i,

over the allocated layers (the output layer, and any named in ``exclude``, are left unpruned),
i.e. spend the sparsity where it adds the least relative noise (``w_i`` defaults to ``n_i``:
every element's noise counts the same). Per element, ``dVar/da = E[|g| 1{|g|<a}]`` and
``dS/da = E[|g| 1{|g|<a}] / a^2`` for *any* distribution of ``|g|``, so the marginal cost of
sparsity is ``dD_i/dS_i = a_i^2 / E_i[g^2]``: it grows with ``a_i``, the problem is convex, and
its KKT conditions give ``a_i = min(c * sqrt(n_i E_i[g^2] / w_i), a_max_i)`` with one scalar
``c`` set by the budget and ``a_max_i`` the largest threshold the cosine floor and the cap allow.
With element-count weights the thresholds are a common multiple of each layer's RMS gradient.

The model of a layer (:class:`ConditionedModel`, the default for statistics rows) is its own
data: the sums ``sum_abs``, ``sum_sq`` give ``E|g|`` and ``E g^2`` exactly, the 64 largest
magnitudes (``top_abs``) are known one by one, and the binade histogram gives the cumulative
distribution exactly at every power of two. Above the largest entry nothing exists: there
every value is pruned, and ``S = 1 - E|g| / a``, ``Var = a E|g| - E g^2`` hold exactly. A
lognormal fitted to the same layer puts mass above the maximum that the data does not have:
over a calibration run of the CNN the fits of the classifier layers (sigma 4.7 and 5.9 nats)
give an RMS gradient ``e^18`` and ``e^28`` times the data's, which made pruning almost
everything there look free. The parametric families (``threshold_rule="lognormal"``, ``"normal"``,
``"laplace"``) remain for rows given by their parameters and for what-if reasoning.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gradstats.families import solve_ratio
from gradstats.layers import output_layer  # noqa: F401 - its home is gradstats.layers; importable here too
from gradstats.pruning.conditioned import ConditionedModel, has_data
from gradstats.pruning.thresholds import (
    FAMILIES,
    _row_params,
    _subset,
    added_variance,
    expected_sparsity,
    resolve,
    threshold,
)
from gradstats.stats import HIST_BINS, merge_stats

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

#: default largest target any one layer is given (expected sparsity, zeros included)
DEFAULT_CAP = 0.98
#: magnitude models :func:`allocate` accepts: the data-conditioned model and the families
ALLOCATION_MODELS = ("histogram",) + FAMILIES


# ----------------------------------------------------------------------------- the output layer
# ----------------------------------------------------------------------------- result
@dataclass(frozen=True)
class Allocation:
    """Result of :func:`allocate`: per-layer targets, thresholds and their predicted cost.

    Attributes: ``layers`` (names), ``n`` (element counts), ``targets`` (expected sparsity of
    each layer, zeros included; an excluded layer's is its zeros alone), ``thresholds`` (0
    where nothing is pruned), ``cosine`` (predicted cosine similarity), ``added_variance``
    (relative, ``1/cos^2 - 1``), ``floors`` (NaN where none), ``caps`` (largest target allowed
    per layer), ``excluded`` (layers left unpruned: the output layer and ``exclude``),
    ``output_layer`` (its name, or None), ``budget``, ``achieved`` (element-weighted mean of the
    allocated layers' targets), ``objective`` (``sum w_i D_i``; weighted by the noise model, the
    noise ratio the pruning adds summed over the layers, to first order), ``uniform_objective`` (the same
    with every allocated layer at the budget, ignoring floors and caps), ``model`` (the
    magnitude model: ``"histogram"`` for the data-conditioned model, a family name, or
    ``"mixed"``), ``weights``, ``weighting`` (``"noise"``: the noise model's weights,
    ``"elements"``: element counts, ``"given"``: the caller's).
    """

    layers: list[str]
    n: np.ndarray
    targets: np.ndarray
    thresholds: np.ndarray
    cosine: np.ndarray
    added_variance: np.ndarray
    floors: np.ndarray
    budget: float
    achieved: float
    objective: float
    uniform_objective: float
    model: str = "lognormal"
    weights: np.ndarray = field(default_factory=lambda: np.zeros(0))
    caps: np.ndarray = field(default_factory=lambda: np.zeros(0))
    excluded: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    output_layer: str | None = None
    weighting: str = "elements"

    def to_dataframe(self) -> "pd.DataFrame":
        """One row per layer.

        Example:
            >>> a = allocate({"l1": {"mu": -9.0, "sigma": 2.0, "n": 1000},
            ...               "l2": {"mu": -12.0, "sigma": 1.0, "n": 3000}}, 0.8)
            >>> list(a.to_dataframe().columns)[:3]
            ['layer', 'n', 'target']
        """
        import pandas as pd

        L = len(self.layers)
        return pd.DataFrame({"layer": self.layers, "n": self.n, "target": self.targets,
                             "threshold": self.thresholds, "cosine": self.cosine,
                             "added_variance": self.added_variance, "cosine_floor": self.floors,
                             "cap": self.caps if len(self.caps) == L else np.full(L, np.nan),
                             "excluded": self.excluded if len(self.excluded) == L else np.zeros(L, bool)})

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python form (lists and floats), e.g. for JSON."""
        return {"layers": list(self.layers), "n": [int(v) for v in self.n],
                "targets": self.targets.tolist(), "thresholds": self.thresholds.tolist(),
                "cosine": self.cosine.tolist(), "added_variance": self.added_variance.tolist(),
                "floors": [None if math.isnan(v) else float(v) for v in self.floors],
                "caps": [float(v) for v in self.caps], "excluded": [bool(v) for v in self.excluded],
                "output_layer": self.output_layer,
                "budget": self.budget, "achieved": self.achieved, "objective": self.objective,
                "uniform_objective": self.uniform_objective, "model": self.model,
                "weights": [float(v) for v in self.weights], "weighting": self.weighting}

    def layer_targets(self) -> dict[str, float | None]:
        """``{layer: target sparsity}`` of the allocation, None for a layer it leaves unpruned; a plan
        takes them with :meth:`gradstats.Plan.with_allocation`.

        Example:
            >>> a = allocate({"fc1": {"mu": -9.0, "sigma": 2.0, "n": 1000},
            ...               "fc2": {"mu": -12.0, "sigma": 1.0, "n": 30}}, 0.8,
            ...              layer_info={"fc1": "Linear", "fc2": "Linear"})
            >>> a.layer_targets()["fc2"] is None
            True
        """
        ex = self.excluded if len(self.excluded) == len(self.layers) else np.zeros(len(self.layers), bool)
        return {name: None if x else float(t) for name, t, x in zip(self.layers, self.targets, ex)}

    def plot(self, path: str | None = None) -> Any:
        """Bar chart of per-layer targets and cosines (see :mod:`gradstats.plots.pruning`)."""
        from gradstats.plots.pruning import plot_allocation

        return plot_allocation(self, path)


# ----------------------------------------------------------------------------- inputs
def _layers(layers: Any, sizes: Any) -> tuple[list[str], list[Any], np.ndarray, Any]:
    """Names, rows, element counts, and the run (or None) the rows came from."""
    import pandas as pd

    from gradstats.run import Run

    run = None
    if isinstance(layers, Run):
        run = layers
        st = run.stats(kinds=["grad"])
        order = [str(v) for v in run.layer_info().get("name", pd.Series(dtype=str))]
        rank = {k: i for i, k in enumerate(order)}
        if len(st):
            st = st.assign(_order=st["layer"].map(lambda v: rank.get(str(v), len(rank))))
            st = st.sort_values(["_order", "step"], kind="stable").drop(columns="_order")
        layers = st
    if isinstance(layers, pd.DataFrame):
        df = layers
        if "kind" in df.columns:  # a run's statistics: the neural gradients only
            df = df[df["kind"] == "grad"]
        if "layer" in df.columns:
            names, rows = [], []
            for name, grp in df.groupby("layer", sort=False):
                recs = grp.to_dict("records")
                if len(recs) > 1 and "sum_ln_abs" in grp.columns:
                    for r in recs:
                        if not isinstance(r.get("hist"), (np.ndarray, list)):
                            r["hist"] = np.zeros(HIST_BINS, dtype=np.int64)
                    recs = [merge_stats(recs)]
                rows.append(recs[0])
                names.append(str(name))
        else:
            names = [str(i) for i in df.index]
            rows = df.to_dict("records")
    elif isinstance(layers, Mapping):
        names, rows = [str(k) for k in layers], list(layers.values())
    else:
        raise ValueError("layers must be a Run, a DataFrame (one statistics row per layer, or a "
                         "'layer' column) or a mapping name -> statistics row / fit result; got "
                         f"{type(layers).__name__}")
    if not rows:
        raise ValueError("allocate needs at least one layer")
    if sizes is not None:
        if isinstance(sizes, Mapping):
            try:
                n = np.array([float(sizes[k]) for k in names])
            except KeyError as e:
                raise ValueError(f"sizes has no entry for layer {e.args[0]!r}") from None
        else:
            n = np.asarray(sizes, dtype=np.float64).reshape(-1)
    else:
        try:
            n = np.array([float(r["n"]) if isinstance(r, Mapping) else float(getattr(r, "n"))
                          for r in rows])
        except (KeyError, AttributeError):
            raise ValueError("element counts are missing: give rows with a field 'n' or pass "
                             "sizes=") from None
    if n.shape != (len(rows),) or not (np.isfinite(n) & (n > 0)).all():
        raise ValueError(f"sizes must be one positive count per layer ({len(rows)}), got {n}")
    return names, rows, n, run


def _excluded(names: list[str], output: Any, exclude: Any, layer_info: Any, run: Any,
              warn: bool) -> tuple[np.ndarray, str | None]:
    if isinstance(exclude, str):
        exclude = [exclude]
    exclude = [str(e) for e in (exclude or ())]
    out_name = None
    if isinstance(output, str) and output == "auto":
        source = layer_info if layer_info is not None else run
        if source is not None:     # the model's output layer, if it is among the layers given
            out_name = output_layer(source)
            if out_name not in names:
                out_name = None
        elif warn:
            log.warning("allocate: no layer types (pass the run itself, layer_info=, or output_layer=), "
                        "so the output layer is not identified and not excluded")
    elif output is not None:
        out_name = str(output)
        if out_name not in names:
            raise ValueError(f"output_layer {out_name!r} is not one of the layers {names}")
    unknown = sorted(set(exclude) - set(names))
    if unknown:
        raise ValueError(f"exclude names unknown layers: {unknown}")
    ex = np.array([k == out_name or k in exclude for k in names], dtype=bool)
    return ex, out_name


# ----------------------------------------------------------------------------- the solver
class _Costs:
    """Per-layer sparsity and relative added variance at given thresholds (one per layer),
    from the conditioned model or a parametric family."""

    def __init__(self, rows: list[Any], model: str | None) -> None:
        L = len(rows)
        if model is None:
            kinds = ["histogram" if has_data(r) else "lognormal" for r in rows]
        elif model == "histogram":
            bad = [i for i, r in enumerate(rows) if not has_data(r)]
            if bad:
                raise ValueError("threshold_rule='histogram' needs statistics rows with n, n_zero, sum_abs, "
                                 f"sum_sq, max_abs and hist; row(s) {bad} lack them")
            kinds = ["histogram"] * L
        elif model in FAMILIES:
            kinds = [model] * L
        else:
            raise ValueError(f"model must be None or one of {ALLOCATION_MODELS}, got {model!r}")
        self.kinds = kinds
        self.name = kinds[0] if len(set(kinds)) == 1 else "mixed"
        self.data = np.array([k == "histogram" for k in kinds])
        self.cond = [ConditionedModel.from_stats(r) if d else None for r, d in zip(rows, self.data)]
        self.p0 = np.zeros(L)
        self.m2 = np.zeros(L)
        self.fam = None
        par = ~self.data
        if par.any():
            fam = kinds[int(np.flatnonzero(par)[0])]
            params = [_row_params(rows[i]) for i in np.flatnonzero(par)]
            get = lambda k, d: np.array([p.get(k, d) for p in params], dtype=np.float64)  # noqa: E731
            scale_key = "scale_normal" if fam == "normal" else "scale_laplace"
            m, p0, _ = resolve(None, model=fam, mu=get("mu", np.nan) if fam == "lognormal" else None,
                               sigma=get("sigma", np.nan) if fam == "lognormal" else None,
                               p0=get("p0", 0.0), scale=get(scale_key, np.nan) if fam != "lognormal" else None)
            self.fam, self.m, self.par = fam, m, par
            self.p0[par] = p0
            self.m2[par] = (1.0 - p0) * m.m2()
        for i, c in enumerate(self.cond):
            if c is not None:
                self.p0[i], self.m2[i] = c.p0, c.mean_sq

    def _kw(self, mask: np.ndarray, key: str = "threshold_rule") -> dict[str, Any]:
        """The family's parameters of the layers in ``mask``, and the family under ``key``
        (``"threshold_rule"`` for threshold and expected_sparsity, ``"family"`` for added_variance)."""
        sub = mask[self.par]
        if hasattr(self.m, "mu"):
            return {"mu": self.m.mu[sub], "sigma": self.m.sigma[sub], key: self.fam}
        return {"scale": self.m.scale[sub], key: self.fam}

    def sparsity(self, a: np.ndarray) -> np.ndarray:
        s = np.empty(a.size)
        for i, c in enumerate(self.cond):
            if c is not None:
                s[i] = c.sparsity(a[i])
        if self.fam is not None:
            p = self.par
            ap = a[p]
            sp = np.where(np.isinf(ap), 1.0, 0.0)
            fin = np.isfinite(ap)
            if fin.any():
                mask = p.copy()
                mask[p] = fin
                sp[fin] = np.asarray(expected_sparsity(ap[fin], p0=self.p0[mask], **self._kw(mask)))
            s[p] = sp
        return s

    def relative_variance(self, a: np.ndarray) -> np.ndarray:
        d = np.empty(a.size)
        for i, c in enumerate(self.cond):
            if c is not None:
                d[i] = c.added_variance(a[i], relative=True)
        if self.fam is not None:
            p = self.par
            d[p] = np.asarray(added_variance(a[p], relative=True, **self._kw(p, "family")), dtype=np.float64)
        return d

    def cosine(self, a: np.ndarray) -> np.ndarray:
        return 1.0 / np.sqrt(1.0 + self.relative_variance(a))

    def threshold(self, s: np.ndarray) -> np.ndarray:
        """Thresholds for targets ``s`` (one per layer)."""
        out = np.empty(s.size)
        for i, c in enumerate(self.cond):
            if c is not None:
                out[i] = c.threshold(s[i])
        if self.fam is not None:
            p = self.par
            out[p] = np.asarray(threshold(s[p], p0=self.p0[p], **self._kw(p)), dtype=np.float64)
        return out

    def threshold_for_floor(self, floors: np.ndarray, sel: np.ndarray) -> np.ndarray:
        """Largest thresholds whose cosine is at least ``floors`` on the layers ``sel``."""
        out = np.full(floors.size, np.inf)
        for i in np.flatnonzero(sel):
            c = self.cond[i]
            if c is not None:
                out[i] = c.threshold_for_variance(1.0 / floors[i] ** 2 - 1.0)
        if self.fam is not None:
            ps = sel & self.par
            if ps.any():
                sub = _subset(self.m, ps[self.par])
                out[ps] = sub.from_x(solve_ratio(sub, 1.0 / floors[ps] ** 2))
        return out


def _weights(weights: Any, names: list[str], n: np.ndarray, run: Any) -> tuple[np.ndarray, str]:
    """The objective's per-layer weights and what they are (see :func:`allocate`'s ``weights``)."""
    if isinstance(weights, str):
        if weights != "auto":
            raise ValueError(f"weights must be 'auto', None, one value per layer or a mapping name -> weight, "
                             f"got {weights!r}")
        if run is not None and not run.table("noise").empty:
            from gradstats.noise.terms import noise_weights

            w = noise_weights(run, names)
            return np.array([w[name] for name in names], dtype=float), "noise"
        return n.astype(float).copy(), "elements"
    if weights is None:
        return n.astype(float).copy(), "elements"
    return _per_layer(weights, names, "weights"), "given"


def allocate(layers: Any, budget: float, *, cosine_floor: Any = None, weights: Any = "auto",
             sizes: Any = None, threshold_rule: str | None = None, cap: Any = DEFAULT_CAP,
             output_layer: str | None = "auto", exclude: Any = (), layer_info: Any = None) -> Allocation:
    """Per-layer sparsity targets meeting a global ``budget`` (element-weighted mean target of
    the allocated layers) at the least weighted relative added noise, with a per-layer cap,
    optional per-layer cosine-similarity floors, and the output layer left unpruned.

    ``layers``: a :class:`gradstats.run.Run` (its neural-gradient statistics, every step merged
    per layer, in model order; its layer types identify the output layer), a DataFrame of
    statistics rows (one per layer, or a ``layer`` column whose rows are merged, e.g.
    ``run.stats()``: only rows of kind ``"grad"`` are used), or a mapping name -> statistics
    row / fit result / ``{"mu", "sigma", "p0", "n"}``.

    ``threshold_rule``: ``None`` (default) models each layer from its own data where the row carries the
    statistics (:class:`ConditionedModel`, reported as ``"histogram"``: exact sums, exact top
    magnitudes, binade histogram; exact above the maximum) and by the lognormal closed forms
    where it carries parameters only; ``"histogram"`` insists on the data; ``"lognormal"``,
    ``"normal"``, ``"laplace"`` use the family's closed forms from the fitted parameters
    (what-if reasoning: a family's tail beyond the data's maximum can make heavy pruning look
    free).

    ``cap``: the largest target any layer is given (expected sparsity, zeros included; default
    :data:`DEFAULT_CAP` = 0.98), one number, a mapping name -> cap or one value per layer;
    ``None`` for no cap. A layer whose zeros already exceed its cap is left as it is.
    ``cosine_floor``: one number, a mapping name -> floor, or an array (NaN: none).
    ``output_layer``: ``"auto"`` (default) excludes the layer :func:`output_layer` finds from
    ``layer_info`` (a Run, its ``layer_info()``, an ``nn.Module`` or a mapping name -> type) or
    from ``layers`` when it is a Run (without either, nothing is excluded and a warning is
    logged); a layer name excludes that layer; ``None`` excludes none. ``exclude``: further
    layer names to leave unpruned. Excluded layers stay in the result with threshold 0 and
    their zeros as target, and do not count towards the budget.

    ``weights``: importance per layer, one value per layer or a mapping name -> weight; ``None``:
    element counts (every element's relative noise counts the same); ``"auto"`` (default): for a
    Run that holds noise records (traced with ``sample_every=``), the weights of the noise model
    that bounds ``recommend`` (:func:`gradstats.noise.terms.noise_weights`): the objective is then
    the noise ratio the pruning adds against SGD's own, summed over the layers, the quantity that
    ranks the study's losses (``docs/noise.md``); element counts otherwise. ``Allocation.weighting``
    says which (``"noise"``, ``"elements"`` or ``"given"``). ``sizes``: element counts
    when the rows lack ``n``. A budget below the zeros already present gives threshold 0
    everywhere (and ``achieved`` above the budget); a budget the caps and floors cannot allow
    raises ``ValueError`` naming the most they allow.

    Example:
        >>> layers = {"conv1": {"mu": -9.0, "sigma": 2.5, "p0": 0.4, "n": 20000},
        ...           "fc": {"mu": -12.0, "sigma": 1.2, "n": 5000}}
        >>> a = allocate(layers, 0.85)
        >>> round(a.achieved, 9), bool(a.objective < a.uniform_objective)
        (0.85, True)
        >>> bool(a.targets.max() <= 0.98)
        True
        >>> b = allocate(layers, 0.85, cosine_floor={"conv1": 0.9})
        >>> bool(b.cosine[0] >= 0.9 - 1e-12)
        True
        >>> c = allocate(layers, 0.5, layer_info={"conv1": "Conv2d", "fc": "Linear"})
        >>> c.output_layer, c.excluded.tolist(), float(c.thresholds[1])
        ('fc', [False, True], 0.0)
    """
    try:
        B = float(budget)
    except (TypeError, ValueError):
        raise ValueError(f"budget must be a number in [0, 1), got {budget!r}") from None
    if not 0.0 <= B < 1.0:
        raise ValueError(f"budget must lie in [0, 1) (a fraction of all elements), got {B}")
    model = threshold_rule
    if model is not None and model not in ALLOCATION_MODELS:
        raise ValueError(f"threshold_rule must be None or one of {ALLOCATION_MODELS}, got {model!r}")
    names, rows, n, run = _layers(layers, sizes)
    L = len(names)
    costs = _Costs(rows, model)
    # without layer types the output layer is unknown: worth a warning for a run's statistics
    excluded, out_name = _excluded(names, output_layer, exclude, layer_info, run, warn=bool(costs.data.any()))
    p0 = costs.p0
    w, weighting = _weights(weights, names, n, run)
    if not (np.isfinite(w) & (w > 0)).all():
        raise ValueError(f"weights must be positive and finite, got {w}")
    floors = np.full(L, np.nan) if cosine_floor is None else _per_layer(cosine_floor, names,
                                                                        "cosine_floor")
    bad = ~np.isnan(floors) & ~((floors > 0) & (floors <= 1))
    if bad.any():
        raise ValueError(f"cosine floors must lie in (0, 1], got {floors[bad]}")
    caps = np.ones(L) if cap is None else _per_layer(cap, names, "cap")
    caps = np.where(np.isnan(caps), 1.0, caps)
    if not ((caps > 0) & (caps <= 1)).all():
        raise ValueError(f"caps must lie in (0, 1] (largest target per layer), got {caps}")
    # largest threshold each layer may take: floor (E T^2 / E g^2 <= 1 / floor^2), cap, exclusion
    a_max = np.full(L, np.inf)
    has = ~np.isnan(floors)
    a_max[has & (floors >= 1)] = 0.0
    sel = has & (floors < 1)
    if sel.any():
        a_max = np.minimum(a_max, costs.threshold_for_floor(floors, sel))
    capped = caps < 1
    if capped.any():
        ca = np.full(L, np.inf)
        ca[capped] = costs.threshold(np.where(capped, np.maximum(caps, 0.0), 0.0))[capped]
        ca[capped & (caps <= p0)] = 0.0
        a_max = np.minimum(a_max, ca)
    a_max[excluded] = 0.0
    alloc = ~excluded
    if not alloc.any():
        raise ValueError("every layer is excluded: nothing to allocate")
    r = np.sqrt(n * costs.m2 / w)
    Na = n[alloc].sum()

    def thresholds(lnc: float) -> np.ndarray:
        return np.minimum(math.exp(lnc) * r if lnc < 700 else np.where(r > 0, np.inf, 0.0), a_max)

    def total(a: np.ndarray) -> float:
        return float((n * costs.sparsity(a))[alloc].sum() / Na)

    floor_total = float((n * p0)[alloc].sum() / Na)
    if B <= floor_total:
        log.info("budget %.4f is met by the exact zeros alone (%.4f): nothing to prune", B,
                 floor_total)
        a = np.zeros(L)
    else:
        most = total(a_max)
        if most < B - 1e-12:
            what = " and ".join(k for k, v in (("caps", capped.any()), ("cosine floors", sel.any()),
                                               ("exclusions", excluded.any())) if v) or "layers' data"
            raise ValueError(f"budget {B} cannot be met under the {what}: they allow at most {most:.6f}")
        lo, hi = 0.0, 0.0
        while total(thresholds(lo)) > B and lo > -700:
            lo -= 4.0
        while total(thresholds(hi)) < B and hi < 700:
            hi += 4.0
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if total(thresholds(mid)) < B:
                lo = mid
            else:
                hi = mid
            if hi - lo < 1e-15 * max(1.0, abs(mid)):
                break
        a = thresholds(hi)
    targets = np.minimum(costs.sparsity(a), np.maximum(caps, p0))   # a cap's threshold, to rounding
    dvar = costs.relative_variance(a)
    cos = 1.0 / np.sqrt(1.0 + dvar)
    ua = np.where(alloc, costs.threshold(np.where(alloc, np.maximum(B, p0), 0.0)), 0.0)
    udvar = costs.relative_variance(ua)
    objective = float((w * dvar)[alloc].sum())
    if weighting == "noise":
        _warn_noise(objective, int(alloc.sum()), B)
    return Allocation(layers=names, n=n, targets=targets, thresholds=a, cosine=cos,
                      added_variance=dvar, floors=floors, budget=B,
                      achieved=float((n * targets)[alloc].sum() / Na), objective=objective,
                      uniform_objective=float((w * udvar)[alloc].sum()), model=costs.name,
                      weights=w, caps=caps, excluded=excluded, output_layer=out_name, weighting=weighting)


def _warn_noise(total: float, layers: int, budget: float) -> None:
    """A warning where the noise ratio an allocation adds, summed over its layers (first order),
    exceeds the default per-layer bound times their number: then at least one layer's is over it."""
    from gradstats.noise.terms import NOISE_BOUND

    if layers and total > NOISE_BOUND * layers:
        log.warning("allocate(budget=%g) adds a noise ratio of %.3g summed over its %d layers (first order; R = 1 "
                    "doubles SGD's own minibatch noise), more than %d x the bound of %g that recommend keeps per layer: "
                    "at least one layer is over it. The study lost accuracy wherever a layer's measured ratio reached "
                    "0.32 and kept it up to 0.015 (docs/noise.md); recommend(run, sparsity=%g) grants what the bound "
                    "allows", budget, total, layers, layers, NOISE_BOUND, budget)


def _per_layer(v: Any, names: list[str], what: str) -> np.ndarray:
    if isinstance(v, Mapping):
        unknown = set(map(str, v)) - set(names)
        if unknown:
            raise ValueError(f"{what} names unknown layers: {sorted(unknown)}")
        return np.array([float(v.get(k, np.nan)) for k in names], dtype=np.float64)
    arr = np.asarray(v, dtype=np.float64)
    if arr.ndim == 0:
        return np.full(len(names), float(arr))
    if arr.shape != (len(names),):
        raise ValueError(f"{what} must be one number, a mapping, or one value per layer "
                         f"({len(names)}); got shape {arr.shape}")
    return arr
