"""Accuracy under stochastic pruning of the neural gradients, per target sparsity and threshold rule.

The CNN with BatchNorm is trained on Fashion-MNIST from scratch (400 SGD steps at batch 128,
cosine schedule; three seeds) with every convolution and linear layer's neural gradient pruned
stochastically (unbiased: small values become 0 or the threshold) at sparsity 0, 0.5, 0.7, 0.8,
0.85, 0.9 and 0.95, the threshold from the lognormal model of the running mu and sigma of
ln|g| (conditioned on the running maximum and mean |g|). At 0.85 and 0.9 the lognormal threshold
is set beside the model-free histogram rule, the exact quantile of each tensor
(``threshold_rule="exact"``) and the normal-model threshold.

    python experiments/pruning_accuracy.py [--quick] [--out DIR] [--workers N]

Writes ``pruning_accuracy.json`` (the table, the per-job rows, settings) and
``pruning_accuracy.png`` to ``--out`` (default ``experiments/results``); finished jobs are kept in
``jobs.jsonl`` there, so a rerun only trains what is missing.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _accuracy import Job, aggregate, compare_to_baseline, parse_args, run_jobs, save_results  # noqa: E402

import gradstats  # noqa: E402

SPARSITIES = (0.0, 0.5, 0.7, 0.8, 0.85, 0.9, 0.95)
RULE_SPARSITIES = (0.85, 0.9)
RULES = ("lognormal", "histogram", "exact", "normal")


def jobs(model: str, steps: int, seeds, prepare: dict, *, sparsities=SPARSITIES,
         rule_sparsities=RULE_SPARSITIES) -> list[Job]:
    out = []
    for s in sparsities:
        rules = RULES if s in rule_sparsities else ("lognormal",)
        for rule in rules:
            plan = None if s == 0 else gradstats.Plan.uniform(sparsity=s, threshold_rule=rule).to_dict()
            label = "baseline" if s == 0 else f"sparsity {s:g} {rule}"
            for seed in seeds:
                out.append(Job("pruning", label, model, seed, steps, plan,
                               {"target_sparsity": s, "threshold_rule": rule if s else "none"}, prepare))
    return out


def run(args, model: str = "cnn", **kw):
    t0 = time.perf_counter()
    df = run_jobs(jobs(model, args.steps(model), args.seeds, args.prepare, **kw), args.out / "jobs.jsonl",
                  workers=args.workers, desc=f"pruning {model}")
    table = aggregate(df, ["model", "target_sparsity", "threshold_rule"])
    return df, compare_to_baseline(table, table["target_sparsity"] == 0), time.perf_counter() - t0


def main(argv: list[str] | None = None):
    args = parse_args(__doc__, argv)
    df, table, wall = run(args)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    save_results(args, "pruning_accuracy", table, df, wall)
    from gradstats.plots.accuracy import plot_accuracy_vs_sparsity

    plot_accuracy_vs_sparsity(table, path=args.out / "pruning_accuracy.png")
    return table


if __name__ == "__main__":
    main()
