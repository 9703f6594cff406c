"""Accuracy with low-precision neural gradients: formats from FP8 to FP4, three ways to scale them.

The CNN with BatchNorm is trained on Fashion-MNIST from scratch (400 SGD steps at batch 128,
cosine schedule; three seeds) with every convolution and linear layer's neural gradient rounded
to a low-precision float format in the backward pass:

* ``global``: one power-of-two scale for every layer, held fixed: the one that minimises the mean
  over layers of each layer's predicted relative error, from the layers' mu and sigma of ln|g|
  over a calibration trace (the first 50 steps of the plain model, seed 0) -- static loss
  scaling, chosen well;
* ``per-layer``: each layer's optimal power-of-two scale for its running mu and sigma
  (``scale="lognormal"``, refreshed every step) -- the study's local scaling;
* ``recommended``: per layer, the exponent/mantissa split and scale that
  :func:`gradstats.recommend` predicts best from the calibration trace, for each width 8..4;
* block-scaled FP4 (``e2m1fn``): MX (blocks of 32, E8M0 scales) and NVFP4 style (blocks of 16,
  E4M3 scales);

with round-to-nearest-even, and stochastic rounding for FP4.

    python experiments/lowprec_accuracy.py [--quick] [--out DIR] [--workers N]

Writes ``lowprec_accuracy.json`` and ``lowprec_accuracy.png`` to ``--out`` (default
``experiments/results``); finished jobs are kept in ``jobs.jsonl`` there.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _accuracy import Job, aggregate, calibrate, compare_to_baseline, global_scale, parse_args, run_jobs, save_results  # noqa: E402

import gradstats  # noqa: E402
from gradstats.zoo.models import build_model  # noqa: E402

#: per-tensor formats (name, bits): nearest rounding with per-layer scales
FORMATS = (("e5m2", 8), ("e4m3fn", 8), ("e3m3fn", 7), ("e4m1fn", 6), ("e3m2fn", 6), ("e2m3fn", 6),
           ("e2m2fn", 5), ("e2m1fn", 4))
#: formats also run with one global scale (one per width but FP7)
GLOBAL = ("e5m2", "e4m3fn", "e3m2fn", "e2m2fn", "e2m1fn")
#: per-layer scaled formats also run with stochastic rounding
STOCHASTIC = ("e2m1fn",)
#: recommended splits per width (nearest; the narrowest also stochastic)
WIDTHS = (8, 7, 6, 5, 4)
STOCHASTIC_WIDTHS = (4,)
#: block scaling of FP4: (label, block size, scale format)
BLOCKS = (("MX", 32, "e8m0"), ("NVFP4", 16, "e4m3"))


def plans(model: str, calib: gradstats.run.Run) -> list[tuple[str, dict, dict]]:
    """``(label, info, plan dict)`` for every configuration."""
    layers = list(gradstats.Plan.uniform().resolve(build_model(model)))
    last = int(calib.steps[-1])
    out = []
    for name, bits in FORMATS:
        fmt = gradstats.FPFormat.parse(name)
        info = {"bits": bits, "format": str(fmt), "rounding": "nearest"}
        if name in GLOBAL:
            s = global_scale(fmt, calib, layers)
            out.append((f"{fmt} global", {**info, "scaling": "global", "scale": s},
                        gradstats.Plan.uniform(format=fmt, scale="fixed", scale_value=s).to_dict()))
        out.append((f"{fmt} per-layer", {**info, "scaling": "per-layer"},
                    gradstats.Plan.uniform(format=fmt).to_dict()))
        if name in STOCHASTIC:
            out.append((f"{fmt} per-layer SR", {**info, "rounding": "stochastic", "scaling": "per-layer"},
                        gradstats.Plan.uniform(format=fmt, rounding="stochastic").to_dict()))
    for bits in WIDTHS:
        for rounding in ("nearest", "stochastic") if bits in STOCHASTIC_WIDTHS else ("nearest",):
            plan = gradstats.recommend(calib, bits=bits, steps=range(0, last + 1), rounding=rounding, candidates="any")
            fmts = sorted({str(r.format) for r in plan.resolve(layers).values()})
            out.append((f"FP{bits} recommended{' SR' if rounding == 'stochastic' else ''}",
                        {"bits": bits, "format": "/".join(fmts), "rounding": rounding, "scaling": "recommended"},
                        plan.to_dict()))
    for label, block, scale_format in BLOCKS:
        for rounding in ("nearest", "stochastic"):
            out.append((f"e2m1fn {label}{' SR' if rounding == 'stochastic' else ''}",
                        {"bits": 4, "format": "e2m1fn", "rounding": rounding, "scaling": f"block {label}"},
                        gradstats.Plan.uniform(format=f"e2m1fn:block={block}:scale={scale_format}", scale="amax",
                                               rounding=rounding).to_dict()))
    return out


def jobs(model: str, steps: int, seeds, prepare: dict, calib) -> list[Job]:
    out = [Job("lowprec", "baseline", model, seed, steps, None,
               {"bits": 32, "format": "float32", "rounding": "-", "scaling": "none"}, prepare) for seed in seeds]
    for label, info, plan in plans(model, calib):
        out += [Job("lowprec", label, model, seed, steps, plan, info, prepare) for seed in seeds]
    return out


def run(args, model: str = "cnn"):
    t0 = time.perf_counter()
    calib = calibrate(model, prepare_kw=args.prepare, steps=args.calibration_steps)
    df = run_jobs(jobs(model, args.steps(model), args.seeds, args.prepare, calib), args.out / "jobs.jsonl",
                  workers=args.workers, desc=f"low precision {model}")
    table = aggregate(df, ["model", "label", "bits", "format", "rounding", "scaling"])
    return df, compare_to_baseline(table, table["label"] == "baseline"), time.perf_counter() - t0


def main(argv: list[str] | None = None):
    args = parse_args(__doc__, argv)
    df, table, wall = run(args)
    print(table.drop(columns=["model"]).to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    save_results(args, "lowprec_accuracy", table, df, wall, calibration_steps=args.calibration_steps)
    from gradstats.plots.accuracy import plot_accuracy_by_format

    plot_accuracy_by_format(table, path=args.out / "lowprec_accuracy.png")
    return table


if __name__ == "__main__":
    main()
