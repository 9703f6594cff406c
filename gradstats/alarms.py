"""Alarms while tracing: a layer whose gradient is all zero for several steps, has non-finite
values, or would be flushed to zero by a format being watched (the kind of failure that, unseen,
silently trains on zero gradients).

The tracer runs :class:`Alarms` on its writer thread, as a sink of each committed statistics
table (nothing is added to the training thread): each alarm is logged once per layer and kind
(logger ``gradstats.alarms``, WARNING) and recorded in the run's ``"alarms"`` table
(``open_run(path).table("alarms")``: step, layer, kind, alarm, value, message) and in
``Run.summary()["alarms"]``. ``gradstats.trace(..., alarms=...)`` takes ``True`` (the default:
zero and non-finite gradients), ``False``, or an :class:`Alarms` with formats to watch.

This module is also the one vocabulary of what can go wrong with a layer's gradient, while tracing
(alarms) and while a plan is applied (:func:`gradstats.apply`'s alerts): :data:`KINDS` declares each
kind once (its name, which stage raises it, what it means) and :class:`Alarm` is the record of one
raised, whichever stage raised it.

Example:
    >>> import tempfile, torch, gradstats
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    >>> with gradstats.trace(m, tempfile.mkdtemp(), alarms=Alarms(zero_steps=2)) as t:
    ...     for _ in range(3):
    ...         (m(torch.randn(8, 4)) * 0).sum().backward(); t.step()      # every gradient is zero
    >>> gradstats.open_run(t.path).table("alarms")[["layer", "alarm"]].values.tolist()
    [['0', 'zero'], ['1', 'zero']]
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np

from gradstats.stats.law import HistogramLaw, law_flushed, tensor_scale

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

__all__ = ["Alarm", "AlarmKind", "Alarms", "ALARM_KINDS", "ALERT_KINDS", "KINDS"]


@dataclass(frozen=True)
class AlarmKind:
    """One kind of alarm: its name, the stages that raise it (``"trace"``: :class:`Alarms` while
    tracing; ``"apply"``: :func:`gradstats.apply`'s alerts) and what it means.

    Example:
        >>> KINDS["nonfinite"].raised_by
        ('trace', 'apply')
    """

    name: str
    raised_by: tuple[str, ...]
    meaning: str


def _kinds(*kinds: AlarmKind) -> dict[str, AlarmKind]:
    return {k.name: k for k in kinds}


#: every kind of alarm, declared once, in the order summaries list them
KINDS: dict[str, AlarmKind] = _kinds(
    AlarmKind("zero", ("trace",), "the layer's gradient was all zero for zero_steps steps in a row"),
    AlarmKind("nonfinite", ("trace", "apply"), "NaN or infinite entries in the gradient"),
    AlarmKind("flush", ("trace",), "a watched format would flush more than flush_bound of the non-zero entries "
                                   "to zero (raised as flush:<format>)"),
    AlarmKind("overflow", ("apply",), "more than overflow_bound of a call's entries saturated at the format's maximum"),
    AlarmKind("gain", ("apply",), "the magnitude gain <out, g> / <g, g> is off 1 by more than bias_bound"),
    AlarmKind("underflow", ("apply",), "rounding flushes more than underflow_bound of the non-zero entries"),
    AlarmKind("drift", ("apply",), "rounding flushed far more than the plan predicted: the gradient has moved since calibration"),
    AlarmKind("sparsity", ("apply",), "the achieved sparsity exceeds the layer's target by more than the margin"),
    AlarmKind("zero_gradient", ("apply",), "the gradient leaving the layer was all zeros for zero_calls calls"),
)

#: the alarms of the tracer: ``zero`` (all-zero gradient for ``zero_steps`` steps in a row), ``nonfinite`` (NaN
#: or inf entries), ``flush:<fmt>`` (a watched format would flush more than ``flush_bound`` of
#: the non-zero entries)
ALARM_KINDS = tuple(k for k, v in KINDS.items() if "trace" in v.raised_by)
#: the alerts of :func:`gradstats.apply`, in the order ``Applied.summary()`` lists them
ALERT_KINDS = tuple(k for k, v in KINDS.items() if "apply" in v.raised_by)


@dataclass(frozen=True)
class Alarm:
    """One alarm raised on a layer: by the tracer (with its ``step``, the ``tensor`` kind and a
    ``value``) or by :func:`gradstats.apply` (with the layer's call counter ``seq``).

    Args:
        kind: a key of :data:`KINDS`, optionally with a detail after a colon (``"flush:e4m3fn"``).
        layer: the layer's name.
        message: what happened, in words.
        step: the training step (tracer).
        tensor: which tensor of the layer (``"grad"``, ``"act"``, ...).
        value: the measured quantity (a count, a fraction).
        seq: the layer's call counter (apply).

    Example:
        >>> a = Alarm("flush:e4m3fn", "fc", "e4m3fn would flush 80%", step=3, value=0.8)
        >>> a.base, a.row()["alarm"], Alarm("gain", "fc", "off", seq=7).alert_row()["kind"]
        ('flush', 'flush:e4m3fn', 'gain')
    """

    kind: str
    layer: str
    message: str
    step: Optional[int] = None
    tensor: str = "grad"
    value: float = math.nan
    seq: Optional[int] = None

    def __post_init__(self) -> None:
        if self.base not in KINDS:
            raise ValueError(f"unknown alarm kind {self.kind!r}: use one of {list(KINDS)} (a detail may follow "
                             "a colon, as in 'flush:e4m3fn')")

    @property
    def base(self) -> str:
        """The kind without its detail (``"flush"`` of ``"flush:e4m3fn"``)."""
        return self.kind.split(":", 1)[0]

    def row(self) -> dict[str, Any]:
        """The row of the run's ``"alarms"`` table (step, layer, kind of tensor, alarm, value, message)."""
        return {"step": self.step, "layer": self.layer, "kind": self.tensor, "alarm": self.kind,
                "value": float(self.value), "message": self.message}

    def alert_row(self) -> dict[str, Any]:
        """The row of the run's ``"applied_alerts"`` table (layer, seq, kind, message)."""
        return {"layer": self.layer, "seq": self.seq, "kind": self.kind, "message": self.message}


@dataclass
class Alarms:
    """What the tracer watches for (see the module doc).

    Args:
        zero_steps: alarm when a layer's gradient is all zero this many steps in a row (calls and
            ranks of a step together); None: never.
        nonfinite: alarm on NaN or infinite entries.
        watch: formats whose what-if underflow is checked (:func:`gradstats.what_if`, per tensor at
            the amax scale with ``rounding``): names, a comma-separated string, or None.
        flush_bound: the fraction of non-zero entries a watched format may flush to zero.
        rounding: of the watched formats.
        kinds: which tensors are watched (default the neural gradients).
    """

    zero_steps: Optional[int] = 3
    nonfinite: bool = True
    watch: Union[str, Sequence[str], None] = None
    flush_bound: float = 0.5
    rounding: str = "nearest"
    kinds: Sequence[str] = ("grad",)
    #: alarms raised so far: (layer, kind, alarm) -> the first record
    raised: dict = field(default_factory=dict, repr=False)
    _zero_run: dict = field(default_factory=dict, repr=False)
    _formats: list = field(default_factory=list, repr=False)
    _record: Optional[Callable[[list[dict[str, Any]]], None]] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        from gradstats.formats import PREDICTED_ROUNDINGS, parse_list

        if self.zero_steps is not None and (isinstance(self.zero_steps, bool) or not isinstance(self.zero_steps, int)
                                            or self.zero_steps < 1):
            raise ValueError(f"zero_steps must be a positive int or None, got {self.zero_steps!r}")
        if not 0.0 <= float(self.flush_bound) <= 1.0:
            raise ValueError(f"flush_bound must be a fraction in [0, 1], got {self.flush_bound!r}")
        if self.rounding not in PREDICTED_ROUNDINGS:
            raise ValueError(f"rounding must be one of {PREDICTED_ROUNDINGS} (what the watched formats' flush is "
                             f"predicted for), got {self.rounding!r}")
        self._formats = parse_list(self.watch)
        self.watch = [str(f) for f in self._formats]
        self.kinds = tuple(self.kinds)

    def bind(self, record: Callable[[list[dict[str, Any]]], None]) -> "Alarms":
        """Where alarm records go (the tracer binds its ``log_rows("alarms", ...)``)."""
        self._record = record
        return self

    def write(self, stats: pd.DataFrame) -> None:
        """Check a committed statistics table (the tracer's writer calls it)."""
        new: list[dict[str, Any]] = []
        for kind in self.kinds:
            part = stats[stats["kind"] == kind]
            if not len(part):
                continue
            per = part.groupby(["step", "layer"], sort=True).agg(n=("n", "sum"), n_zero=("n_zero", "sum"),
                                                                 n_nonfinite=("n_nonfinite", "sum")).reset_index()
            # row by row only where something is to be said (non-finite entries, an all-zero
            # gradient); every other row just ends its layer's run of all-zero steps
            nonfinite = (per["n_nonfinite"] > 0).to_numpy() if self.nonfinite else np.zeros(len(per), bool)
            allzero = ((per["n"] > 0) & (per["n_zero"] == per["n"])).to_numpy()
            zero_layers = set(per["layer"][allzero]) if self.zero_steps is not None else set()
            if self.zero_steps is not None:
                for layer in set(per["layer"]) - zero_layers:
                    self._zero_run[(layer, kind)] = 0
            look = nonfinite | per["layer"].isin(zero_layers).to_numpy()
            for step, layer, nf, az in zip(per["step"][look], per["layer"][look], per["n_nonfinite"][look],
                                           allzero[look]):
                if self.nonfinite and nf > 0:
                    new += self._raise(int(step), layer, kind, "nonfinite", int(nf),
                                       f"{int(nf)} non-finite entries (NaN or inf)")
                if self.zero_steps is not None and layer in zero_layers:
                    run = self._zero_run.get((layer, kind), 0) + 1 if az else 0
                    self._zero_run[(layer, kind)] = run
                    if run >= self.zero_steps:
                        new += self._raise(int(step), layer, kind, "zero", run,
                                           f"all-zero gradient for {run} steps in a row")
            if self.watch:
                finite = part[part["n_nonfinite"] == 0]
                order = {name: i for i, name in enumerate(dict.fromkeys(finite["layer"]))}
                groups = sorted(finite.groupby(["step", "layer"]), key=lambda kv: (kv[0][0], order[kv[0][1]]))
                for (step, layer), g in groups:
                    rows = [r for r in g.to_dict("records") if int(r["n"]) > int(r["n_zero"]) and np.sum(r["hist"])]
                    if not rows:
                        continue
                    nz = np.array([int(r["n"]) - int(r["n_zero"]) for r in rows], dtype=np.float64)
                    laws = [HistogramLaw.from_stats(r) for r in rows]   # one law per row, for every format
                    for fmt in self._formats:  # the what-if underflow (gradstats.what_if), from the same law
                        flushed = [law_flushed(law, fmt, tensor_scale(fmt, "amax", float(r["max_abs"])), self.rounding)
                                   for law, r in zip(laws, rows)]
                        u = float(np.sum(nz * flushed) / nz.sum())
                        if u > self.flush_bound:
                            new += self._raise(int(step), layer, kind, f"flush:{fmt}", u,
                                               f"{fmt} ({self.rounding}, amax scale) would flush {u:.0%} of "
                                               f"the non-zero entries to zero (bound {self.flush_bound:.0%})")
        if new and self._record is not None:
            self._record(new)

    def _raise(self, step: int, layer: str, kind: str, alarm: str, value: float, msg: str) -> list[dict[str, Any]]:
        key = (layer, kind, alarm)
        if key in self.raised:
            return []
        rec = Alarm(alarm, layer, msg, step=step, tensor=kind, value=float(value)).row()
        self.raised[key] = rec
        log.warning("gradstats alarm: layer %r (%s) at step %d: %s", layer, kind, step, msg)
        return [rec]

    def by_layer(self) -> dict[str, list[str]]:
        """The alarms raised so far, per layer."""
        out: dict[str, list[str]] = {}
        for (layer, _kind, alarm) in self.raised:
            out.setdefault(layer, []).append(alarm)
        return out


def as_alarms(value: Union[bool, Alarms, None], *, watch: Iterable[str] | None = None) -> Optional[Alarms]:
    """``trace(alarms=...)``: True (the defaults), False/None (off) or an :class:`Alarms`."""
    if value is None or value is False:
        return None
    if value is True:
        return Alarms()
    if isinstance(value, Alarms):
        return value
    raise ValueError(f"alarms must be True (zero and non-finite gradients), False, or a gradstats.alarms.Alarms "
                     f"(to watch formats too), got {type(value).__name__}")
