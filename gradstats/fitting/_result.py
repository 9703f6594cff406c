"""``FitResult``: the outcome of one fit, and its tabular, dict and figure views."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from gradstats.families import MAGNITUDE_MODEL, mean_loglik
from gradstats.fitting._compare import information_criteria, ranking, vuong

_PAIRS = (("lognormal", "normal"), ("lognormal", "laplace"), ("normal", "laplace"))


@dataclass(frozen=True)
class FitResult:
    """Fitted families and their comparison on the non-zero finite magnitudes ``|g|``.

    Attributes:
        n, n_nonzero, n_zero, n_nonfinite: counts (``n_nonzero`` magnitudes are compared).
        zero_fraction: ``n_zero / (n - n_nonfinite)``, the point mass at zero.
        nonfinite_fraction: ``n_nonfinite / n``, the share of inf/NaN values (counted and
            excluded from every fit, as the tracer's statistics count them).
        families: the families reported.
        params: ``params[family]``: lognormal ``mu``, ``sigma`` (of ``ln|g|``); normal
            ``scale`` (half-normal on ``|g|``), signed ``loc``, ``std``; laplace ``scale``
            (exponential on ``|g|``), signed ``loc``, ``b``. Signed fits use every finite value
            (zeros included); from statistics alone the signed Laplace fit is absent.
        loglik: mean log-likelihood per magnitude; ``aic``, ``bic``: information criteria.
        ks: KS distance on the magnitudes; ``ks_error``: bound on ``|ks - exact KS|``
            (0 for ``ks_method="exact"``; the proven histogram half-width for ``"hist"``; the
            DKW bound, holding with probability ``ks_confidence``, for ``"subsample"``).
        ks_n: magnitudes KS was computed on.
        ad: Anderson-Darling ``A^2`` of ``ln|g|`` against the fitted normal (``None`` without
            sorted values: ``ks`` other than ``"exact"``, or fits from statistics).
        vuong: ``vuong[(a, b)]``: ``z`` (positive favours ``a``), ``effect`` = ``z/sqrt(n)``,
            two-sided ``p``; empty for fits from statistics (needs cross moments).
        best, runner_up: by log-likelihood; ``separated``: whether Vuong's test separates
            them at level 0.05 (``None`` without a Vuong test).
        ln_skew, ln_exkurt: skewness and excess kurtosis of ``ln|g|`` (0 for a lognormal;
            ``None`` from statistics).
        source: ``"samples"`` (raw values) or ``"stats"`` (streamed sufficient statistics).

    Example:
        >>> import torch, gradstats
        >>> r = gradstats.fit(torch.randn(10_000))
        >>> r.best, r.to_dataframe().shape[0]
        ('normal', 3)
    """

    n: int
    n_nonzero: int
    n_zero: int
    n_nonfinite: int
    families: tuple[str, ...]
    params: dict[str, dict[str, float]]
    loglik: dict[str, float]
    aic: dict[str, float]
    bic: dict[str, float]
    ks: dict[str, float]
    ks_error: dict[str, float]
    ks_method: str
    ks_n: int
    ks_confidence: float
    ad: float | None
    vuong: dict[tuple[str, str], dict[str, float]]
    best: str
    runner_up: str | None
    separated: bool | None
    ln_skew: float | None
    ln_exkurt: float | None
    source: str
    log2_edges: np.ndarray = field(repr=False, compare=False)
    log2_counts: np.ndarray = field(repr=False, compare=False)
    qq_p: np.ndarray | None = field(default=None, repr=False, compare=False)
    qq_ln: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def zero_fraction(self) -> float:
        finite = self.n - self.n_nonfinite
        return self.n_zero / finite if finite else 0.0

    @property
    def nonfinite_fraction(self) -> float:
        return self.n_nonfinite / self.n if self.n else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Scalar results as plain Python types (Vuong pairs keyed ``"a/b"``; the plotting
        arrays are left out)."""
        keys = ("n", "n_nonzero", "n_zero", "n_nonfinite", "ks_method", "ks_n", "ks_confidence", "ad",
                "best", "runner_up", "separated", "ln_skew", "ln_exkurt", "source")
        d: dict[str, Any] = {k: getattr(self, k) for k in keys}
        d["zero_fraction"] = self.zero_fraction
        d["nonfinite_fraction"] = self.nonfinite_fraction
        d["families"] = list(self.families)
        for k in ("params", "loglik", "aic", "bic", "ks", "ks_error"):
            d[k] = {f: (dict(v) if isinstance(v, Mapping) else v) for f, v in getattr(self, k).items()}
        d["vuong"] = {f"{a}/{b}": dict(v) for (a, b), v in self.vuong.items()}
        return d

    def _vuong_vs(self, fam: str) -> Mapping[str, float] | None:
        other = self.runner_up if fam == self.best else self.best
        if other is None:
            return None
        t = self.vuong.get((fam, other))
        if t is not None:
            return t
        t = self.vuong.get((other, fam))
        return None if t is None else {**t, "z": -t["z"], "effect": -t["effect"], "mean": -t["mean"]}

    def rows(self) -> list[dict[str, Any]]:
        """One dict per family (the rows of :meth:`to_dataframe`)."""
        nan = math.nan
        best_ll = self.loglik[self.best]
        out = []
        for f in self.families:
            p = self.params[f]
            t = self._vuong_vs(f)
            out.append({
                "family": f, "model": MAGNITUDE_MODEL[f], "source": self.source,
                "n": self.n, "n_nonzero": self.n_nonzero, "zero_fraction": self.zero_fraction,
                "n_nonfinite": self.n_nonfinite, "nonfinite_fraction": self.nonfinite_fraction,
                "mu": self.params.get("lognormal", {}).get("mu", nan),
                "sigma": self.params.get("lognormal", {}).get("sigma", nan),
                "scale": math.exp(p["mu"]) if f == "lognormal" else p["scale"],
                "loc": p.get("loc", nan), "signed_scale": p.get("std", p.get("b", nan)),
                "loglik": self.loglik[f], "delta_loglik": self.loglik[f] - best_ll,
                "aic": self.aic[f], "bic": self.bic[f],
                "ks": self.ks.get(f, nan), "ks_error": self.ks_error.get(f, nan),
                "ks_method": self.ks_method,
                "vuong_z": nan if t is None else t["z"], "vuong_effect": nan if t is None else t["effect"],
                "vuong_p": nan if t is None else t["p"],
                "best": f == self.best, "separated": self.separated if f == self.best else None,
                "ad": nan if self.ad is None else self.ad,
                "ln_skew": nan if self.ln_skew is None else self.ln_skew,
                "ln_exkurt": nan if self.ln_exkurt is None else self.ln_exkurt,
            })
        return out

    def to_dataframe(self) -> Any:
        """pandas view: one row per family. ``vuong_*`` compare the row's family with the best
        one (the best row: with the runner-up); NaN marks what the source cannot give (see
        the attributes)."""
        import pandas as pd

        return pd.DataFrame(self.rows())

    def summary(self) -> Any:
        """The comparison as a DataFrame, one row per family (:meth:`to_dataframe`); ``str(result)`` is
        the same as a small text table."""
        return self.to_dataframe()

    def text(self) -> str:
        """The comparison as a small text table (``str(result)``)."""
        head = (f"n={self.n:,}  non-zero={self.n_nonzero:,}  zero fraction={self.zero_fraction:.4g}  "
                f"non-finite={self.n_nonfinite:,}  source={self.source}  KS: {self.ks_method}")
        lines = [head, f"{'family':<10} {'magnitude model':<16} {'parameters':<34} {'loglik/n':>10} "
                       f"{'dBIC':>12} {'KS':>10} {'Vuong z vs best':>16}"]
        best_bic = self.bic[self.best]
        for f in self.families:
            p = self.params[f]
            ps = (f"mu={p['mu']:.4g} sigma={p['sigma']:.4g}" if f == "lognormal" else f"scale={p['scale']:.4g}")
            if "loc" in p:
                ps += f" loc={p['loc']:.3g}"
            ks = f"{self.ks[f]:.4g}" if f in self.ks else "-"
            if self.ks_error.get(f):
                ks += f"±{self.ks_error[f]:.2g}"
            t = self._vuong_vs(f) if f != self.best else None
            z = f"{t['z']:.4g}" if t else "-"
            lines.append(f"{f:<10} {MAGNITUDE_MODEL[f]:<16} {ps:<34} {self.loglik[f]:>10.5g} "
                         f"{self.bic[f] - best_bic:>12.5g} {ks:>10} {z:>16}")
        verdict = f"best: {self.best}"
        t = self._vuong_vs(self.best)
        if t is not None:
            verdict += (f" over {self.runner_up}: Vuong z={t['z']:.4g}, effect z/sqrt(n)={t['effect']:.3g}, "
                        f"{'separated' if self.separated else 'NOT separated'} at p<0.05")
        lines.append(verdict)
        if self.ln_skew is not None:
            ad = "" if self.ad is None else f", Anderson-Darling A^2={self.ad:.4g} (n={self.ks_n:,})"
            lines.append(f"ln|g|: skewness={self.ln_skew:.4g}, excess kurtosis={self.ln_exkurt:.4g}{ad}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    def plot(self, **kwargs: Any) -> Any:
        """Histogram of ``log2|g|`` with the fitted densities, and a Q-Q plot of ``ln|g|``
        (see :func:`gradstats.plots.fit.plot_fit`). Returns a matplotlib Figure."""
        from gradstats.plots.fit import plot_fit

        return plot_fit(self, **kwargs)


#: the columns of :meth:`FitResult.rows`, in order
ROW_COLUMNS = ("family", "model", "source", "n", "n_nonzero", "zero_fraction", "n_nonfinite",
               "nonfinite_fraction", "mu", "sigma", "scale", "loc", "signed_scale", "loglik", "delta_loglik",
               "aic", "bic", "ks", "ks_error", "ks_method", "vuong_z", "vuong_effect", "vuong_p", "best",
               "separated", "ad", "ln_skew", "ln_exkurt")


def failed_rows(families: Sequence[str], source: str) -> list[dict[str, Any]]:
    """Rows shaped as :meth:`FitResult.rows` for a group that was not fitted: every number NaN,
    ``best`` False, ``separated`` and ``ks_method`` None (the caller says why, e.g. a ``status``)."""
    out = []
    for f in families:
        row: dict[str, Any] = dict.fromkeys(ROW_COLUMNS, math.nan)
        row.update(family=f, model=MAGNITUDE_MODEL[f], source=source, ks_method=None, best=False, separated=None)
        out.append(row)
    return out


def assemble(fams: Sequence[str], *, source: str, n: int, n_zero: int, n_nonfinite: int, m: int,
             p: Mapping[str, float], signed: Mapping[str, float], vuong_sq: Sequence[float] | None,
             s3: float | None, s4: float | None, ks: dict[str, float], ks_error: dict[str, float],
             ks_method: str, ks_n: int, ad: float | None, ks_confidence: float,
             log2_edges: np.ndarray, log2_counts: np.ndarray,
             qq: tuple[np.ndarray | None, np.ndarray | None]) -> FitResult:
    """Build a FitResult from the MLE parameters ``p`` (mu, sigma, s, b) and the sums."""
    params: dict[str, dict[str, float]] = {}
    for f in fams:
        if f == "lognormal":
            params[f] = {"mu": p["mu"], "sigma": p["sigma"]}
        elif f == "normal":
            params[f] = {"scale": p["s"]}
            if "normal_loc" in signed:
                params[f].update(loc=signed["normal_loc"], std=signed["normal_std"])
        else:
            params[f] = {"scale": p["b"]}
            if "laplace_loc" in signed:
                params[f].update(loc=signed["laplace_loc"], b=signed["laplace_b"])
    full = {"lognormal": {"mu": p["mu"], "sigma": p["sigma"]}, "normal": {"scale": p["s"]},
            "laplace": {"scale": p["b"]}}
    loglik = {f: mean_loglik(f, full[f]) for f in fams}
    ic = {f: information_criteria(f, loglik[f], m) for f in fams}
    tests: dict[tuple[str, str], dict[str, float]] = {}
    if vuong_sq is not None:
        all_ll = {f: mean_loglik(f, full[f]) for f in full}
        for i, (fa, fb) in enumerate(_PAIRS):
            if fa in fams and fb in fams:
                tests[(fa, fb)] = vuong(all_ll[fa] - all_ll[fb], vuong_sq[i] / m, m)
    best, runner, sep = ranking(loglik, tests)
    return FitResult(
        n=n, n_nonzero=m, n_zero=n_zero, n_nonfinite=n_nonfinite, families=tuple(fams), params=params,
        loglik=loglik, aic={f: ic[f][0] for f in fams}, bic={f: ic[f][1] for f in fams},
        ks=ks, ks_error=ks_error, ks_method=ks_method, ks_n=ks_n, ks_confidence=ks_confidence, ad=ad,
        vuong=tests, best=best, runner_up=runner, separated=sep,
        ln_skew=None if s3 is None else s3 / m, ln_exkurt=None if s4 is None else s4 / m - 3.0,
        source=source, log2_edges=log2_edges, log2_counts=log2_counts, qq_p=qq[0], qq_ln=qq[1])
