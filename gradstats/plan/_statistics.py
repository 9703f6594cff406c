"""The per-layer statistics a recommendation is made from: which layers of a run
(:func:`_select_layers`), which steps (:func:`_steps_filter`), and their merged statistics and
lognormal moments (:func:`_moments`; :func:`layer_moments` is the public view, exported by
:mod:`gradstats.plan.recommend`)."""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Sequence, Union

import numpy as np

from gradstats.run import as_run
from gradstats.stats import lognormal_moments, merge_stats

log = logging.getLogger("gradstats.plan.recommend")

#: ``steps=``: 'latest' (or None), an int, a range or slice, or a list of steps
Steps = Union[None, str, int, range, slice, Sequence[int]]


@dataclass(frozen=True)
class _Moments:
    layers: list[str]
    mu: np.ndarray
    sigma: np.ndarray
    p0: np.ndarray
    amax: np.ndarray        # the maximum of one captured tensor (median over the captures)
    rows: list[dict[str, Any]]
    steps: tuple[int, int]


def _steps_filter(df, steps: Steps):
    """Rows of the statistics frame used for ``steps`` (:mod:`gradstats.run.select`'s grammar, and
    ``"latest"``: each layer's latest step) and a description of the choice."""
    from gradstats.run.select import select_steps

    if steps is None or (isinstance(steps, str) and steps == "latest"):
        last = df.groupby("layer")["step"].transform("max")
        return df[df["step"] == last], "the latest step of each layer"
    if isinstance(steps, str) or isinstance(steps, bool):
        raise ValueError(f"steps must be 'latest' (each layer's latest step), an int, a range or slice, or a "
                         f"list of steps; got {steps!r}")
    chosen = select_steps(sorted(int(v) for v in df["step"].unique()), steps)
    what = f"step {chosen[0]}" if len(chosen) == 1 else f"steps {chosen[0]}..{chosen[-1]} ({len(chosen)})"
    return df[df["step"].isin(chosen)], what


def _select_layers(run, layers: str | Sequence[str] | None) -> list[str]:
    info = run.layer_info()
    names = [str(n) for n in info["name"]] if len(info) else []
    if layers is None:
        from gradstats.layers import matmul_layers

        chosen = matmul_layers(info)
        if not chosen:
            raise ValueError(f"the run at {run.path} traced no matmul layer (convolution, linear, Conv1D, "
                             f"attention; its layers: {names}); pass layers= (names or globs) to choose among "
                             "them, or gradstats.layers.register_matmul_type() for a custom type")
        return chosen
    from gradstats.run.select import layer_matcher

    pats = [layers] if isinstance(layers, (str, re.Pattern)) else list(layers)
    if not pats or not all(isinstance(p, (str, re.Pattern)) for p in pats):
        raise ValueError(f"layers must be None, a glob, 're:PATTERN', a compiled regex, or a non-empty list of "
                         f"them, got {layers!r}")
    chosen: set[str] = set()
    for p in pats:                      # each pattern must match: a typo is an error, not a silent no-op
        match = layer_matcher(p)
        hit = [n for n in names if match(n)]
        if not hit:
            raise ValueError(f"layers: {getattr(p, 'pattern', p)!r} matches no traced layer of the run "
                             f"(its layers: {names})")
        chosen.update(hit)
    return [n for n in names if n in chosen]


def layer_moments(run: Any, *, steps: Steps = "latest", layers: str | Sequence[str] | None = None,
                  kind: str = "grad") -> "Any":
    """Per-layer ``mu``, ``sigma`` (of ``ln|g|``), ``p0`` and the merged statistics a
    recommendation is made from, as a DataFrame (one row per layer, calls and ranks merged):
    ``amax`` is the largest ``|g|`` of all the captures merged, ``numel`` and
    ``amax_per_capture`` the size and (median) maximum of one captured tensor, which the format
    predictions are conditioned on.

    ``steps``: ``"latest"`` (each layer's latest captured step), an int, a ``range`` or ``slice``,
    or a list of steps, merged (:mod:`gradstats.run.select`). ``layers``: ``None`` for every traced
    convolution and linear layer, or names/globs.

    Example:
        >>> import tempfile, torch, gradstats
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4))
        >>> with gradstats.trace(m, tempfile.mkdtemp()) as t:
        ...     for _ in range(2):
        ...         m(torch.randn(8, 4)).square().sum().backward(); t.step()
        >>> df = layer_moments(t.path, steps=range(2))
        >>> list(df.columns[:5]), int(df["n"][0])
        (['layer', 'mu', 'sigma', 'p0', 'amax'], 64)
    """
    import pandas as pd

    mom = _moments(as_run(run), steps=steps, layers=layers, kind=kind, skip_empty=False)
    rows = []
    for name, mu, sigma, p0, row in zip(mom.layers, mom.mu, mom.sigma, mom.p0, mom.rows):
        rows.append({"layer": name, "mu": mu, "sigma": sigma, "p0": p0, "amax": row["max_abs"],
                     "first_step": row["first_step"],
                     "last_step": row["last_step"], **{k: v for k, v in row.items() if k not in
                                                        ("first_step", "last_step")}})
    return pd.DataFrame(rows)


def _moments(run, *, steps: Steps, layers, kind: str, skip_empty: bool = True) -> _Moments:
    names = _select_layers(run, layers)
    df = run.stats(kinds=[kind])
    if len(df) == 0:
        raise ValueError(f"the run at {run.path} has no {kind!r} statistics yet (no committed steps)")
    df = df[df["layer"].isin(names)]
    sel, what = _steps_filter(df, steps)
    groups: dict[str, list[dict[str, Any]]] = {}
    for rec in sel.to_dict("records"):  # one conversion: per-group conversions dominate otherwise
        groups.setdefault(rec["layer"], []).append(rec)
    missing = [n for n in names if n not in groups]
    if missing:
        have = sorted(df[df["layer"] == missing[0]]["step"].unique().tolist())
        raise ValueError(f"no {kind!r} statistics at {what} for layers {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}; layer {missing[0]!r} has steps "
                         f"{have[:10]}{' ...' if len(have) > 10 else ''}")
    out_layers, mus, sigmas, p0s, amaxs, rows, empty = [], [], [], [], [], [], []
    nonfinite: dict[str, list[int]] = {}       # layers left out whose gradients were NaN/inf: at which steps
    lo, hi = math.inf, -math.inf
    for n in names:
        g = groups[n]
        m = merge_stats(g)
        s0, s1 = min(int(r["step"]) for r in g), max(int(r["step"]) for r in g)
        m["first_step"], m["last_step"] = s0, s1
        m["numel"] = m["n"] / len(g)                     # elements of one captured tensor
        # and its maximum: apply conditions on each tensor's own amax, so the predictions take a
        # typical capture's maximum with that tensor's size (not the maximum over all captures,
        # which is the extreme of len(g) tensors)
        m["amax_per_capture"] = float(np.nanmedian([float(r["max_abs"]) for r in g]))
        mu, sigma = lognormal_moments(m)
        if skip_empty and not (math.isfinite(mu) and math.isfinite(sigma) and sigma > 0):
            bad = sorted({int(r["step"]) for r in g if r.get("n_nonfinite", 0) > 0})
            if bad:
                nonfinite[n] = bad
            else:
                empty.append(n)
            continue
        lo, hi = min(lo, s0), max(hi, s1)
        out_layers.append(n)
        mus.append(mu)
        sigmas.append(sigma)
        p0s.append(m["n_zero"] / m["n"] if m["n"] else math.nan)
        amaxs.append(m["amax_per_capture"])
        rows.append(m)
    if empty:
        log.warning("no recommendation for layers %s: their gradients have no spread at %s (all zero, "
                    "or one magnitude), so there is nothing to fit", empty, what)
    if nonfinite:
        said = "; ".join(f"{n} at steps {b[:6]}{' ...' if len(b) > 6 else ''}" for n, b in nonfinite.items())
        log.warning("no recommendation for layers %s: their gradients were NaN/inf (%s; a diverged loss?), so "
                    "there is nothing to fit; choose steps before the divergence with steps=", list(nonfinite), said)
    if not out_layers:
        if nonfinite:
            raise ValueError(f"no layer of the run at {run.path} has finite gradients with a spread at {what}: the "
                             f"gradients were NaN/inf ({said}); pass steps= before the loss diverged")
        raise ValueError(f"no layer of the run at {run.path} has non-zero gradients with a spread at {what}")
    return _Moments(out_layers, np.array(mus), np.array(sigmas), np.array(p0s), np.array(amaxs), rows,
                    (int(lo), int(hi)) if out_layers else (0, 0))
