"""Past the study: more sparsity and fewer bits at once, as the analysis recommends.

The study reports no accuracy loss at 85% gradient sparsity and with FP6 gradients. Here the CNN
with BatchNorm (Fashion-MNIST, 400 SGD steps at batch 128, cosine schedule, three seeds) is
trained with plans that :func:`gradstats.recommend` derives from a calibration trace (the first 50
steps of the plain model): per-layer formats and scales at 6, 5 and 4 bits (4 bits block-scaled,
NVFP4 style), stochastic rounding, combined with stochastic pruning at 85%, 90% and 95% -- the same
target on every layer, or (``allocated``) a global element-weighted budget spread over the layers
by :func:`gradstats.pruning.allocate` at the least predicted added noise (the big convolutions
take most of the sparsity, the small classifier layers little). A
configuration *holds* when its mean test accuracy is within one standard deviation (over seeds)
of the plain baseline's.

    python experiments/push.py [--quick] [--out DIR] [--workers N]

Writes ``push.json`` to ``--out`` (default ``experiments/results``); finished jobs are kept in
``jobs.jsonl`` there (the baseline and pruning-only rows are shared with pruning_accuracy.py).
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _accuracy import Job, aggregate, calibrate, compare_to_baseline, parse_args, run_jobs, save_results  # noqa: E402
from pruning_accuracy import jobs as pruning_jobs  # noqa: E402

import gradstats  # noqa: E402

#: (sparsity, bits, granularity, rounding); bits None: pruning only
CONFIGS = ((0.85, 6, "tensor", "nearest"), (0.85, 6, "tensor", "stochastic"),
           (0.9, 5, "tensor", "stochastic"), (0.95, 5, "tensor", "stochastic"),
           (0.9, 4, "nvfp4", "stochastic"), (None, 4, "nvfp4", "stochastic"), (None, 5, "tensor", "stochastic"))
#: the same budgets spread over the layers by gradstats.pruning.allocate (element-weighted global
#: sparsity at the least added noise): (budget, bits, granularity, rounding); bits None: pruning only
ALLOCATED = ((0.9, None, None, None), (0.95, None, None, None), (0.9, 5, "tensor", "stochastic"),
             (0.95, 5, "tensor", "stochastic"), (0.9, 4, "nvfp4", "stochastic"))


def allocated(calib, budget: float, layers: list[str]) -> tuple[list, list[float]]:
    """Per-layer sparsity entries for a global budget, from the calibration statistics."""
    from gradstats.pruning import allocate

    st = calib.stats(kinds=["grad"])
    a = allocate(st[st["layer"].isin(layers)], budget)
    return [gradstats.PlanEntry(n, sparsity=float(t)) for n, t in zip(a.layers, a.targets)], list(a.targets)


def jobs(model: str, steps: int, seeds, prepare: dict, calib) -> list[Job]:
    from gradstats.zoo.models import build_model

    last = int(calib.steps[-1])
    layers = list(gradstats.Plan.uniform().resolve(build_model(model)))
    out = pruning_jobs(model, steps, seeds, prepare, sparsities=(0.0, 0.85, 0.9, 0.95), rule_sparsities=())
    # the same jobs as the pruning experiment's (their results are shared), with this table's keys
    out = [replace(j, info={"sparsity": j.info["target_sparsity"], "bits": 32, "format": "float32",
                            "rounding": "-", "granularity": "-"}) for j in out]
    for sparsity, bits, gran, rounding in CONFIGS:
        plan = gradstats.recommend(calib, bits=bits, steps=range(0, last + 1), rounding=rounding, sparsity=sparsity,
                                   noise_bound=None,       # the protocol as run: before the noise bound
                                   granularity=gran, candidates="any")
        fmts = sorted({str(r.format) for r in plan.resolve(calib).values() if r.format is not None})
        label = (f"sparsity {sparsity:g} + " if sparsity else "") + f"FP{bits} {gran} {rounding}"
        info = {"sparsity": sparsity or 0.0, "bits": bits, "format": "/".join(fmts), "rounding": rounding,
                "granularity": gran}
        out += [Job("push", label, model, seed, steps, plan.to_dict(), info, prepare) for seed in seeds]
    for budget, bits, gran, rounding in ALLOCATED:
        entries, targets = allocated(calib, budget, layers)
        if bits is None:
            plan, fmts = gradstats.Plan.uniform(layers=layers).with_entries(*entries), []
        else:
            plan = gradstats.recommend(calib, bits=bits, steps=range(0, last + 1), rounding=rounding, granularity=gran,
                                       candidates="any")
            fmts = sorted({str(r.format) for r in plan.resolve(calib).values() if r.format is not None})
            plan = plan.with_entries(*entries)
        label = f"allocated {budget:g}" + (f" + FP{bits} {gran} {rounding}" if bits else "")
        info = {"sparsity": budget, "bits": bits or 32, "format": "/".join(fmts) or "float32",
                "rounding": rounding or "-", "granularity": gran or "-",
                "layer_targets": "/".join(f"{t:.3f}" for t in targets)}
        out += [Job("push", label, model, seed, steps, plan.to_dict(), info, prepare) for seed in seeds]
    return out


def run(args, model: str = "cnn"):
    t0 = time.perf_counter()
    calib = calibrate(model, prepare_kw=args.prepare, steps=args.calibration_steps)
    df = run_jobs(jobs(model, args.steps(model), args.seeds, args.prepare, calib), args.out / "jobs.jsonl",
                  workers=args.workers, desc=f"push {model}")
    if "layer_targets" not in df:
        df["layer_targets"] = None
    table = aggregate(df, ["model", "label", "sparsity", "bits", "format", "rounding", "granularity", "layer_targets"])
    return df, compare_to_baseline(table, table["label"] == "baseline", "holds"), time.perf_counter() - t0


def main(argv: list[str] | None = None):
    args = parse_args(__doc__, argv)
    df, table, wall = run(args)
    print(table.drop(columns=["model"]).to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    save_results(args, "push", table, df, wall, calibration_steps=args.calibration_steps)
    return table


if __name__ == "__main__":
    main()
