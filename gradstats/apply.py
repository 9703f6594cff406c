"""Enforce a per-layer :class:`~gradstats.plan.Plan` on neural gradients during training.

``gradstats.apply(model, plan)`` makes the neural gradient ``g = dL/dy`` at each planned
layer's output pass through the layer's rule in the backward pass, before it flows on to
earlier layers and into that layer's own weight gradient: stochastic pruning at the threshold
of the rule's sparsity target, then rounding to its format at its scale. Per layer it keeps the
running mean and std of ``ln|g|``, the zero fraction and ``amax`` (one fused reduction per
refresh: :func:`gradstats.stats.tensor_stats_vector`), refreshes thresholds and scales every
``refresh_every`` gradients, and records what each call achieved (sparsity, underflow,
saturation) beside what the model predicted.

It also watches for a layer that leaves what its plan promised, from the counts and sums the fused
pass returns anyway (:class:`gradstats.ops.fused.CompressCounts`), and warns once per layer and
kind (logger ``gradstats.apply``, level WARNING; listed in ``Applied.summary()["alerts"]`` and, with
``log_to=``, the run's ``"applied_alerts"`` table): non-finite values in the incoming gradient
(a NaN loss), more entries clipped at the format's maximum than :data:`OVERFLOW_BOUND` (or the
plan's own prediction, if larger), a magnitude gain ``<out, g> / <g, g>`` off 1 by more than
:data:`BIAS_BOUND` beyond the call's sampling noise (in one call, or over all calls so far),
rounding to nearest that flushes more than :data:`UNDERFLOW_BOUND` of the non-zero values,
achieved sparsity above the target by more than :data:`SPARSITY_MARGIN`, and a gradient that is
all zeros for :data:`ZERO_CALLS` calls in a row. Beside each call's achieved sparsity,
underflow, saturation (and, when measured, error) it records what the lognormal model predicts
for them at the running statistics; with ``fallback=`` (opt-in, a :class:`Fallback`) a layer
whose gradient drifts past a bound has its rule changed a step at a time (stochastic rounding,
then the next wider format of its family, then full precision), logged and recorded.
``Applied.state_dict()`` and ``load_state_dict()`` checkpoint everything that decides the next
output, the changed rules included, so a training resumed from a checkpoint repeats the
uninterrupted one bit for bit.

The per-layer solvers of a refresh (threshold, predicted sparsity, scale, predictions) run on
the scalar fast paths of :mod:`gradstats._scalar`, which repeat the vectorised reference solvers
of :mod:`gradstats.pruning` and :mod:`gradstats.fpanalysis` on Python floats; inputs outside
their domain go to the reference.

Example:
    >>> import torch, gradstats
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    >>> plan = gradstats.Plan.uniform(format="e3m2fn", sparsity=0.8, layers=["0", "2"])
    >>> with gradstats.apply(model, plan) as applied:
    ...     model(torch.randn(32, 16)).square().mean().backward()
    >>> sorted(applied.to_dataframe()["layer"])
    ['0', '2']
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import numpy as np
import pandas as pd
import torch
from torch import nn

from gradstats import _scalar
from gradstats.formats import FPFormat
from gradstats.noise.record import sending_back
from gradstats.ops.fused import CompressCounts, prune_quantize
from gradstats.stats import HIST_BINS, HIST_MIN_EXP, SCALAR_FIELDS, VECTOR_LEN, tensor_stats_vector, vector_to_stats
from gradstats.wrappers import named_layers, unwrap

log = logging.getLogger(__name__)

_F = {name: i for i, name in enumerate(SCALAR_FIELDS)}

#: Alert "sparsity": the achieved sparsity of a call exceeds the layer's target (or the zero
#: fraction its gradient arrived with, if larger) by more than this, beyond sampling noise
#: (three standard deviations of ``n`` keep-or-zero draws, at most ``1.5 / sqrt(n)``). The
#: threshold rules hit their targets within about 0.03 (docs/apply.md), so a larger excess is the
#: format flushing what pruning kept, or a threshold model that does not fit the layer.
SPARSITY_MARGIN = 0.05
#: Alert "underflow": rounding to nearest flushes more than this fraction of the layer's non-zero
#: gradient values to zero (beyond sampling noise): the flush bound that ``recommend`` plans with
#: (:data:`gradstats.fpanalysis.FLUSH_BOUND`). Flushing is a systematic shrinkage of the layer's
#: weight gradient (and, our untested hypothesis, under Adam a lost step for every flushed value);
#: see docs/apply.md.
UNDERFLOW_BOUND = 0.01
#: Alert "overflow": more than this fraction of a call's entries saturated at the format's maximum
#: (or more than the plan predicted, if it predicted more), beyond sampling noise
OVERFLOW_BOUND = 0.001
#: Alert "gain": the magnitude gain ``<out, g> / <g, g>`` of a call, or of all calls so far, is off 1
#: by more than this beyond five standard errors of its own random draws (the bias bound of
#: ``recommend``: pruning and stochastic rounding are unbiased, so a gain off 1 is flushing or clipping)
BIAS_BOUND = 0.01
#: Alert "zero_gradient": the gradient leaving the layer was all zeros for this many calls in
#: a row (nothing reaches its weights: the symptom of a broken low-precision kernel or scale).
ZERO_CALLS = 3
#: the kinds of alert, in the order ``Applied.summary()`` lists them
ALERT_KINDS = ("nonfinite", "overflow", "gain", "underflow", "drift", "sparsity", "zero_gradient")
#: version of the layout of :meth:`Applied.state_dict` (version 1, without the predictions and
#: the fallback state, still loads)
STATE_VERSION = 2
#: the _LayerState fields a state dict carries (``hist`` is only read on the refresh that sets it)
_STATE_FIELDS = ("seq", "mu", "m2", "p0", "amax", "rms", "mean_abs", "threshold",
                 "predicted_sparsity", "scale", "zero_run")
#: fields added in state dict version 2 (defaults when loading version 1)
_STATE_FIELDS_V2 = ("predicted_underflow", "predicted_overflow", "predicted_error", "fallback_run", "gain_sums")
#: the actions a :class:`Fallback` can take, in the order of the default ladder
FALLBACK_ACTIONS = ("stochastic", "widen", "full", "dense")
#: ``fallback=`` names: shorthands for a :class:`Fallback` with these actions
FALLBACK_PRESETS = {"widen": ("stochastic", "widen", "full"), "stochastic": ("stochastic",), "full": ("full",)}
#: the next width of a format's family, where the generic rule (one more exponent and one more
#: mantissa bit, same special values) does not give the format that hardware has
_WIDER = {"e2m3fn": "e4m3fn"}


def widen(fmt: FPFormat) -> Optional[FPFormat]:
    """The next wider format of ``fmt``'s family, up to 8 bits (None at 8 bits and above): one
    more exponent and one more mantissa bit with the same special values (``e2m1fn -> e3m2fn ->
    e4m3fn``, ``e3m2 -> e4m3``), and ``e2m3fn -> e4m3fn`` (the OCP FP6 formats both widen to the
    FP8 format with the range gradients need).

    Example:
        >>> str(widen(FPFormat.parse("e3m2fn"))), widen(FPFormat.parse("e4m3fn"))
        ('e4m3fn', None)
    """
    if fmt.bits >= 8 or not fmt.signed:
        return None
    name = str(fmt)
    if name in _WIDER:
        return FPFormat.parse(_WIDER[name])
    try:
        return FPFormat(fmt.exp_bits + 1, fmt.man_bits + 1, special=fmt.special, subnormals=fmt.subnormals)
    except ValueError:
        return None


@dataclass(frozen=True)
class Fallback:
    """When and how :func:`apply` changes a layer's rule whose gradient drifts from what its rule
    should give (opt-in: ``apply(..., fallback=Fallback(...))``, or a name of
    :data:`FALLBACK_PRESETS`).

    A call *drifts* when one of the bounds is exceeded (None switches a bound off):

    Attributes:
        underflow: more than this fraction of the non-zero values that reach the rounding are
            flushed to zero by the format (the systematic shrinkage that training feels; the
            lognormal model's prediction is recorded beside it).
        saturation: more than this fraction of them saturate at the format's max.
        sparsity: the achieved sparsity exceeds the predicted one (the threshold model at the
            running statistics, or the zeros the gradient arrived with, if more) by more than
            this, beyond sampling noise (``1.5 / sqrt(n)``).
        error: the relative error of the layer's output, ``|out - g|^2 / |g|^2``, exceeds this
            many times the predicted one (pruning and rounding together, the lognormal model at
            the running statistics, threshold and scale). Measuring it is one more pass over
            the gradient per call, so it is off (None) unless set.
        patience: act after this many drifting calls in a row.
        actions: the ladder, each used at most once, in order: ``"stochastic"`` (rounding to
            stochastic: unbiased, also in the subnormal range), ``"widen"`` (the next wider
            format of the family, :func:`widen`: ``e3m2fn -> e4m3fn``; repeat it to widen
            twice), ``"full"`` (no quantisation), ``"dense"`` (no pruning). The format actions
            answer drift that involves the format (underflow, saturation, an excess of zeros
            that the flushing accounts for, the error of a quantising rule); ``"dense"`` answers
            an excess of zeros that it does not (the threshold model misses the layer). Actions
            that would not change the rule (stochastic rounding already, no wider format) are
            passed over.

    Each change is logged (logger ``gradstats.apply``, WARNING), listed in
    ``Applied.fallbacks`` and ``summary()["fallbacks"]``, marked in the call's record
    (``fallback`` column), logged to the tracer's run as the table ``"applied_fallbacks"``
    with ``log_to=``, and kept in ``Applied.state_dict()``. The new rule's scale is set from the
    running statistics at once; it takes effect from the layer's next gradient.

    Example:
        >>> Fallback().actions, Fallback(underflow=0.2, actions=["widen"]).actions
        (('stochastic', 'widen', 'full'), ('widen',))
    """

    underflow: Optional[float] = 0.5
    saturation: Optional[float] = 0.01
    sparsity: Optional[float] = 0.05
    error: Optional[float] = None
    patience: int = 2
    actions: tuple[str, ...] = FALLBACK_PRESETS["widen"]

    def __post_init__(self) -> None:
        for k in ("underflow", "saturation", "sparsity"):
            v = getattr(self, k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < 1.0):
                raise ValueError(f"Fallback {k} must be None (no bound) or a fraction in [0, 1), got {v!r}")
        if self.error is not None and (isinstance(self.error, bool) or not isinstance(self.error, (int, float))
                                       or not self.error > 1.0):
            raise ValueError(f"Fallback error must be None (not measured) or a factor above 1 (achieved over "
                             f"predicted relative error), got {self.error!r}")
        if not isinstance(self.patience, int) or isinstance(self.patience, bool) or self.patience < 1:
            raise ValueError(f"Fallback patience must be a positive int (drifting calls in a row), got "
                             f"{self.patience!r}")
        acts = (self.actions,) if isinstance(self.actions, str) else self.actions
        if not isinstance(acts, (list, tuple)) or not acts or any(a not in FALLBACK_ACTIONS for a in acts):
            raise ValueError(f"Fallback actions must be a non-empty list of {list(FALLBACK_ACTIONS)}, got "
                             f"{self.actions!r}")
        object.__setattr__(self, "actions", tuple(acts))

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the actions as a list)."""
        return {"underflow": self.underflow, "saturation": self.saturation, "sparsity": self.sparsity,
                "error": self.error, "patience": self.patience, "actions": list(self.actions)}


def _as_fallback(fallback: Any) -> Optional[Fallback]:
    if fallback is None or isinstance(fallback, Fallback):
        return fallback
    if isinstance(fallback, str) and fallback in FALLBACK_PRESETS:
        return Fallback(actions=FALLBACK_PRESETS[fallback])
    raise ValueError(f"fallback must be None (off), a gradstats.apply.Fallback or one of "
                     f"{sorted(FALLBACK_PRESETS)}, got {fallback!r}")


@dataclass
class _LayerState:
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
    hist: Optional[_scalar.Histogram] = None   # the latest refresh's histogram (threshold_rule="histogram")
    scale: float = 1.0
    zero_run: int = 0               # consecutive calls whose output was all zeros
    alerts: dict[str, str] = field(default_factory=dict)   # kind -> message of each alert fired
    predicted_underflow: float = math.nan   # the lognormal model's fractions of the entries
    predicted_overflow: float = math.nan    # flushed and saturated, and the relative error
    predicted_error: float = math.nan       # of the output, at the running statistics
    fallback_run: int = 0           # consecutive drifting calls
    gain_sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])   # dot, norm2, noise2 over calls
    fallback_done: list[int] = field(default_factory=list)   # indices of the Fallback actions taken

    @property
    def sigma(self) -> float:
        return math.sqrt(max(self.m2 - self.mu * self.mu, 0.0))


def _stats_vector(g: torch.Tensor, full: bool) -> torch.Tensor:
    """:func:`gradstats.stats.tensor_stats_vector` of ``g`` (``full``: with the binade counts and
    the top magnitudes, which the histogram rule reads): on the CPU the C kernel writes into the
    vector directly."""
    from gradstats.stats import kernel_applies, write_stats

    x = g.detach()
    if x.dtype != torch.float32:
        x = x.float()
    x = x.reshape(-1)
    x = x.contiguous() if x.is_cpu else x
    if not kernel_applies(x):
        return tensor_stats_vector(x, full=full)
    out = torch.full((VECTOR_LEN,), math.nan, dtype=torch.float64)
    write_stats(x, out.data_ptr(), full=full)
    return out


def _histogram(v: torch.Tensor) -> _scalar.Histogram:
    """The histogram rule's distribution of a statistics vector: :meth:`LogHistogram.from_stats`
    of its row, in floats (the binade counts, the top magnitudes as atoms, the data's range)."""
    k = len(SCALAR_FIELDS)
    a = v.cpu().numpy()
    h = a[k: k + HIST_BINS]
    nz = np.flatnonzero(h > 0)
    i = int(nz[0]) if nz.size else 0
    j = int(nz[-1]) + 1 if nz.size else 0
    return _scalar.Histogram.from_stats(h[i:j].tolist(), HIST_MIN_EXP + i, int(a[_F["n"]]), int(a[_F["n_zero"]]),
                                        a[k + HIST_BINS:].astype(np.float32).tolist(), float(a[_F["min_abs"]]),
                                        float(a[_F["max_abs"]]))


def _stats_update(st: _LayerState, v: torch.Tensor, ema: Optional[float]) -> None:
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


def _fast(fast: Callable[[], Any], reference: Callable[[], Any]) -> Any:
    """``fast()``, or ``reference()`` where the fast path declines (inputs outside its domain, or
    arithmetic it does not repeat): the reference then computes the value or raises its error."""
    try:
        out = fast()
    except (ArithmeticError, ValueError):
        return reference()
    return reference() if out is None else out


def _scale_for(rule: Any, st: _LayerState) -> float:
    """:meth:`Rule.scale_for` at the running statistics; the lognormal search on the fast path.

    The rounding sees the pruned gradient, whose largest magnitude is the threshold when that
    lies above the running ``amax`` (the values below it are rounded up to it): the ``amax``
    scale and the lognormal scale's ``amax`` floor take the larger of the two, so that pruning
    does not push every value it keeps into saturation."""
    sigma = max(st.sigma, 1e-6)
    amax = st.amax
    if rule.prunes and math.isfinite(st.threshold) and st.threshold > amax:
        amax = st.threshold
    if rule.scale == "lognormal":
        return _fast(lambda: _scalar.lognormal_scale(rule.format, rule.rounding, st.mu, sigma, amax),
                     lambda: rule.scale_for(mu=st.mu, sigma=sigma, amax=amax))
    return rule.scale_for(mu=st.mu, sigma=sigma, amax=amax)


def _predict(rule: Any, st: _LayerState, numel: int) -> None:
    """The lognormal model's fractions flushed and saturated and the output's relative error at
    the running statistics, threshold and scale, conditioned on the running ``amax`` for a tensor
    of ``numel`` entries (NaN where it has none: block scales, no statistics yet)."""
    st.predicted_underflow = st.predicted_overflow = st.predicted_error = math.nan
    if math.isnan(st.mu) or (rule.quantizes and rule.block_size is not None):
        return
    a = st.threshold if rule.prunes else 0.0
    if not math.isfinite(a):
        return
    try:
        st.predicted_underflow, st.predicted_overflow, st.predicted_error = _scalar.predict(
            rule.format, rule.rounding, st.mu, max(st.sigma, 1e-6), min(st.p0, 1 - 1e-9), a,
            st.scale if rule.quantizes else 1.0, st.amax if st.amax > 0 and math.isfinite(st.amax) else None,
            numel)
    except (ArithmeticError, ValueError):
        pass


def _predicted_share(st: _LayerState, rule: Any, fraction: float) -> float:
    """A predicted fraction of all entries (``predicted_underflow``, ``predicted_overflow``) as a
    share of the entries that the same lognormal model predicts to reach the rounding (non-zero
    after pruning at the running threshold): the denominator of the fallback's bounds and of the
    achieved share (NaN when unknown)."""
    try:
        zeros = (_scalar.expected_sparsity(st.threshold, mu=st.mu, sigma=max(st.sigma, 1e-6),
                                           p0=min(st.p0, 1 - 1e-9)) if rule.prunes else st.p0)
    except (ArithmeticError, ValueError):
        return math.nan
    reach = 1.0 - zeros
    return min(fraction / reach, 1.0) if math.isfinite(reach) and reach > 0 else math.nan


def _relative_error(out: torch.Tensor, g: torch.Tensor) -> float:
    """``|out - g|^2 / |g|^2`` (NaN for a zero gradient)."""
    x = g.detach().reshape(-1).float()
    d = out.reshape(-1).float() - x
    den = float(torch.dot(x, x))
    return float(torch.dot(d, d)) / den if den > 0 else math.nan


def _fallback_rule(action: str, rule: Any, kinds: set[str]) -> Any:
    """The rule after ``action``, or None where it does not apply (to the rule, or to drift of
    these ``kinds``: ``"format"`` and/or ``"pruning"``)."""
    if action == "dense":
        return rule.replace(sparsity=None) if "pruning" in kinds and rule.prunes else None
    if "format" not in kinds or not rule.quantizes:
        return None
    if action == "stochastic":
        return rule.replace(rounding="stochastic") if rule.rounding != "stochastic" else None
    if action == "widen":
        wider = widen(rule.format)
        return rule.replace(format=wider) if wider is not None else None
    return rule.replace(format=None, block_size=None, scale_format=None, scale_rounding=None)      # "full"


class Applied:
    """The handle :func:`apply` returns: removes the hooks (``.remove()``, or use it as a
    context manager) and holds what was done (``.history``, ``.to_dataframe()``,
    ``.summary()``, ``.alerts``); ``state_dict()`` / ``load_state_dict()`` checkpoint it.

    Each record: ``layer``, ``seq`` (the layer's gradient count), ``n``, ``format``,
    ``rounding``, ``scale``, ``target_sparsity``, ``threshold``, ``predicted_sparsity`` (the
    threshold rule's model at the running statistics), ``achieved_sparsity``,
    ``pruned_fraction``, ``underflow_fraction`` and ``predicted_underflow`` (fractions of the
    entries flushed to zero by the rounding), ``overflow_fraction`` and ``predicted_overflow``
    (saturated), ``error`` (``|out - g|^2 / |g|^2``, measured only for a :class:`Fallback` with
    an ``error`` bound; NaN otherwise) and ``predicted_error``, ``fallback`` (the action this
    call triggered, or ``""``), ``mu``, ``sigma``, ``p0``, ``amax``. The predictions are the
    lognormal model's (:func:`gradstats._scalar.predict`) at the running statistics, threshold
    and scale.
    """

    def __init__(self, model: nn.Module, plan: Any, *,
                 refresh_every: Union[int, Callable[[int], bool]] = 1, warmup: int = 0,
                 ema: Optional[float] = None, log_to: Any = None, seed: int = 0,
                 sync_stats: bool = False, record: bool = True,
                 sparsity_margin: Optional[float] = SPARSITY_MARGIN,
                 underflow_bound: Optional[float] = UNDERFLOW_BOUND,
                 zero_calls: Optional[int] = ZERO_CALLS,
                 fallback: Union[Fallback, str, None] = None,
                 overflow_bound: Optional[float] = OVERFLOW_BOUND,
                 bias_bound: Optional[float] = BIAS_BOUND) -> None:
        from gradstats.plan import Plan

        if not isinstance(model, nn.Module):
            raise ValueError(f"apply() needs a torch.nn.Module as model, got {type(model).__name__}")
        if isinstance(plan, (str, os.PathLike)):
            plan = Plan.load(plan)
        if not isinstance(plan, Plan):
            raise ValueError(f"plan must be a gradstats.Plan or the path of a saved plan, got "
                             f"{type(plan).__name__}")
        if not callable(refresh_every) and (not isinstance(refresh_every, int) or isinstance(refresh_every, bool)
                                            or refresh_every < 1):
            raise ValueError("refresh_every must be a positive int (1 = every gradient) or a schedule, a "
                             f"function of the call index (0, 1, ...) returning True to refresh; got {refresh_every!r}")
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
            raise ValueError(f"warmup must be an int >= 0 (the number of each layer's first gradients "
                             f"left unchanged; 0: enforce from the first), got {warmup!r}")
        if ema is not None and not (0.0 <= ema < 1.0):
            raise ValueError(f"ema must be None or a decay in [0, 1), got {ema}")
        if log_to is not None and not hasattr(log_to, "log_rows"):
            raise ValueError("log_to must be a gradstats.Tracer (attached to the run to log into)")
        if sparsity_margin is not None and not (0.0 <= sparsity_margin < 1.0):
            raise ValueError(f"sparsity_margin must be None (no check) or in [0, 1), got {sparsity_margin!r}")
        if underflow_bound is not None and not (0.0 <= underflow_bound < 1.0):
            raise ValueError(f"underflow_bound must be None (no check) or a fraction in [0, 1), got "
                             f"{underflow_bound!r}")
        if zero_calls is not None and (not isinstance(zero_calls, int) or isinstance(zero_calls, bool)
                                       or zero_calls < 1):
            raise ValueError(f"zero_calls must be None (no check) or a positive int, got {zero_calls!r}")
        for nm, v in (("overflow_bound", overflow_bound), ("bias_bound", bias_bound)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < 1.0):
                raise ValueError(f"{nm} must be None (no check) or a fraction in [0, 1), got {v!r}")
        fallback = _as_fallback(fallback)
        root = unwrap(model)            # DDP, DataParallel, FSDP, torch.compile: the user's names
        self.plan = plan
        self.rules = {n: r for n, r in plan.resolve(root).items() if not r.is_identity}
        if any(e.types is not None for e in plan.entries):      # a selection by type: say what it left
            from gradstats.layers import log_unplanned

            log_unplanned(log, "gradstats.apply", plan.unplanned(root))
        self.plan_rules = dict(self.rules)      # as planned (self.rules: in force, after any fallback)
        self.fallback = fallback
        #: every rule change a fallback made: dicts of layer, seq, action, reason, from and to rule
        self.fallbacks: list[dict[str, Any]] = []
        self.refresh_every = refresh_every
        self.warmup = warmup
        self.ema = ema
        self.log_to = log_to
        self.sync_stats = sync_stats
        self.record = record
        self.sparsity_margin = sparsity_margin
        self.underflow_bound = underflow_bound
        self.zero_calls = zero_calls
        self.overflow_bound = overflow_bound
        self.bias_bound = bias_bound
        self.generator = torch.Generator().manual_seed(seed)
        self.history: list[dict[str, Any]] = []
        self.state = {n: _LayerState() for n in self.rules}
        modules = dict(named_layers(root))
        self._handles = [modules[n].register_forward_hook(self._forward_hook(n)) for n in self.rules]

    # -- lifecycle
    def remove(self) -> None:
        """Remove every hook: the model trains exactly as without the plan again."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> "Applied":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    # -- hooks
    def _forward_hook(self, name: str) -> Callable[..., None]:
        from gradstats.tracer import first_grad_tensor

        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if not (torch.is_grad_enabled() and module.training):
                return
            out = first_grad_tensor(output)
            if out is not None:
                out.register_hook(lambda g: None if sending_back() else self._compress(name, g))
        return hook

    def _refresh(self, name: str, g: torch.Tensor, refresh: bool) -> None:
        from gradstats import pruning

        rule, st = self.rules[name], self.state[name]
        hist_rule = rule.prunes and rule.threshold_rule == "histogram"
        need_stats = refresh or (rule.quantizes and rule.scale == "amax" and rule.block_size is None)
        v = None
        if need_stats:   # the histogram rule reads the binade counts; the others the moments alone
            v = _stats_vector(g, full=refresh and hist_rule)
            if self.sync_stats and torch.distributed.is_available() and torch.distributed.is_initialized():
                v = _all_reduce_stats(v)
            _stats_update(st, v, self.ema)
            if refresh and hist_rule:
                st.hist = _fast(lambda: _histogram(v), lambda: None)
        if refresh and rule.prunes and not math.isnan(st.mu):
            if rule.threshold_rule == "exact":
                st.threshold = float(pruning.exact_threshold(g, rule.sparsity, stochastic=True))
                st.predicted_sparsity = rule.sparsity
            elif rule.threshold_rule == "histogram":     # model-free, from the binade histogram
                h = st.hist
                st.threshold = _fast(lambda: h.threshold(rule.sparsity), lambda: float(
                    pruning.threshold(rule.sparsity, vector_to_stats(v), threshold_rule="histogram")))
                st.predicted_sparsity = _fast(lambda: h.expected_sparsity(st.threshold), lambda: float(
                    pruning.expected_sparsity(st.threshold, vector_to_stats(v), threshold_rule="histogram")))
            else:
                self._model_threshold(rule, st)
        if rule.quantizes and rule.block_size is None and not math.isnan(st.mu):
            if rule.scale == "amax" or (refresh and rule.scale == "lognormal") or rule.scale == "fixed":
                old = st.scale
                st.scale = _scale_for(rule, st)
                if (self.record or self.fallback is not None) and not refresh and st.scale != old:
                    _predict(rule, st, g.numel())
        if refresh and (self.record or self.fallback is not None):
            _predict(rule, st, g.numel())

    def _refreshes(self, k: int) -> bool:
        """Whether call ``k`` (counted from the end of the warm-up) refreshes: every
        ``refresh_every``-th, or as the schedule says; the first always does."""
        if k == 0:
            return True
        if callable(self.refresh_every):
            return bool(self.refresh_every(k))
        return k % self.refresh_every == 0

    @staticmethod
    def _model_threshold(rule: Any, st: _LayerState) -> None:
        """Threshold and predicted sparsity of the model rules (lognormal, naive_lognormal,
        normal, laplace), on the scalar fast path (the reference for inputs outside it)."""
        from gradstats import pruning

        kw = {"mu": st.mu, "sigma": max(st.sigma, 1e-6), "p0": min(st.p0, 1 - 1e-9)}
        if rule.threshold_rule == "normal":
            kw = {"scale": st.rms, "p0": kw["p0"]}
        elif rule.threshold_rule == "laplace":
            kw = {"scale": st.mean_abs, "p0": kw["p0"]}
        # conditioned on the running maximum and mean |g|: no threshold above the data
        cond = ({"amax": st.amax, "mean_abs": st.mean_abs}
                if st.amax > 0 and math.isfinite(st.amax) and st.mean_abs <= st.amax else {})
        st.threshold = _fast(
            lambda: _scalar.threshold(rule.sparsity, rule.threshold_rule, **kw, **cond),
            lambda: float(pruning.threshold(rule.sparsity, threshold_rule=rule.threshold_rule, **kw, **cond)))
        model = "lognormal" if rule.threshold_rule == "naive_lognormal" else rule.threshold_rule
        if cond and st.threshold >= st.amax:   # every entry below: exact on the tensor
            st.predicted_sparsity = 1.0 - st.mean_abs / st.threshold
        elif st.threshold > 0 and model == rule.threshold_rule:
            st.predicted_sparsity = rule.sparsity  # the threshold solves the model for it (1e-9)
        else:
            st.predicted_sparsity = _fast(
                lambda: _scalar.expected_sparsity(st.threshold, model, **kw),
                lambda: float(pruning.expected_sparsity(st.threshold, threshold_rule=model, **kw)))

    @torch.compiler.disable
    def _compress(self, name: str, g: torch.Tensor) -> torch.Tensor:
        rule, st = self.rules[name], self.state[name]
        k = st.seq - self.warmup                       # the call index since the warm-up
        if k < 0:                 # warm-up: the gradient passes unchanged, the statistics follow it
            with torch.no_grad():
                self._refresh(name, g, True)
            st.seq += 1
            return g
        refresh = self._refreshes(k)
        err = math.nan
        with torch.no_grad():
            self._refresh(name, g, refresh)
            # the rule's own quantize arguments (format, rounding, blocks and their scales): one home
            q = rule.quantize_kwargs() if rule.quantizes else {"fmt": None, "rounding": rule.rounding}
            out, counts = prune_quantize(g, st.threshold if rule.prunes else 0.0, q.pop("fmt"), scale=st.scale,
                                         generator=self.generator, **q)
            if self.fallback is not None and self.fallback.error is not None and counts.n:
                err = _relative_error(out, g)
        if counts.n:
            self._check(name, st, counts)
        rec = None
        if self.record:       # before a fallback changes the rule (and its scale and predictions)
            n = max(counts.n, 1)
            q = rule.quantizes
            rec = {"layer": name, "seq": st.seq, "n": counts.n,
                   "format": None if rule.format is None else str(rule.format), "rounding": rule.rounding,
                   "scale": st.scale if q and rule.block_size is None else math.nan,
                   "target_sparsity": rule.sparsity if rule.prunes else math.nan,
                   "threshold": st.threshold if rule.prunes else math.nan,
                   "predicted_sparsity": st.predicted_sparsity if rule.prunes else math.nan,
                   "achieved_sparsity": counts.zeros / n, "pruned_fraction": counts.pruned / n,
                   "underflow_fraction": counts.underflow / n,
                   "predicted_underflow": st.predicted_underflow if q else 0.0,
                   "overflow_fraction": counts.saturated / n,
                   "predicted_overflow": st.predicted_overflow if q else 0.0,
                   "gain": counts.gain, "gain_se": counts.gain_se, "bias": counts.bias,
                   "nonfinite": counts.nonfinite,
                   "error": counts.error if math.isnan(err) else err, "predicted_error": st.predicted_error,
                   "fallback": "",
                   "mu": st.mu, "sigma": st.sigma, "p0": st.p0, "amax": st.amax}
        if self.fallback is not None and counts.n:
            action = self._drift(name, st, counts, err)
            if rec is not None:
                rec["fallback"] = action
        if rec is not None:
            self.history.append(rec)
            if self.log_to is not None:
                self.log_to.log_rows("applied", [rec])
        st.seq += 1
        return out.to(g.dtype)

    def _check(self, name: str, st: _LayerState, c: CompressCounts) -> None:
        """The alerts, from the counts and sums the kernel returns anyway: a few scalar operations."""
        rule = self.rules[name]
        if c.nonfinite and "nonfinite" not in st.alerts:
            self._alert(name, st, "nonfinite", (
                f"{c.nonfinite} of the {c.n} values of the incoming gradient are NaN or inf (call {st.seq}): a NaN "
                "or overflowing loss upstream (check the loss, the learning rate, the loss scale); the plan "
                "cannot do what it says on them"))
        planned = self.plan_rules[name].predicted if name in self.plan_rules else None
        if rule.quantizes and self.overflow_bound is not None and "overflow" not in st.alerts and c.saturated:
            pred = getattr(planned, "overflow", None)
            # block scales clip some blocks' maxima by design (by at most 1/16 for NVFP4's e4m3 scales):
            # a band around the plan's prediction; per-tensor scales: the bound, or the prediction if larger
            bound = (max(self.overflow_bound, 1.5 * (pred or 0.0) + 0.01) if rule.block_size is not None
                     else max(self.overflow_bound, pred or 0.0))
            sat = (c.saturated - c.nonfinite) / c.n
            if sat > bound + 3 * math.sqrt(max(bound, 1.0 / c.n) / c.n):
                self._alert(name, st, "overflow", (
                    f"{sat:.2%} of the values were clipped at {rule.format}'s maximum (call {st.seq}; bound "
                    f"{bound:g}{', the plan predicted ' + format(pred, '.2%') if pred else ''}): the scale puts the "
                    "largest values (or the threshold pruning rounds up to) above the format's range. Use "
                    "scale='amax' without a positive scale_shift, or check the plan with plan.verify(run)"))
        pred_fl = getattr(planned, "flushed", None)
        if rule.quantizes and pred_fl is not None and "drift" not in st.alerts and c.underflow:
            fl = c.underflow / c.n
            band = 2 * pred_fl + 0.01
            if fl > band + 3 * math.sqrt(band / c.n):
                self._alert(name, st, "drift", (
                    f"{fl:.2%} of the values were flushed to zero by rounding (call {st.seq}), where the plan "
                    f"predicted {pred_fl:.2%} on its calibration steps: the gradient has moved since (its spread "
                    "or scale changed). Recalibrate: trace a few steps of this part of the training and "
                    "recommend again, or apply(..., fallback='widen')"))
        if self.bias_bound is not None and "gain" not in st.alerts and c.norm2 > 0 and math.isfinite(c.dot):
            gs = st.gain_sums
            gs[0] += c.dot
            gs[1] += c.norm2
            gs[2] += max(c.noise2, 0.0)
            cum_gain, cum_se = gs[0] / gs[1], math.sqrt(gs[2]) / gs[1]
            for g_, se, what in ((c.gain, c.gain_se, "in this call"), (cum_gain, cum_se, "over all calls so far")):
                if abs(g_ - 1) > self.bias_bound + 5 * se:
                    self._alert(name, st, "gain", (
                        f"the gradient's magnitude gain <out, g>/<g, g> is {g_:.3f} {what} (call {st.seq}; bound "
                        f"1 +- {self.bias_bound:g}, standard error {se:.3g}): the plan "
                        f"{'shrinks' if g_ < 1 else 'inflates'} this layer's gradient systematically ("
                        f"{c.saturated / c.n:.2%} clipped, {c.underflow / c.n:.2%} flushed). Use "
                        "rounding='stochastic' and scale='amax', or check the plan with plan.verify(run)"))
                    break
        if c.zeros == c.n:
            st.zero_run += 1
            if self.zero_calls is not None and st.zero_run >= self.zero_calls and "zero_gradient" not in st.alerts:
                self._alert(name, st, "zero_gradient", (
                    f"the gradient leaving it was all zeros for {st.zero_run} calls in a row (call {st.seq}): "
                    "nothing reaches this layer's weights or the layers before it. Check the incoming "
                    "gradient, the format's range at this scale, or the low-precision kernel"))
        else:
            st.zero_run = 0
        if (c.underflow and self.underflow_bound is not None and "underflow" not in st.alerts
                and rule.rounding != "stochastic"):      # stochastic flushes are unbiased: noise, not shrinkage
            nonzero_in = c.n - (c.zeros - c.pruned - c.underflow)    # the non-zero values of the input
            b = self.underflow_bound
            if c.underflow > b * nonzero_in + 3 * math.sqrt(max(b, 1.0 / nonzero_in) * nonzero_in):
                where = (f"with blocks of {rule.block_size}" if rule.block_size is not None
                         else f"at scale 2^{math.log2(st.scale):g}")
                self._alert(name, st, "underflow", (
                    f"{c.underflow / nonzero_in:.1%} of the layer's non-zero values were flushed to zero by "
                    f"rounding to nearest {rule.format} {where} (call {st.seq}; bound {self.underflow_bound}): "
                    "a systematic shrinkage of this layer's gradient. Use rounding='stochastic', a larger "
                    "scale (scale='amax'), or a format with more exponent bits"))
        if rule.prunes and self.sparsity_margin is not None and "sparsity" not in st.alerts:
            n = c.n
            floor = max(rule.sparsity, (c.zeros - c.pruned - c.underflow) / n)   # target, or zeros on arrival
            excess = c.zeros / n - floor
            if excess > self.sparsity_margin + 1.5 / math.sqrt(n):
                cause = (f"the format flushed {c.underflow / n:.1%} of the entries: raise the scale, use "
                         "rounding='stochastic', or lower the target" if 2 * c.underflow >= excess * n else
                         "the threshold model misses this layer's distribution: try threshold_rule='histogram'"
                         if rule.threshold_rule != "histogram" else
                         "the gradient changed since the threshold was refreshed: refresh more often "
                         "(refresh_every) or use ema=None")
                self._alert(name, st, "sparsity", (
                    f"achieved sparsity {c.zeros / n:.3f} exceeds the target {rule.sparsity:g} by {excess:.3f} "
                    f"(margin {self.sparsity_margin:g}; call {st.seq}): {cause}"))

    def _alert(self, name: str, st: _LayerState, kind: str, msg: str) -> None:
        st.alerts[kind] = msg
        log.warning("gradstats.apply: layer %r: %s", name, msg)
        if self.log_to is not None:
            self.log_to.log_rows("applied_alerts", [{"layer": name, "seq": st.seq, "kind": kind, "message": msg}])

    def _drift(self, name: str, st: _LayerState, c: CompressCounts, err: float) -> str:
        """Compare the call with its bounds; after ``patience`` drifting calls in a row, change the
        layer's rule by the next applicable action. Returns the action taken, or ``""``."""
        fb, rule = self.fallback, self.rules[name]
        n = c.n
        reasons: list[tuple[str, str]] = []               # (what it involves, text)
        reaching = n - c.zeros + c.underflow               # non-zero entries that reached the rounding
        if rule.quantizes and reaching > 0:
            if fb.underflow is not None and c.underflow > fb.underflow * reaching:
                reasons.append(("format", f"{c.underflow / reaching:.1%} of the non-zero values reaching the "
                                          f"rounding flushed to zero, predicted "
                                          f"{_predicted_share(st, rule, st.predicted_underflow):.1%} "
                                          f"(bound {fb.underflow:g})"))
            if fb.saturation is not None and c.saturated > fb.saturation * reaching:
                reasons.append(("format", f"{c.saturated / reaching:.2%} of them saturated, predicted "
                                          f"{_predicted_share(st, rule, st.predicted_overflow):.2%} "
                                          f"(bound {fb.saturation:g})"))
        if rule.prunes and fb.sparsity is not None and math.isfinite(st.predicted_sparsity):
            floor = max(st.predicted_sparsity, (c.zeros - c.pruned - c.underflow) / n)
            excess = c.zeros / n - floor
            if excess > fb.sparsity + 1.5 / math.sqrt(n):
                kind = "format" if rule.quantizes and 2 * c.underflow >= excess * n else "pruning"
                reasons.append((kind, f"achieved sparsity {c.zeros / n:.3f} above the predicted "
                                      f"{floor:.3f} by {excess:.3f} (bound {fb.sparsity:g})"))
        if (fb.error is not None and math.isfinite(err) and math.isfinite(st.predicted_error)
                and err > fb.error * st.predicted_error):
            reasons.append(("format" if rule.quantizes else "pruning",
                            f"relative error {err:.3g}, {err / max(st.predicted_error, 1e-300):.3g} times the "
                            f"predicted {st.predicted_error:.3g} (bound {fb.error:g}x)"))
        if not reasons:
            st.fallback_run = 0
            return ""
        st.fallback_run += 1
        if st.fallback_run < fb.patience:
            return ""
        kinds = {k for k, _ in reasons}
        for i, action in enumerate(fb.actions):
            if i in st.fallback_done:
                continue
            new = _fallback_rule(action, rule, kinds)
            if new is not None:
                break
        else:
            return ""                                      # the ladder is used up for this drift
        st.fallback_done.append(i)
        st.fallback_run = 0
        self.rules[name] = new
        if new.quantizes and new.block_size is None and not math.isnan(st.mu):
            st.scale = _scale_for(new, st)
        elif not new.quantizes:
            st.scale = 1.0
        _predict(new, st, n)
        reason = "; ".join(t for _, t in reasons)
        row = {"layer": name, "seq": st.seq, "action": action, "reason": reason,
               "from_format": None if rule.format is None else str(rule.format), "from_rounding": rule.rounding,
               "from_sparsity": rule.sparsity if rule.prunes else None,
               "to_format": None if new.format is None else str(new.format), "to_rounding": new.rounding,
               "to_sparsity": new.sparsity if new.prunes else None}
        self.fallbacks.append(row)
        log.warning("gradstats.apply: layer %r: fallback %r at call %d after %d drifting call(s): %s. Was %s; "
                    "now %s", name, action, st.seq, fb.patience, reason, rule.describe(), new.describe())
        if self.log_to is not None:
            self.log_to.log_rows("applied_fallbacks", [row])
        return action

    @property
    def alerts(self) -> dict[str, dict[str, str]]:
        """Per layer that raised any: ``{kind: message}`` of the alerts fired (each at most once;
        kinds in :data:`ALERT_KINDS`)."""
        return {n: dict(st.alerts) for n, st in self.state.items() if st.alerts}

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything that decides the next output, as plain data (tensors, numbers, strings,
        lists, dicts: ``torch.load(..., weights_only=True)`` reads it back): per layer the call
        counter, running statistics, threshold, scale, predictions, alert state, the fallback
        state and the rule in force (changed by a fallback, it replaces the plan's rule when
        loaded), the fallbacks taken, and the random generator
        (every random draw of apply, on any device, comes from this one CPU generator). Saved
        beside the model's and optimizer's state dicts, a resumed training repeats the
        uninterrupted one bit for bit. The per-call records (``history``) are not included:
        with ``log_to=`` they are in the run; a resumed handle's history starts empty and its
        ``seq`` values continue.

        Example:
            >>> import torch, gradstats
            >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8))
            >>> plan = gradstats.Plan.uniform(format="e4m3fn", sparsity=0.5, rounding="stochastic", layers=["0"])
            >>> a = gradstats.apply(model, plan)
            >>> model(torch.randn(4, 8)).sum().backward()
            >>> b = gradstats.apply(torch.nn.Sequential(torch.nn.Linear(8, 8)), plan)
            >>> b.load_state_dict(a.state_dict()); b.state["0"].seq
            1
        """
        return {
            "version": STATE_VERSION,
            "generator": self.generator.get_state(),
            "refresh_every": _schedule_text(self.refresh_every),
            "warmup": self.warmup,
            "ema": self.ema,
            "fallback": None if self.fallback is None else self.fallback.to_dict(),
            "fallbacks": [dict(r) for r in self.fallbacks],
            "layers": {n: {**{k: getattr(st, k) for k in _STATE_FIELDS + _STATE_FIELDS_V2},
                           "alerts": dict(st.alerts), "fallback_done": list(st.fallback_done),
                           "rule": self.rules[n].to_dict()} for n, st in self.state.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (on a handle of the same plan's layers).

        A ``ValueError`` names the layers that differ; different ``refresh_every`` or ``ema``
        settings are accepted with a warning (the resumed training then is not the same one).
        """
        sd = state_dict
        if not isinstance(sd, dict) or "layers" not in sd or "generator" not in sd:
            raise ValueError("load_state_dict expects what Applied.state_dict() returned (a dict with "
                             f"'layers' and 'generator'), got {type(sd).__name__}"
                             + (f" with keys {sorted(sd)}" if isinstance(sd, dict) else ""))
        if sd.get("version") not in (1, STATE_VERSION):
            raise ValueError(f"state dict version {sd.get('version')!r} is not {STATE_VERSION}, the one this "
                             "gradstats writes (or 1, which it reads)")
        layers = sd["layers"]
        missing = [n for n in self.state if n not in layers]
        extra = [n for n in layers if n not in self.state]
        if missing or extra:
            raise ValueError(f"the state dict is of other layers than this handle's plan: layers of the plan "
                             f"missing from it: {missing}; layers in it the plan does not enforce on this "
                             f"model: {extra}. Load it into apply() of the plan and model it was saved from")
        mine = {"refresh_every": _schedule_text(self.refresh_every), "warmup": self.warmup,
                "ema": self.ema, "fallback": None if self.fallback is None else self.fallback.to_dict()}
        for k, v in mine.items():
            if k == "warmup" and k not in sd and v == 0:
                continue                                   # saved before warmup existed
            if (k in sd or k not in ("fallback", "warmup")) and sd.get(k) != v:
                log.warning("gradstats.apply: the state dict was saved with %s=%r, this handle uses %r: the "
                            "resumed training will not repeat the saved one", k, sd.get(k), v)
        gen = sd["generator"]
        if not isinstance(gen, torch.Tensor) or gen.dtype != torch.uint8:
            raise ValueError(f"state dict 'generator' must be a torch.uint8 tensor (Generator.get_state()), "
                             f"got {type(gen).__name__}")
        from gradstats.plan import Rule

        states, rules = {}, dict(self.plan_rules)
        for n, d in layers.items():
            bad = [k for k in _STATE_FIELDS if k not in d]
            if bad:
                raise ValueError(f"state dict entry of layer {n!r} lacks {bad}")
            st = _LayerState(**{k: d[k] for k in _STATE_FIELDS}, **{k: d[k] for k in _STATE_FIELDS_V2 if k in d})
            st.seq, st.zero_run, st.fallback_run = int(st.seq), int(st.zero_run), int(st.fallback_run)
            st.alerts = {str(k): str(v) for k, v in d.get("alerts", {}).items()}
            st.fallback_done = [int(i) for i in d.get("fallback_done", [])]
            if st.fallback_done:                 # a fallback changed this layer's rule: continue with it
                try:
                    rules[n] = Rule(**d["rule"])
                except (KeyError, TypeError, ValueError) as exc:
                    raise ValueError(f"state dict entry of layer {n!r}: its rule (changed by a fallback) "
                                     f"does not load: {exc}") from None
            states[n] = st
        self.generator.set_state(gen.clone())
        self.state = states
        self.rules = rules
        self.fallbacks = [dict(r) for r in sd.get("fallbacks", [])]

    # -- results
    def to_dataframe(self) -> pd.DataFrame:
        """Every recorded call, one row each (see the class docstring for the columns)."""
        return pd.DataFrame(self.history)

    def summary(self) -> pd.DataFrame:
        """Per layer, predicted beside achieved for each quantity of the whole operator (pruning
        *and* rounding, what leaves the layer; fractions of all entries):

        - ``plan_<q>``: what the plan predicted when it was made (its :class:`~gradstats.plan.Prediction`
          from ``recommend``'s calibration steps; NaN where the plan carries none);
        - ``predicted_<q>``: the lognormal model at this training's running statistics, threshold
          and scale (mean over calls);
        - ``achieved_<q>``: measured on each call (mean over calls);

        for ``sparsity``, ``underflow`` (non-zero values after pruning that rounding flushed to zero),
        ``overflow`` (clipped at the format's maximum), ``gain`` (``<out, g> / <g, g>``: 1 is
        unbiased) and ``error`` (``|out - g|^2 / |g|^2``). Also ``calls``, ``format`` and ``rounding``
        (the last call's rule), ``target_sparsity``, the last ``mu`` and ``sigma`` (of ln|g|),
        ``alerts`` (the kinds that fired, ``"overflow, gain"``; ``""`` if none) and ``fallbacks``
        (the actions a fallback took)."""
        df = self.to_dataframe()
        if df.empty:
            return df
        agg = df.groupby("layer", sort=False).agg(
            calls=("seq", "size"), format=("format", "last"), rounding=("rounding", "last"),
            target_sparsity=("target_sparsity", "mean"),
            predicted_sparsity=("predicted_sparsity", "mean"), achieved_sparsity=("achieved_sparsity", "mean"),
            predicted_underflow=("predicted_underflow", "mean"), achieved_underflow=("underflow_fraction", "mean"),
            predicted_overflow=("predicted_overflow", "mean"), achieved_overflow=("overflow_fraction", "mean"),
            achieved_gain=("gain", "mean"),
            predicted_error=("predicted_error", "mean"), achieved_error=("error", "mean"),
            mu=("mu", "last"), sigma=("sigma", "last"))
        agg["predicted_gain"] = math.nan       # the running model predicts no gain; the plan does
        order = [n for n in self.rules if n in agg.index]            # model order
        out = agg.loc[order].reset_index()
        pred = [self.plan_rules[n].predicted for n in order]

        def plan_col(field_: str) -> list[float]:
            return [math.nan if p is None or getattr(p, field_) is None else float(getattr(p, field_)) for p in pred]

        for q, field_ in (("sparsity", "sparsity"), ("underflow", "flushed"), ("overflow", "overflow"),
                          ("gain", "gain"), ("error", "error")):
            out.insert(out.columns.get_loc(f"predicted_{q}"), f"plan_{q}", plan_col(field_))
        out.insert(out.columns.get_loc("sigma") + 1, "alerts",
                   [", ".join(k for k in ALERT_KINDS if k in self.state[n].alerts) for n in order])
        out["fallbacks"] = [", ".join(r["action"] for r in self.fallbacks if r["layer"] == n) for n in order]
        return out

    def to_dict(self) -> dict[str, Any]:
        """The plan, the settings and the per-layer summary as plain data."""
        return {"plan": self.plan.to_dict(), "refresh_every": _schedule_text(self.refresh_every),
                "warmup": self.warmup, "ema": self.ema,
                "fallback": None if self.fallback is None else self.fallback.to_dict(),
                "fallbacks": [dict(r) for r in self.fallbacks], "summary": self.summary().to_dict("records")}

    def __repr__(self) -> str:
        return f"Applied(layers={list(self.rules)}, calls={len(self.history)})"


def _schedule_text(refresh_every: Union[int, Callable[[int], bool]]) -> Union[int, str]:
    """``refresh_every`` as plain data: the int, or the schedule function's qualified name."""
    if callable(refresh_every):
        return f"schedule:{getattr(refresh_every, '__qualname__', type(refresh_every).__name__)}"
    return refresh_every


def _all_reduce_stats(v: torch.Tensor) -> torch.Tensor:
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


def apply(model: nn.Module, plan: Union[Any, str, os.PathLike], *,
          refresh_every: Union[int, Callable[[int], bool]] = 1, warmup: int = 0,
          ema: Optional[float] = None, log_to: Any = None, seed: int = 0,
          sync_stats: bool = False, record: bool = True,
          sparsity_margin: Optional[float] = SPARSITY_MARGIN,
          underflow_bound: Optional[float] = UNDERFLOW_BOUND,
          zero_calls: Optional[int] = ZERO_CALLS,
          fallback: Union[Fallback, str, None] = None,
          overflow_bound: Optional[float] = OVERFLOW_BOUND,
          bias_bound: Optional[float] = BIAS_BOUND) -> Applied:
    """Enforce ``plan`` on the neural gradients of ``model`` in the backward pass.

    Args:
        model: the model (DDP, DataParallel, FSDP and ``torch.compile`` wrappers are looked
            through: :func:`gradstats.wrappers.unwrap`); every pattern of the plan must match
            one of its modules.
        plan: a :class:`gradstats.Plan` or the path of a saved plan.
        refresh_every: recompute each layer's statistics, threshold and (``"lognormal"``)
            scale every this many gradients of that layer; ``"amax"`` scales follow every step.
            Or a schedule: a function of the call index ``k`` (0 at the first enforced
            gradient) that returns True to refresh, e.g. ``lambda k: k < 100 or k % 10 == 0``
            (every call for 100, then every tenth). The first enforced call always refreshes.
        warmup: each layer's first ``warmup`` gradients pass unchanged (a warm-up) while
            its statistics, threshold and scale follow them (the study trained half an epoch
            before pruning); the plan takes effect at the next one, warm. Warm-up calls are
            not recorded; ``seq`` counts them (the first record has ``seq == warmup``).
        ema: decay of an exponential moving average of the statistics (None: the latest).
        log_to: a :class:`gradstats.Tracer`; each call's record goes into its run's
            ``"applied"`` table (``open_run(path).table("applied")``).
        seed: seed of the random draws of stochastic pruning and rounding.
        sync_stats: under ``torch.distributed``, all-reduce the statistics so every rank uses
            the same thresholds and scales.
        record: keep per-call records (``Applied.history``).
        sparsity_margin: warn when a call's achieved sparsity exceeds the layer's target by
            more than this (beyond sampling noise); None: no check.
        underflow_bound: warn when rounding to nearest flushes more than this fraction of the
            layer's non-zero values to zero (beyond sampling noise; a systematic shrinkage;
            stochastic rounding's flushes are unbiased and not checked); None: no check.
        overflow_bound: warn when more than this fraction of a call's entries are clipped at the
            format's maximum (or more than the plan predicted, if more); None: no check.
        bias_bound: warn when the magnitude gain ``<out, g> / <g, g>`` of a call, or of all calls
            so far, is off 1 by more than this beyond five standard errors; None: no check.
        zero_calls: warn when a layer's enforced gradient is all zeros this many calls in a
            row; None: no check.
        fallback: None (off, the default), a :class:`Fallback`, or a name of
            :data:`FALLBACK_PRESETS` (``"widen"``: the default ladder, stochastic rounding, then
            the next wider format of the family, then full precision): when a layer's gradient
            drifts past the fallback's bounds, change its rule a step at a time (logged, in
            ``Applied.fallbacks``, ``summary()``, the records, the run with ``log_to=``, and the
            state dict).

    Each alert is logged once per layer and kind (logger ``gradstats.apply``, WARNING) and
    listed in ``Applied.summary()["alerts"]`` and ``Applied.alerts``. To resume a training
    exactly, checkpoint ``Applied.state_dict()`` with the model and optimizer and load it into
    the new handle (``load_state_dict``).

    Eval mode and ``torch.no_grad`` are untouched; each call of a module reused in one step,
    and each micro-batch of gradient accumulation, is compressed on its own.

    Example:
        >>> import torch, gradstats
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8))
        >>> handle = gradstats.apply(model, gradstats.Plan.uniform(format="e4m3fn", scale="amax", layers=["0"]))
        >>> model(torch.randn(4, 8)).sum().backward()
        >>> handle.remove(); handle.summary()["format"].tolist()
        ['e4m3fn']
    """
    return Applied(model, plan, refresh_every=refresh_every, warmup=warmup, ema=ema, log_to=log_to,
                   seed=seed, sync_stats=sync_stats, record=record, sparsity_margin=sparsity_margin,
                   underflow_bound=underflow_bound, zero_calls=zero_calls, fallback=fallback,
                   overflow_bound=overflow_bound, bias_bound=bias_bound)
