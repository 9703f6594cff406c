"""Check a plan against a run: each layer's operator predicted and replayed on the run's own samples.

For every planned layer and calibration step, :func:`verify` sets the threshold and scale the way
:func:`gradstats.apply` sets them from that step's statistics (the plan's threshold rule; the scale
rule at ``max(amax, threshold)``, since pruning rounds small values *up* to the threshold), then

- **predicts** what the composed operator does (:func:`gradstats.fpanalysis.composed.predict_composed`,
  from the step's binade histogram and top magnitudes; per-tensor scales), and
- **replays** it: the exact operator (:func:`gradstats.prune_quantize`, the plan's seed) on the
  step's stored samples, counting what it did.

A layer *fails* where the prediction, or the replay beyond its sampling noise (three standard
errors), breaks a bound: more than ``overflow_bound`` of the entries clipped at the
format's maximum, a magnitude gain ``<Q(g), g> / <g, g>`` or bias off 1 (0) by more than
``bias_bound``, or, rounding to nearest, more than ``flush_bound`` of the non-zero values flushed to
zero. :func:`gradstats.recommend` runs this on every layer it plans and takes its next choice where
a layer fails; ``plan.verify(run)`` checks any plan, a hand-edited one too.

What the checks repeat is done once per scope (:mod:`gradstats.plan._shared`, which ``recommend`` and
``verify`` open): the statistics rows and samples are read once, each row's histogram law is made
once, and a threshold, scale, prediction or whole layer check is computed once per content of what it
depends on, however many candidate rules, noise-bound rounds and repairs ask for it again. The
planned layers' samples on the calibration steps are held for the scope (about 1 MB per layer at the
default 65,536 samples and four steps).

Block-scaled rules (MX, NVFP4) are replayed on the samples in the order stored, a uniform random
sample: their blocks hold exchangeable entries, not the tensor's neighbours, so the replay is an
estimate for blocks (rows of different magnitudes make real blocks more uniform); per-tensor rules
are replayed exactly.

Example:
    >>> import tempfile, torch, gradstats
    >>> m = torch.nn.Sequential(torch.nn.Linear(64, 256))
    >>> with gradstats.trace(m, tempfile.mkdtemp(), sample_every=1) as t:
    ...     for _ in range(2):
    ...         m(torch.randn(32, 64)).sin().sum().backward(); t.step()
    >>> bad = gradstats.Plan.uniform(format="e2m3fn", rounding="nearest", sparsity=0.85, scale="amax",
    ...                              scale_shift=1, output_layer=False)
    >>> v = bad.verify(t.path)
    >>> v.ok, bool(v.per_layer().loc[0, "replayed_overflow"] > 0.1)
    (False, True)
"""
from __future__ import annotations

import logging
import math
from typing import Any, Optional, Sequence

import numpy as np
import torch

from gradstats.plan._shared import remember, row_key, rule_key, shared_work
from gradstats.plan.check_table import TABLE_WIDTH, format_checks  # noqa: F401 - the table's home
from gradstats.plan.verification import QUANTITIES, Verification, layer_summary, step_weights  # noqa: F401 - their home
from gradstats.run.select import AUTO_STEPS, calibration_steps  # noqa: F401 - their home is run.select

log = logging.getLogger(__name__)

__all__ = ["verify", "Verification", "OVERFLOW_BOUND", "QUANTITIES", "calibration_steps", "operator_settings"]

#: the largest fraction of a layer's entries a plan may clip at its format's maximum
OVERFLOW_BOUND = 0.001


def operator_settings(rule: Any, row: Any, samples: Optional[torch.Tensor] = None) -> tuple[float, float]:
    """``(threshold, scale)`` that :func:`gradstats.apply` sets for a tensor whose statistics row is
    ``row``: the rule's threshold for its sparsity (0 without pruning; the ``"exact"`` rule from the
    samples where given, else the histogram rule) and its per-tensor scale at ``max(amax, threshold)``
    (1 for block-scaled rules and no format).

    Example:
        >>> import torch
        >>> from gradstats.plan import Rule
        >>> from gradstats.stats import tensor_stats
        >>> operator_settings(Rule(format="e4m3fn", scale="amax"), tensor_stats(torch.tensor([1.0, -3.0])))
        (0.0, 128.0)
    """
    a = 0.0
    if rule.prunes:
        from gradstats.pruning.rules import THRESHOLD_RULES, LayerStats

        entry = THRESHOLD_RULES[rule.threshold_rule]
        if not entry.from_statistics and samples is not None:       # it reads the tensor: the samples
            a = float(entry.threshold(rule.sparsity, LayerStats(tensor=samples.reshape(-1)), stochastic=True))
        else:
            how = rule.threshold_rule if entry.from_statistics else entry.stand_in
            a = remember(("threshold", row_key(row), how, float(rule.sparsity)),
                         lambda: _threshold(row, how, float(rule.sparsity)))
        if not (math.isfinite(a) and a >= 0):
            a = 0.0
    scale = 1.0
    if rule.quantizes and rule.block_size is None:
        scale = remember(("scale", row_key(row), rule_key(rule), a), lambda: _scale(rule, row, a))
    return a, scale


def _threshold(row: Any, how: str, sparsity: float) -> float:
    from gradstats import pruning
    from gradstats.pruning.rules import THRESHOLD_RULES

    src = row
    if THRESHOLD_RULES[how].needs_histogram and int(row["n"]) > 0:   # the row's histogram made once, kept
        from gradstats.pruning.histogram import LogHistogram

        src = remember(("log_histogram", row_key(row)), lambda: LogHistogram.from_stats(row))
    return float(np.asarray(pruning.threshold(np.array([sparsity]), [src], threshold_rule=how))[0])


def _scale(rule: Any, row: Any, a: float) -> float:
    from gradstats.stats import lognormal_moments

    amax = float(row["max_abs"])
    mu, sigma = lognormal_moments(row)
    return rule.scale_for(mu=mu, sigma=max(sigma, 1e-6) if math.isfinite(sigma) else 1e-6, amax=max(amax, a))


def replay(rule: Any, x: torch.Tensor, threshold: float, scale: float, *, seed: int = 0,
           tensor_amax: Optional[float] = None) -> dict[str, float]:
    """The exact operator of ``rule`` at ``threshold`` and ``scale`` on the values ``x``: what it did
    (:data:`QUANTITIES`) and the standard errors of the gain and the bias (``gain_se``, ``bias_se``).

    ``x``: a stored sample as :meth:`gradstats.run.Run.sample_matrix` gives it, whole token groups
    of the channels-last gradient matrix, so that block scales are replayed on exactly the blocks apply
    forms (:mod:`gradstats.ops.layout`; a 1-D sample of an older run is taken in its stored order);
    ``tensor_amax``: the whole tensor's largest magnitude, from which NVFP4's tensor scale is taken."""
    from gradstats.ops.fused import prune_quantize

    x = x.detach().float()
    if x.dim() != 2:
        x = x.reshape(-1)
    s, q = rule.scheme, {}
    if s is not None and s.tensor_scale is not None and tensor_amax is not None:      # NVFP4's two-level scale
        whole = max(float(tensor_amax), threshold)               # pruning rounds small values up to the threshold
        if s.hadamard is None:
            q["tensor_amax"] = whole
        elif x.numel():
            # rotated: the whole rotated tensor's maximum, estimated as the sample's rotated maximum times
            # the ratio of the whole's maximum to the sample's (the rotation spreads each one alike)
            from gradstats.ops.hadamard import rotate

            part = max(float(x.abs().max()), threshold)
            if part > 0:
                q["tensor_amax"] = float(rotate(x, s.hadamard)[0].abs().max()) * whole / part
    out, c = prune_quantize(x, threshold, s, scale=scale, seed=seed, **q)
    n = max(c.n, 1)
    nz = max(int((x != 0).sum()), 1)
    da = (out.abs() - x.abs()).double()
    bias_se = float(torch.sqrt((da * da).sum())) / c.abs_in if c.abs_in > 0 else math.nan
    return {"sparsity": c.zeros / n, "underflow": c.underflow / n, "flushed": c.underflow / nz,
            "overflow": c.saturated / n, "gain": c.gain, "bias": c.bias, "error": c.error,
            "gain_se": c.gain_se, "bias_se": bias_se, "n": c.n, "nonzero": nz}


def predict(rule: Any, row: Any, threshold: float, scale: float) -> dict[str, float]:
    """The composed operator's prediction (:data:`QUANTITIES`) for a tensor of statistics ``row``
    (block-scaled rules: blocks of exchangeable entries, :func:`gradstats.fpanalysis.composed.composed_blocks`)."""
    s = rule.scheme.replace(hadamard=None) if rule.quantizes else None    # the transform is checked on samples
    key = ("predict", row_key(row), s, rule.rounding, float(threshold), float(scale))
    return dict(remember(key, lambda: _predict(row, s, float(threshold), float(scale), rule.rounding)))


def _predict(row: Any, s: Any, threshold: float, scale: float, rounding: str) -> dict[str, float]:
    from gradstats.fpanalysis.composed import predict_composed

    try:
        p = predict_composed(row, s, threshold=threshold, scale=scale, rounding=rounding, law=_law(row))
    except ValueError:
        return {k: math.nan for k in QUANTITIES}
    return {k: getattr(p, k) for k in QUANTITIES}


def _law(row: Any) -> Any:
    """The row's :class:`~gradstats.stats.law.HistogramLaw`, made once per row within a shared scope
    (``"histogram"``, which makes it, where the row has none to make)."""
    from gradstats.stats.law import HistogramLaw

    def make() -> Any:
        try:
            return HistogramLaw.from_stats(row)
        except ValueError:
            return "histogram"
    return remember(("law", row_key(row)), make)


def problems(rule: Any, got: dict[str, float], *, bias_bound: float, flush_bound: Optional[float],
             overflow_bound: float) -> list[str]:
    """What breaks a bound in ``got`` (replayed, or predicted: standard errors 0), beyond three
    standard errors; [] when nothing does."""
    out = []
    n = float(got.get("n", math.inf) or math.inf)
    ov = got["overflow"]
    # per-tensor scales only: a block scale rule clips some blocks' maxima by design (MX's floor rule up
    # to 2**(emax + 1), NVFP4's e4m3 scale rounded down), a small loss the gain and bias bounds judge
    if rule.quantizes and rule.block_size is None and math.isfinite(ov) and \
            ov > overflow_bound + 3 * math.sqrt(overflow_bound / n):
        out.append(f"clips {ov:.2%} of the values at the format's maximum (bound {overflow_bound:g})")
    gse = got.get("gain_se", 0.0) or 0.0
    if math.isfinite(got["gain"]) and abs(got["gain"] - 1) > bias_bound + 3 * (gse if math.isfinite(gse) else 0):
        out.append(f"magnitude gain {got['gain']:.3f} (bound 1 +- {bias_bound:g})")
    bse = got.get("bias_se", 0.0) or 0.0
    # a rotated rule (Hadamard) spreads its unbiased rounding noise over every entry, zeros included, so
    # sum |out| grows with the noise while E[out] = g: its shrinkage is the gain's to judge, not |out|'s
    rotated = getattr(rule, "hadamard", None) is not None
    if not rotated and math.isfinite(got["bias"]) and \
            abs(got["bias"]) > bias_bound + 3 * (bse if math.isfinite(bse) else 0):
        out.append(f"magnitude bias {got['bias']:+.3f} (bound {bias_bound:g})")
    if flush_bound is not None and rule.quantizes and rule.rounding == "nearest":
        nz = float(got.get("nonzero", math.inf) or math.inf)
        fl = got["flushed"]
        if math.isfinite(fl) and fl > flush_bound + 3 * math.sqrt(flush_bound / nz):
            out.append(f"rounding to nearest flushes {fl:.2%} of the non-zero values (bound {flush_bound:g})")
    return out


def check_layer(run: Any, layer: str, rule: Any, steps: Sequence[int], *, rows: dict[int, Any] | None = None,
                kind: str = "grad", seed: int = 0, bias_bound: float, flush_bound: Optional[float],
                overflow_bound: float, samples: dict[int, Any] | None = None) -> list[dict[str, Any]]:
    """The rows of :class:`Verification` for one layer and rule (``samples``: the layer's stored
    samples per step, :func:`layer_samples`, read once when several rules are checked)."""
    if samples is None:
        samples = layer_samples(run, layer, steps, kind)
    rows = rows or {}
    xs = tuple(samples.get(s) for s in steps)
    key = ("check", _run_key(run), layer, rule_key(rule), tuple(int(s) for s in steps), kind, seed, bias_bound,
           flush_bound, overflow_bound, tuple(None if rows.get(s) is None else row_key(rows[s]) for s in steps),
           tuple(id(x) for x in xs))
    got, _ = remember(key, lambda: (_check_layer(layer, rule, steps, rows, samples, seed=seed, bias_bound=bias_bound,
                                                 flush_bound=flush_bound, overflow_bound=overflow_bound), xs))
    return [{**r, "problems": list(r["problems"])} for r in got]


def _run_key(run: Any) -> tuple[str, int]:
    return str(getattr(run, "path", "")), id(run)


def _check_layer(layer: str, rule: Any, steps: Sequence[int], rows: dict[int, Any], samples: dict[int, Any], *,
                 seed: int, bias_bound: float, flush_bound: Optional[float],
                 overflow_bound: float) -> list[dict[str, Any]]:
    out = []
    for step in steps:
        row = rows.get(step)
        if row is None:
            continue
        x = samples.get(step)
        a, s = operator_settings(rule, row, x)
        rep = (replay(rule, x, a, s, seed=seed + step, tensor_amax=_finite(row.get("max_abs")))
               if x is not None and x.numel() else None)
        whole_blocks = rule.quantizes and rule.block_size is not None and rep is not None and x.dim() == 2
        # block scales: the replay on whole blocks of the sample, laid out as apply lays them, is the
        # prediction (exact per block); the exchangeable-block model only where the run has no such sample
        pred = {q: rep[q] for q in QUANTITIES} if whole_blocks else predict(rule, row, a, s)
        source = ("blocks" if whole_blocks else "exchangeable blocks (no sample with its layout)"
                  if rule.quantizes and rule.block_size is not None else "lognormal")
        # the replay (within its sampling noise) and the noise-free prediction must both hold
        probs = ["predicted: " + p for p in problems(rule, {**pred, "n": math.inf}, bias_bound=bias_bound,
                                                     flush_bound=flush_bound, overflow_bound=overflow_bound)]
        if rep is not None:
            probs += ["replayed: " + p for p in problems(rule, rep, bias_bound=bias_bound, flush_bound=flush_bound,
                                                         overflow_bound=overflow_bound)]
        rec = {"layer": layer, "step": int(step), "rule": rule.describe(), "threshold": a, "scale": s,
               "predicted_from": source,
               "samples": 0 if rep is None else int(rep["n"]),
               **{f"predicted_{q}": pred[q] for q in QUANTITIES},
               **{f"replayed_{q}": (rep[q] if rep is not None else math.nan) for q in QUANTITIES},
               "ok": not probs, "problems": probs}
        out.append(rec)
    return out


def _finite(v: Any) -> Optional[float]:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def layer_samples(run: Any, layer: str, steps: Sequence[int], kind: str = "grad") -> dict[int, torch.Tensor]:
    """The stored samples of ``layer``'s first call at each of ``steps`` that has them, with their
    layout (:meth:`gradstats.run.Run.sample_matrix`)."""
    def read() -> dict[int, torch.Tensor]:
        idx = remember(("sample_index", _run_key(run)), run.sample_index)
        if not len(idx):
            return {}
        have = set(idx.loc[(idx["layer"] == layer) & (idx["kind"] == kind) & (idx["call"] == 0), "step"].astype(int))
        return {int(s): run.sample_matrix(layer, int(s), kind=kind, call=0) for s in steps if int(s) in have}

    return dict(remember(("samples", _run_key(run), layer, tuple(int(s) for s in steps), kind), read))


def step_rows(run: Any, layers: Sequence[str], steps: Sequence[int], kind: str = "grad") -> dict[str, dict[int, Any]]:
    """Per layer and step, the statistics row of the layer's first call (rank 0 or the lowest)."""
    key = ("step_rows", _run_key(run), tuple(layers), tuple(int(s) for s in steps), kind)
    got = remember(key, lambda: _step_rows(run, layers, steps, kind))
    return {n: dict(per) for n, per in got.items()}


def _step_rows(run: Any, layers: Sequence[str], steps: Sequence[int], kind: str) -> dict[str, dict[int, Any]]:
    df = run.stats(kinds=[kind])
    df = df[df["layer"].isin(list(layers)) & df["step"].isin(list(steps))]
    if "call" in df.columns:
        df = df[df["call"] == 0]
    if "rank" in df.columns and len(df):
        df = df[df["rank"] == df["rank"].min()]
    out: dict[str, dict[int, Any]] = {n: {} for n in layers}
    for rec in df.to_dict("records"):
        out[rec["layer"]][int(rec["step"])] = rec
    return out


def verify(plan: Any, run: Any, *, steps: Any = "auto", kind: str = "grad", seed: int = 0,
           bias_bound: Optional[float] = None, flush_bound: Optional[float] = None,
           overflow_bound: float = OVERFLOW_BOUND) -> Verification:
    """Check ``plan`` against ``run``: per planned layer and calibration step (``steps``, see
    :func:`calibration_steps`), the composed operator predicted from the step's statistics and
    replayed on its stored samples, against the bounds (the module doc). ``bias_bound`` and
    ``flush_bound`` default to :data:`gradstats.fpanalysis.BIAS_BOUND` and ``FLUSH_BOUND`` (0.01 each).

    Example:
        >>> import tempfile, torch, gradstats
        >>> m = torch.nn.Sequential(torch.nn.Linear(16, 64))
        >>> with gradstats.trace(m, tempfile.mkdtemp(), sample_every=1) as t:
        ...     m(torch.randn(32, 16)).exp().sum().backward(); t.step()
        >>> v = gradstats.Plan.uniform(format="e4m3fn", scale="amax", rounding="stochastic",
        ...                            output_layer=False).verify(t.path)
        >>> v.ok, list(v.per_layer()["layer"])
        (True, ['0'])
    """
    from gradstats.fpanalysis.training import BIAS_BOUND, FLUSH_BOUND
    from gradstats.run import as_run

    r = as_run(run)
    rules = {n: rule for n, rule in plan.resolve(r, strict=False).items() if not rule.is_identity}
    bias_bound = BIAS_BOUND if bias_bound is None else float(bias_bound)
    flush_bound = FLUSH_BOUND if flush_bound is None else flush_bound
    if not rules:
        return Verification([], bias_bound, flush_bound, overflow_bound, [])
    chosen = calibration_steps(r, list(rules), kind=kind, steps=steps)
    per = step_rows(r, list(rules), chosen, kind)
    rows: list[dict[str, Any]] = []
    with shared_work():
        for name, rule in rules.items():
            rows += check_layer(r, name, rule, chosen, rows=per[name], kind=kind, seed=seed, bias_bound=bias_bound,
                                flush_bound=flush_bound, overflow_bound=overflow_bound)
    return Verification(rows, bias_bound, flush_bound, overflow_bound, chosen)


def _alternatives(rule: Any, candidates: Sequence[Any]) -> list[tuple[Any, str]]:
    """The choices tried, in order, when ``rule`` fails its check: the same format without the scale
    shift that saturates, with MX scales rounded up (no block maximum clipped), rounded
    stochastically (unbiased, also below the smallest value; with MX scales rounded up too), at the
    plain amax scale, the other candidate formats of the width that way, then no rounding at all and,
    for a pruned layer, last, neither rounding nor pruning (the gradient as it is: passes)."""
    out: list[tuple[Any, str]] = []
    plain = {"format": None, "block_size": None, "scale_format": None, "scale_rounding": None, "scale": "lognormal",
             "scale_value": None, "scale_shift": 0}
    if rule.quantizes:
        per_tensor = rule.block_size is None
        # MX scales rounded down clip block maxima: rounded up (rceil) alone, and with each later choice
        rceil = {"scale_rounding": "rceil"} if (not per_tensor and rule.scale_format == "e8m0"
                                                and rule.scale_rounding in (None, "floor")) else {}
        up = ", MX scales rounded up (rceil)" if rceil else ""
        if per_tensor and rule.scale == "amax" and rule.scale_shift > 0:
            out.append((rule.replace(scale_shift=0), "scale shift 0"))
        if rceil:
            out.append((rule.replace(**rceil), "MX scales rounded up (rceil: no block maximum clipped)"))
        if rule.rounding != "stochastic":
            out.append((rule.replace(rounding="stochastic"), "stochastic rounding"))
            if rceil:
                out.append((rule.replace(rounding="stochastic", **rceil), "stochastic rounding" + up))
        if per_tensor and (rule.scale != "amax" or rule.scale_shift != 0):
            out.append((rule.replace(rounding="stochastic", scale="amax", scale_value=None, scale_shift=0),
                        "stochastic rounding at the amax scale"))
        for f in candidates:
            if f != rule.format and f.bits == rule.format.bits:
                kw = {"scale": "amax", "scale_value": None, "scale_shift": 0} if per_tensor else rceil
                out.append((rule.replace(format=f, rounding="stochastic", **kw), f"{f} with stochastic rounding{up}"))
        out.append((rule.replace(**plain), "full precision"))
    if rule.prunes:
        out.append((rule.replace(**plain, sparsity=None), "full precision without pruning"))
    return out


def _prediction_fields(per: dict[str, Any]) -> dict[str, Any]:
    """Prediction fields from a per-layer check row: the model's numbers, the replay's where the model
    has none (block scales)."""
    def pick(q: str) -> Optional[float]:
        for side in ("predicted", "replayed"):
            v = per.get(f"{side}_{q}")
            if v is not None and math.isfinite(v):
                return float(v)
        return None

    out = {"sparsity": pick("sparsity"), "error": pick("error"), "bias": pick("bias"),
           "flushed": pick("underflow"), "overflow": pick("overflow"), "gain": pick("gain")}
    if out["sparsity"] is not None:
        out["sparsity"] = min(max(out["sparsity"], 0.0), 1.0)
    return out


def _json_row(per: dict[str, Any], steps: Sequence[int], note: str) -> dict[str, Any]:
    row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in per.items()}
    row["calibration_steps"] = [int(s) for s in steps]
    row["note"] = note
    return row


def repair(plan: Any, run: Any, steps: Sequence[int], *, candidates: Sequence[Any], seed: int = 0,
           bias_bound: float, flush_bound: Optional[float], overflow_bound: float = OVERFLOW_BOUND,
           kind: str = "grad", plan_name: Optional[str] = None) -> Any:
    """``plan`` with every planned layer checked (:func:`check_layer` on ``steps``): a layer that fails
    gets the first of :func:`_alternatives` that passes, with the note of why, and where none does
    the last of them (no rounding and, for a pruned layer, no pruning), never the rule that failed.
    The plan carries the choice exactly: the layer's entry (its last exact one, rewritten, or a new
    one) sets every :class:`~gradstats.plan.Rule` field in which the choice differs from the rule
    planned, so the plan resolves to what the check approved, which ``plan.verify(run)`` on the same
    steps with the same seed passes, and :func:`gradstats.apply` enforces. Its
    :class:`~gradstats.plan.Prediction` takes the composed operator's numbers. The per-layer rows go
    into the plan's ``checks``. Used by :func:`gradstats.recommend`. The layers changed are logged in one
    warning that names the plan (``plan_name``; default from its provenance): per layer what failed, what now."""
    import dataclasses

    from gradstats.plan._rules import RULE_FIELDS, PlanEntry, Prediction
    from gradstats.plan.check_table import plan_label, repair_line, repair_summary

    def differs(a: Any, b: Any) -> dict[str, Any]:
        """The fields of rule ``b`` in which it differs from rule ``a`` (the prediction aside)."""
        return {k: getattr(b, k) for k in RULE_FIELDS if k != "predicted" and getattr(a, k) != getattr(b, k)}

    def whole(fields: dict[str, Any], want: Any) -> dict[str, Any]:
        """``fields``, or with every field of the rule ``want`` where they are no rule on the plan's
        defaults alone, as an entry must be (MX scales rounded up, where a pattern entry sets the blocks)."""
        try:
            plan.defaults.replace(**{k: v for k, v in fields.items() if k != "predicted"})
            return fields
        except ValueError:
            return {**fields, **{k: getattr(want, k) for k in RULE_FIELDS if k != "predicted"}}

    rules = {n: rule for n, rule in plan.resolve(run, strict=False).items() if not rule.is_identity}
    per_rows = step_rows(run, list(rules), steps, kind)
    bounds = {"bias_bound": bias_bound, "flush_bound": flush_bound, "overflow_bound": overflow_bound}
    checks: list[dict[str, Any]] = []
    entries = list(plan.entries)
    last = {e.layer: i for i, e in enumerate(entries) if e.types is None and not e.is_pattern}
    added: dict[str, Any] = {}
    chosen_rules: dict[str, Any] = {}
    said: list[str] = []                # per layer changed: what failed, what was done (one warning)
    for name, rule in rules.items():
        xs = layer_samples(run, name, steps, kind)
        recs = check_layer(run, name, rule, steps, rows=per_rows[name], kind=kind, seed=seed, samples=xs, **bounds)
        note, chosen = "", rule
        if recs and not all(r["ok"] for r in recs):
            first = next(r for r in recs if not r["ok"])
            why = f"{rule.describe()} failed at step {first['step']}: " + "; ".join(first["problems"])
            failed = ""
            for alt, label in _alternatives(rule, candidates):
                alt_recs = check_layer(run, name, alt, steps, rows=per_rows[name], kind=kind, seed=seed,
                                       samples=xs, **bounds)
                bad = next((r for r in alt_recs if not r["ok"]), None)
                if bad is None:
                    recs, chosen = alt_recs, alt
                    note = f"{why} -> {label}" + (f"; {failed}" if alt.is_identity and failed else "")
                    break
                failed = f"{label} failed at step {bad['step']}: " + "; ".join(bad["problems"])
                recs, chosen = alt_recs, alt
            else:
                # not even the last choice passed: the layer is left in the highest precision tried, not
                # as planned, and its check rows say what still fails
                note = f"{why}; no alternative passed: {failed}; left in {chosen.describe()}"
            said.append(repair_line(name, rule, first, chosen, passed=label if bad is None else None))
        if not recs:
            continue
        per = layer_summary(recs)
        checks.append(_json_row(per, steps, note))
        i = last.get(name)
        old = entries[i] if i is not None else None
        base = old.predicted if old is not None and isinstance(old.predicted, Prediction) else Prediction()
        pred = dataclasses.replace(base, **{k: v for k, v in _prediction_fields(per).items() if v is not None})
        # every field in which the choice differs from the rule planned (rounding, scales, block scale
        # rounding, format, blocks, pruning): what the check approved is what the plan carries
        changed = differs(rule, chosen)
        if old is not None:
            entries[i] = dataclasses.replace(old, **whole({**old.overrides, **changed, "predicted": pred}, chosen))
        elif changed:
            added[name] = PlanEntry(name, **whole({**changed, "predicted": pred}, chosen))
        chosen_rules[name] = chosen
    if said:
        log.warning("%s", repair_summary(plan_name or plan_label(plan), said, len(rules), steps))
    out = dataclasses.replace(plan, entries=(*entries, *added.values()), checks=tuple(checks))
    # an entry after the one rewritten that selects module types may set one of the fields again: a last
    # exact entry restates the choice there
    got = out.resolve(run, strict=False)
    fix = [PlanEntry(n, **whole(differs(got[n], want), want)) for n, want in chosen_rules.items()
           if n in got and differs(got[n], want)]
    return out.with_entries(*fix) if fix else out
