"""Distributions across model families: which model of |x| fits neural gradients, weights and activations.

Four built-in models are traced across a short training from scratch: the CNN with BatchNorm,
the ResNet-20-style CNN and the MLP on Fashion-MNIST, and the character-level transformer on
Shakespeare. Statistics of every layer are taken every 10 steps; raw samples (up to 32,768
values) of the neural gradients, the weights and the activations of every layer at the first,
middle and last step. Every sampled (layer, step, kind) is fitted with the lognormal, half-normal
and exponential models of |x| (``gradstats.fit_run``: exact KS, Vuong test). Per model and kind:

* how often lognormal has the higher likelihood than normal, and than Laplace, and how often it is
  the best of the three with a significant Vuong test (p < 0.05); the median Vuong effect size
  (z / sqrt(n)) of lognormal against its best rival;
* the median KS distance per family;
* the range of sigma (std of log2|x|, binades) over layers and steps, from the statistics.

    python experiments/distributions.py [--quick] [--out DIR]

Writes ``distributions.json`` (summary, per-layer verdicts, settings) and
``distributions_ks.png`` to ``--out`` (default ``experiments/results``).
"""
from __future__ import annotations

import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _accuracy import environment, parse_args, write_json  # noqa: E402

import gradstats  # noqa: E402

#: model -> (steps, prepare keywords, run keywords)
MODELS = {
    "cnn": (300, {}, {}),
    "resnet20": (120, {}, {}),
    "mlp": (300, {}, {}),
    "transformer": (150, {"d_model": 128, "n_layers": 4}, {"batch_size": 16}),
}
KINDS = ("grad", "act", "weight")
FAMILIES = ("lognormal", "normal", "laplace")


def trace(name: str, steps: int, prepare_kw: dict, run_kw: dict, path: Path, *, samples: int, seed: int = 0):
    """Train ``name`` for ``steps`` steps with statistics every 10 steps and samples at five."""
    from gradstats.zoo.training import prepare

    task = prepare(name, seed=seed, **prepare_kw)
    sample_steps = sorted({int(round(f * (steps - 1))) for f in np.linspace(0, 1, 3)})
    every = sorted(set(range(0, steps, 10)) | set(sample_steps))
    with gradstats.trace(task.model, path, kinds=KINDS, every=every, sample_every=sample_steps,
                         samples=samples, seed=seed) as tracer:
        res = task.run(steps, schedule="cosine", progress=False, callback=lambda s, loss: tracer.step(), **run_kw)
    return gradstats.open_run(path), res, sample_steps


def summarize(fits: pd.DataFrame, stats: pd.DataFrame) -> pd.DataFrame:
    """One row per model and kind (see the module doc)."""
    rows = []
    ok = fits[(fits["status"] == "ok") & (fits["source"] == "samples")]
    for (model, kind), g in ok.groupby(["model", "kind"], sort=False):
        wide = g.pivot_table(index=["layer", "step"], columns="family", values="loglik")
        ln = g[g["family"] == "lognormal"].set_index(["layer", "step"])
        best = g[g["best"]].set_index(["layer", "step"])
        sig_best = (best["family"] == "lognormal") & (best["vuong_p"] < 0.05)
        st = stats[(stats["model"] == model) & (stats["kind"] == kind)]
        s2 = st["sigma_log2"].dropna()
        row = {"model": model, "kind": kind, "groups": len(wide), "layers": g["layer"].nunique(),
               "lognormal_beats_normal": float((wide["lognormal"] > wide["normal"]).mean()),
               "lognormal_beats_laplace": float((wide["lognormal"] > wide["laplace"]).mean()),
               "lognormal_best_significant": float(sig_best.reindex(wide.index).fillna(False).mean()),
               "lognormal_effect_median": float(ln["vuong_effect"].median())}
        for fam in FAMILIES:
            row[f"ks_median_{fam}"] = float(g[g["family"] == fam]["ks"].median())
        row.update(sigma_log2_min=float(s2.min()) if len(s2) else math.nan,
                   sigma_log2_median=float(s2.median()) if len(s2) else math.nan,
                   sigma_log2_max=float(s2.max()) if len(s2) else math.nan,
                   zero_fraction_median=float(st["zero_fraction"].median()) if len(st) else math.nan)
        rows.append(row)
    return pd.DataFrame(rows)


def layer_stats(run, model: str) -> pd.DataFrame:
    """sigma of log2|x| and the zero fraction of every (layer, step, kind) statistics row."""
    from gradstats.stats import lognormal_moments, merge_stats

    st = run.stats()
    rows = []
    for (layer, step, kind), g in st.groupby(["layer", "step", "kind"], sort=False):
        m = merge_stats(g.to_dict("records"))
        nnz = m["n"] - m["n_zero"] - m["n_nonfinite"]
        sigma = lognormal_moments(m)[1] / math.log(2) if nnz >= 16 else math.nan
        rows.append({"model": model, "layer": layer, "step": int(step), "kind": kind, "n": int(m["n"]),
                     "sigma_log2": sigma, "zero_fraction": m["n_zero"] / max(m["n"], 1)})
    return pd.DataFrame(rows)


def run(models: dict, workdir: Path | None = None, *, samples: int = 65536, verbose: bool = True):
    workdir = Path(workdir or tempfile.mkdtemp(prefix="gradstats-distributions-"))
    fits, stats, timing = [], [], {}
    for name, (steps, prepare_kw, run_kw) in models.items():
        t0 = time.perf_counter()
        run_, res, sample_steps = trace(name, steps, prepare_kw, run_kw, workdir / name, samples=samples)
        f = gradstats.fit_run(run_, steps=sample_steps, kinds=KINDS, progress=verbose)
        fits.append(f.assign(model=name))
        stats.append(layer_stats(run_, name))
        timing[name] = {"steps": steps, "sample_steps": sample_steps, "wall_s": round(time.perf_counter() - t0, 1),
                        "final_loss": float(np.mean(res.losses[-10:])), "test_accuracy": res.test_accuracy}
        if verbose:
            print(f"# {name}: {steps} steps, {timing[name]['wall_s']} s", flush=True)
    fits_df, stats_df = pd.concat(fits, ignore_index=True), pd.concat(stats, ignore_index=True)
    return summarize(fits_df, stats_df), fits_df, stats_df, timing


def main(argv: list[str] | None = None):
    args = parse_args(__doc__, argv)
    models = MODELS
    if args.quick:
        models = {"cnn": (4, dict(args.prepare), {}), "mlp": (4, dict(args.prepare), {})}
    t0 = time.perf_counter()
    summary, fits, stats, timing = run(models, samples=4096 if args.quick else 32768, verbose=not args.quick)
    print(summary.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    verdicts = pd.concat([gradstats.fitting.layer_verdicts(g).assign(model=m)
                          for m, g in fits[fits["source"] == "samples"].groupby("model", sort=False)])
    write_json(args.out / "distributions.json", {
        "command": "python experiments/distributions.py" + (" --quick" if args.quick else ""),
        "data": "Fashion-MNIST (full) and Shakespeare" if not args.quick else "Fashion-MNIST committed subset",
        "seeds": [0], "models": {m: {"steps": s, "prepare": p, "run": r} for m, (s, p, r) in models.items()},
        "timing": timing, "wall_s": round(time.perf_counter() - t0, 1), "environment": environment(),
        "summary": summary.to_dict("records"), "layer_verdicts": verdicts.to_dict("records")})
    from gradstats.plots.study import plot_ks_by_model

    plot_ks_by_model(fits, path=args.out / "distributions_ks.png")
    return summary


if __name__ == "__main__":
    main()
