"""Heterogeneous pruning budgets that hold: ``pruning.allocate`` at a global 0.9 against 0.9 on every layer.

The CNN with BatchNorm is trained on Fashion-MNIST from scratch (400 SGD steps at batch 128,
cosine schedule; seeds 0-4 by default) four ways: plain (the baseline); with the neural gradient
of every convolution and linear layer but the output layer pruned stochastically at 0.9
(``Plan.uniform(sparsity=0.9)``); the same with the output layer (the logits) pruned too; and with
per-layer targets from :func:`gradstats.pruning.allocate` at a global, element-weighted budget of
0.9, computed from a calibration trace (the first 50 steps of the plain model, seed 0): each
layer modelled from its own statistics (conditioned on its maximum), targets capped at 0.98, the
output layer left unpruned. Every pruned plan uses the same threshold rule (the plan default).

    python experiments/allocation_accuracy.py [--quick] [--out DIR] [--workers N] [--seeds 0 1 2]

Writes ``allocation_accuracy.json`` (the table, the per-layer targets, the per-job rows, the data
source) to ``--out`` (default ``experiments/results``); finished jobs are kept in
``allocation_jobs.jsonl`` there, so a rerun only trains what is missing.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _accuracy import (  # noqa: E402
    CALIBRATION_STEPS,
    QUICK_PREPARE,
    QUICK_STEPS,
    RESULTS,
    STEPS,
    Job,
    aggregate,
    calibrate,
    environment,
    run_jobs,
    write_json,
)

import gradstats  # noqa: E402

BUDGET = 0.9
SEEDS = (0, 1, 2, 3, 4)


def conv_linear(model) -> list[str]:
    """Every convolution and linear layer of ``model``, the output layer included, in model order."""
    import torch.nn as nn

    from gradstats.wrappers import named_layers

    return [n for n, m in named_layers(model) if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear))]


def allocated_plan(calib, budget: float, layers: list[str]):
    """The plan of per-layer targets for ``budget`` over ``layers`` (the output layer among them is
    left unpruned), and the allocation."""
    from gradstats.pruning import allocate

    st = calib.stats(kinds=["grad"])
    a = allocate(st[st["layer"].isin(layers)], budget, layer_info=calib)
    return gradstats.Plan.uniform(layers=layers).with_allocation(a), a


def jobs(model: str, steps: int, seeds, prepare: dict, calib, budget: float = BUDGET):
    from gradstats.zoo.models import build_model

    layers = conv_linear(build_model(model))
    plan, alloc = allocated_plan(calib, budget, layers)
    configs = {f"uniform {budget:g}": gradstats.Plan.uniform(sparsity=budget),
               f"uniform {budget:g} incl. output layer": gradstats.Plan.uniform(sparsity=budget, layers=layers),
               f"allocated {budget:g}": plan}
    out = []
    for seed in seeds:
        out.append(Job("allocation", "baseline", model, seed, steps, None, {"config": "baseline"}, prepare))
        for label, p in configs.items():
            out.append(Job("allocation", label, model, seed, steps, p.to_dict(), {"config": label}, prepare))
    return out, alloc


def run(model: str = "cnn", *, seeds=SEEDS, steps: int | None = None, prepare: dict | None = None,
        calibration_steps: int = CALIBRATION_STEPS, workers: int = 2, out: Path = RESULTS,
        budget: float = BUDGET):
    """Train every job (reusing finished ones in ``out/allocation_jobs.jsonl``); returns the job
    rows, the table (mean and std over seeds per configuration) and the allocation."""
    prepare = prepare or {}
    steps = steps or STEPS[model]
    calib = calibrate(model, prepare_kw=prepare, steps=calibration_steps)
    js, alloc = jobs(model, steps, seeds, prepare, calib, budget)
    df = run_jobs(js, Path(out) / "allocation_jobs.jsonl", workers=workers, desc=f"allocation {model}")
    table = aggregate(df, ["model", "config"])
    return df, table, alloc


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny data, a few steps, one seed (smoke test)")
    ap.add_argument("--out", default=str(RESULTS), help="directory of the JSON results")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (one torch thread each; 0: in this process)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help=f"seeds (default {list(SEEDS)})")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = tuple(args.seeds) if args.seeds else ((0,) if args.quick else SEEDS)
    prepare = QUICK_PREPARE if args.quick else {}
    steps = QUICK_STEPS if args.quick else STEPS["cnn"]
    t0 = time.perf_counter()
    df, table, alloc = run("cnn", seeds=seeds, steps=steps, prepare=prepare,
                           calibration_steps=3 if args.quick else CALIBRATION_STEPS, workers=args.workers,
                           out=out)
    print(table[["config", "seeds", "acc_mean", "acc_std", "acc_min", "achieved_sparsity"]]
          .to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(alloc.to_dataframe().to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    from gradstats.zoo.training import prepare as prep

    source = prep("cnn", seed=0, **prepare).train_data.source
    write_json(out / "allocation_accuracy.json", {
        "command": "python experiments/allocation_accuracy.py" + (" --quick" if args.quick else ""),
        "data": f"Fashion-MNIST ({source})", "seeds": list(seeds), "steps": steps, "budget": BUDGET,
        "calibration_steps": 3 if args.quick else CALIBRATION_STEPS, "wall_s": round(time.perf_counter() - t0, 1),
        "environment": environment(), "allocation": alloc.to_dict(), "table": table.to_dict("records"),
        "jobs": df.to_dict("records")})
    return table, alloc


if __name__ == "__main__":
    main()
