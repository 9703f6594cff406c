"""The analysis of a run: what ``gradstats report RUN -o DIR`` and ``make demo`` compute before
they write (:mod:`gradstats.report`, whose docstring says what is analysed;
:mod:`gradstats.report.write` writes it).

Example:
    >>> import gradstats
    >>> from gradstats.report import analyse
    >>> a = analyse(gradstats.zoo.data.data_dir() / "sample-run", bits=[8], sparsities=[0.9])
    >>> a.plan().entries[0].layer, list(a.summary().columns[:2])
    ('conv1', ['layer', 'std log2|g|'])
"""
from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from gradstats.pruning.allocation import output_layer
from gradstats.report.write import Report, pct_label, write_report
from gradstats.run import as_run
from gradstats.study import plan_errors

log = logging.getLogger(__name__)

__all__ = ["analyse", "report", "Analysis", "SPARSITIES", "BITS"]

#: target sparsities of the report (the study's headline 85%, and 90%)
SPARSITIES = (0.85, 0.9)
#: bit widths of the recommended formats
BITS = (8, 6, 4)
_LN2 = math.log(2.0)


# ----------------------------------------------------------------------------- analysis
@dataclass
class Analysis:
    """The analysis of one run (see :func:`analyse`).

    Attributes:
        run: the :class:`gradstats.Run`.
        table: one row per traced layer: type, zero fraction, mean and std of ``log2|g|`` (at the
            step the plans were made from), the fit verdict over the fitted steps (winner, wins,
            median KS per family, median Vuong effect size of the winner), the threshold per target
            sparsity, and per bit width the recommended format, its log2 scale and predicted error.
        fits: the rows of :func:`gradstats.fit_run` (one per layer, step and family).
        verdicts: per-layer summary of ``fits`` (:func:`gradstats.fitting.layer_verdicts`).
        plans: ``plans[sparsity][bits]``: the :class:`~gradstats.plan.Plan` of :func:`gradstats.recommend`.
        errors: predicted against measured quantisation error per layer, bit width and sampled step
            (empty for a run without raw samples).
        sparsities, bits: the targets and widths analysed.
        fit_steps: the steps fitted; plan_step: the statistics step the plans were made from.
        context: ``{label: text}`` lines shown at the top of the report.
        skipped: ``{layer: reason}`` of the selected layers left out of the analysis (no
            neural-gradient statistics in the run).
        failures: the groups that could not be fitted (:func:`gradstats.fitting.failed_groups`:
            layer, kind, source, status, steps, n_steps); empty when every group was fitted.
    """

    run: Any
    table: pd.DataFrame
    fits: pd.DataFrame
    verdicts: pd.DataFrame
    plans: dict[float, dict[int, Any]]
    errors: pd.DataFrame
    sparsities: tuple[float, ...]
    bits: tuple[int, ...]
    fit_steps: list[int]
    plan_step: int
    context: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    failures: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(
        columns=["layer", "kind", "source", "status", "steps", "n_steps"]))

    def plan(self, bits: int | None = None, sparsity: float | None = None) -> Any:
        """The plan of one width and target (default: the first of each, FP8 at 85%)."""
        s = self.sparsities[0] if sparsity is None else sparsity
        b = self.bits[0] if bits is None else bits
        if s not in self.plans or b not in self.plans[s]:
            why = "" if any(self.plans.values()) else (" (no layer was planned: none of the analysed layers is a "
                                                       "convolution or linear layer with statistics)")
            raise ValueError(f"no plan for bits={b}, sparsity={s}; analysed bits {list(self.bits)} and "
                             f"sparsities {list(self.sparsities)}{why}")
        return self.plans[s][b]

    def to_dataframe(self) -> pd.DataFrame:
        """The per-layer table (a copy)."""
        return self.table.copy()

    def to_dict(self) -> dict[str, Any]:
        """Plain data: the run, the settings, the per-layer table, the plans, the skipped layers
        and the groups that were not fitted."""
        return {"run": str(self.run.path), "sparsities": list(self.sparsities), "bits": list(self.bits),
                "fit_steps": list(self.fit_steps), "plan_step": self.plan_step, "context": dict(self.context),
                "layers": _records(self.table),
                "plans": {pct_label(s): {str(b): p.to_dict() for b, p in ps.items()} for s, ps in self.plans.items()},
                "skipped": dict(self.skipped), "failures": _records(self.failures)}

    def summary(self) -> pd.DataFrame:
        """The per-layer summary (the columns ``gradstats report`` prints) as a DataFrame of text cells;
        ``str(analysis)`` is the same as a text table with its notes (what ``gradstats report`` and the
        demo print)."""
        head, rows = _summary_rows(self)
        return pd.DataFrame(rows, columns=head)

    def text(self) -> str:
        """The per-layer summary as a text table, with the notes on what was not analysed."""
        return _text_table(self)

    def __str__(self) -> str:
        return self.text()

    def write(self, out_dir: str | os.PathLike[str], *, figures: bool = True, progress: bool = False) -> "Report":
        """Write the plans, tables, figures and ``report.md`` into ``out_dir``; see :func:`report`."""
        return write_report(self, Path(out_dir), figures=figures, progress=progress)


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    out = []
    for rec in df.to_dict("records"):
        out.append({k: (None if isinstance(v, float) and not math.isfinite(v) else
                        v.item() if isinstance(v, np.generic) else
                        [x.item() if isinstance(x, np.generic) else x for x in v]
                        if isinstance(v, (list, tuple, np.ndarray)) else v) for k, v in rec.items()})
    return out


def _fit_steps(run: Any) -> tuple[list[int], bool]:
    from gradstats.study import sampled_steps

    have = sampled_steps(run, "grad")
    if have:
        return have, True
    steps = sorted(int(s) for s in run.steps)
    if not steps:
        raise ValueError(f"the run at {run.path} has no committed steps yet")
    return steps, False


def _plan_step(run: Any, sampled: list[int], has_samples: bool, layers: Sequence[str],
               damaged: set[int]) -> int:
    """The step the plans are made from: the latest step with intact raw samples (so predicted
    and measured errors refer to the same gradients), else the latest step; statistics of the
    analysed ``layers`` only."""
    st = run.stats(kinds=["grad"])
    if len(st):
        st = st[st["layer"].isin(list(layers))]
    have = set(int(s) for s in st["step"].unique()) if len(st) else set()
    if has_samples:
        both = [s for s in sampled if s in have and s not in damaged]
        if both:
            return both[-1]
    if not have:
        raise ValueError(f"the run at {run.path} has no neural-gradient statistics")
    return max(have)


def _no_statistics(run: Any, names: Sequence[str]) -> dict[str, str]:
    """``{layer: reason}`` of the layers of ``names`` without neural-gradient statistics."""
    st = run.stats(kinds=["grad"])
    have = set(st["layer"].unique()) if len(st) else set()
    return {n: ("no 'grad' statistics in the run: the module was never called as a module (its weights "
                "used functionally, e.g. the out_proj of nn.MultiheadAttention) or its output needed no "
                "gradient") for n in names if n not in have}


def analyse(run: Any, *, sparsities: Iterable[float] = SPARSITIES, bits: Iterable[int] = BITS,
            progress: bool = False, context: Mapping[str, str] | None = None,
            layers: str | re.Pattern | Sequence[str] | None = None) -> Analysis:
    """Fit every layer of a run, derive thresholds and recommended formats, check the predictions.

    Args:
        run: a :class:`gradstats.Run` or the path of a run directory.
        sparsities: target sparsities (fractions of zeros in ``[0, 1)``); one plan per target and width.
        bits: bit widths of the recommended formats.
        progress: progress bars.
        context: ``{label: text}`` lines shown at the top of the report (e.g. the data used).
        layers: which traced layers: None (all), or the tracer's patterns (:func:`gradstats.trace`'s
            ``layers=``): a name or glob, ``"re:PATTERN"`` (a regex matched in full), a compiled
            regex, or a list of those.

    The fits use the steps with raw samples (exact KS and Vuong's test), or every step's streamed
    statistics for a run without samples. The plans are made from the statistics of the latest
    sampled step whose samples are intact (else the latest step), so that the predicted error can
    be measured on the same gradients. Only convolution and linear layers are planned (the
    study's choice).

    Nothing a model's layers can do is fatal: selected layers without neural-gradient statistics
    are skipped (``Analysis.skipped``, logged, noted in the text); groups that cannot be fitted
    (identically zero gradients, damaged sample files) are rows with NaN numbers and a ``status``
    (``Analysis.failures``; ``fit_status``, ``failed_steps`` and ``fit_error`` in the table).
    Raises ValueError for bad arguments, a pattern that matches no layer, or a run without any
    neural-gradient statistics.

    Example:
        >>> import gradstats
        >>> a = analyse(gradstats.zoo.data.data_dir() / "sample-run", sparsities=[0.9], bits=[8])
        >>> list(a.plans), list(a.plans[0.9]), a.plan_step
        ([0.9], [8], 196)
    """
    from gradstats._progress import progress_bar
    from gradstats.fitting import failed_groups, fit_run, layer_verdicts
    from gradstats.layers import matmul_layers
    from gradstats.plan.recommend import recommend_each
    from gradstats.run.select import select_layers

    run = as_run(run)
    sps = tuple(float(s) for s in sparsities)
    bts = tuple(int(b) for b in bits)
    if not sps or not bts:
        raise ValueError("analyse needs at least one target sparsity and one bit width")
    for s in sps:
        if not 0.0 <= s < 1.0:
            raise ValueError(f"target sparsities must lie in [0, 1), got {s}")
    selected = select_layers(list(run.layers), layers)
    skipped = _no_statistics(run, selected)
    for name, why in skipped.items():
        log.warning("layer %s is left out of the report: %s", name, why)
    names = [n for n in selected if n not in skipped]
    if not names:
        raise ValueError(f"none of the selected layers {selected} has neural-gradient ('grad') statistics in "
                         f"the run at {run.path}; the layers that have them: "
                         f"{[n for n in run.layers if n not in _no_statistics(run, run.layers)]}")
    bar = progress_bar(total=4, desc="analyse", unit="stage", progress=progress, logger=log,
                       note=f"analysing {len(names)} layer(s) of the run at {run.path}: fits, plans, errors")
    fit_steps, has_samples = _fit_steps(run)
    bar.stage(f"fitting {len(names)} layer(s) at {len(fit_steps)} step(s)"
              f"{' (raw samples)' if has_samples else ' (statistics)'}")
    fits = fit_run(run, layers=names, steps=fit_steps, kinds=("grad",), use_samples=has_samples,
                   progress=progress)
    verdicts = layer_verdicts(fits)
    failures = failed_groups(fits)
    damaged = {int(step) for r in failures.to_dict("records") if str(r["status"]).startswith("damaged")
               for step in r["steps"]}
    bar.update()
    bar.stage(f"planning sparsity {', '.join(f'{x:g}' for x in sps)} at {', '.join(map(str, bts))} bits")
    plan_step = _plan_step(run, fit_steps, has_samples, names, damaged)
    st = run.stats(kinds=["grad"])
    at_step = set(st[st["step"] == plan_step]["layer"]) if len(st) else set()
    matmul = set(matmul_layers(run))
    logits = output_layer(run)          # left in full precision and unpruned, as recommend does
    planned = [n for n in names if n in matmul and n in at_step and n != logits]
    if planned:
        # each width's own choice on every layer (the whole-plan noise bound would widen some: a
        # 4-bit column of 8-bit formats), as the format figures draw them
        plans = {s: recommend_each(run, bits=list(bts), sparsity=s, steps=plan_step, layers=planned, noise_bound=None)
                 for s in sps}
    else:
        log.warning("no plans: none of the analysed layers %s is a convolution or linear layer with statistics "
                    "at step %d", names, plan_step)
        plans = {s: {} for s in sps}
    bar.update()
    bar.stage("measuring the plans' errors")
    measure = has_samples and plan_step not in damaged  # the samples of the plans' own step
    errors = plan_errors(run, plans[sps[0]] if measure else {}, plan_step)
    bar.update()
    table = _layer_table(run, names, verdicts, plans, plan_step, sps, bts, at_step)
    bar.update()
    bar.close()
    return Analysis(run=run, table=table, fits=fits, verdicts=verdicts, plans=plans, errors=errors,
                    sparsities=sps, bits=bts, fit_steps=fit_steps, plan_step=plan_step,
                    context=dict(context or {}), skipped=skipped, failures=failures)


def _layer_table(run: Any, names: Sequence[str], verdicts: pd.DataFrame, plans: Mapping[float, Mapping[int, Any]],
                 plan_step: int, sps: Sequence[float], bts: Sequence[int], at_step: set[str]) -> pd.DataFrame:
    from gradstats.plan.recommend import layer_moments

    info = run.layer_info()
    types = dict(zip(info["name"], info["type"])) if len(info) else {}
    with_stats = [n for n in names if n in at_step]
    mom = layer_moments(run, steps=plan_step, layers=with_stats) if with_stats else pd.DataFrame()
    mom = {r["layer"]: r for r in mom.to_dict("records")}
    ver = {r["layer"]: r for r in verdicts.to_dict("records")} if len(verdicts) else {}
    entries = {(s, b): {e.layer: e for e in ps[b].entries} if b in ps else {} for s, ps in plans.items() for b in bts}
    rows = []
    for name in names:
        m, v = mom.get(name, {}), ver.get(name, {})
        mu, sigma = m.get("mu", math.nan), m.get("sigma", math.nan)
        row: dict[str, Any] = {
            "layer": name, "type": types.get(name), "zero_fraction": m.get("p0", math.nan),
            "mean_log2": mu / _LN2 if mu is not None else math.nan,
            "std_log2": sigma / _LN2 if sigma is not None else math.nan,
            "verdict": v.get("winner"), "fitted_steps": v.get("groups", 0),
            "wins_lognormal": v.get("wins_lognormal", 0),
            "ks_lognormal": v.get("ks_lognormal", math.nan), "ks_normal": v.get("ks_normal", math.nan),
            "ks_laplace": v.get("ks_laplace", math.nan), "vuong_effect": v.get("vuong_effect", math.nan),
            "planned": any(name in entries[(s, b)] for s in sps for b in bts)}
        for s in sps:
            e = entries[(s, bts[0])].get(name)
            row[f"threshold_{pct_label(s)}"] = e.predicted.threshold if e is not None else math.nan
            row[f"predicted_sparsity_{pct_label(s)}"] = e.predicted.sparsity if e is not None else math.nan
        for b in bts:
            e = entries[(sps[0], b)].get(name)
            row[f"fp{b}"] = str(e.format) if e is not None else None
            row[f"fp{b}_log2_scale"] = math.log2(e.predicted.scale) if e is not None and e.predicted.scale else math.nan
            row[f"fp{b}_error"] = e.predicted.error if e is not None else math.nan
        n_ok, n_bad = int(v.get("groups", 0)), int(v.get("failed", 0))
        row["fit_status"] = "ok" if n_ok and not n_bad else "partial" if n_ok else "failed" if n_bad else "none"
        row["failed_steps"] = n_bad
        fail = v.get("failure")
        row["fit_error"] = fail if isinstance(fail, str) else None
        rows.append(row)
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- text views
def _fmt_thr(t: float, p0: float, s: float) -> str:
    if not math.isfinite(t):
        return "-"
    if t == 0.0:
        return f"0 (zeros {p0:.0%})" if p0 >= s else "0"
    return f"{t:.2e}"


def _summary_rows(a: Analysis) -> tuple[list[str], list[list[str]]]:
    head = ["layer", "std log2|g|", "zeros", "best fit", "KS lognormal"]
    head += [f"thr {pct_label(s)}%" for s in a.sparsities]
    head += [f"FP{b}" for b in a.bits]
    rows = []
    num = lambda v, f: f"{v:{f}}" if isinstance(v, (int, float)) and math.isfinite(v) else "-"  # noqa: E731
    for r in a.table.to_dict("records"):
        verdict = "-"
        if isinstance(r["verdict"], str):
            n, wins = int(r["fitted_steps"]), int(r["wins_lognormal"])
            verdict = f"lognormal {wins}/{n}" if r["verdict"] == "lognormal" else \
                f"{r['verdict']} (lognormal {wins}/{n})"
        bad = int(r.get("failed_steps", 0) or 0)
        if bad:
            verdict = "failed" if verdict == "-" else f"{verdict}, {bad} failed"
        row = [r["layer"], num(r["std_log2"], ".2f"), num(r["zero_fraction"], ".0%"), verdict,
               num(r["ks_lognormal"], ".3f")]
        row += [_fmt_thr(r[f"threshold_{pct_label(s)}"], r["zero_fraction"], s) for s in a.sparsities]
        for b in a.bits:
            f = r[f"fp{b}"]
            row.append("-" if not isinstance(f, str) else f"{f} 2^{int(r[f'fp{b}_log2_scale'])}"
                       if math.isfinite(r[f"fp{b}_log2_scale"]) else f)
        rows.append(row)
    return head, rows


def _text_table(a: Analysis) -> str:
    head, rows = _summary_rows(a)
    w = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(cells))  # noqa: E731
    out = [line(head), line(["-" * x for x in w])] + [line(r) for r in rows]
    nl = int((a.table["verdict"] == "lognormal").sum())
    out.append(f"lognormal is the best fit of {nl} of {len(a.table)} layers (majority over {len(a.fit_steps)} "
               f"fitted step(s)); std log2|g| and the plans from step {a.plan_step}; thresholds: stochastic "
               f"pruning, histogram rule (model-free, from each layer's binade histogram); formats: best ExMy (saturating, OCP 'fn') at its power-of-two scale "
               f"2^k (gradients are multiplied by 2^k before the cast); '-': layer not planned (the plans "
               f"cover convolution and linear layers)")
    out += _notes(a)
    return "\n".join(out)


def _notes(a: Analysis) -> list[str]:
    """Text lines on what was not analysed: skipped layers, groups not fitted, missing plans."""
    from gradstats.fitting import failure_lines

    out = []
    if len(a.failures):
        n = int(a.failures["n_steps"].sum())
        out.append(f"not fitted: {n} (layer, step) group(s); their rows in the fits have NaN numbers and a "
                   f"status saying why:")
        out += failure_lines(a.failures, kind=False, source=False)
    if a.skipped:
        out.append(f"skipped layers ({len(a.skipped)}), not in the table:")
        out += [f"  {name}: {why}" for name, why in a.skipped.items()]
    if not any(a.plans.values()):
        out.append("no plans: none of the analysed layers is a convolution or linear layer with statistics at "
                   f"step {a.plan_step}")
    return out


def report(run: Any, out_dir: str | os.PathLike[str], *, sparsities: Iterable[float] = SPARSITIES,
           bits: Iterable[int] = BITS, figures: bool = True, progress: bool = False,
           context: Mapping[str, str] | None = None,
           layers: str | re.Pattern | Sequence[str] | None = None) -> Report:
    """Analyse a run (:func:`analyse`) and write the report into ``out_dir``:

    - ``plan.json``: the plan of the first width and target (FP8 at 85% by default), ready for
      :func:`gradstats.apply`; ``plans/fp{bits}-s{pct}.json``: every width and target;
    - ``layers.csv`` (the per-layer table), ``fits.parquet`` (every fit), ``errors.csv`` (predicted
      against measured quantisation error);
    - ``figures/*.png`` (:func:`gradstats.figures.write_figures`) and ``report.md`` embedding them.

    ``layers`` selects traced layers with the tracer's patterns (see :func:`analyse`); the
    tables, fits and plans cover those, the per-layer figures draw the run's layers. Layers
    without statistics and groups that cannot be fitted are noted, never fatal (see
    :func:`analyse`); without a convolution or linear layer no plan files are written.

    Example:
        >>> import tempfile, gradstats
        >>> rep = report(gradstats.zoo.data.data_dir() / "sample-run", tempfile.mkdtemp(), bits=[8],
        ...              sparsities=[0.85], figures=False)
        >>> gradstats.Plan.load(rep.files["plan"]).entries[0].layer
        'conv1'
    """
    return analyse(run, sparsities=sparsities, bits=bits, progress=progress, context=context,
                   layers=layers).write(out_dir, figures=figures, progress=progress)
