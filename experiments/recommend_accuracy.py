"""What a user gets with the default settings: recommended and uniform plans against the baseline
and against hand-picked configurations of the same width, paired by seed.

The CNN with BatchNorm is trained on Fashion-MNIST from scratch (the experiments' protocol: 400
SGD steps at batch 128, cosine schedule) for each seed, with

* ``baseline``: no plan;
* ``recommend(calib, bits=6)``, ``recommend(calib, bits=6, sparsity=0.85)`` and
  ``Plan.uniform(sparsity=0.85)``, every argument at its default (the calibration run: the first
  50 steps of the plain model, seed 0);
* the same-width configurations a user would pick by hand, on the same layers as the default
  plans: e4m1fn, e3m2fn and e2m3fn with nearest rounding and per-layer lognormal scales, and with
  stochastic rounding at the amax scale;
* for contrast, the previous defaults: ``recommend(bits=6)`` by relative MSE among every split,
  round-to-nearest, and 85% pruning of every convolution and linear layer (logits included) with
  the pure lognormal threshold.

Each configuration's accuracy is compared with the baseline's of the same seed (same data order
and initialisation): the mean paired difference and its standard error.

    python experiments/recommend_accuracy.py [--quick] [--out DIR] [--workers N] [--seeds S ...]
                                             [--defaults-only]

(``--defaults-only``: the baseline and the three default plans alone, e.g. for more seeds.)

Writes ``recommend_accuracy.json`` to ``--out`` (default ``experiments/results``); finished jobs
are kept in ``recommend_jobs.jsonl`` there (an interrupted run resumes).
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pandas as pd  # noqa: E402
from _accuracy import Job, calibrate, parse_args, run_jobs, save_results  # noqa: E402

import gradstats  # noqa: E402
from gradstats.zoo.models import build_model  # noqa: E402

EXPERIMENT = "recommend"
SEEDS = (0, 1, 2, 3, 4)
HAND = ("e4m1fn", "e3m2fn", "e2m3fn")


def plans(model: str, calib) -> list[tuple[str, dict, dict]]:
    """``(label, info, plan dict)`` for every configuration."""
    layers = list(gradstats.Plan.uniform().resolve(build_model(model)))     # the default selection
    out = [
        ("recommend(bits=6)", {"kind": "default"}, gradstats.recommend(calib, bits=6)),
        ("recommend(bits=6, sparsity=0.85)", {"kind": "default"}, gradstats.recommend(calib, bits=6, sparsity=0.85, noise_bound=None)),
        ("Plan.uniform(sparsity=0.85)", {"kind": "default"}, gradstats.Plan.uniform(sparsity=0.85)),
    ]
    for fmt in HAND:
        out.append((f"{fmt} nearest, lognormal scale", {"kind": "hand"},
                    gradstats.Plan.uniform(format=fmt, rounding="nearest", scale="lognormal", layers=layers)))
        out.append((f"{fmt} stochastic, amax scale", {"kind": "hand"},
                    gradstats.Plan.uniform(format=fmt, rounding="stochastic", scale="amax", layers=layers)))
    every = list(gradstats.Plan.uniform(output_layer=False).resolve(build_model(model)))
    out.append(("old default: recommend(bits=6) by MSE, nearest", {"kind": "old"},
                gradstats.recommend(calib, bits=6, objective="mse", rounding="nearest", candidates="any",
                                    layers=every, threshold_rule="lognormal")))
    out.append(("old default: 85% lognormal rule, every layer", {"kind": "old"},
                gradstats.Plan.uniform(sparsity=0.85, threshold_rule="lognormal", layers=every)))
    return [(label, info, plan.to_dict()) for label, info, plan in out]


def paired(df: pd.DataFrame) -> pd.DataFrame:
    """Per configuration: mean accuracy, the mean paired difference to the baseline and its
    standard error (over seeds), achieved sparsity, underflow."""
    acc = df.pivot_table(index="seed", columns="label", values="test_accuracy") * 100
    base = acc["baseline"]
    rows = []
    for label in dict.fromkeys(df["label"]):
        d = (acc[label] - base).dropna()
        n = len(d)
        se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
        g = df[df["label"] == label]
        rows.append({"label": label, "kind": g["kind"].iloc[0], "seeds": n, "acc_mean": float(acc[label].mean()),
                     "acc_std": float(acc[label].std(ddof=1)) if n > 1 else math.nan,
                     "diff_mean": float(d.mean()), "diff_se": se,
                     "within_1se": bool(d.mean() >= -se) if n > 1 else None,
                     "achieved_sparsity": float(g["achieved_sparsity"].mean()),
                     "underflow": float(g["underflow_fraction"].mean()), "failed": int(g.get("error", pd.Series()).notna().sum())})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    import argparse

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--defaults-only", action="store_true")
    known, rest = pre.parse_known_args(argv)
    args = parse_args(__doc__, rest)
    seeds = args.seeds if (args.quick or args.seed_list) else SEEDS
    t0 = time.perf_counter()
    model, steps = "cnn", args.steps("cnn")
    calib = calibrate(model, prepare_kw=args.prepare, steps=args.calibration_steps)
    jobs = [Job(EXPERIMENT, "baseline", model, s, steps, None, {"kind": "baseline"}, args.prepare) for s in seeds]
    for label, info, plan in plans(model, calib):
        if known.defaults_only and info["kind"] != "default":
            continue
        jobs += [Job(EXPERIMENT, label, model, s, steps, plan, info, args.prepare) for s in seeds]
    df = run_jobs(jobs, args.out / "recommend_jobs.jsonl", workers=args.workers, desc="recommend vs hand-picked")
    table = paired(df)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    args.seeds = seeds
    save_results(args, "recommend_accuracy", table, df, time.perf_counter() - t0,
                 calibration_steps=args.calibration_steps)
    return table


if __name__ == "__main__":
    main()
