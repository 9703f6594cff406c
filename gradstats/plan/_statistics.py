"""The per-layer statistics a recommendation is made from, the first stage of
:func:`gradstats.recommend` (:func:`gather`): which layers of a run (:func:`_select_layers`; from the
same layer table, the output layer left out and where the plan may prune), which steps
(:func:`_steps_filter`, and the calibration steps the checks replay), their merged statistics and
lognormal moments (:func:`_moments`; :func:`layer_moments` is the public view, exported by
:mod:`gradstats.plan.recommend`), and the pruning thresholds those moments give (:func:`_thresholds`)."""
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

    @property
    def numel(self) -> np.ndarray:
        """Per layer, the elements of one captured tensor: the size the format predictions are
        conditioned on, with ``amax``."""
        return np.array([r["numel"] for r in self.rows], dtype=np.float64)


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


def _select_layers(run, layers: str | Sequence[str] | None, info: Any = None) -> list[str]:
    """The names of the traced layers ``layers`` selects (None: every matmul layer), in the run's
    order; ``info``: the run's layer table where it was read already."""
    if info is None:
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


def _moments(run, *, steps: Steps, layers, kind: str, skip_empty: bool = True, info: Any = None) -> _Moments:
    names = _select_layers(run, layers, info)
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


@dataclass(frozen=True)
class _Gathered:
    """What a recommendation is made from (:func:`gather`): the planned layers' moments, the output
    layer left out (None: none), the steps merged (those ``"auto"`` chose, else as given), the steps
    the checks replay, and per layer the pruning threshold at the requested sparsity and the sparsity
    it is predicted to reach (both NaN without sparsity and where the plan does not prune)."""

    mom: _Moments
    output_layer: str | None
    steps: Steps
    check_steps: list[int]
    threshold: np.ndarray
    sparsity: np.ndarray


def gather(run, *, layers: str | Sequence[str] | None, output_layer: str | bool | None, prune_at: str | None,
           steps: Steps, sparsity: float | None, threshold_rule: str) -> _Gathered:
    """The statistics of ``run`` a recommendation is made from, its layer table read once: the layers
    planned (``layers`` names or globs; None: every matmul layer but the output layer, which
    ``output_layer`` names, finds (None, ``"auto"``, True) or keeps planned (False)), the steps merged
    (``"auto"``: the calibration steps, :func:`gradstats.run.select.calibration_steps`), the layers'
    moments, and the thresholds of ``threshold_rule`` at ``sparsity`` where ``prune_at``
    (:attr:`gradstats.Plan.prune_at`, resolved) lets the plan prune.

    Example:
        >>> import tempfile, torch, gradstats
        >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        >>> with gradstats.trace(m, tempfile.mkdtemp()) as t:
        ...     for _ in range(2):
        ...         m(torch.randn(16, 8)).square().sum().backward(); t.step()
        >>> g = gather(gradstats.open_run(t.path), layers=None, output_layer=None, prune_at="auto", steps="latest",
        ...            sparsity=0.5, threshold_rule="histogram")
        >>> g.mom.layers, g.output_layer, g.check_steps, bool(g.threshold[0] > 0), float(g.sparsity[0])
        (['0'], '2', [1], True, 0.5)
    """
    from gradstats.layers import output_layer as find_output
    from gradstats.plan._plan import pruned_layers
    from gradstats.plan.checks import calibration_steps  # the steps the checks calibrate on and replay

    info = run.layer_info()
    skip = None
    if layers is None and output_layer is not False:
        skip = find_output(info) if output_layer in (None, "auto", True) else str(output_layer)
        names = [n for n in _select_layers(run, None, info) if n != skip]
        if not names:
            raise ValueError(f"the run at {run.path} traced no convolution or linear layer but its output "
                             f"layer {skip!r}; pass output_layer=False to plan it")
    else:
        names = _select_layers(run, layers, info)
    chosen = None
    if isinstance(steps, str) and steps == "auto":
        steps = chosen = calibration_steps(run, names, steps="auto")
    mom = _moments(run, steps=steps, layers=names, kind="grad", info=info)
    where = pruned_layers(prune_at, info) if sparsity is not None else None
    thr, pred = _thresholds(mom, sparsity, threshold_rule, where)
    check_steps = chosen or calibration_steps(run, mom.layers, steps=steps)
    return _Gathered(mom, skip, steps, check_steps, thr, pred)


def _thresholds(mom: _Moments, sparsity: float | None, rule: str,
                where: Sequence[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per layer: the threshold of ``rule`` at ``sparsity`` (NaN for 'exact') and the sparsity it is
    predicted to reach: the target for the model-free rules ('exact', 'histogram'), under the
    lognormal model for the others. Both NaN without sparsity, and at the layers that ``where`` (the
    layers the plan prunes; None: all) leaves out: no threshold, no prediction."""
    n = len(mom.layers)
    if sparsity is None:
        return np.full(n, np.nan), np.full(n, np.nan)
    from gradstats import pruning
    from gradstats.pruning.rules import THRESHOLD_RULES

    entry = THRESHOLD_RULES[rule]
    if not entry.from_statistics:     # set on each tensor when the plan runs ('exact'): no threshold yet
        thr = np.full(n, np.nan)
    else:
        thr = np.asarray(pruning.threshold(np.full(n, float(sparsity)), mom.rows, threshold_rule=rule),
                         dtype=np.float64)
    if entry.model_free:              # it aims at the target on the data itself
        pred = np.maximum(float(sparsity), mom.p0)
    else:
        pred = np.asarray(pruning.expected_sparsity(thr, mu=mom.mu, sigma=mom.sigma, p0=mom.p0), dtype=np.float64)
    if where is not None:
        off = np.array([name not in set(where) for name in mom.layers])
        thr, pred = np.where(off, np.nan, thr), np.where(off, np.nan, pred)
    return thr, pred
