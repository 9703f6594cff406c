"""The settings of :func:`gradstats.apply`: the alert bounds, the checkpoint layout, and the
:class:`Fallback` ladder (with :func:`widen`, the next wider format of a family).

Example:
    >>> from gradstats.apply.settings import Fallback, widen
    >>> from gradstats.formats import FPFormat
    >>> Fallback().patience, str(widen(FPFormat.parse("e2m1fn")))
    (2, 'e3m2fn')
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from gradstats._config import resolve_config
from gradstats.alarms import ALERT_KINDS as ALERT_KINDS  # declared with the tracer's alarms (one vocabulary)
from gradstats.formats import FPFormat
from gradstats.ops.engine import check_engine

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
#: Alert "gain": the magnitude gain ``<out, g> / <g, g>`` of a call is off 1 by more than this beyond
#: five standard errors of its own random draws, or that of all calls so far beyond two standard errors
#: of theirs (and by five off 1): a sustained 1.5% shrinkage alerts within a few calls (the bias bound
#: of ``recommend``: pruning and stochastic rounding are unbiased, so a gain off 1 is flushing or clipping)
BIAS_BOUND = 0.01
#: Alert "zero_gradient": the gradient leaving the layer was all zeros for this many calls in
#: a row (nothing reaches its weights: the symptom of a broken low-precision kernel or scale).
ZERO_CALLS = 3
#: version of the layout of :meth:`Applied.state_dict` (version 1, without the predictions and
#: the fallback state, still loads)
STATE_VERSION = 2
#: the LayerState fields a state dict carries (``hist`` is only read on the refresh that sets it)
_STATE_FIELDS = ("seq", "mu", "m2", "p0", "amax", "rms", "mean_abs", "threshold",
                 "predicted_sparsity", "scale", "zero_run")
#: fields added in state dict version 2 (defaults when loading version 1)
_STATE_FIELDS_V2 = ("predicted_underflow", "predicted_overflow", "predicted_error", "fallback_run", "gain_sums",
                    "solved_mu")
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


def as_fallback(fallback: Any) -> Optional[Fallback]:
    if fallback is None or isinstance(fallback, Fallback):
        return fallback
    if isinstance(fallback, str) and fallback in FALLBACK_PRESETS:
        return Fallback(actions=FALLBACK_PRESETS[fallback])
    raise ValueError(f"fallback must be None (off), a gradstats.apply.Fallback or one of "
                     f"{sorted(FALLBACK_PRESETS)}, got {fallback!r}")


def fallback_rule(action: str, rule: Any, kinds: set[str]) -> Any:
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


@dataclass(frozen=True)
class ApplyConfig:
    """The options of :func:`gradstats.apply` as one validated, frozen value (what the trainer
    callbacks of :mod:`gradstats.integrations` pass on too). Each field is the keyword of the same
    name (see :func:`gradstats.apply` for what it does); ``apply(model, plan, config=cfg)`` and
    the keywords may be combined, and a keyword that contradicts the config is a ``ValueError``.

    Example:
        >>> cfg = ApplyConfig(warmup=10, fallback="widen")
        >>> cfg.warmup, cfg.fallback.actions
        (10, ('stochastic', 'widen', 'full'))
        >>> ApplyConfig.resolve(cfg, warmup=10) is cfg
        True
    """

    refresh_every: Any = 1                  # int >= 1, or a schedule: call index -> bool
    warmup: int = 0
    ema: Optional[float] = None
    seed: int = 0
    sync_stats: bool = False
    record: bool = True
    sparsity_margin: Optional[float] = SPARSITY_MARGIN
    underflow_bound: Optional[float] = UNDERFLOW_BOUND
    zero_calls: Optional[int] = ZERO_CALLS
    fallback: Any = None                    # None, a Fallback, or a name of FALLBACK_PRESETS
    overflow_bound: Optional[float] = OVERFLOW_BOUND
    bias_bound: Optional[float] = BIAS_BOUND
    engine: Optional[str] = None            # None: GRADSTATS_ENGINE's, else each device's default

    def __post_init__(self) -> None:
        check_engine(self.engine)
        r = self.refresh_every
        if not callable(r) and (not isinstance(r, int) or isinstance(r, bool) or r < 1):
            raise ValueError("refresh_every must be a positive int (1 = every gradient) or a schedule, a "
                             f"function of the call index (0, 1, ...) returning True to refresh; got {r!r}")
        if not isinstance(self.warmup, int) or isinstance(self.warmup, bool) or self.warmup < 0:
            raise ValueError(f"warmup must be an int >= 0 (the number of each layer's first gradients "
                             f"left unchanged; 0: enforce from the first), got {self.warmup!r}")
        if self.ema is not None and not (0.0 <= self.ema < 1.0):
            raise ValueError(f"ema must be None or a decay in [0, 1), got {self.ema}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.sparsity_margin is not None and not (0.0 <= self.sparsity_margin < 1.0):
            raise ValueError(f"sparsity_margin must be None (no check) or in [0, 1), got {self.sparsity_margin!r}")
        if self.underflow_bound is not None and not (0.0 <= self.underflow_bound < 1.0):
            raise ValueError(f"underflow_bound must be None (no check) or a fraction in [0, 1), got "
                             f"{self.underflow_bound!r}")
        z = self.zero_calls
        if z is not None and (not isinstance(z, int) or isinstance(z, bool) or z < 1):
            raise ValueError(f"zero_calls must be None (no check) or a positive int, got {z!r}")
        for nm, v in (("overflow_bound", self.overflow_bound), ("bias_bound", self.bias_bound)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < 1.0):
                raise ValueError(f"{nm} must be None (no check) or a fraction in [0, 1), got {v!r}")
        object.__setattr__(self, "fallback", as_fallback(self.fallback))

    @classmethod
    def resolve(cls, config: Optional["ApplyConfig"], **keywords: Any) -> "ApplyConfig":
        """The config that ``config`` and ``apply``'s keyword arguments say together (a keyword at
        its default defers to ``config``; one that contradicts it is a ``ValueError``).

        Example:
            >>> ApplyConfig.resolve(ApplyConfig(warmup=5), warmup=2)
            Traceback (most recent call last):
            ...
            ValueError: apply(config=..., warmup=2) contradicts the config's warmup=5: pass the option in one place
        """
        return resolve_config(cls, config, "apply", "gradstats.apply.ApplyConfig", **keywords)
