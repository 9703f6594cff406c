"""Writing the report of an analysed run (:meth:`gradstats.report.Analysis.write`,
:func:`gradstats.report.report`): the plans, the tables, the figures and ``report.md``, and the
:class:`Report` that says what was written.

Example:
    >>> import tempfile, gradstats
    >>> from gradstats.report import analyse
    >>> rep = analyse(gradstats.zoo.data.data_dir() / "sample-run", bits=[8], sparsities=[0.9]).write(
    ...     tempfile.mkdtemp(), figures=False)
    >>> rep.markdown.name, sorted(rep.files)[:2]
    ('report.md', ['errors', 'fits'])
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import pandas as pd

from gradstats.pruning.allocation import output_layer

__all__ = ["Report"]


def pct_label(s: float) -> str:
    """A sparsity as the whole percent that names its plan and columns (0.85 -> ``"85"``)."""
    return f"{round(100 * s):d}"


def _md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    out = ["| " + " | ".join(esc(h) for h in head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


@dataclass
class Report:
    """What :func:`report` wrote.

    Attributes:
        out_dir: the output directory.
        analysis: the :class:`Analysis`.
        files: ``{name: path}`` of the plans and tables (``plan``, ``plan_fp8_s85``, ..., ``fits``,
            ``layers``, ``errors``, ``report``).
        figures: ``{name: path}`` of the PNG figures (empty with ``figures=False``).
    """

    out_dir: Path
    analysis: Any          # the Analysis (gradstats.report.analysis) that was written
    files: dict[str, Path]
    figures: dict[str, Path]

    @property
    def markdown(self) -> Path:
        """The path of ``report.md``."""
        return self.files["report"]

    def summary(self) -> pd.DataFrame:
        """The analysis' per-layer summary (:meth:`Analysis.summary`); ``str(report)`` adds the files
        written."""
        return self.analysis.summary()

    def text(self) -> str:
        """The analysis' summary table and the files written (``str(report)``)."""
        lines = [self.analysis.text(), "", f"wrote to {self.out_dir}:"]
        for name, p in {**self.files, **self.figures}.items():
            lines.append(f"  {p.relative_to(self.out_dir) if p.is_relative_to(self.out_dir) else p}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    def to_dataframe(self) -> pd.DataFrame:
        """The analysis' per-layer table (:meth:`Analysis.to_dataframe`)."""
        return self.analysis.to_dataframe()

    def to_dict(self) -> dict[str, Any]:
        """Plain data: the output directory, the files and the analysis."""
        return {"out_dir": str(self.out_dir), "files": {k: str(v) for k, v in self.files.items()},
                "figures": {k: str(v) for k, v in self.figures.items()}, "analysis": self.analysis.to_dict()}


def write_report(a: Any, out: Path, *, figures: bool, progress: bool) -> Report:
    from gradstats.figures import FIGURES, write_figures

    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    if any(a.plans.values()):
        a.plan().save(out / "plan.json")
        files["plan"] = out / "plan.json"
        (out / "plans").mkdir(exist_ok=True)
    for s, ps in a.plans.items():
        for b, p in ps.items():
            path = out / "plans" / f"fp{b}-s{pct_label(s)}.json"
            p.save(path)
            files[f"plan_fp{b}_s{pct_label(s)}"] = path
    a.table.to_csv(out / "layers.csv", index=False)
    files["layers"] = out / "layers.csv"
    a.fits.to_parquet(out / "fits.parquet", index=False)
    files["fits"] = out / "fits.parquet"
    a.errors.to_csv(out / "errors.csv", index=False)
    files["errors"] = out / "errors.csv"
    figs: dict[str, Path] = {}
    if figures:
        figs = write_figures(a.run, out / "figures", plans=a.plans[a.sparsities[0]] or None, errors=a.errors,
                             progress=progress)
    md = _markdown(a, out, files, figs, {k: v[1] for k, v in FIGURES.items()})
    (out / "report.md").write_text(md)
    files["report"] = out / "report.md"
    return Report(out_dir=out, analysis=a, files=files, figures=figs)


def _markdown(a: Any, out: Path, files: Mapping[str, Path], figs: Mapping[str, Path],
              captions: Mapping[str, str]) -> str:
    from gradstats import __version__

    run = a.run
    m = run.manifest
    rel = lambda p: os.path.relpath(p, out)  # noqa: E731
    idx = run.sample_index()
    sampled = sorted(int(s) for s in idx["step"].unique()) if len(idx) else []
    lines = [f"# gradstats report: {m.get('model_class', 'model')}", ""]
    lines += [f"- run: `{run.path}` ({len(run.layers)} traced layers, {len(run.steps)} steps with statistics "
              f"{run.steps[0]}..{run.steps[-1]}, raw samples at steps {sampled or 'none'})",
              f"- model: {m.get('model_class')} with {m.get('model_params', 0):,} parameters; captured kinds "
              f"{', '.join(m.get('capture', {}).get('kinds', []))}"]
    lines += [f"- {k}: {v}" for k, v in a.context.items()]
    lines += [f"- gradstats {__version__}; std log2|g| and plans from step {a.plan_step}; fits over steps "
              f"{a.fit_steps if len(a.fit_steps) <= 12 else f'{a.fit_steps[0]}..{a.fit_steps[-1]}'}", ""]
    lines += ["## Per layer", ""]
    summary = a.summary()
    lines += [_md_table(list(summary.columns), summary.values.tolist()), ""]
    if len(a.failures):
        lines += ["## Groups not fitted", "",
                  "These (layer, step) groups have rows with NaN numbers in the fits; the status says why "
                  "(`error`: no family fits the values, e.g. an identically zero gradient; `damaged`: the "
                  "run's file of those samples is damaged on disk). The rest of the run is analysed.", "",
                  _md_table(["layer", "steps", "source", "status"],
                            [[r["layer"], ", ".join(str(x) for x in r["steps"]), r["source"], r["status"]]
                             for r in a.failures.to_dict("records")]), ""]
    if a.skipped:
        lines += ["Skipped layers (not in the table):", ""]
        lines += [f"- `{name}`: {why}" for name, why in a.skipped.items()]
        lines += [""]
    nl = int((a.table["verdict"] == "lognormal").sum())
    exact = a.fits[(a.fits["status"] == "ok") & a.fits["ks_method"].isin(["exact", "subsample"])]
    ks = {f: exact[exact["family"] == f]["ks"].median() for f in ("lognormal", "normal", "laplace")}
    lines += [f"Lognormal is the best of the three magnitude models (by likelihood, majority over the fitted "
              f"steps) for **{nl} of {len(a.table)}** layers. Median exact KS distance over the fits from raw samples: "
              + ", ".join(f"{f} {v:.3f}" for f, v in ks.items() if math.isfinite(v)) + ".", "",
              "Thresholds are for stochastic pruning (values below the threshold become 0 or "
              "+-threshold, unbiased) under the histogram rule (model-free, from each layer's binade "
              "histogram: the default); when the exact zeros already exceed the target the threshold is 0. "
              "Formats are the hardware formats of each width (FP8 e4m3fn/e5m2, FP6 e2m3fn/e3m2fn, FP4 "
              "e2m1fn) with the rounding and power-of-two scale 2^k that `recommend` chooses for training: "
              "the least predicted noise whose predicted magnitude bias (flush to zero and saturation) "
              "stays within 1%; '-' marks layers the plans leave alone (only convolution and linear layers "
              "are planned, and the output layer"
              + (f" `{logits}`" if (logits := output_layer(a.run)) else "")
              + " stays in full precision, as in the study).", ""]
    if len(a.errors):
        lines += ["## Predicted and measured quantisation error", "",
                  f"Relative MSE (MSE / E[g^2]) of the recommended format at its scale, predicted from the "
                  f"lognormal fit of step {a.plan_step} and measured by quantising that step's raw samples:", ""]
        er = a.errors.sort_values(["bits", "layer"], ascending=[False, True])
        rows = [[r["layer"], f"FP{r['bits']}", f"{r['format']} 2^{int(r['log2_scale'])}", f"{r['sigma_log2']:.2f}",
                 f"{r['predicted']:.3g}", f"{r['measured']:.3g}",
                 f"{r['measured'] / r['predicted']:.2f}" if r["predicted"] > 0 else "-"]
                for r in er.to_dict("records")]
        lines += [_md_table(["layer", "width", "format", "std log2|g|", "predicted", "measured", "measured / predicted"],
                            rows), ""]
        lost = er[er["measured"] >= 0.99]
        bad = er[(er["measured"] > 2 * er["predicted"]) & (er["measured"] > 1e-3) & (er["measured"] < 0.99)]
        name = lambda d: ", ".join(sorted(set(f"{r.layer} (FP{r.bits})" for r in d.itertuples())))  # noqa: E731
        if len(lost):
            lines += [f"**Warning**: with the recommended scale every value of {name(lost)} is flushed to zero "
                      "(measured relative error 1): the scale, optimal for a lognormal with this sigma, puts "
                      "these layers' real gradients, whose upper tail is bounded (see the Q-Q plots), below "
                      "the format's smallest value. Use the `amax` scale rule for them or check them before "
                      "applying the plan.", ""]
        if len(bad):
            lines += [f"**Warning**: the measured error exceeds twice the prediction for {name(bad)}: their "
                      "gradients are far from lognormal in the tails (see the Q-Q plots), so the lognormal "
                      "optimum of the scale does not hold for them. Check these layers before applying the "
                      "plan.", ""]
    applied = run.table("applied")
    if len(applied):
        g = applied.groupby("layer", sort=False).agg(calls=("seq", "size"), target=("target_sparsity", "mean"),
                                                     predicted=("predicted_sparsity", "mean"),
                                                     achieved=("achieved_sparsity", "mean"))
        lines += ["## Plan applied during the run", "",
                  _md_table(["layer", "calls", "target", "predicted", "achieved"],
                            [[str(k), str(int(r.calls)), f"{r.target:.3f}", f"{r.predicted:.3f}", f"{r.achieved:.3f}"]
                             for k, r in g.iterrows()]), ""]
    if figs:
        lines += ["## Figures", "", "How to read each figure: `docs/figures.md` in the gradstats repository.", ""]
        for name, p in figs.items():
            cap = captions.get(name, name)
            lines += [f"### {cap[:1].upper() + cap[1:]}", "", f"![{name}]({rel(p)})", ""]
    lines += ["## Plans", ""]
    if "plan" in files:
        lines += [f"- `{rel(files['plan'])}`: FP{a.bits[0]} with {pct_label(a.sparsities[0])}% sparsity (the default plan)"]
        lines += [f"- `{rel(p)}`" for k, p in files.items() if k.startswith("plan_")]
        lines += ["", "Apply one during training (the schema is documented in `docs/plan-format.md`):", "",
                  "```python", "import gradstats", "",
                  f"plan = gradstats.Plan.load(\"{rel(files['plan'])}\")",
                  "with gradstats.apply(model, plan) as applied:", "    ...  # train as usual",
                  "print(applied.summary())", "```"]
    else:
        lines += [f"No plan: none of the analysed layers is a convolution or linear layer with statistics at "
                  f"step {a.plan_step}."]
    lines += ["", f"Tables: `{rel(files['layers'])}` (this table, all columns), `{rel(files['fits'])}` (every fit), "
              f"`{rel(files['errors'])}` (predicted vs measured error).", ""]
    return "\n".join(lines)
