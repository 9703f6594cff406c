"""The informational values of a plan: :class:`Prediction` (what a recommendation predicted for a
layer) and :class:`Provenance` (where a plan came from), with the checks the plan's values share
(:func:`_err`, :func:`_opt_float`, :func:`_check_keys`). Imported from :mod:`gradstats.plan`."""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping, Sequence

__all__ = ["Prediction", "Provenance"]


# --------------------------------------------------------------------------- checks
def _err(where: str, msg: str) -> ValueError:
    return ValueError(f"{where}: {msg}" if where else msg)


def _opt_float(v: Any, name: str, where: str, *, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False, hi_open: bool = False) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _err(where, f"{name} must be a number or null, got {v!r}")
    x = float(v)
    if not math.isfinite(x):
        raise _err(where, f"{name} must be finite, got {x}")
    bad = (lo is not None and (x < lo or (lo_open and x == lo))) or \
          (hi is not None and (x > hi or (hi_open and x == hi)))
    if bad:
        rng = f"{'(' if lo_open else '['}{'-inf' if lo is None else f'{lo:g}'}, " \
              f"{'inf' if hi is None else f'{hi:g}'}{')' if hi_open else ']'}"
        raise _err(where, f"{name} must lie in {rng}, got {x}")
    return x


def _check_keys(d: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    for k in d:
        if k not in allowed:
            raise _err(where, f"unknown key {k!r}; allowed keys: {list(allowed)}")



# --------------------------------------------------------------------------- values
@dataclass(frozen=True)
class Prediction:
    """Numbers known when a rule was recommended (informational; never used to enforce).

    Attributes:
        error: predicted quantisation error, ``E[(Q(g) - g)^2] / E[g^2]`` (relative MSE).
        sparsity: predicted fraction of zeros after pruning (exact zeros included).
        mu, sigma: mean and std of ``ln|g|`` (natural log) of the non-zero entries.
        p0: fraction of exact zeros before pruning.
        scale: the scale multiplier the analysis found best at recommendation time (the
            lognormal optimum, before the amax floor of :meth:`Rule.scale_for`).
        threshold: the pruning threshold the rule gave at recommendation time.
        amax: the largest ``|g|`` of one captured tensor that the predictions are conditioned
            on (over merged steps: the median of the captures' maxima, since ``apply`` conditions
            each call on its own tensor's maximum).
        bias: predicted relative magnitude bias ``E[|Q(g)| - |g|] / E|g|`` of the quantisation
            (negative: shrinkage; :attr:`gradstats.fpanalysis.ErrorResult.bias`).
        flushed: predicted fraction of the entries a non-zero value of which becomes zero.
        overflow: predicted fraction of the entries saturated at the format's maximum.
        gain: predicted magnitude gain ``E[out g] / E[g^2]`` (1: neither shrunk nor inflated).

    Recommended plans predict for the composed operator, pruning then rounding
    (:mod:`gradstats.fpanalysis.composed`), averaged over the calibration steps.

    Example:
        >>> Prediction(error=1e-3, sigma=2.0).to_dict()
        {'error': 0.001, 'sigma': 2.0}
    """

    error: float | None = None
    sparsity: float | None = None
    mu: float | None = None
    sigma: float | None = None
    p0: float | None = None
    scale: float | None = None
    threshold: float | None = None
    amax: float | None = None
    bias: float | None = None
    flushed: float | None = None
    overflow: float | None = None
    gain: float | None = None

    def __post_init__(self) -> None:
        w = "predicted"
        for name, lo, hi, lo_open in (("error", 0.0, None, False), ("sparsity", 0.0, 1.0, False),
                                      ("mu", None, None, False), ("sigma", 0.0, None, False),
                                      ("p0", 0.0, 1.0, False), ("scale", 0.0, None, True),
                                      ("threshold", 0.0, None, False), ("amax", 0.0, None, False),
                                      ("bias", None, None, False), ("flushed", 0.0, 1.0, False),
                                      ("overflow", 0.0, 1.0, False), ("gain", None, None, False)):
            object.__setattr__(self, name, _opt_float(getattr(self, name), name, w, lo=lo, hi=hi,
                                                      lo_open=lo_open))

    def to_dict(self) -> dict[str, float]:
        """The fields that are set (not None)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, d: Any, where: str = "predicted") -> "Prediction":
        """From a dict such as :meth:`to_dict` gives; unknown keys are an error."""
        if not isinstance(d, Mapping):
            raise _err(where, f"expected an object of predicted numbers, got {type(d).__name__}")
        _check_keys(d, [f.name for f in dataclasses.fields(cls)], where)
        try:
            return cls(**d)
        except ValueError as exc:
            raise _err(where, str(exc).removeprefix("predicted: ")) from None



@dataclass(frozen=True)
class Provenance:
    """Where a plan came from.

    Attributes:
        source: the run directory it was recommended from (or None).
        gradstats_version: the version that made it.
        created: UTC time of creation, ISO 8601 (``2025-01-31T12:00:00Z``).
        generator: how it was made, e.g. ``"recommend(bits=8, sparsity=0.85, ...)"``.
        steps: ``[first, last]`` steps of the statistics used (or None).

    Example:
        >>> p = Provenance.now(source="runs/cnn", generator="uniform")
        >>> p.created.endswith("Z"), p.source
        (True, 'runs/cnn')
    """

    source: str | None = None
    gradstats_version: str | None = None
    created: str | None = None
    generator: str | None = None
    steps: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        for k in ("source", "gradstats_version", "created", "generator"):
            v = getattr(self, k)
            if v is not None and not isinstance(v, (str, os.PathLike)):
                raise _err("provenance", f"{k} must be a string or null, got {v!r}")
            if isinstance(v, os.PathLike):
                object.__setattr__(self, k, os.fspath(v))
        if self.created is not None:
            try:
                datetime.fromisoformat(self.created.replace("Z", "+00:00"))
            except ValueError:
                raise _err("provenance", f"created must be an ISO 8601 time, got {self.created!r}") from None
        if self.steps is not None:
            s = self.steps
            if not (isinstance(s, (list, tuple)) and len(s) == 2 and
                    all(isinstance(v, int) and not isinstance(v, bool) for v in s) and s[0] <= s[1]):
                raise _err("provenance", f"steps must be [first, last] integers, got {s!r}")
            object.__setattr__(self, "steps", (int(s[0]), int(s[1])))

    @classmethod
    def now(cls, **kw: Any) -> "Provenance":
        """Provenance stamped with this gradstats version and the current UTC time."""
        from gradstats._version import __version__

        t = datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
        return cls(gradstats_version=__version__, created=t, **kw)

    def to_dict(self) -> dict[str, Any]:
        """Every field (steps as a list)."""
        d = dataclasses.asdict(self)
        d["steps"] = list(self.steps) if self.steps is not None else None
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "Provenance":
        """From a dict such as :meth:`to_dict` gives; unknown keys are an error."""
        if not isinstance(d, Mapping):
            raise _err("provenance", f"expected an object, got {type(d).__name__}")
        _check_keys(d, [f.name for f in dataclasses.fields(cls)], "provenance")
        return cls(**d)
