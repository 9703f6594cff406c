"""The threshold rules, one object per rule name, for one layer at a time.

Every rule answers the same three questions about one layer described by a :class:`LayerStats`:

- ``threshold(target, stats)``: the threshold ``a`` whose expected sparsity is ``target``;
- ``expected_sparsity(a, stats)``: the sparsity the rule's model expects at a threshold;
- ``predicted_sparsity(target, a, stats)``: the sparsity it expects at the threshold it set for
  ``target`` (``expected_sparsity``, with the shortcuts a rule knows: a solved model gives
  ``target`` back, a threshold above the tensor's maximum is exact on the tensor).

:data:`THRESHOLD_RULES` maps each name of :data:`gradstats.pruning.RULES` (and ``"exact"``, the
selection on the tensor itself, registered beside it in :mod:`gradstats.pruning.operator`) to its
rule. :func:`gradstats.apply` refreshes every threshold through it; each rule solves the same
equation as the vectorised :func:`gradstats.pruning.threshold` that ``recommend`` calls, to about
1e-12 relative (``tests/pruning/test_one_layer.py``). Adding a rule is one class here and its entry.

The model rules run on the families in floats (:func:`gradstats.families.one_family`), the
histogram rule on :class:`gradstats.pruning.histogram.OneLogHistogram`: a single layer's solve
costs microseconds, not the array bookkeeping of the vectorised verbs.

Example:
    >>> from gradstats.pruning.rules import THRESHOLD_RULES, LayerStats
    >>> rule = THRESHOLD_RULES["lognormal"]
    >>> a = rule.threshold(0.9, LayerStats(mu=-10.0, sigma=2.0))
    >>> abs(rule.expected_sparsity(a, LayerStats(mu=-10.0, sigma=2.0)) - 0.9) < 1e-12
    True
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from gradstats.families import one_family, solve_sparsity_one
from gradstats.pruning.histogram import OneLogHistogram


@dataclass(frozen=True)
class LayerStats:
    """One layer's statistics, as the threshold rules read them.

    Attributes:
        mu, sigma: mean and std of ``ln|g|`` of the non-zero entries (the lognormal rules).
        p0: fraction of exact zeros.
        scale_normal, scale_laplace: the half-normal's ``s`` and the exponential's ``b`` (the
            ``"normal"`` and ``"laplace"`` rules).
        amax, mean_abs: the tensor's largest ``|g|`` and its mean ``|g|`` over all entries (zeros
            included): the model rules' conditioning (see :func:`gradstats.pruning.threshold`).
        hist: the binade histogram (the ``"histogram"`` rule).
        tensor: the gradient itself (the ``"exact"`` rule).

    Example:
        >>> LayerStats(mu=0.0, sigma=1.0).p0
        0.0
    """

    mu: float = math.nan
    sigma: float = math.nan
    p0: float = 0.0
    scale_normal: float = math.nan
    scale_laplace: float = math.nan
    amax: Optional[float] = None
    mean_abs: Optional[float] = None
    hist: Optional[OneLogHistogram] = None
    tensor: Any = None


def _check_fraction(name: str, v: float) -> float:
    v = float(v)
    if not 0.0 <= v < 1.0:
        raise ValueError(f"{name} must lie in [0, 1) (a fraction of zeros below 1); got {v!r}")
    return v


class ThresholdRule:
    """Base of the rules: ``name`` and the three methods (see the module docstring)."""

    name = ""

    def threshold(self, target: float, stats: LayerStats, *, stochastic: bool = True) -> float:
        raise NotImplementedError

    def expected_sparsity(self, a: float, stats: LayerStats, *, stochastic: bool = True) -> float:
        raise NotImplementedError

    def predicted_sparsity(self, target: float, a: float, stats: LayerStats) -> float:
        """The expected sparsity of the stochastic operator at ``a``, the threshold set for ``target``."""
        return self.expected_sparsity(a, stats)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class FamilyRule(ThresholdRule):
    """A model rule: the family's threshold for the non-zero part (aimed at
    ``(target - p0) / (1 - p0)``), conditioned on the tensor's ``amax`` and ``mean_abs`` when
    ``stats`` has them. ``rounds_up=False`` is the naive rule: the family's hard quantile, which
    ignores the values the stochastic operator rounds up to the threshold."""

    def __init__(self, name: str, family: str, rounds_up: bool = True) -> None:
        self.name, self.family, self.rounds_up = name, family, rounds_up

    def model(self, stats: LayerStats) -> Any:
        """The family for one layer in floats (a ``ValueError`` names a missing parameter)."""
        scale = {"normal": stats.scale_normal, "laplace": stats.scale_laplace}.get(self.family)
        return one_family(self.family, mu=stats.mu, sigma=stats.sigma, scale=scale)

    def threshold(self, target: float, stats: LayerStats, *, stochastic: bool = True) -> float:
        stochastic = stochastic and self.rounds_up
        s = _check_fraction("target sparsity", target)
        z = _check_fraction("p0 (fraction of exact zeros)", stats.p0)
        m = self.model(stats)
        q = (s - z) / (1.0 - z)
        a = m.from_x(solve_sparsity_one(m, q, stochastic=stochastic)) if q > 0 else 0.0
        if stats.amax is None:
            return a
        am = float(stats.amax)
        if not (am > 0 and math.isfinite(am)):
            raise ValueError(f"amax must be positive and finite (the largest |g| of the tensor), got {am!r}")
        if not stochastic:
            return min(a, am)
        if stats.mean_abs is None:
            raise ValueError("conditioning the stochastic operator's threshold on amax needs mean_abs= too "
                             "(the mean |g| over all entries, zeros included)")
        ma = float(stats.mean_abs)
        if not 0 <= ma <= am:
            raise ValueError("mean_abs must lie in [0, amax] (the mean |g| over all entries, zeros included)")
        if a > 0 and s >= 1.0 - ma / am:       # every entry lies below: exact on the tensor
            return ma / (1.0 - s)
        return min(a, am)

    def expected_sparsity(self, a: float, stats: LayerStats, *, stochastic: bool = True) -> float:
        a = float(a)
        if not a >= 0:
            raise ValueError(f"threshold must be >= 0, got {a!r}")
        z = _check_fraction("p0 (fraction of exact zeros)", stats.p0)
        m = self.model(stats)
        if math.isinf(a):
            s = 1.0
        elif a > 0:
            x = m.to_x(a)
            s = m.stochastic(x) if stochastic else m.hard(x)
        else:
            s = 0.0
        return z + (1.0 - z) * min(max(s, 0.0), 1.0)

    def predicted_sparsity(self, target: float, a: float, stats: LayerStats) -> float:
        """Exact on the tensor above its ``amax`` (``1 - mean_abs / a``); ``target`` where the
        stochastic model was solved for it (to 1e-9); else the model's expected sparsity."""
        cond = stats.amax is not None and stats.mean_abs is not None
        if cond and a >= stats.amax:
            return 1.0 - stats.mean_abs / a
        if a > 0 and self.rounds_up:
            return float(target)
        return self.expected_sparsity(a, stats)


class HistogramRule(ThresholdRule):
    """The model-free rule: the operator's sparsity read off ``stats.hist``
    (:class:`~gradstats.pruning.histogram.OneLogHistogram`)."""

    name = "histogram"

    @staticmethod
    def _hist(stats: LayerStats) -> OneLogHistogram:
        if stats.hist is None:
            raise ValueError("the histogram rule needs LayerStats(hist=...): the binade histogram "
                             "(OneLogHistogram.from_stats of a statistics row)")
        return stats.hist

    def threshold(self, target: float, stats: LayerStats, *, stochastic: bool = True) -> float:
        return self._hist(stats).threshold(float(target), stochastic=stochastic)

    def expected_sparsity(self, a: float, stats: LayerStats, *, stochastic: bool = True) -> float:
        return self._hist(stats).expected_sparsity(float(a), stochastic=stochastic)


#: the registry: each threshold rule name -> its rule (and ``"exact"``, registered by
#: :mod:`gradstats.pruning.operator`, which holds the selection it runs)
THRESHOLD_RULES: dict[str, ThresholdRule] = {
    "lognormal": FamilyRule("lognormal", "lognormal"),
    "naive_lognormal": FamilyRule("naive_lognormal", "lognormal", rounds_up=False),
    "normal": FamilyRule("normal", "normal"),
    "laplace": FamilyRule("laplace", "laplace"),
    "histogram": HistogramRule(),
}


def register(rule: ThresholdRule) -> ThresholdRule:
    """Add ``rule`` to :data:`THRESHOLD_RULES` under its name (a rule that needs what this module
    must not import registers itself: ``"exact"``, in :mod:`gradstats.pruning.operator`).

    Example:
        >>> register(THRESHOLD_RULES["laplace"]) is THRESHOLD_RULES["laplace"]
        True
    """
    if not isinstance(rule, ThresholdRule) or not rule.name:
        raise ValueError(f"register() takes a named ThresholdRule, got {rule!r}")
    THRESHOLD_RULES[rule.name] = rule
    return rule
