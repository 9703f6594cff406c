"""Format, rounding and scale that training can live with: :func:`choose_for_training`.

The relative mean squared error that :func:`best_format` minimises is the wrong objective for
training. With round-to-nearest, the MSE-optimal scale keeps the largest values exact and flushes
most small ones to zero: a systematic shrinkage of every weight gradient the tensor feeds, which
SGD does not average away (it averages noise, not bias). Measured on a CNN, accuracy loss across
FP configurations ranked with the end-to-end bias of the weight gradient and the flushed fraction,
poorly with the MSE (``docs/fpanalysis.md``, "Training-aware choice").

So the choice here is constrained: among the candidate formats, both roundings and power-of-two
scales ``s = amax_scale(fmt, amax) * 2**shift`` (the scale relative to the tensor's running
maximum, the way :func:`gradstats.apply` enforces it), take the smallest predicted relative MSE
whose predicted magnitude bias ``|E[|Q(g)| - |g|]| / E|g|`` (:attr:`ErrorResult.bias`:
flush-to-zero and saturation, conditioned on the tensor's maximum) is at most ``bias_bound``
and, for round-to-nearest, whose predicted flushed fraction of the non-zero entries is at most
``flush_bound``. The magnitude bias weighs each flushed value by its size, so a wide layer can
lose a third of its entries to zero within a 1% bias; SGD shrugs that off (the large values carry
its step), Adam does not (measured: a transformer trained with AdamW lost 0.94 nats with those plans and nothing with the same formats rounded stochastically,
``docs/RESULTS.md`` 1.4.1; that Adam's per-weight normalisation is the reason is our hypothesis, not
yet tested). Stochastic rounding removes the bias inside the range and keeps every
value in expectation, so a feasible choice always exists at the amax scale; nearest rounding wins
where it keeps both small, since its noise is lower.

Example:
    >>> c = choose_for_training(6, mu=-12.0, sigma=2.3, amax=2e-2, numel=1e5)
    >>> str(c.format), c.rounding, c.scale_shift, abs(c.bias) <= c.bias_bound
    ('e3m2fn', 'stochastic', 0, True)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence, Union

import numpy as np

from gradstats.formats import FPFormat, amax_scale, parse
from gradstats.fpanalysis import _params as P
from gradstats.fpanalysis.error import expected_error

__all__ = ["choose_for_training", "TrainingChoice", "BIAS_BOUND", "FLUSH_BOUND", "OBJECTIVES"]

#: default bound on the predicted relative magnitude bias: 1% shrinkage of every weight gradient
BIAS_BOUND = 0.01
#: default bound on the predicted fraction of the non-zero entries that round-to-nearest flushes to
#: zero (a transformer trained with AdamW lost 0.94 nats with plans that flushed 36%; the reason we
#: give, not yet tested: Adam normalises every weight's step, so a small gradient flushed is a lost
#: step however little it weighs in the magnitude bias)
FLUSH_BOUND = 0.01
#: the objectives :func:`gradstats.recommend` knows: this module's, and the plain relative MSE
OBJECTIVES = ("training", "mse")
#: shifts (binades) of the scale relative to the amax scale that are searched
SHIFTS = tuple(range(-8, 5))
from gradstats.formats import PREDICTED_ROUNDINGS as _ROUNDINGS  # noqa: E402

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True)
class TrainingChoice:
    """What :func:`choose_for_training` picked, per layer (lists and arrays of one entry per layer;
    plain values when one layer was given).

    Attributes:
        format, rounding: the chosen format and rounding.
        scale_shift: binades of the scale above the amax scale (``0``: the tensor's maximum lands
            in the format's top binade; negative: headroom; positive: the largest values saturate).
        scale: the scale for the ``amax`` given (``amax_scale(format, amax) * 2**scale_shift``).
        error: predicted relative MSE ``E[(Q(g) - g)**2] / E[g**2]``.
        bias: predicted relative magnitude bias (negative: shrinkage).
        flushed: predicted fraction of all entries that become zero from a non-zero value.
        flushed_mass: predicted fraction of ``E|g|`` carried by the values that become zero.
        saturated: predicted fraction of entries clipped to the format's maximum.
        feasible: whether the bias bound was met (otherwise the smallest ``|bias|`` was taken).
        bias_bound, flush_bound, names: the setting.
    """

    format: Any
    rounding: Any
    scale_shift: Any
    scale: Any
    error: Any
    bias: Any
    flushed: Any
    flushed_mass: Any
    saturated: Any
    feasible: Any
    bias_bound: float = BIAS_BOUND
    names: Optional[list] = None
    flush_bound: Optional[float] = FLUSH_BOUND
    _fields: tuple = field(default=("scale_shift", "scale", "error", "bias", "flushed", "flushed_mass",
                                    "saturated", "feasible"), repr=False)

    def to_dataframe(self) -> "pd.DataFrame":
        """One row per layer."""
        import pandas as pd

        def col(v):
            return list(v) if isinstance(v, (list, np.ndarray)) else [v]

        df = pd.DataFrame({"format": [str(f) for f in col(self.format)], "rounding": col(self.rounding),
                           **{f: col(getattr(self, f)) for f in self._fields}})
        if self.names is not None:
            df.insert(0, "layer", self.names)
        return df

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (arrays as lists, formats as names)."""
        d = {f: (getattr(self, f).tolist() if isinstance(getattr(self, f), np.ndarray) else getattr(self, f))
             for f in self._fields}
        fm = self.format
        d["format"] = [str(f) for f in fm] if isinstance(fm, list) else str(fm)
        d["rounding"] = self.rounding
        d["bias_bound"], d["flush_bound"], d["names"] = self.bias_bound, self.flush_bound, self.names
        return d


def _candidates(bits: int, candidates: Any) -> list[FPFormat]:
    from gradstats.fpanalysis.choice import DEFAULT_CANDIDATES, preset_formats

    if candidates is None or isinstance(candidates, str):
        fmts = preset_formats(candidates or DEFAULT_CANDIDATES, bits, granularity="tensor")
    else:
        fmts = [parse(c) for c in candidates]
        fmts = [f for f in fmts if f.bits == bits]
        if not fmts:
            raise ValueError(f"candidates hold no {bits}-bit format")
    return fmts


def choose_for_training(bits: int, *, mu: P.ArrayLike, sigma: P.ArrayLike, amax: P.ArrayLike,
                        p0: P.ArrayLike = 0.0, numel: P.ArrayLike | None = None,
                        candidates: Union[None, str, Iterable[Any]] = None,
                        roundings: Sequence[str] = _ROUNDINGS, bias_bound: float = BIAS_BOUND,
                        shifts: Sequence[int] = SHIFTS, threshold: P.ArrayLike | None = None,
                        names: Optional[Sequence[str]] = None,
                        flush_bound: Optional[float] = FLUSH_BOUND) -> TrainingChoice:
    """Per layer, the format of ``bits`` bits, the rounding and the scale (relative to the
    tensor's maximum) with the smallest predicted relative MSE whose predicted magnitude bias is
    within ``bias_bound`` and, rounding to nearest, whose predicted flushed fraction of the
    non-zero entries is within ``flush_bound`` (see the module doc). Vectorised over layers.

    Args:
        bits: the width.
        mu, sigma: mean and std of ``ln|g|`` (natural log) per layer; ``p0``: zero fraction.
        amax: each tensor's largest magnitude (the scale is chosen relative to it, and the
            prediction conditioned on it); ``numel``: entries per tensor.
        candidates: formats to choose among: a list, or a name of
            :func:`~gradstats.fpanalysis.preset_formats` (default ``"ocp"``: the formats hardware has).
        roundings: the roundings allowed (``"nearest"``, ``"stochastic"``).
        bias_bound: the largest ``|bias|`` accepted (default :data:`BIAS_BOUND`).
        flush_bound: the largest predicted fraction of the non-zero entries that round-to-nearest may
            flush (default :data:`FLUSH_BOUND`, 1%); None: no bound (the choice before it, which
            suits SGD but not Adam).
        shifts: the scale shifts (binades) searched.
        threshold: the pruning threshold applied before quantising, per layer (optional): then
            nearest rounding is only considered at scales that keep the threshold representable
            (``threshold * s`` at least the smallest positive value; 0: that layer is not
            pruned): the pruned tensor holds
            ``+-threshold`` in place of many small values, and flushing those would be a large
            bias. Stochastic rounding stays unbiased below the smallest value.
        names: layer names (for the DataFrame view).

    Example:
        >>> c = choose_for_training(8, mu=[-12.0, -8.0], sigma=[1.2, 3.0], amax=[1e-3, 5.0], numel=1e5,
        ...                         candidates=["e4m3fn", "e5m2"])
        >>> [str(f) for f in c.format], list(c.rounding), [int(k) for k in c.scale_shift]
        (['e4m3fn', 'e4m3fn'], ['nearest', 'stochastic'], [0, 0])

    (the wide second layer: to nearest, e4m3fn would flush more than 1% of its values)
    """
    bits = P.check_bits(bits)
    if not (isinstance(bias_bound, (int, float)) and not isinstance(bias_bound, bool) and bias_bound > 0):
        raise ValueError(f"bias_bound must be a positive fraction (e.g. 0.01), got {bias_bound!r}")
    if flush_bound is not None and not (isinstance(flush_bound, (int, float)) and not isinstance(flush_bound, bool)
                                        and 0 <= flush_bound <= 1):
        raise ValueError(f"flush_bound must be None or a fraction in [0, 1] (e.g. 0.01), got {flush_bound!r}")
    roundings = list(roundings)
    bad = [r for r in roundings if r not in _ROUNDINGS]
    if bad or not roundings:
        raise ValueError(f"roundings must be a non-empty subset of {_ROUNDINGS}, got {roundings}")
    shifts = [int(k) for k in shifts]
    if not shifts:
        raise ValueError("shifts must list at least one scale shift (binades relative to the amax scale)")
    extra = [("amax", amax)] + ([("threshold", threshold)] if threshold is not None else [])
    shape, arrs = P.lognormal(mu, sigma, p0, *extra)
    mu_, s_, p0_, am = arrs[:4]
    am = P.check_amax(am)
    thr = arrs[4] if threshold is not None else None
    nn = P.numel_array(numel, shape)
    fmts = _candidates(bits, candidates)
    n = mu_.size
    best = {"obj": np.full(n, np.inf), "absb": np.full(n, np.inf)}
    pick: dict[str, list] = {k: [None] * n for k in ("format", "rounding")}
    vals = {k: np.full(n, np.nan) for k in ("scale_shift", "scale", "error", "bias", "flushed",
                                            "flushed_mass", "saturated")}
    feasible = np.zeros(n, dtype=bool)
    # ties (a small tensor whose values all stay normal at several shifts) go to the shift closest
    # to the amax scale, then to nearest rounding, then to the first candidate
    shifts = sorted(set(shifts), key=lambda k: (abs(k), k))
    for fmt in fmts:
        base = np.array([amax_scale(fmt, a) for a in am])
        for rounding in roundings:
            for k in shifts:
                sc = base * math.ldexp(1.0, k)
                ok = (sc >= 2.0 ** -126) & (sc <= 2.0 ** 126)
                if thr is not None and rounding == "nearest":
                    # pruned values flushed would be a bias (a threshold of 0: not pruned)
                    ok &= (thr <= 0) | (thr * sc >= fmt.min_subnormal)
                if not ok.any():
                    continue
                r = expected_error(fmt, mu=mu_, sigma=s_, p0=p0_, scale=np.where(ok, sc, 1.0),
                                   rounding=rounding, amax=am, numel=nn)
                err, bias = np.atleast_1d(r.total), np.atleast_1d(r.bias)
                fits = ok & (np.abs(bias) <= bias_bound)
                if flush_bound is not None and rounding == "nearest":
                    nonzero = np.maximum(1.0 - p0_, 1e-300)
                    fits &= np.atleast_1d(r.flushed) / nonzero <= flush_bound
                # a feasible choice beats any infeasible one; among feasible, the smaller error;
                # among infeasible (none found yet), the smaller |bias|
                better = (fits & (~feasible | (err < best["obj"] * (1 - 1e-9)))) | (
                    ok & ~fits & ~feasible & (np.abs(bias) < best["absb"] * (1 - 1e-9)))
                for i in np.nonzero(better)[0]:
                    pick["format"][i], pick["rounding"][i] = fmt, rounding
                    vals["scale_shift"][i], vals["scale"][i] = k, sc[i]
                    vals["error"][i], vals["bias"][i] = err[i], bias[i]
                    vals["flushed"][i] = np.atleast_1d(r.flushed)[i]
                    vals["flushed_mass"][i] = np.atleast_1d(r.flushed_mass)[i]
                    vals["saturated"][i] = np.atleast_1d(r.saturated)[i]
                    best["obj"][i], best["absb"][i] = err[i], abs(bias[i])
                feasible |= fits
    if any(f is None for f in pick["format"]):
        raise ValueError("no candidate scale fits float32 for some layer (amax far outside the formats' range)")
    single = shape == ()
    if single:
        return TrainingChoice(format=pick["format"][0], rounding=pick["rounding"][0],
                              scale_shift=int(vals["scale_shift"][0]),
                              **{k: float(v[0]) for k, v in vals.items() if k != "scale_shift"},
                              feasible=bool(feasible[0]), bias_bound=float(bias_bound),
                              names=list(names) if names is not None else None, flush_bound=flush_bound)
    return TrainingChoice(format=pick["format"], rounding=pick["rounding"],
                          scale_shift=vals["scale_shift"].astype(int),
                          **{k: v for k, v in vals.items() if k != "scale_shift"},
                          feasible=feasible, bias_bound=float(bias_bound),
                          names=list(names) if names is not None else None, flush_bound=flush_bound)
