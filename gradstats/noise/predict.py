"""What a plan costs: the noise it adds to each layer's weight gradient, against SGD's own.

For a planned layer ``l`` the *noise ratio* is

    R_l = (i_l + e_l (1 + i_l)) * q2_l / minibatch_l,    i_l = sum_m gain[m, l] e_m (1 + i_m)

- ``e_m``: the relative error ``E(out - g)^2 / E g^2`` of layer ``m``'s operator (pruning then
  rounding), predicted from the stored binade histogram and top magnitudes of its gradient by the
  composed-operator model (:func:`gradstats.plan.checks.predict`, the exact added variance of
  stochastic pruning ``|g| (a - |g|)`` below the threshold, no lognormal tail);
- ``i_l``: the relative noise that the planned layers ``m`` downstream of ``l`` (its output feeds
  their input, from the autograd graph the trace recorded) send back into ``l``'s output gradient.
  ``gain[m, l]`` is measured once by the trace (:class:`gradstats.noise.record.Propagation`: noise
  shaped like ``g_m`` sent back from ``m`` alone); each operator adds its error to the gradient it
  receives, noise included, so noise compounds through pruned layers in series. A run without
  measured gains falls back to ``gain = 1`` and no compounding;
- ``q2_l = sum_r |g_r|^2 |x_r|^2`` turns a relative error of the output gradient into added variance
  of the weight gradient (independent per entry), and ``minibatch_l`` is that weight gradient's
  minibatch variance at the run's batch size (both recorded by the trace,
  :mod:`gradstats.noise.record`).

``R = 1`` doubles the noise SGD already has. :func:`gradstats.noise.noise_probe` measures the same
ratio by running the plan; ``docs/noise.md`` compares the two and explains the default bound.

Example:
    >>> import tempfile, torch, gradstats
    >>> m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    >>> with gradstats.trace(m, tempfile.mkdtemp(), sample_every=1) as t:
    ...     for _ in range(2):
    ...         m(torch.randn(32, 16)).logsumexp(1).mean().backward(); t.step()
    >>> p = gradstats.Plan.uniform(sparsity=0.9, output_layer=False)
    >>> df = predicted_noise(t.path, p).to_dataframe()
    >>> list(df["layer"]), bool((df["noise"] > 0).all())
    (['0', '2'], True)
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np

from gradstats.noise.terms import NOISE_BOUND, downstream, gain_of, gains, noise_terms, noise_weights  # noqa: F401 - re-exported

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)
#: the run-level facts already logged, so that a run planned many times (one plan per width and
#: sparsity) says each once
_SAID: set[tuple[object, ...]] = set()

__all__ = ["predicted_noise", "NoisePrediction", "noise_terms", "downstream", "gains", "incoming_noise",
           "operator_error", "noise_weights", "NOISE_BOUND"]


def operator_error(rule: Any, rows: Sequence[Any], weights: Optional[Sequence[float]] = None) -> float:
    """The relative error ``E(out - g)^2 / E g^2`` of ``rule``'s operator, predicted on each
    statistics row (one per calibration step) with the threshold and scale that apply sets from it,
    averaged with ``weights``. 0 for an identity rule; NaN where nothing can be predicted.

    Example:
        >>> import torch
        >>> from gradstats.plan import Rule
        >>> from gradstats.stats import tensor_stats
        >>> row = tensor_stats(torch.randn(10000).exp())
        >>> 0.0 < operator_error(Rule(sparsity=0.5), [row]) < 1.0
        True
    """
    from gradstats.plan.checks import operator_settings, predict

    if rule is None or rule.is_identity or not rows:
        return 0.0
    errs = []
    for row in rows:
        a, scale = operator_settings(rule, row)
        errs.append(predict(rule, row, a, scale)["error"])
    w = np.ones(len(errs)) if weights is None else np.asarray(weights, dtype=float)
    e = np.asarray(errs, dtype=float)
    ok = np.isfinite(e)
    return float(np.sum(w[ok] * e[ok]) / np.sum(w[ok])) if ok.any() else math.nan


class PerLayer:
    """What the noise results share: ``records`` (one dict per layer, with ``layer``), read by layer
    name (``result[name]``: the record's :attr:`value` field) and as plain data."""

    records: list[dict[str, Any]]
    #: the field ``result[layer]`` reads
    value = "noise"

    def layers_dict(self) -> dict[str, dict[str, Any]]:
        """``{layer: record without its name}``."""
        return {r["layer"]: {k: v for k, v in r.items() if k != "layer"} for r in self.records}

    def __getitem__(self, layer: str) -> float:
        for r in self.records:
            if r["layer"] == layer:
                return float(r[self.value])
        raise KeyError(layer)


@dataclass(frozen=True)
class NoisePrediction(PerLayer):
    """Per planned layer: ``error`` (its operator's relative error), ``incoming`` (the relative
    error carried back from the planned layers downstream), ``q2``, ``minibatch``, ``noise``
    (the ratio ``R``), ``local_noise`` (``R`` from this layer's own operator alone) and
    ``pruning_noise`` (``R`` from the plan's pruning alone, over its rounding: what
    ``recommend``'s noise bound limits).

    Example:
        >>> NoisePrediction([{"layer": "fc", "noise": 0.01}], 0.02).ok
        True
    """

    records: list[dict[str, Any]]
    bound: Optional[float] = None
    steps: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every layer's predicted ratio within ``bound`` (True without a bound)."""
        if self.bound is None:
            return True
        return all(not (r.get("noise", 0.0) > self.bound) for r in self.records)

    def to_dataframe(self) -> "pd.DataFrame":
        """One row per layer."""
        import pandas as pd

        cols = ["layer", "error", "incoming", "q2", "minibatch", "local_noise", "noise", "pruning_noise"]
        return pd.DataFrame(self.records, columns=cols)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"bound", "steps", "layers": {name: record}}``."""
        return {"bound": self.bound, "steps": list(self.steps), "layers": self.layers_dict()}


def incoming_noise(errors: dict[str, float], down: dict[str, list[str]],
                   gain: dict[tuple[str, str], float]) -> dict[str, float]:
    """Per planned layer, the relative noise its output gradient receives from the planned layers
    downstream: ``sum_m gain[m, l] * e_m * (1 + incoming_m)`` (each operator adds its relative error
    to the gradient it receives, noise included; without measured gains, the plain sum of the ``e_m``).

    Example:
        >>> incoming_noise({"a": 0.1, "b": 0.2}, {"a": ["b"], "b": []}, {("b", "a"): 0.5})
        {'b': 0.0, 'a': 0.1}
    """
    out: dict[str, float] = {}
    for name in sorted(errors, key=lambda n: len(down.get(n, ()))):       # downstream layers first
        total = 0.0
        for m in down.get(name, ()):
            e = errors.get(m, math.nan)
            if not math.isfinite(e):
                continue
            total += gain_of(gain, m, name) * e * (1.0 + out.get(m, 0.0) if gain else 1.0)
        out[name] = total
    return out


def _combine(errors: dict[str, float], terms: "pd.DataFrame", down: dict[str, list[str]],
             layers: Sequence[str], gain: Optional[dict[tuple[str, str], float]] = None) -> list[dict[str, Any]]:
    inc = incoming_noise({n: errors.get(n, 0.0) for n in layers}, down, gain or {})
    recs = []
    for name in layers:
        e = errors.get(name, 0.0)
        if name in terms.index and terms.loc[name, "minibatch"] > 0:
            q2, mb = float(terms.loc[name, "q2"]), float(terms.loc[name, "minibatch"])
            c = q2 / mb
        else:
            c = q2 = mb = math.nan
        total = inc[name] + e * (1.0 + inc[name])
        recs.append({"layer": name, "error": e, "incoming": inc[name], "q2": q2, "minibatch": mb,
                     "local_noise": e * c, "noise": total * c})
    return recs


def predicted_noise(run: Any, plan: Any, *, steps: Any = "auto", bound: Optional[float] = None) -> NoisePrediction:
    """The noise ratio ``R`` (module doc) that ``plan`` is predicted to add to each planned layer
    of the model traced in ``run``, from the run's statistics and noise records on the calibration
    ``steps`` (:func:`gradstats.plan.checks.calibration_steps`). Layers the trace holds no noise
    record of (not a Linear or convolution, or a run traced before these were recorded) get NaN.

    Example:
        >>> import tempfile, torch, gradstats
        >>> m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        >>> with gradstats.trace(m, tempfile.mkdtemp(), sample_every=1) as t:
        ...     for _ in range(2):
        ...         m(torch.randn(64, 8)).logsumexp(1).mean().backward(); t.step()
        >>> lo = predicted_noise(t.path, gradstats.Plan.uniform(sparsity=0.3, output_layer=False))
        >>> hi = predicted_noise(t.path, gradstats.Plan.uniform(sparsity=0.9, output_layer=False))
        >>> hi["0"] > lo["0"] > 0
        True
    """
    from gradstats.plan.checks import calibration_steps, step_rows
    from gradstats.run import as_run

    r = as_run(run)
    rules = {n: rule for n, rule in plan.resolve(r, strict=False).items() if not rule.is_identity}
    if not rules:
        return NoisePrediction([], bound)
    chosen = calibration_steps(r, list(rules), steps=steps)
    error_at = _layer_errors(rules, step_rows(r, list(rules), chosen), chosen)
    terms = noise_terms(r, list(rules), chosen)
    missing = [n for n in rules if n not in terms.index]
    if missing:
        said = ("missing", str(r.path), tuple(missing)) in _SAID
        (log.debug if said else log.info)("no noise record for %d planned layer(s) (%s) in the run at %s: their "
                                          "predicted noise is NaN", len(missing), ", ".join(missing[:5]), r.path)
        _SAID.add(("missing", str(r.path), tuple(missing)))
    sparsity = {name: rule.sparsity or 0.0 for name, rule in rules.items()}
    return NoisePrediction(_records(error_at, sparsity, terms, downstream(r), gains(r)), bound, list(chosen))


def _records(error_at: Callable[[str, float], float], sparsity: dict[str, float], terms: "pd.DataFrame",
             down: dict[str, list[str]], gain: dict[tuple[str, str], float]) -> list[dict[str, Any]]:
    """The noise records of layers pruned at ``sparsity`` (and rounded as their rules say): the whole
    operators' ratio (``noise``) and, beside it, ``pruning_noise``: the ratio of what the pruning adds
    over the rounding alone, propagated the same way."""
    layers = list(sparsity)
    recs = _combine({n: error_at(n, s) for n, s in sparsity.items()}, terms, down, layers, gain)
    pruning = _combine({n: max(error_at(n, s) - error_at(n, 0.0), 0.0) for n, s in sparsity.items()},
                       terms, down, layers, gain)
    for rec, p in zip(recs, pruning):
        rec["pruning_noise"] = p["noise"]
    return recs


def bound_sparsity(layers: Sequence[str], requested: dict[str, float], error_at: Callable[[str, float], float],
                   terms: "pd.DataFrame", down: dict[str, list[str]], bound: float, iterations: int = 10,
                   gain: Optional[dict[tuple[str, str], float]] = None) -> dict[str, dict[str, Any]]:
    """Per layer, the largest sparsity up to ``requested[layer]`` (layers absent from ``requested``
    are not pruned) that keeps every layer's predicted ratio within ``bound``.

    Each layer's bound is a budget of relative error ``bound * minibatch / q2`` shared by the layer
    and the planned layers downstream of it (each weighted by the measured ``gain`` of its noise
    to the layer, 1 without gains; to first order, as the bound keeps the errors small); layers are granted their sparsity from the output
    backwards, each taking at most an equal share of what is left of every budget it draws on, so no
    budget is overdrawn. ``error_at(layer, s)`` is the layer's operator error at sparsity ``s``
    (increasing in ``s``). Returns per layer ``requested``, ``granted``, ``error``, ``reason``.

    Example:
        >>> import pandas as pd
        >>> terms = pd.DataFrame({"q2": [1.0, 1.0], "minibatch": [1.0, 1.0]}, index=["a", "b"])
        >>> out = bound_sparsity(["a", "b"], {"a": 0.9, "b": 0.9}, lambda n, s: s / 10, terms,
        ...                      {"a": ["b"], "b": []}, 0.02)
        >>> round(out["b"]["granted"], 2), round(out["a"]["granted"], 2)
        (0.1, 0.1)
    """
    planned = set(layers)
    contrib = {l: [l] + [m for m in down.get(l, ()) if m in planned] for l in layers}
    budget, used, left = {}, {}, {}
    for l in layers:
        if l in terms.index and terms.loc[l, "q2"] > 0 and terms.loc[l, "minibatch"] > 0:
            budget[l] = bound * float(terms.loc[l, "minibatch"] / terms.loc[l, "q2"])
        else:
            budget[l] = math.inf            # nothing recorded: no bound can be computed
        used[l], left[l] = 0.0, len(contrib[l])
    draws_on = {m: [l for l in layers if m in contrib[l]] for m in layers}
    out: dict[str, dict[str, Any]] = {}
    fixed = [m for m in layers if m not in requested]
    pruned = sorted((m for m in layers if m in requested), key=lambda m: len(down.get(m, ())))
    for m in fixed + pruned:
        e0 = error_at(m, 0.0)
        e0 = e0 if math.isfinite(e0) else 0.0
        want = requested.get(m, 0.0)
        w = {l: (1.0 if l == m else gain_of(gain or {}, m, l)) for l in draws_on[m]}
        share = min(((budget[l] - used[l]) / (left[l] * w[l]) for l in draws_on[m] if w[l] > 0), default=math.inf)
        if m not in requested or want <= 0:
            s, e, reason = 0.0, e0, "not pruned"
        elif not math.isfinite(share):
            s, e, reason = want, error_at(m, want), "no noise record: requested"
        elif e0 > share:
            s, e, reason = 0.0, e0, "the rounding alone exceeds the noise bound"
        else:
            e_want = error_at(m, want)
            if e_want <= share:
                s, e, reason = want, e_want, "requested"
            else:
                lo, hi, e = 0.0, want, e0
                for _ in range(iterations):
                    mid = 0.5 * (lo + hi)
                    em = error_at(m, mid)
                    if em <= share:
                        lo, e = mid, em
                    else:
                        hi = mid
                s, reason = lo, "noise bound"
        for l in draws_on[m]:
            used[l] += w[l] * e
            left[l] -= 1
        out[m] = {"requested": want, "granted": s, "error": e, "reason": reason}
    return out


def rule_at(rule: Any, sparsity: float) -> Any:
    """``rule`` with its sparsity set to ``sparsity`` (None at 0)."""
    return replace(rule, sparsity=float(sparsity) if sparsity > 0 else None)


def _layer_errors(rules: dict[str, Any], rows: dict[str, dict[int, Any]], steps: Sequence[int]) -> Callable:
    from gradstats.plan.checks import step_weights

    cache: dict[tuple[str, float], float] = {}

    def error_at(name: str, s: float) -> float:
        key = (name, round(float(s), 6))
        if key not in cache:
            have = [t for t in steps if t in rows[name]]
            cache[key] = operator_error(rule_at(rules[name], s), [rows[name][t] for t in have],
                                        step_weights(have) if have else None)
        return cache[key]
    return error_at


def bound_plan(plan: Any, run: Any, steps: Sequence[int], bound: Optional[float],
               requested: Optional[float] = None, *, solve_for: Optional[float] = None) -> Any:
    """``plan`` with each pruned layer's sparsity lowered where needed so that the noise ratio its
    *pruning* adds (over the plan's rounding alone) stays within ``bound`` at every planned layer
    (:func:`bound_sparsity`), and the plan's ``noise`` records filled: requested and granted
    sparsity, the reason, ``predicted_noise`` (the whole plan's ratio, rounding included) and
    ``pruning_noise`` (the part the bound limits; the evidence behind the default bound was measured
    on pruning alone, ``docs/noise.md``). With ``bound=None`` only the records. ``requested``: the
    sparsity asked for (default: each rule's). ``solve_for``: the bound the sparsities are solved for,
    when it is to be tighter than the ``bound`` the plan records (``recommend``, after a repair).

    Example:
        >>> import tempfile, torch, gradstats
        >>> m = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        >>> with gradstats.trace(m, tempfile.mkdtemp(), sample_every=1) as t:
        ...     for _ in range(2):
        ...         m(torch.randn(64, 8)).logsumexp(1).mean().backward(); t.step()
        >>> p = bound_plan(gradstats.Plan.uniform(sparsity=0.95, output_layer=False), t.path, [0], 1e-3)
        >>> {c["layer"]: c["sparsity"] < 0.95 for c in p.noise}
        {'0': True, '2': True}
    """
    import dataclasses

    from gradstats.plan.checks import step_rows
    from gradstats.run import as_run

    r = as_run(run)
    rules = {n: rule for n, rule in plan.resolve(r, strict=False).items() if not rule.is_identity}
    if not rules:
        return plan
    rows = step_rows(r, list(rules), steps)
    error_at = _layer_errors(rules, rows, steps)
    terms = noise_terms(r, list(rules), steps)
    down = downstream(r)
    gain = gains(r)
    want = {n: (requested if requested is not None else rule.sparsity) for n, rule in rules.items() if rule.prunes}
    if bound is not None and (terms.empty or not down):
        said = ("no records", str(r.path)) in _SAID          # a fact of the run: said once, not once per plan
        (log.debug if said else log.warning)("the run at %s holds no noise records (traced before gradstats "
                                             "recorded them, or with noise=False): plans made from it do not bound "
                                             "their noise; trace again to bound it", r.path)
        _SAID.add(("no records", str(r.path)))
        bound = None
    def added_by_pruning(n: str, sp: float) -> float:     # what the bound limits: the pruning's share
        return max(error_at(n, sp) - error_at(n, 0.0), 0.0)

    if bound is None:
        granted = {n: {"requested": want.get(n), "granted": want.get(n, 0.0) or 0.0,
                       "error": error_at(n, want.get(n, 0.0) or 0.0), "reason": "requested" if n in want else
                       "not pruned"} for n in rules}
    else:
        granted = bound_sparsity(list(rules), want, added_by_pruning, terms, down,
                                 float(solve_for if solve_for is not None else bound), gain=gain)
    preds = {rec["layer"]: rec for rec in _records(error_at, {n: granted[n]["granted"] for n in rules}, terms, down,
                                                  gain)}
    records = [{"layer": n, "requested_sparsity": granted[n]["requested"],
                "sparsity": granted[n]["granted"], "sparsity_reason": granted[n]["reason"],
                "operator_error": float(preds[n]["error"]), "predicted_noise": _num(preds[n]["noise"]),
                "pruning_noise": _num(preds[n]["pruning_noise"])} for n in rules]
    entries: list[Any] = list(plan.entries)
    extra: list[dict[str, Any]] = []
    if bound is not None:
        by_name = {e.layer: i for i, e in enumerate(entries) if not e.is_pattern}
        for n, g in granted.items():
            if n not in want or g["granted"] >= want[n]:
                continue
            s = float(g["granted"])
            if n in by_name:
                e = entries[by_name[n]]
                pred = e.predicted
                if pred is not None and dataclasses.is_dataclass(pred):
                    pred = dataclasses.replace(pred, sparsity=s)
                entries[by_name[n]] = dataclasses.replace(e, sparsity=s, predicted=pred)
            else:
                extra.append({"layer": n, "sparsity": s})
    out = dataclasses.replace(plan, entries=tuple(entries), noise_bound=bound, noise=tuple(records))
    return out.with_entries(*extra) if extra else out


def _num(v: float) -> Optional[float]:
    return float(v) if v is not None and math.isfinite(v) else None
