"""What a plan costs: the noise it adds to each layer's weight gradient, against SGD's own.

For a planned layer ``l`` the *noise ratio* is

    R_l = (i_l + e_l (1 + i_l)) * q2_l / minibatch_l,    i_l = sum_m gain[m, l] e_m (1 + i_m)

- ``e_m``: the relative error ``E(out - g)^2 / E g^2`` of layer ``m``'s operator (pruning then
  rounding), predicted from the stored binade histogram and top magnitudes of its gradient by the
  composed-operator model (:func:`gradstats.plan.checks.predict`, the exact added variance of
  stochastic pruning ``|g| (a - |g|)`` below the threshold, no lognormal tail);
- ``i_l``: the relative noise that the planned layers ``m`` downstream of ``l`` (its output feeds
  their input, from the autograd graph the trace recorded) send back into ``l``'s output gradient.
  ``gain[m, l]`` is measured once by the trace (:class:`gradstats.tracer.noise.Propagation`: noise
  shaped like ``g_m`` sent back from ``m`` alone), as ``l``'s weight gradient sees it (what it adds
  there over ``q2_l``, :func:`gradstats.noise.gains`: noise mixed by the backward pass is not
  independent per entry); each operator adds its error to the gradient it receives, noise included,
  so noise compounds through pruned layers in series. A run without measured gains falls back to
  ``gain = 1`` and no compounding;
- ``q2_l = sum_r |g_r|^2 |x_r|^2`` turns a relative error of the output gradient into added variance
  of the weight gradient (independent per entry), and ``minibatch_l`` is that weight gradient's
  minibatch variance at the run's batch size (both recorded by the trace,
  :mod:`gradstats.tracer.noise`).

``R = 1`` doubles the noise SGD already has. :func:`gradstats.noise_probe` measures the same
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
    rules = plan.resolve(r, strict=False)      # identity rules too: what later layers send back reaches them
    if all(rule.is_identity for rule in rules.values()):
        return NoisePrediction([], bound)
    chosen = calibration_steps(r, list(rules), steps=steps)
    error_at = layer_errors(rules, step_rows(r, list(rules), chosen), chosen)
    terms = noise_terms(r, list(rules), chosen)
    missing = [n for n in rules if n not in terms.index]
    if missing:
        said = ("missing", str(r.path), tuple(missing)) in _SAID
        (log.debug if said else log.info)("no noise record for %d planned layer(s) (%s) in the run at %s: their "
                                          "predicted noise is NaN", len(missing), ", ".join(missing[:5]), r.path)
        _SAID.add(("missing", str(r.path), tuple(missing)))
    sparsity = {name: rule.sparsity or 0.0 for name, rule in rules.items()}
    return NoisePrediction(noise_records(error_at, sparsity, terms, downstream(r), gains(r)), bound, list(chosen))


def recorded_layers(terms: "pd.DataFrame", layers: Sequence[str]) -> list[str]:
    """The layers of ``layers``, in their order, that ``terms`` holds a record of SGD's noise for (a positive
    minibatch term): those whose predicted ratio is a number."""
    return [n for n in layers if n in terms.index and terms.loc[n, "minibatch"] > 0]


def noise_records(error_at: Callable[[str, float], float], sparsity: dict[str, float], terms: "pd.DataFrame",
             down: dict[str, list[str]], gain: dict[tuple[str, str], float]) -> list[dict[str, Any]]:
    """The noise records of layers pruned at ``sparsity`` (and rounded as their rules say): the whole
    operators' ratio (``noise``) and, beside it, ``pruning_noise``: the ratio of what the pruning adds
    over the rounding alone, propagated the same way."""
    layers = list(sparsity)
    recs = _combine({n: error_at(n, s) for n, s in sparsity.items()}, terms, down, layers, gain)
    if not recorded_layers(terms, layers):
        for rec in recs:          # no layer has SGD's noise to compare with: every ratio is NaN (_combine),
            rec["pruning_noise"] = math.nan      # and the errors without pruning are not computed for them
        return recs
    pruning = _combine({n: max(error_at(n, s) - error_at(n, 0.0), 0.0) for n, s in sparsity.items()},
                       terms, down, layers, gain)
    for rec, p in zip(recs, pruning):
        rec["pruning_noise"] = p["noise"]
    return recs


def rule_at(rule: Any, sparsity: float) -> Any:
    """``rule`` with its sparsity set to ``sparsity`` (None at 0)."""
    return replace(rule, sparsity=float(sparsity) if sparsity > 0 else None)


def layer_errors(rules: dict[str, Any], rows: dict[str, dict[int, Any]], steps: Sequence[int]) -> Callable:
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
