"""Thresholds that hit their target under ``apply``, over a whole training run: the achieved
sparsity of each planned layer, element-weighted over every call of the run, against the target,
per threshold rule and layer type.

``Plan.uniform(sparsity=t, threshold_rule=rule)`` with every other argument at its default (every
convolution and linear layer but the output layer, thresholds refreshed every step from the running
statistics) is applied while the model trains from scratch:

* the CNN with BatchNorm on Fashion-MNIST (the experiments' protocol: 400 SGD steps at batch 128,
  cosine schedule): convolution and linear layers;
* the character transformer (4 blocks, d = 128) on Shakespeare, ``--transformer-steps`` AdamW steps:
  linear layers and the attention projections (q, k, v, output);

at the targets 0.5, 0.6, 0.7, 0.8, 0.85, 0.9 and 0.95, with the default rule (``histogram``) and the
study's closed form (``lognormal``); one seed. Achieved is the fraction of exact zeros of each call's
output (what the operator drew), so it carries the binomial noise of the draws.

    python experiments/threshold_training.py [--quick] [--out DIR] [--workers N] [--transformer-steps N]
                                             [--rules histogram lognormal] [--refresh-every N]

Writes ``threshold_training.json`` (per rule and layer type: mean and max over layers and targets of
|achieved - target|, the signed mean, and the element-weighted mean over everything) to ``--out``;
finished jobs are kept in ``threshold_jobs.jsonl`` there.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pandas as pd  # noqa: E402
from _accuracy import QUICK_PREPARE, QUICK_STEPS, RESULTS, STEPS, Job, environment, run_jobs, write_json  # noqa: E402
from pruning_real import layer_types  # noqa: E402

import gradstats  # noqa: E402

TARGETS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)
RULES = ("histogram", "lognormal")
TRANSFORMER_STEPS = 120


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny data, a few steps, two targets (smoke test)")
    ap.add_argument("--out", default=str(RESULTS), help="directory of the JSON results")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (one torch thread each; 0: in this process)")
    ap.add_argument("--transformer-steps", type=int, default=TRANSFORMER_STEPS)
    ap.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    ap.add_argument("--refresh-every", type=int, default=1, metavar="N",
                    help="apply(..., refresh_every=N): statistics, threshold and scale solved on every N-th gradient "
                         "(default 1, apply's own); the jobs of another N are other jobs")
    a = ap.parse_args(argv)
    a.out = Path(a.out)
    a.out.mkdir(parents=True, exist_ok=True)
    return a


def jobs(args: argparse.Namespace) -> list[Job]:
    targets = (0.5, 0.9) if args.quick else TARGETS
    out = []
    for model in ("cnn", "transformer"):
        steps = QUICK_STEPS if args.quick else (STEPS["cnn"] if model == "cnn" else args.transformer_steps)
        prep = (QUICK_PREPARE if model == "cnn" else {"n_layers": 1, "d_model": 32}) if args.quick else {}
        for rule in args.rules:
            for t in targets:
                plan = gradstats.Plan.uniform(sparsity=t, threshold_rule=rule).to_dict()
                out.append(Job("threshold", f"{rule} {t:g}", model, 0, steps, plan,
                               {"threshold_rule": rule, "target_sparsity": t}, prep,
                               apply={"refresh_every": args.refresh_every} if args.refresh_every != 1 else {}))
    return out


def per_layer(df: pd.DataFrame) -> pd.DataFrame:
    rows, types_of = [], {}
    for _, r in df.iterrows():
        types = types_of.setdefault(r["model"], layer_types(r["model"]))
        for layer, v in (r.get("layers") or {}).items():
            rows.append({"model": r["model"], "rule": r["threshold_rule"], "target": r["target_sparsity"],
                         "layer": layer, "type": types.get(layer, "other"), "n": v["n"],
                         "achieved": v["achieved_sparsity"], "miss": v["achieved_sparsity"] - r["target_sparsity"]})
    return pd.DataFrame(rows)


def summarise(layers: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (rule, kind), g in list(layers.groupby(["rule", "type"])) + [((r, "all layers"), g) for r, g in
                                                                      layers.groupby("rule")]:
        w = g["n"]
        rows.append({"rule": rule, "type": kind, "cases": len(g), "mean_abs_miss": float(g["miss"].abs().mean()),
                     "max_abs_miss": float(g["miss"].abs().max()), "mean_miss": float(g["miss"].mean()),
                     "weighted_abs_miss": float((g["miss"].abs() * w).sum() / w.sum())})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = parse(argv)
    t0 = time.perf_counter()
    df = run_jobs(jobs(args), args.out / "threshold_jobs.jsonl", workers=args.workers, desc="thresholds in training")
    if "error" in df and df["error"].notna().any():
        raise SystemExit(f"failed jobs: {df[df['error'].notna()][['label', 'model', 'error']].to_dict('records')}")
    layers = per_layer(df)
    table = summarise(layers)
    pd.set_option("display.width", 160)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    write_json(args.out / "threshold_training.json", {
        "command": "python experiments/threshold_training.py" + (" --quick" if args.quick else "")
                   + (f" --refresh-every {args.refresh_every}" if args.refresh_every != 1 else "")
                   + (f" --rules {' '.join(args.rules)}" if list(args.rules) != list(RULES) else ""),
        "refresh_every": args.refresh_every,
        "steps": {"cnn": QUICK_STEPS if args.quick else STEPS["cnn"],
                  "transformer": QUICK_STEPS if args.quick else args.transformer_steps},
        "targets": sorted(set(layers["target"])), "wall_s": round(time.perf_counter() - t0, 1),
        "environment": environment(), "table": table.to_dict("records"), "layers": layers.to_dict("records")})
    return table


if __name__ == "__main__":
    main()
