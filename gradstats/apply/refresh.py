"""The refresh of :func:`gradstats.apply`: each planned layer's running statistics (one fused
reduction of the gradient), and from them its threshold and predicted sparsity (the rule of
:data:`gradstats.pruning.rules.THRESHOLD_RULES`, as ``recommend``), its scale
(:meth:`gradstats.plan.Rule.scale_for`) and the lognormal model's predictions
(:func:`gradstats.fpanalysis.composed.predict_one`).

Example:
    >>> from gradstats.apply.refresh import LayerState
    >>> st = LayerState(mu=-9.0, m2=81.0 + 2.25)
    >>> st.sigma
    1.5
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np
import torch

from gradstats.fpanalysis.composed import predict_one
from gradstats.pruning.histogram import LogHistogram
from gradstats.pruning.rules import THRESHOLD_RULES, LayerStats
from gradstats.stats import HIST_BINS, HIST_MIN_EXP, SCALAR_FIELDS, VECTOR_LEN, tensor_stats_vector
from gradstats.stats.kernel import has_native_kernel, write_stats_raw

log = logging.getLogger("gradstats.apply")

_F = {name: i for i, name in enumerate(SCALAR_FIELDS)}


class Pending:
    """The lognormal model's predictions for one solve, not yet computed: the inputs of
    :func:`predictions` as they were when the settings were solved (computed once, when first read:
    a record or the state that nobody reads costs no solve)."""

    __slots__ = ("rule", "args", "value")

    def __init__(self, rule: Any, st: "LayerState", numel: int) -> None:
        self.rule = rule
        self.args = (st.mu, st.sigma, st.p0, st.threshold, st.scale, st.amax, numel)
        self.value: Optional[tuple[float, float, float]] = None

    def resolve(self) -> tuple[float, float, float]:
        """``(predicted_underflow, predicted_overflow, predicted_error)``."""
        if self.value is None:
            self.value = predictions(self.rule, *self.args)
        return self.value


class _Predicted:
    """A prediction field of :class:`LayerState`: a plain value, except that while the state holds a
    :class:`Pending` (its settings solved, their predictions not yet asked for) reading any of the
    three computes them first."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj: Any, objtype: Any = None) -> float:
        if obj is None:
            return math.nan                      # the dataclass's default
        d = obj.__dict__
        pending = d.get("pending")
        if pending is not None:
            d["_predicted_underflow"], d["_predicted_overflow"], d["_predicted_error"] = pending.resolve()
            d["pending"] = None
        return d[self.slot]  # type: ignore[no-any-return]

    def __set__(self, obj: Any, value: float) -> None:
        obj.__dict__[self.slot] = value


@dataclass
class LayerState:
    """Running statistics and current settings of one planned layer."""

    seq: int = 0                    # gradients processed so far
    mu: float = math.nan            # running mean of ln|g|
    m2: float = math.nan            # running mean of ln^2|g|
    p0: float = 0.0                 # running zero fraction
    amax: float = math.nan          # running max |g|
    rms: float = math.nan           # running sqrt(E g^2) (normal-model thresholds)
    mean_abs: float = math.nan      # running E|g| (Laplace-model thresholds)
    threshold: float = 0.0
    predicted_sparsity: float = math.nan
    hist: Optional[LogHistogram] = None   # the latest refresh's histogram (threshold_rule="histogram")
    scale: float = 1.0
    zero_run: int = 0               # consecutive calls whose output was all zeros
    alerts: dict[str, str] = field(default_factory=dict)   # kind -> message of each alert fired
    predicted_underflow: float = _Predicted(0)  # type: ignore[assignment]  # the lognormal model's fractions
    predicted_overflow: float = _Predicted(1)  # type: ignore[assignment]   # of the entries flushed and saturated,
    predicted_error: float = _Predicted(2)  # type: ignore[assignment]      # and the output's relative error
    fallback_run: int = 0           # consecutive drifting calls
    gain_sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])   # dot, norm2, noise2 over calls
    fallback_done: list[int] = field(default_factory=list)   # indices of the Fallback actions taken
    solved_mu: float = math.nan     # the running mean of ln|g| the threshold and scale were solved at
    pending: Optional[Pending] = field(default=None, repr=False, compare=False)   # predictions not yet computed

    @property
    def sigma(self) -> float:
        return math.sqrt(max(self.m2 - self.mu * self.mu, 0.0))


#: what of a layer's state a call's record reports as it was when the call ran
SNAPSHOT = ("scale", "threshold", "predicted_sparsity", "predicted_underflow", "predicted_overflow",
            "predicted_error", "mu", "sigma", "p0", "amax")


def snapshot(st: LayerState) -> dict[str, float]:
    """The state a record reports, as it is now."""
    return {k: getattr(st, k) for k in SNAPSHOT}


def stats_vector(g: torch.Tensor, full: bool) -> torch.Tensor:
    """:func:`gradstats.stats.tensor_stats_vector` of ``g`` (``full``: with the binade counts and
    the top magnitudes, which the histogram rule reads): on the CPU the C kernel writes into the
    vector directly."""
    from gradstats.ops.engine import use_native
    from gradstats.stats import kernel_applies, write_stats

    x = g.detach()
    if not use_native(x.device.type):      # the device's engine reads the gradient as it is
        return tensor_stats_vector(x, full=full)
    if x.dtype != torch.float32:
        x = x.float()
    x = x.reshape(-1)
    x = x.contiguous() if x.is_cpu else x
    if not kernel_applies(x):
        return tensor_stats_vector(x, full=full)
    out = torch.full((VECTOR_LEN,), math.nan, dtype=torch.float64)
    write_stats(x, out.data_ptr(), full=full)
    return out


def histogram_of(v: Union[torch.Tensor, np.ndarray], *, kernel_row: bool = False) -> LogHistogram:
    """The histogram rule's distribution of a statistics vector: :meth:`LogHistogram.from_stats`
    of its row, in floats (the binade counts, the top magnitudes as atoms, the data's range).
    ``kernel_row``: ``v`` is a float64 array the C statistics kernel wrote from float32 data (its top
    magnitudes float32 values already): read in place, in one call."""
    k = len(SCALAR_FIELDS)
    if kernel_row and isinstance(v, np.ndarray) and v.dtype == np.float64 and v.flags.c_contiguous \
            and v.size == VECTOR_LEN:
        p = v.ctypes.data
        made = LogHistogram.from_binades_at(p + 8 * k, HIST_BINS, HIST_MIN_EXP, int(v[_F["n"]]), int(v[_F["n_zero"]]),
                                            p + 8 * (k + HIST_BINS), VECTOR_LEN - k - HIST_BINS,
                                            float(v[_F["min_abs"]]), float(v[_F["max_abs"]]))
        if made is not None:
            return made
    a = v if isinstance(v, np.ndarray) else v.cpu().numpy()
    h = a[k: k + HIST_BINS]
    nz = np.flatnonzero(h > 0)
    i = int(nz[0]) if nz.size else 0
    j = int(nz[-1]) + 1 if nz.size else 0
    return LogHistogram.from_binades(h[i:j], HIST_MIN_EXP + i, int(a[_F["n"]]), int(a[_F["n_zero"]]),
                                     a[k + HIST_BINS:].astype(np.float32), float(a[_F["min_abs"]]),
                                     float(a[_F["max_abs"]]))


def stats_update(st: LayerState, v: Union[torch.Tensor, np.ndarray], ema: Optional[float]) -> None:
    """Fold one statistics vector into the running state (EMA, or replace when ema is None)."""
    s = v[: len(SCALAR_FIELDS)].tolist()
    n, nz, nf = s[_F["n"]], s[_F["n_zero"]], s[_F["n_nonfinite"]]
    m = n - nz - nf
    fin = n - nf
    if m <= 0:
        return
    new = {"mu": s[_F["sum_ln_abs"]] / m, "m2": s[_F["sum_ln_abs_sq"]] / m, "p0": nz / max(n, 1),
           "amax": s[_F["max_abs"]], "rms": math.sqrt(s[_F["sum_sq"]] / fin),
           "mean_abs": s[_F["sum_abs"]] / fin}
    for k, val in new.items():
        old = getattr(st, k)
        if ema is None or math.isnan(old):
            setattr(st, k, val)
        else:
            setattr(st, k, ema * old + (1 - ema) * val)


def layer_stats(st: LayerState, g: Optional[torch.Tensor] = None) -> LayerStats:
    """The running statistics as the threshold rules read them (``g``: the gradient, for the
    exact rule). The model rules are conditioned on the running maximum and mean ``|g|`` where
    those are consistent: no threshold above the data."""
    cond = st.amax > 0 and math.isfinite(st.amax) and st.mean_abs <= st.amax
    # the families describe the non-zero magnitudes (p0 apart), as pruning.threshold's scales do:
    # E g^2 and E|g| over the non-zero entries, from the running means over all of them (exact
    # without non-finite values, which raise their own alert)
    nonzero = max(1.0 - st.p0, 1e-9)
    return LayerStats(mu=st.mu, sigma=max(st.sigma, 1e-6), p0=min(st.p0, 1 - 1e-9),
                      scale_normal=st.rms / math.sqrt(nonzero), scale_laplace=st.mean_abs / nonzero,
                      amax=st.amax if cond else None, mean_abs=st.mean_abs if cond else None, hist=st.hist,
                      tensor=g)


def scale_for(rule: Any, st: LayerState) -> float:
    """:meth:`Rule.scale_for` at the running statistics.

    The rounding sees the pruned gradient, whose largest magnitude is the threshold when that
    lies above the running ``amax`` (the values below it are rounded up to it): the ``amax``
    scale and the lognormal scale's ``amax`` floor take the larger of the two, so that pruning
    does not push every value it keeps into saturation."""
    sigma = max(st.sigma, 1e-6)
    amax = st.amax
    if rule.prunes and math.isfinite(st.threshold) and st.threshold > amax:
        amax = st.threshold
    return rule.scale_for(mu=st.mu, sigma=sigma, amax=amax)


def predict(rule: Any, st: LayerState, numel: int) -> None:
    """The lognormal model's fractions flushed and saturated and the output's relative error at
    the running statistics, threshold and scale, conditioned on the running ``amax`` for a tensor
    of ``numel`` entries (NaN where it has none: no statistics yet). Block scales: the plan's own
    prediction, made by replaying the rule on whole blocks of the run's samples (``plan.checks``)."""
    st.pending = None
    st.predicted_underflow, st.predicted_overflow, st.predicted_error = predictions(
        rule, st.mu, st.sigma, st.p0, st.threshold, st.scale, st.amax, numel)


def defer_predict(rule: Any, st: LayerState, numel: int) -> None:
    """:func:`predict`, computed when first read (a :class:`Pending` of the inputs as they are now):
    the same values, at no cost to a call whose predictions nobody reads."""
    st.pending = Pending(rule, st, numel)


def predictions(rule: Any, mu: float, sigma: float, p0: float, threshold: float, scale: float, amax: float,
                numel: int) -> tuple[float, float, float]:
    """What :func:`predict` sets, from the state's values: ``(underflow, overflow, error)``."""
    nan = math.nan
    if rule.quantizes and rule.block_size is not None:
        p = rule.predicted
        if p is None:
            return nan, nan, nan
        f = lambda v: nan if v is None else float(v)  # noqa: E731
        return f(p.flushed), f(p.overflow), f(p.error)
    if math.isnan(mu):
        return nan, nan, nan
    a = threshold if rule.prunes else 0.0
    if not math.isfinite(a):
        return nan, nan, nan
    try:
        return predict_one(rule.format, rule.rounding, mu, max(sigma, 1e-6), min(p0, 1 - 1e-9), a,
                           scale if rule.quantizes else 1.0, amax if amax > 0 and math.isfinite(amax) else None,
                           numel)
    except (ArithmeticError, ValueError):
        return nan, nan, nan


def fill_predictions(rec: dict[str, Any], pending: Pending, quantizes: bool) -> None:
    """Set a record's ``predicted_underflow``, ``predicted_overflow`` (0 for a rule that does not
    round) and ``predicted_error`` from its pending predictions."""
    u, o, e = pending.resolve()
    rec["predicted_underflow"] = u if quantizes else 0.0
    rec["predicted_overflow"] = o if quantizes else 0.0
    rec["predicted_error"] = e


def predicted_share(st: LayerState, rule: Any, fraction: float) -> float:
    """A predicted fraction of all entries (``predicted_underflow``, ``predicted_overflow``) as a
    share of the entries that the same lognormal model predicts to reach the rounding (non-zero
    after pruning at the running threshold): the denominator of the fallback's bounds and of the
    achieved share (NaN when unknown)."""
    try:
        zeros = (THRESHOLD_RULES["lognormal"].expected_sparsity(st.threshold, layer_stats(st))
                 if rule.prunes else st.p0)
    except (ArithmeticError, ValueError):
        return math.nan
    reach = 1.0 - zeros
    return min(fraction / reach, 1.0) if math.isfinite(reach) and reach > 0 else math.nan


def relative_error(out: torch.Tensor, g: torch.Tensor) -> float:
    """``|out - g|^2 / |g|^2`` (NaN for a zero gradient)."""
    x = g.detach().reshape(-1).float()
    d = out.reshape(-1).float() - x
    den = float(torch.dot(x, x))
    return float(torch.dot(d, d)) / den if den > 0 else math.nan


def all_reduce_stats(v: torch.Tensor) -> torch.Tensor:
    """Combine one statistics vector over the ranks: sums and counts add, the max is a max and
    the min a min. The top magnitudes, which apply does not read, are left out (NaN)."""
    import torch.distributed as dist

    from gradstats.stats import TOP_K

    v = v.clone()
    imax, imin = _F["max_abs"], _F["min_abs"]
    mx, mn = v[imax: imax + 1].clone(), v[imin: imin + 1].clone()
    dist.all_reduce(v)
    dist.all_reduce(mx, op=dist.ReduceOp.MAX)
    dist.all_reduce(mn, op=dist.ReduceOp.MIN)
    v[imax], v[imin] = mx[0], mn[0]
    v[-TOP_K:] = math.nan
    return v


#: the predictions a record reports (left pending by a lazy solve)
PREDICTED = ("predicted_underflow", "predicted_overflow", "predicted_error")


class Records:
    """The per-call records of :class:`~gradstats.apply.Applied` (its ``history``): a call's
    predictions may be left pending by a lazy solve and are computed when the records are read, once
    each."""

    def __init__(self) -> None:
        self._records: list[dict[str, Any]] = []
        self._unresolved: list[tuple[dict[str, Any], Pending, bool]] = []

    def read(self) -> list[dict[str, Any]]:
        """Every record, the pending predictions computed first."""
        todo, self._unresolved = self._unresolved, []
        for rec, pending, quantizes in todo:
            fill_predictions(rec, pending, quantizes)
        return self._records

    def reset(self, records: list[dict[str, Any]]) -> None:
        self._records, self._unresolved = records, []

    def add(self, rec: dict[str, Any], pending: Optional[Pending], quantizes: bool, *, now: bool = False) -> None:
        """Keep ``rec``; its predictions, where ``pending``, computed when read (or ``now``)."""
        if pending is not None:
            if now:
                fill_predictions(rec, pending, quantizes)
            else:
                self._unresolved.append((rec, pending, quantizes))
        self._records.append(rec)


def record_snapshot(st: LayerState) -> dict[str, Any]:
    """:func:`snapshot` of the state for a call's record, its predictions left pending (under
    ``"pending"``) where the solve left them so."""
    if st.pending is None:
        return snapshot(st)
    snap: dict[str, Any] = {k: getattr(st, k) for k in SNAPSHOT if k not in PREDICTED}
    snap["pending"] = st.pending
    return snap


class Refresher:
    """The refresh of :class:`~gradstats.apply.Applied`: each planned layer's settings (threshold,
    scale, predictions) from its running statistics. It shares the handle's ``rules`` (in force,
    changed by a fallback) and ``state``."""

    def __init__(self, rules: dict[str, Any], state: dict[str, LayerState], config: Any) -> None:
        self.rules, self.state, self.config = rules, state, config
        self._vectors: dict[str, tuple[np.ndarray, int]] = {}   # per layer: the array the C kernel writes its
        #                                                          statistics into, and its address

    def refresh(self, name: str, g: torch.Tensor, refresh: bool, *, flat: bool = False) -> None:
        """The statistics of ``g`` folded into the layer's state, then its settings solved from
        them (the synchronous path: the host reads the statistics in the backward pass). ``flat``: the
        caller has found ``g`` a contiguous float32 CPU tensor and the CPU's engine the native one, so
        the C kernel writes the statistics into the layer's own array (no torch operation)."""
        rule = self.rules[name]
        hist_rule = rule.prunes and THRESHOLD_RULES[rule.threshold_rule].needs_histogram
        if self.needs_stats(rule, refresh):   # the histogram rule reads the binade counts; the others the moments alone
            full = refresh and hist_rule
            sync = self.config.sync_stats and torch.distributed.is_available() and torch.distributed.is_initialized()
            if flat and not sync and has_native_kernel():
                made = self._vectors.get(name)
                if made is None:
                    v = np.empty(VECTOR_LEN)
                    made = self._vectors[name] = (v, v.ctypes.data)
                v = made[0]
                write_stats_raw(g.data_ptr(), g.numel(), made[1], full=full)
            else:
                v = stats_vector(g, full=full)
                if sync:
                    v = all_reduce_stats(v)
            self.fold(name, v, full)
        self.solve(name, refresh, g.numel(), g, lazy=True)

    @staticmethod
    def needs_stats(rule: Any, refresh: bool) -> bool:
        """Whether a call reads the gradient's statistics: on a refresh, and on every call of a
        per-tensor ``"amax"`` scale."""
        return refresh or (rule.quantizes and rule.scale == "amax" and rule.block_size is None)

    def fold(self, name: str, v: Union[torch.Tensor, np.ndarray], hist: bool) -> None:
        """Fold one statistics vector (on the host) into the layer's running state; ``hist``: keep
        its binade counts for the histogram rule."""
        st = self.state[name]
        stats_update(st, v, self.config.ema)
        if hist:
            st.hist = histogram_of(v, kernel_row=isinstance(v, np.ndarray))   # (refresh's own kernel rows)

    def solve(self, name: str, refresh: bool, numel: int, g: Optional[torch.Tensor] = None, *,
               lazy: bool = False) -> None:
        """The layer's threshold, predicted sparsity, scale and predictions from its running state
        (``g``: the gradient, which the exact rule selects from; ``numel``: its size). ``lazy``: the
        predictions (which decide no output) computed when first read (:class:`Pending`), the same
        values."""
        rule, st = self.rules[name], self.state[name]
        predict_ = defer_predict if lazy else predict
        if refresh and rule.prunes and not math.isnan(st.mu):
            threshold_rule = THRESHOLD_RULES[rule.threshold_rule]     # the rule recommend uses
            stats = layer_stats(st, g)
            st.threshold = threshold_rule.threshold(rule.sparsity, stats)
            st.predicted_sparsity = threshold_rule.predicted_sparsity(rule.sparsity, st.threshold, stats)
        if rule.quantizes and rule.block_size is None and not math.isnan(st.mu):
            if rule.scale == "amax" or (refresh and rule.scale == "lognormal") or rule.scale == "fixed":
                old = st.scale
                st.scale = scale_for(rule, st)
                if (self.config.record or self.config.fallback is not None) and not refresh and st.scale != old:
                    predict_(rule, st, numel)
        if refresh and (self.config.record or self.config.fallback is not None):
            predict_(rule, st, numel)
        st.solved_mu = st.mu

    def refreshes(self, k: int) -> bool:
        """Whether call ``k`` (counted from the end of the warm-up) refreshes: every
        ``refresh_every``-th, or as the schedule says; the first always does."""
        if k == 0:
            return True
        if callable(self.config.refresh_every):
            return bool(self.config.refresh_every(k))
        return k % self.config.refresh_every == 0
