"""Analytic thresholds for a target sparsity, and what a threshold costs.

All functions are vectorised over layers: every numeric argument may be a Python number, a
numpy array or a torch tensor (broadcast together); the parameters may also come from a
``source``: a statistics row of :mod:`gradstats.stats` (a dict or a pandas Series), a pandas
DataFrame of such rows (one result per row), a fit result (anything with
``.params["lognormal"]["mu"]``, ``["sigma"]``, ``.params["normal"]["scale"]``,
``.params["laplace"]["scale"]`` and ``.zero_fraction``), or a list of those. Explicit keyword
values take precedence over the source. ``mu`` and ``sigma`` are the mean and standard
deviation of ``ln|g|`` (natural log) of the non-zero entries; ``p0`` is the fraction of exact
zeros (default 0, or the source's); ``scale`` is the bell-shaped models' parameter.

Return type: a float when every input is a scalar, a torch tensor (float64, on the input's
device) when any input is a tensor, a numpy array otherwise.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Union

import numpy as np
import torch

from gradstats.families import FAMILY_REGISTRY, Exponential, Family, HalfNormal, Lognormal
from gradstats.pruning.rules import THRESHOLD_RULES, FamilyRule, LayerStats
from gradstats.stats import lognormal_moments, n_nonzero

ArrayLike = Union[float, int, np.ndarray, torch.Tensor, list, tuple]

#: the families of the non-zero magnitudes (the names of :data:`gradstats.families.FAMILY_REGISTRY`)
FAMILIES = tuple(FAMILY_REGISTRY)
#: the threshold rules that work from a layer's statistics (the models, the lognormal quantile that
#: ignores the rounding up, the model-free histogram rule): the names of the registry
#: :data:`gradstats.pruning.rules.THRESHOLD_RULES` whose rule has ``from_statistics``
RULES = tuple(name for name, rule in THRESHOLD_RULES.items() if rule.from_statistics)
#: the default threshold rule: the model-free histogram rule, the most accurate sort-free rule on
#: real gradients (``docs/pruning.md``); :func:`threshold` and :func:`expected_sparsity` use it
#: where the source carries a histogram, the lognormal closed form where only its parameters exist
DEFAULT_RULE = "histogram"


# ----------------------------------------------------------------------------- parameters
def _stats_params(row: Mapping[str, Any]) -> dict[str, float]:
    n = int(row["n"])
    m = n_nonzero(row)
    if n <= 0:
        raise ValueError("the statistics row describes an empty tensor (n = 0): no threshold "
                         "can be derived from it")
    if m <= 0:
        raise ValueError("the statistics row has no non-zero finite entries: mu and sigma of "
                         "ln|g| are undefined")
    mu, sigma = lognormal_moments(row)
    out = {"mu": mu, "sigma": sigma, "p0": int(row["n_zero"]) / n}
    if "sum_sq" in row:
        out["scale_normal"] = math.sqrt(float(row["sum_sq"]) / m)
    if "sum_abs" in row:
        out["scale_laplace"] = float(row["sum_abs"]) / m
        amax = float(row.get("max_abs", math.nan))
        if amax > 0 and math.isfinite(amax):       # the tensor's own maximum and mean |g|
            out["amax"] = amax
            out["mean_abs"] = float(row["sum_abs"]) / (n - int(row.get("n_nonfinite", 0)))
    return out


def _fit_params(fit: Any) -> dict[str, float]:
    p = fit.params
    out: dict[str, float] = {"p0": float(getattr(fit, "zero_fraction", 0.0) or 0.0)}
    for key, fam, par in (("mu", "lognormal", "mu"), ("sigma", "lognormal", "sigma"),
                          ("scale_normal", "normal", "scale"), ("scale_laplace", "laplace", "scale")):
        try:
            out[key] = float(p[fam][par])
        except (KeyError, TypeError):
            pass
    return out


def _row_params(row: Any) -> dict[str, float]:
    if hasattr(row, "params") and hasattr(row, "zero_fraction"):
        return _fit_params(row)
    if isinstance(row, Mapping) or hasattr(row, "index") and hasattr(row, "get"):
        keys = set(row.keys())
        if {"n", "n_zero", "sum_ln_abs", "sum_ln_abs_sq"} <= keys:
            return _stats_params(row)
        if "mu" in keys or "scale" in keys:
            out = {k: float(row[k]) for k in ("mu", "sigma", "p0") if k in keys}
            if "scale" in keys:
                out["scale_normal"] = out["scale_laplace"] = float(row["scale"])
            return out
    raise ValueError(f"cannot read distribution parameters from a {type(row).__name__}: expected "
                     "a statistics row (fields n, n_zero, sum_ln_abs, ...), a fit result, a "
                     "DataFrame of statistics rows, or a list of those")


def _source_params(source: Any) -> tuple[dict[str, np.ndarray], bool]:
    """Parameters of ``source`` as arrays, and whether the source was a single row."""
    import pandas as pd

    if isinstance(source, pd.DataFrame):
        rows = [_row_params(r) for r in source.to_dict("records")]
        single = False
    elif isinstance(source, (list, tuple)):
        rows = [_row_params(r) for r in source]
        single = False
    else:
        rows = [_row_params(source)]
        single = True
    keys = set().union(*[r.keys() for r in rows]) if rows else set()
    out = {k: np.array([r.get(k, np.nan) for r in rows], dtype=np.float64) for k in keys}
    if single:
        out = {k: v.reshape(()) for k, v in out.items()}
    return out, single


def _as_array(v: Any) -> np.ndarray:
    if isinstance(v, torch.Tensor):
        return v.detach().to("cpu", torch.float64).numpy()
    return np.asarray(v, dtype=np.float64)


def _wrap(result: np.ndarray, inputs: tuple[Any, ...]) -> Any:
    for v in inputs:
        if isinstance(v, torch.Tensor):
            return torch.as_tensor(result, dtype=torch.float64, device=v.device)
    if result.ndim == 0:
        return float(result)
    return result


def _check_range(name: str, v: np.ndarray, lo: float, hi: float, what: str) -> None:
    bad = ~((v >= lo) & (v < hi))
    if bad.any():
        raise ValueError(f"{name} must lie in [{lo:g}, {hi:g}) ({what}); got {v[bad].reshape(-1)[:5]}")


def resolve(source: Any, *, model: str, mu: Any = None, sigma: Any = None, p0: Any = None,
            scale: Any = None) -> tuple[Family, np.ndarray, bool]:
    """The model (with flattened broadcast parameters), ``p0`` and whether the inputs were
    one layer. Raises ``ValueError`` on missing or invalid parameters."""
    if model not in FAMILIES:
        raise ValueError(f"model must be one of {FAMILIES}, got {model!r}")
    src: dict[str, np.ndarray] = {}
    if source is not None:
        src, _ = _source_params(source)
    p0v = _as_array(p0) if p0 is not None else src.get("p0", np.zeros(()))
    _check_range("p0 (fraction of exact zeros)", p0v, 0.0, 1.0, "a zero fraction below 1")
    if model == "lognormal":
        muv = _as_array(mu) if mu is not None else src.get("mu")
        sv = _as_array(sigma) if sigma is not None else src.get("sigma")
        if muv is None or sv is None:
            raise ValueError("the lognormal model needs mu and sigma (of ln|g|): pass them, or "
                             "a statistics row or fit result as source")
        if not np.isfinite(muv).all():
            raise ValueError(f"mu (mean of ln|g|) must be finite, got {muv.reshape(-1)[:5]}")
        if not (np.isfinite(sv) & (sv > 0)).all():
            raise ValueError(f"sigma (std of ln|g|) must be positive and finite, got "
                             f"{sv.reshape(-1)[:5]}")
        muv, sv, p0v = np.broadcast_arrays(muv, sv, p0v)
        return Lognormal(muv.ravel().copy(), sv.ravel().copy()), p0v.ravel().copy(), muv.ndim == 0
    key = "scale_normal" if model == "normal" else "scale_laplace"
    sc = _as_array(scale) if scale is not None else src.get(key)
    if sc is None:
        raise ValueError(f"the {model} model needs scale ("
                         f"{'s with s^2 = E g^2' if model == 'normal' else 'b = E|g|'}): pass it, "
                         "or a statistics row or fit result as source")
    if not (np.isfinite(sc) & (sc > 0)).all():
        raise ValueError(f"scale of the {model} model must be positive and finite, got "
                         f"{sc.reshape(-1)[:5]}")
    sc, p0v = np.broadcast_arrays(sc, p0v)
    cls = HalfNormal if model == "normal" else Exponential
    return cls(sc.ravel().copy()), p0v.ravel().copy(), sc.ndim == 0


def _broadcast(model: Family, p0: np.ndarray, v: np.ndarray) -> tuple[Family, np.ndarray, np.ndarray, tuple]:
    """Broadcast the parameters (flat, one per layer) against ``v``; returns flat arrays."""
    params = [model.mu, model.sigma] if isinstance(model, Lognormal) else [model.scale]
    n = params[0].size
    shape = np.broadcast_shapes(v.shape, (n,) if n > 1 else ())
    flat = [np.broadcast_to(p.reshape(()) if n == 1 else p, shape).ravel() for p in params]
    p0f = np.broadcast_to(p0.reshape(()) if p0.size == 1 else p0, shape).ravel()
    vf = np.broadcast_to(v, shape).ravel()
    m = Lognormal(*flat) if isinstance(model, Lognormal) else type(model)(flat[0])
    return m, p0f, vf, shape


def _histograms(source: Any) -> tuple[list[Any], bool]:
    """LogHistograms of a source (a statistics row with ``hist``, a DataFrame or list of such
    rows, or LogHistogram objects) and whether it was a single one."""
    import pandas as pd

    from gradstats.pruning.histogram import LogHistogram

    if source is None:
        raise ValueError("the histogram rule needs a source: a statistics row with its 'hist' "
                         "field, a DataFrame or list of rows, or a LogHistogram")
    if isinstance(source, pd.DataFrame):
        items, single = source.to_dict("records"), False
    elif isinstance(source, (list, tuple)):
        items, single = list(source), False
    else:
        items, single = [source], True
    out = []
    for it in items:
        if isinstance(it, LogHistogram):
            out.append(it)
        elif isinstance(it, Mapping) or hasattr(it, "keys"):
            if int(it["n"]) <= 0:
                raise ValueError("the statistics row describes an empty tensor (n = 0): no "
                                 "threshold can be derived from it")
            out.append(LogHistogram.from_stats(it))
        else:
            raise ValueError(f"the histogram rule cannot read a {type(it).__name__}: expected a "
                             "statistics row with 'hist' or a LogHistogram")
    return out, single


def _has_histogram(source: Any) -> bool:
    """Whether every item of ``source`` carries a histogram (a statistics row with ``hist``, a
    DataFrame with a ``hist`` column, a LogHistogram, or a non-empty list of those)."""
    import pandas as pd

    from gradstats.pruning.histogram import LogHistogram

    if isinstance(source, LogHistogram):
        return True
    if isinstance(source, pd.DataFrame):
        return "hist" in source.columns and len(source) > 0
    if isinstance(source, (list, tuple)):
        return len(source) > 0 and all(_has_histogram(it) for it in source)
    if isinstance(source, Mapping) or hasattr(source, "index") and hasattr(source, "get"):
        return "hist" in source.keys()
    return False


def _rule(model: str | None, source: Any, *explicit: Any) -> str:
    """The rule a call asks for: ``model``, or by default :data:`DEFAULT_RULE` where the source
    carries a histogram and no model parameter is given explicitly, the lognormal otherwise."""
    if model is not None:
        return model
    if source is not None and all(v is None for v in explicit) and _has_histogram(source):
        return DEFAULT_RULE
    return "lognormal"


# ----------------------------------------------------------------------------- public verbs
def expected_sparsity(threshold: ArrayLike, source: Any = None, *, mu: ArrayLike | None = None,
                      sigma: ArrayLike | None = None, threshold_rule: str | None = None,
                      stochastic: bool = True, p0: ArrayLike | None = None,
                      scale: ArrayLike | None = None) -> Any:
    """Expected fraction of zeros after pruning at ``threshold``.

    Stochastic operator (default): ``S = p0 + (1 - p0) * (P(|g| < a) - E[|g| 1{|g|<a}] / a)``;
    for the lognormal model ``S(a) = Phi(z) - exp(mu + sigma^2/2) / a * Phi(z - sigma)`` with
    ``z = (ln a - mu) / sigma``. ``stochastic=False``: the hard threshold, ``P(|g| < a)``.
    ``threshold_rule`` as for :func:`threshold` (by default the histogram rule where ``source`` carries
    a histogram and none of ``mu``, ``sigma``, ``p0``, ``scale`` is given, else the lognormal).

    Example:
        >>> import math
        >>> round(expected_sparsity(math.exp(0.0), mu=0.0, sigma=1.0), 6)
        0.238422
        >>> round(expected_sparsity(1.0, mu=0.0, sigma=2.0), 6)
        0.331898
        >>> expected_sparsity(1.0, mu=0.0, sigma=1.0, stochastic=False)
        0.5
    """
    model = _rule(threshold_rule, source, mu, sigma, p0, scale)
    if model == "histogram":
        hs, single = _histograms(source)
        a = _as_array(threshold)
        if np.isnan(a).any() or (a < 0).any():
            raise ValueError(f"threshold must be >= 0, got {a[~(a >= 0)].reshape(-1)[:5]}")
        rule = THRESHOLD_RULES["histogram"]
        if single:
            st = LayerStats(hist=hs[0])
            out = np.array([rule.expected_sparsity(float(v), st, stochastic=stochastic) for v in a.ravel()])
            out = out.reshape(a.shape)
        else:
            ab = np.broadcast_to(a, (len(hs),))
            out = np.array([rule.expected_sparsity(float(v), LayerStats(hist=h), stochastic=stochastic)
                            for h, v in zip(hs, ab)])
        return _wrap(out, (threshold,))
    m, p0v, single = resolve(source, model=model, mu=mu, sigma=sigma, p0=p0, scale=scale)
    a = _as_array(threshold)
    if np.isnan(a).any() or (a < 0).any():
        raise ValueError(f"threshold must be >= 0, got {a[~(a >= 0)].reshape(-1)[:5]}")
    m, p0f, af, shape = _broadcast(m, p0v, a)
    rule = THRESHOLD_RULES[model]
    if _checked(rule, "expected_sparsity"):      # the inputs are checked above: straight to the model
        out = rule._expected_sparsity(af, p0f, m, stochastic)
    else:
        out = rule.expected_sparsity(af, _layer_stats(m, p0f), stochastic=stochastic)
    return _wrap(out.reshape(shape), (threshold, mu, sigma, p0, scale))


def threshold(target: ArrayLike, source: Any = None, *, mu: ArrayLike | None = None,
              sigma: ArrayLike | None = None, threshold_rule: str | None = None, stochastic: bool = True,
              p0: ArrayLike | None = None, scale: ArrayLike | None = None,
              amax: ArrayLike | None = None, mean_abs: ArrayLike | None = None) -> Any:
    """The threshold ``a`` whose expected sparsity is ``target``.

    ``threshold_rule``: ``"histogram"`` (model-free, from the binade histogram, the largest magnitudes
    and the extremes of a statistics row: see :mod:`gradstats.pruning.histogram`; needs
    ``source``; the most accurate sort-free rule on real gradients), ``"lognormal"`` (the
    study's analytic rule, with closed forms), ``"naive_lognormal"`` (the lognormal
    quantile ``exp(mu + sigma * Phi^-1(S))``, which ignores the values rounded up and so
    undershoots the target under the stochastic operator), ``"normal"`` (half-normal,
    ``scale^2 = E g^2``) or ``"laplace"`` (exponential, ``scale = E|g|``). By default
    (``None``) :data:`DEFAULT_RULE`, the histogram rule, where ``source`` carries histograms
    (statistics rows with ``hist``, or LogHistograms) and none of ``mu``, ``sigma``, ``p0``,
    ``scale`` is given; otherwise the lognormal, the only rule that (mu, sigma) alone can
    set (explicit parameters are the lognormal's). ``stochastic=False``
    gives the hard-threshold quantile of the model. With exact zeros at fraction ``p0`` the
    non-zero part is aimed at ``(target - p0) / (1 - p0)``; when ``target <= p0`` the zeros
    already meet the target and the threshold is 0 (nothing is pruned, and the expected
    sparsity is ``p0``, not ``target``). Solved in ``ln a`` by a bracketed safeguarded Newton
    iteration in float64 to ``|expected_sparsity(threshold(S)) - S| <= 1e-9``.

    ``amax`` (the tensor's largest ``|g|``) and ``mean_abs`` (its mean ``|g|`` over all entries,
    zeros included) condition the rule on the tensor at hand. A model's tail beyond ``amax`` does not
    exist in the data, and a threshold above ``amax`` (which a model reaches for a tensor whose top is
    cut off, such as a classifier's logits gradient) overshoots the target and amplifies every kept
    value. Above ``amax`` no model is needed: every entry lies below the threshold, the stochastic
    operator's expected sparsity on the tensor is exactly ``1 - mean_abs / a``, so when
    ``target >= 1 - mean_abs / amax`` the threshold is ``mean_abs / (1 - target)``, and otherwise the
    model's threshold is capped at ``amax``. The hard operator's threshold is capped at ``amax``
    (``mean_abs`` is not needed there). A statistics row as ``source`` supplies both (its
    ``max_abs`` and ``sum_abs / n``) unless they are given. The ``histogram`` rule ignores these
    arguments: it reads the row's own extremes and largest magnitudes (``top_abs``).

    Example:
        >>> import torch
        >>> from gradstats.stats import tensor_stats
        >>> row = tensor_stats(torch.tensor([0.0, 1.0, -1.5, 3.0]))
        >>> round(threshold(0.5, row), 12)    # the histogram rule: (1 + (1 - 1/a) + (1 - 1.5/a)) / 4
        2.5
        >>> a = threshold(0.9, mu=-10.0, sigma=2.0)          # the lognormal closed form
        >>> abs(expected_sparsity(a, mu=-10.0, sigma=2.0) - 0.9) < 1e-12
        True
        >>> threshold(0.9, mu=-10.0, sigma=2.0, threshold_rule="naive_lognormal") < a
        True
        >>> threshold(0.2, mu=-10.0, sigma=2.0, p0=0.3)
        0.0
        >>> a > 1e-3     # for a tensor whose largest |g| is 1e-4, the model's tail is fiction:
        True
        >>> threshold(0.9, mu=-10.0, sigma=2.0, amax=1e-4, mean_abs=2e-5)   # exact: mean_abs / 0.1
        0.00020000000000000006
        >>> threshold(0.9, mu=-10.0, sigma=2.0, amax=1e-4, mean_abs=2e-6)   # capped at amax
        0.0001
    """
    model = _rule(threshold_rule, source, mu, sigma, p0, scale)
    if model == "histogram":
        hs, single = _histograms(source)
        sv = _as_array(target)
        _check_range("target sparsity", sv, 0.0, 1.0, "a fraction of zeros below 1")
        rule = THRESHOLD_RULES["histogram"]
        if single:
            st = LayerStats(hist=hs[0])
            out = np.array([rule.threshold(float(v), st, stochastic=stochastic) for v in sv.ravel()])
            out = out.reshape(sv.shape)
        else:
            sb = np.broadcast_to(sv, (len(hs),))
            out = np.array([rule.threshold(float(v), LayerStats(hist=h), stochastic=stochastic)
                            for h, v in zip(hs, sb)])
        return _wrap(out, (target,))
    elif model not in FAMILIES and model != "naive_lognormal":
        raise ValueError(f"threshold_rule must be one of {RULES}, got {model!r}")
    m, p0v, _ = resolve(source, model="lognormal" if model == "naive_lognormal" else model, mu=mu, sigma=sigma, p0=p0, scale=scale)
    s = _as_array(target)
    _check_range("target sparsity", s, 0.0, 1.0, "a fraction of zeros below 1")
    m, p0f, sf, shape = _broadcast(m, p0v, s)
    if amax is None and source is not None:
        params, _ = _source_params(source)
        if "amax" in params and np.all(np.isfinite(params["amax"])):
            amax, mean_abs = params["amax"], params["mean_abs"]
    flat = (lambda v: None if v is None else np.broadcast_to(_as_array(v), shape).ravel())  # noqa: E731
    stats = _layer_stats(m, p0f, flat(amax), flat(mean_abs))
    rule = THRESHOLD_RULES[model]                # the rule apply's refresh runs too
    if _checked(rule, "threshold"):              # the inputs are checked above: straight to the model
        a = rule._threshold(sf, p0f, m, stats, stochastic)
    else:
        a = rule.threshold(sf, stats, stochastic=stochastic)
    return _wrap(a.reshape(shape), (target, mu, sigma, p0, scale))


def _checked(rule: Any, method: str) -> bool:
    """Whether ``rule`` is a :class:`~gradstats.pruning.rules.FamilyRule` whose ``method`` is the class's
    (which checks its inputs, then calls ``_<method>`` on them): then :func:`resolve`'s checks suffice."""
    return isinstance(rule, FamilyRule) and getattr(type(rule), method) is getattr(FamilyRule, method)


def _layer_stats(m: Family, p0: np.ndarray, amax: np.ndarray | None = None,
                 mean_abs: np.ndarray | None = None) -> LayerStats:
    """The rules' :class:`LayerStats` of a resolved model's layers (flat arrays of one shape)."""
    if isinstance(m, Lognormal):
        return LayerStats(mu=m.mu, sigma=m.sigma, p0=p0, amax=amax, mean_abs=mean_abs)
    key = "scale_normal" if isinstance(m, HalfNormal) else "scale_laplace"
    return LayerStats(p0=p0, amax=amax, mean_abs=mean_abs, **{key: m.scale})


def predicted_cosine(threshold: ArrayLike, source: Any = None, *, mu: ArrayLike | None = None,
                     sigma: ArrayLike | None = None, family: str = "lognormal",
                     p0: ArrayLike | None = None, scale: ArrayLike | None = None) -> Any:
    """Expected cosine similarity between ``g`` and its stochastic pruning ``T(g)`` at
    ``threshold``: ``sqrt(E g^2 / E T(g)^2)`` with
    ``E T^2 = E[g^2 1{|g| >= a}] + a E[|g| 1{|g| < a}]`` (exact zeros change neither side).

    Example:
        >>> predicted_cosine(0.0, mu=0.0, sigma=1.0)
        1.0
        >>> 0.9 < predicted_cosine(threshold(0.85, mu=0.0, sigma=2.5), mu=0.0, sigma=2.5) < 1.0
        True
    """
    m, p0v, _ = resolve(source, model=family, mu=mu, sigma=sigma, p0=p0, scale=scale)
    d = _added_rel(m, p0v, threshold)
    return _wrap(1.0 / np.sqrt(1.0 + d), (threshold, mu, sigma, p0, scale))


def added_variance(threshold: ArrayLike, source: Any = None, *, mu: ArrayLike | None = None,
                   sigma: ArrayLike | None = None, family: str = "lognormal",
                   p0: ArrayLike | None = None, scale: ArrayLike | None = None,
                   relative: bool = False) -> Any:
    """Expected variance the stochastic pruning at ``threshold`` adds per element,
    ``E[(T(g) - g)^2] = (1 - p0) E[(a|g| - g^2) 1{|g| < a}]`` over all entries (zeros included).
    ``relative=True`` divides by ``E g^2``, giving ``1/cosine^2 - 1`` (computed without
    cancellation, so tiny values stay accurate).

    Example:
        >>> added_variance(0.0, mu=0.0, sigma=1.0)
        0.0
        >>> a = threshold(0.9, mu=0.0, sigma=2.0)
        >>> v = added_variance(a, mu=0.0, sigma=2.0, relative=True)
        >>> abs(v - (1 / predicted_cosine(a, mu=0.0, sigma=2.0) ** 2 - 1)) < 1e-12
        True
    """
    m, p0v, _ = resolve(source, model=family, mu=mu, sigma=sigma, p0=p0, scale=scale)
    d = _added_rel(m, p0v, threshold)
    if relative:
        out = d
    else:
        mb, p0f, _, shape = _broadcast(m, p0v, np.asarray(d))
        out = ((1.0 - p0f) * mb.m2() * d.ravel()).reshape(shape)
    return _wrap(out, (threshold, mu, sigma, p0, scale))


def _added_rel(m: Family, p0v: np.ndarray, threshold: ArrayLike) -> np.ndarray:
    a = _as_array(threshold)
    if np.isnan(a).any() or (a < 0).any():
        raise ValueError(f"threshold must be >= 0, got {a[~(a >= 0)].reshape(-1)[:5]}")
    m, _, af, shape = _broadcast(m, p0v, a)
    d = np.zeros_like(af)
    pos = af > 0
    if pos.any():
        sub = _subset(m, pos)
        d[pos] = sub.added_rel(sub.to_x(af[pos]))
    return d.reshape(shape)


def _subset(m: Family, mask: np.ndarray) -> Family:
    if isinstance(m, Lognormal):
        return Lognormal(m.mu[mask], m.sigma[mask])
    return type(m)(m.scale[mask])
