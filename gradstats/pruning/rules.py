"""The threshold rules, one object per rule name: the one path from a layer's statistics to its
threshold, for ``recommend`` and the plan's checks (through :func:`gradstats.pruning.threshold`),
apply's refresh and :func:`gradstats.pruning.prune`.

Every rule answers the same three questions about the layers a :class:`LayerStats` describes:

- ``threshold(target, stats)``: the threshold ``a`` whose expected sparsity is ``target``;
- ``expected_sparsity(a, stats)``: the sparsity the rule's model expects at a threshold;
- ``predicted_sparsity(target, a, stats)``: the sparsity it expects at the threshold it set for
  ``target`` (``expected_sparsity``, with the shortcuts a rule knows: a solved model gives
  ``target`` back, a threshold above the tensor's maximum is exact on the tensor).

:data:`THRESHOLD_RULES` maps each threshold rule's name to its rule: the rules that work from a
layer's statistics (:data:`gradstats.pruning.RULES`) and ``"exact"``, the selection on the tensor
itself (:func:`exact_threshold`). Adding a rule is one class here and its entry (or :func:`register`).

The model rules are written once for one layer in Python floats (what apply's refresh solves on
every step: microseconds, no array bookkeeping) and for many layers in numpy arrays of one shape
(what :func:`gradstats.pruning.threshold` passes): the families' maths of
:mod:`gradstats.families`, solved by :func:`gradstats.families.solve_sparsity`.

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

import torch

from gradstats._special import MATH, all_, backend, join, shown
from gradstats.families import Family, make_family, solve_sparsity
from gradstats.ops.prune import check_tensor
from gradstats.pruning.histogram import LogHistogram


@dataclass(frozen=True)
class LayerStats:
    """The statistics of one layer (floats) or of many (numpy arrays of one shape), as the threshold
    rules read them.

    Attributes:
        mu, sigma: mean and std of ``ln|g|`` of the non-zero entries (the lognormal rules).
        p0: fraction of exact zeros.
        scale_normal, scale_laplace: the half-normal's ``s`` and the exponential's ``b`` (the
            ``"normal"`` and ``"laplace"`` rules).
        amax, mean_abs: the tensor's largest ``|g|`` and its mean ``|g|`` over all entries (zeros
            included): the model rules' conditioning (see :func:`gradstats.pruning.threshold`).
        hist: the binade histogram (the ``"histogram"`` rule; one layer).
        tensor: the gradient itself (the ``"exact"`` rule; one layer).

    Example:
        >>> LayerStats(mu=0.0, sigma=1.0).p0
        0.0
    """

    mu: Any = math.nan
    sigma: Any = math.nan
    p0: Any = 0.0
    scale_normal: Any = math.nan
    scale_laplace: Any = math.nan
    amax: Any = None
    mean_abs: Any = None
    hist: Optional[LogHistogram] = None
    tensor: Any = None


def _check_fraction(name: str, v: Any) -> Any:
    if type(v) is float:
        if 0.0 <= v < 1.0:
            return v
        ok: Any = False
    else:
        v = float(v) if isinstance(v, int) else v
        ok = (v >= 0.0) & (v < 1.0)
    if not all_(ok):
        raise ValueError(f"{name} must lie in [0, 1) (a fraction of zeros below 1); got {shown(v, ok)!r}")
    return v


def condition_on_amax(a: Any, target: Any, amax: Any, mean_abs: Any, stochastic: bool) -> Any:
    """A model's threshold ``a`` for ``target`` conditioned on the tensor's largest ``|g|``
    (``amax``) and its mean ``|g|`` over all entries (``mean_abs``): capped at ``amax``, and where
    ``target >= 1 - mean_abs / amax`` the threshold that is exact on the tensor, ``mean_abs / (1 -
    target)`` (the stochastic operator; see :func:`gradstats.pruning.threshold`). Floats or arrays.

    Example:
        >>> condition_on_amax(1e-3, 0.9, 1e-4, 2e-6, True)     # capped at amax
        0.0001
    """
    S = MATH if type(a) is float and type(target) is float and type(amax) is float and type(mean_abs) is float \
        else backend(a, target, amax, mean_abs)
    ok = S.isfinite(amax) & (amax > 0)
    if not S.all_(ok):
        raise ValueError(f"amax must be positive and finite (the largest |g| of the tensor), got {S.shown(amax, ok)!r}")
    if not stochastic:
        return S.minimum(a, amax)
    if mean_abs is None:
        raise ValueError("conditioning the stochastic operator's threshold on amax needs mean_abs= too "
                         "(the mean |g| over all entries, zeros included)")
    if not S.all_((mean_abs >= 0) & (mean_abs <= amax)):
        raise ValueError("mean_abs must lie in [0, amax] (the mean |g| over all entries, zeros included)")
    above = (a > 0) & (target >= 1.0 - mean_abs / amax)      # every entry lies below: exact on the tensor
    return S.where(above, mean_abs / (1.0 - target), S.minimum(a, amax))


class ThresholdRule:
    """Base of the rules: ``name``, whether the rule works from a layer's statistics alone
    (``from_statistics``; ``"exact"`` reads the tensor), whether it reads their binade histogram
    (``needs_histogram``), whether it is model-free (``model_free``: its threshold aims at the target on
    the data itself, so the target is its prediction), the rule a layer's statistics stand in with where
    a rule that reads the tensor does not have it (``stand_in``), and the three methods (see the module
    docstring)."""

    name = ""
    from_statistics = True
    needs_histogram = False
    model_free = False
    stand_in: str | None = None

    def threshold(self, target: Any, stats: LayerStats, *, stochastic: bool = True) -> Any:
        raise NotImplementedError

    def expected_sparsity(self, a: Any, stats: LayerStats, *, stochastic: bool = True) -> Any:
        raise NotImplementedError

    def predicted_sparsity(self, target: float, a: float, stats: LayerStats) -> float:
        """The expected sparsity of the stochastic operator at ``a``, the threshold set for ``target``."""
        return self.expected_sparsity(a, stats)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class FamilyRule(ThresholdRule):
    """A model rule: the family's threshold for the non-zero part (aimed at
    ``(target - p0) / (1 - p0)``), conditioned on the tensor's ``amax`` and ``mean_abs`` when
    ``stats`` has them (:func:`condition_on_amax`). ``rounds_up=False`` is the naive rule: the
    family's hard quantile, which ignores the values the stochastic operator rounds up to the
    threshold. One layer in floats or many in arrays of one shape.

    Example:
        >>> import numpy as np
        >>> rule = THRESHOLD_RULES["lognormal"]
        >>> one = rule.threshold(0.9, LayerStats(mu=-10.0, sigma=2.0))
        >>> many = rule.threshold(np.full(2, 0.9), LayerStats(mu=np.full(2, -10.0), sigma=np.full(2, 2.0)))
        >>> bool(abs(many[0] - one) <= 1e-12 * one)
        True
    """

    def __init__(self, name: str, family: str, rounds_up: bool = True) -> None:
        self.name, self.family, self.rounds_up = name, family, rounds_up

    def model(self, stats: LayerStats) -> Family:
        """The family at the layers' parameters (a ``ValueError`` names a missing parameter)."""
        if self.family == "lognormal":
            return make_family("lognormal", mu=stats.mu, sigma=stats.sigma)
        return make_family(self.family, scale=stats.scale_normal if self.family == "normal" else stats.scale_laplace)

    def threshold(self, target: Any, stats: LayerStats, *, stochastic: bool = True) -> Any:
        s = _check_fraction("target sparsity", target)
        z = _check_fraction("p0 (fraction of exact zeros)", stats.p0)
        return self._threshold(s, z, self.model(stats), stats, stochastic)

    def _threshold(self, s: Any, z: Any, m: Family, stats: LayerStats, stochastic: bool) -> Any:
        """:meth:`threshold` from checked inputs: the target ``s`` and ``p0`` ``z`` in ``[0, 1)`` and the
        family ``m`` at the layers' parameters (:meth:`model`)."""
        stochastic = stochastic and self.rounds_up
        S = MATH if type(s) is float and type(z) is float else backend(s, z)
        q = (s - z) / (1.0 - z)
        pos = q > 0                              # else the zeros meet the target: nothing to prune
        if S.all_(pos):
            a = m.from_x(solve_sparsity(m, q, stochastic=stochastic))
        elif S.any_(pos):
            a = S.where(pos, m.from_x(solve_sparsity(m, S.where(pos, q, 0.5), stochastic=stochastic)), 0.0)
        else:
            a = S.where(pos, q, 0.0)
        if stats.amax is None:
            return a
        return condition_on_amax(a, s, stats.amax, stats.mean_abs, stochastic)

    def expected_sparsity(self, a: Any, stats: LayerStats, *, stochastic: bool = True) -> Any:
        a = float(a) if isinstance(a, int) else a
        A = MATH if type(a) is float else backend(a)
        if not A.all_(a >= 0):
            raise ValueError(f"threshold must be >= 0, got {A.shown(a, a >= 0)!r}")
        z = _check_fraction("p0 (fraction of exact zeros)", stats.p0)
        return self._expected_sparsity(a, z, self.model(stats), stochastic)

    def _expected_sparsity(self, a: Any, z: Any, m: Family, stochastic: bool) -> Any:
        """:meth:`expected_sparsity` from checked inputs: thresholds ``a >= 0``, ``p0`` ``z`` in ``[0, 1)``
        and the family ``m`` at the layers' parameters."""
        A = MATH if type(a) is float else backend(a)
        pos = (a > 0) & A.isfinite(a)
        if A.all_(pos):
            x = m.to_x(a)
            s = m.stochastic(x) if stochastic else m.hard(x)
        elif A.any_(pos):
            x = m.to_x(A.where(pos, a, 1.0))
            s = A.where(pos, m.stochastic(x) if stochastic else m.hard(x), A.where(a > 0, 1.0, 0.0))
        else:
            s = A.where(a > 0, 1.0, 0.0)         # inf: every finite value below
        S = m._S if type(a) is float else join(m._S, a)
        return z + (1.0 - z) * S.minimum(S.maximum(s, 0.0), 1.0)

    def predicted_sparsity(self, target: float, a: float, stats: LayerStats) -> float:
        """Exact on the tensor above its ``amax`` (``1 - mean_abs / a``); ``target`` where the
        stochastic model was solved for it (to 1e-9); else the model's expected sparsity. One layer."""
        cond = stats.amax is not None and stats.mean_abs is not None
        if cond and a >= stats.amax:
            return 1.0 - stats.mean_abs / a
        if a > 0 and self.rounds_up:
            return float(target)
        return self.expected_sparsity(a, stats)


class HistogramRule(ThresholdRule):
    """The model-free rule: the operator's sparsity read off ``stats.hist``
    (:class:`~gradstats.pruning.histogram.LogHistogram`)."""

    name = "histogram"
    needs_histogram = True
    model_free = True

    @staticmethod
    def _hist(stats: LayerStats) -> LogHistogram:
        if stats.hist is None:
            raise ValueError("the histogram rule needs LayerStats(hist=...): the binade histogram "
                             "(LogHistogram.from_stats of a statistics row)")
        return stats.hist

    def threshold(self, target: float, stats: LayerStats, *, stochastic: bool = True) -> float:
        return self._hist(stats).threshold(float(target), stochastic=stochastic)

    def expected_sparsity(self, a: float, stats: LayerStats, *, stochastic: bool = True) -> float:
        return self._hist(stats).expected_sparsity(float(a), stochastic=stochastic)


def check_target(target: Any) -> float:
    """``target`` as a sparsity in ``[0, 1)``, or a ``ValueError`` that says what was expected.

    Example:
        >>> check_target(0.85)
        0.85
    """
    try:
        s = float(target)
    except (TypeError, ValueError):
        raise ValueError(f"target sparsity must be a number in [0, 1), got {target!r}") from None
    if not (0.0 <= s < 1.0):
        raise ValueError(f"target sparsity must lie in [0, 1) (a fraction of zeros below 1), got {s}")
    return s


def exact_threshold(x: torch.Tensor, target: float, *, stochastic: bool = False) -> float:
    """The exact threshold of a tensor for a target sparsity (the sort/selection baseline).

    ``stochastic=False``: the hard-threshold quantile by ``torch.kthvalue``: with
    ``k = round(target * n)``, the ``(k+1)``-th smallest ``|x|``, so that hard thresholding
    zeros exactly ``k`` entries when there are no ties (0 when the zeros already reach
    ``k``). ``stochastic=True``: the threshold whose expected sparsity under
    :func:`stochastic_prune` *on this very tensor* is ``target``, from the sorted ``|x|`` and
    their prefix sums: ``S(a) = (1/n) * sum_{|x_i| < a} (1 - |x_i|/a)`` (an O(n log n) oracle).

    Example:
        >>> import torch
        >>> x = torch.tensor([0.0, 1.0, -2.0, 3.0, 4.0])
        >>> exact_threshold(x, 0.4)
        2.0
        >>> a = exact_threshold(x, 0.4, stochastic=True)
        >>> round((1 + (1 - 1 / a) + (1 - 2 / a)) / 5, 12) if 2 < a <= 3 else a
        0.4
    """
    check_tensor(x)
    s = check_target(target)
    ax = x.detach().reshape(-1).abs()
    n = ax.numel()
    if not stochastic:
        k = min(int(round(s * n)), n - 1)
        return float(torch.kthvalue(ax.cpu() if ax.device.type == "mps" else ax, k + 1).values)
    v = torch.sort(ax.double()).values
    if s == 0.0:
        return 0.0
    csum = torch.cumsum(v, 0)
    k = torch.arange(n, dtype=torch.float64, device=v.device)
    # S at a = v[k]: the k entries before it are below a (ties at a contribute 0 either way)
    prev = torch.cat([v.new_zeros(1), csum[:-1]])
    with torch.no_grad():
        s_at = torch.where(v > 0, (k - prev / v) / n, torch.zeros_like(v))
    j = int(torch.searchsorted(s_at, torch.tensor([s], dtype=torch.float64, device=v.device),
                               right=True)[0]) - 1
    if j < 0:
        return 0.0
    # a in [v[j], v[j+1]): the j+1 entries v[0..j] are below a (or equal, contributing 0)
    if float(s_at[j]) == s:
        return float(v[j])
    num, cnt = float(csum[j]), j + 1
    return num / (cnt - n * s)


class ExactRule(ThresholdRule):
    """The selection baseline as a threshold rule (``"exact"`` of
    :data:`~gradstats.pruning.rules.THRESHOLD_RULES`): :func:`exact_threshold` of ``stats.tensor``,
    whose expected sparsity on that tensor is the target, exactly.

    Example:
        >>> import torch
        >>> from gradstats.pruning.rules import LayerStats
        >>> ExactRule().threshold(0.5, LayerStats(tensor=torch.tensor([1.0, 2.0, 3.0, 4.0])), stochastic=False)
        3.0
    """

    name = "exact"
    from_statistics = False
    model_free = True
    stand_in = "histogram"        # the model-free rule on the statistics, where the tensor is not at hand

    def threshold(self, target: float, stats: LayerStats, *, stochastic: bool = True) -> float:
        if stats.tensor is None:
            raise ValueError("the exact rule needs LayerStats(tensor=...): the gradient to select from")
        return float(exact_threshold(stats.tensor, target, stochastic=stochastic))

    def expected_sparsity(self, a: float, stats: LayerStats, *, stochastic: bool = True) -> float:
        if stats.tensor is None:
            raise ValueError("the exact rule needs LayerStats(tensor=...): the gradient to measure")
        x = stats.tensor.detach().abs().double().reshape(-1)
        if not a > 0:
            return float((x == 0).double().mean())
        below = x < a
        if not stochastic:
            return float(below.double().mean())
        return float(torch.where(below, 1.0 - x / a, torch.zeros_like(x)).mean())

    def predicted_sparsity(self, target: float, a: float, stats: LayerStats) -> float:
        return float(target)


#: the registry, the one home of the threshold rules' names: each name -> its rule (the models, the
#: model-free histogram rule, and ``"exact"``, the selection on the tensor itself)
THRESHOLD_RULES: dict[str, ThresholdRule] = {
    "lognormal": FamilyRule("lognormal", "lognormal"),
    "naive_lognormal": FamilyRule("naive_lognormal", "lognormal", rounds_up=False),
    "normal": FamilyRule("normal", "normal"),
    "laplace": FamilyRule("laplace", "laplace"),
    "histogram": HistogramRule(),
    "exact": ExactRule(),
}


def register(rule: ThresholdRule) -> ThresholdRule:
    """Add ``rule`` to :data:`THRESHOLD_RULES` under its name (a rule of one's own: every stage that
    takes a threshold rule's name then takes it).

    Example:
        >>> register(THRESHOLD_RULES["laplace"]) is THRESHOLD_RULES["laplace"]
        True
    """
    if not isinstance(rule, ThresholdRule) or not rule.name:
        raise ValueError(f"register() takes a named ThresholdRule, got {rule!r}")
    THRESHOLD_RULES[rule.name] = rule
    return rule
