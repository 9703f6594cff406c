"""The study's claims re-measured with the noise bound: the prospective protocol of
``docs/protocol-noise.md`` (fixed before any of its trainings).

* **Models.** ResNet-20 on Fashion-MNIST (section 1's protocol: 938 SGD steps, 2 epochs), seeds 0-5;
  the character transformer (d_model 128, 4 layers, 1,200 AdamW steps at batch 16), seeds 0-7; the
  character LSTM (``gradstats.zoo`` model ``"lstm"``, d 128, the transformer's data and training),
  seeds 0-7, new to the study.
* **Configurations.** The baseline, ``recommend(calib, sparsity=0.85)`` (bounded by default),
  ``recommend(calib, sparsity="auto")`` and ``recommend(calib, bits=6)``, every other argument at
  its default. Training length: ResNet-20 at 8 epochs (3,752 steps), baseline and
  ``Plan.uniform(sparsity=0.85)``, seeds 0-2 (the 2-epoch rows are section 1's).
* **Calibration.** Each model's plain run, seed 0, its first 50 steps, traced with
  ``sample_every=[10, 22, 34, 46]`` (noise records on those steps and the step after each); the
  plans are made once and kept in ``noise_plans.json``.
* **Test.** Section 1's (``scale_study.paired_table``): paired differences with the baseline of the
  same seed, mean and 95% t interval against the margin (-0.3 points, -0.01 nats).

Jobs run in priority order: the bounded 85% and "auto" plans on ResNet-20 and the transformer
seed by seed (question 1 and 2 first), then the LSTM, then ``bits=6``, then the 8-epoch rows.
Every finished job is appended to ``noise_jobs.jsonl`` (section 1's jobs that this protocol shares,
the baselines of the same seeds and the 2-epoch 85% rows, are taken from ``scale_jobs.jsonl``);
a rerun trains only what is missing. ``--remaining`` prints what is left and its estimated core
hours.

    python experiments/noise_study.py [--quick] [--out DIR] [--workers N] [--models ...] [--remaining]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pandas as pd  # noqa: E402
from _accuracy import QUICK_PREPARE, RESULTS, Job, calibrate, environment, load_rows, run_jobs, write_json  # noqa: E402
from scale_study import paired_table, remaining  # noqa: E402

EXPERIMENT = "noise"
CALIBRATION_STEPS = 50
SAMPLE_EVERY = (10, 22, 34, 46)
TEXT = dict(metric="loss", margin=-0.01, train={"batch_size": 16}, steps=1200, seeds=tuple(range(8)))
PROTOCOL = {
    "resnet20": dict(steps=938, seeds=tuple(range(6)), metric="accuracy", margin=-0.3, prepare={}, train={}),
    "transformer": dict(TEXT, prepare={"d_model": 128, "n_layers": 4}),
    "lstm": dict(TEXT, prepare={"d_model": 128}),
}
#: question 4: ResNet-20 trained 8 epochs, baseline and 85% uniform pruning, seeds 0-2
LONG = dict(model="resnet20", steps=3752, seeds=(0, 1, 2))
QUICK = {
    "resnet20": dict(steps=3, seeds=(0, 1), prepare=QUICK_PREPARE, train={}, calibration_steps=4, sample_every=(1,)),
    "transformer": dict(steps=4, seeds=(0, 1), prepare={"d_model": 32, "n_layers": 1}, train={"batch_size": 4},
                        calibration_steps=4, sample_every=(1,)),
    "lstm": dict(steps=4, seeds=(0, 1), prepare={"d_model": 32}, train={"batch_size": 4},
                 calibration_steps=4, sample_every=(1,)),
}
#: label -> recommend() arguments (the tier: 1 the bounded pruning, 3 the FP6 claim)
CONFIGS = {"recommend(sparsity=0.85)": ({"sparsity": 0.85}, 1),
           "recommend(sparsity='auto')": ({"sparsity": "auto"}, 1),
           "recommend(bits=6)": ({"bits": 6}, 3)}
UNIFORM = "Plan.uniform(sparsity=0.85)"


def protocol_of(model: str, quick: bool) -> dict:
    """The model's protocol, or its quick version (tests)."""
    return {**PROTOCOL[model], **(QUICK[model] if quick else {})}


def plans_for(model: str, proto: dict, path: Path) -> dict[str, dict]:
    """``{label: Plan.to_dict()}`` for every configuration of ``model``, made once from the
    calibration trace and kept in ``path`` (later sittings train the same plans)."""
    import torch

    import gradstats

    store = json.loads(path.read_text()) if path.exists() else {}
    key = lambda label: f"{model}/{label}/{json.dumps(proto['prepare'], sort_keys=True)}"  # noqa: E731
    labels = list(CONFIGS) + ([UNIFORM] if model == LONG["model"] else [])
    if any(key(lb) not in store for lb in labels):
        torch.set_num_threads(1)
        calib = calibrate(model, prepare_kw=proto["prepare"], steps=proto.get("calibration_steps", CALIBRATION_STEPS),
                          train_kw=proto["train"], sample_every=proto.get("sample_every", SAMPLE_EVERY))
        for label in labels:
            if key(label) not in store:
                plan = (gradstats.Plan.uniform(sparsity=0.85) if label == UNIFORM
                        else gradstats.recommend(calib, **CONFIGS[label][0]))
                store[key(label)] = {"plan": plan.to_dict()}
        write_json(path, store)
    return {lb: store[key(lb)]["plan"] for lb in labels}


def study_jobs(args: argparse.Namespace) -> list[Job]:
    """Every job of the selected models, in priority order (see the module's docstring)."""
    jobs: list[tuple[tuple, Job]] = []
    for model in args.models:
        proto = protocol_of(model, args.quick)
        plans = plans_for(model, proto, args.out / f"noise_plans{'_quick' if args.quick else ''}.json")
        for s in proto["seeds"]:
            def job(label: str, plan: dict | None, tier: int, steps: int = proto["steps"], **info) -> None:
                info = {"table": "length" if steps != proto["steps"] else "noise", "tier": tier, **info}
                order = (tier, s, args.models.index(model), label)
                jobs.append((order, Job(EXPERIMENT, label, model, s, steps, plan, info, dict(proto["prepare"]),
                                        {}, dict(proto["train"]))))
            first = 2 if model == "lstm" else 1
            job("baseline", None, first)
            for label, (kw, tier) in CONFIGS.items():
                job(label, plans[label], max(tier, first), target_sparsity=kw.get("sparsity"), bits=kw.get("bits", 8))
            if model == LONG["model"] and s in LONG["seeds"]:
                steps = QUICK[model]["steps"] * 2 if args.quick else LONG["steps"]
                job("baseline", None, 4, steps=steps, epochs=8)
                job(UNIFORM, plans[UNIFORM], 4, steps=steps, epochs=8, target_sparsity=0.85)
                job(UNIFORM, plans[UNIFORM], 4, epochs=2, target_sparsity=0.85)
    return [j for _, j in sorted(jobs, key=lambda t: t[0])]


def adopt_shared(jobs: list[Job], path: Path, source: Path) -> int:
    """Copy into ``path`` the rows of ``source`` (section 1's jobs) whose training is one of
    ``jobs`` under another experiment's name (a baseline is shared by key; an 85% row of the same
    model, steps, seed and plan is the same training): what need not be trained twice."""
    if not source.exists():
        return 0
    have = load_rows(path)
    theirs = list(load_rows(source).values())
    n = 0
    with open(path, "a") as fh:
        for j in jobs:
            if j.key in have:
                continue
            tail = j.key.split("/", 1)[1]
            match = next((r for r in theirs if r["key"] == j.key or r["key"].split("/", 1)[1] == tail), None)
            if match is not None:
                fh.write(json.dumps({**match, "key": j.key, "adopted_from": match["key"]}) + "\n")
                have[j.key] = match
                n += 1
    return n


def tables(df: pd.DataFrame, *, quick: bool = False) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The protocol's two paired tables from its finished jobs (``scale_study.paired_table``):
    questions 1-3 (every model, its seeds) and question 4 (ResNet-20 at 2 and 8 epochs, baseline and
    ``Plan.uniform(sparsity=0.85)``, seeds 0-2; the 8-epoch labels end in ``" [8 epochs]"``)."""
    protocol = {m: protocol_of(m, quick) for m in PROTOCOL}
    ok = df[df["error"].isna()] if "error" in df else df
    ok = ok[ok["model"].isin(list(protocol))]
    usual = ok["steps"] == ok["model"].map(lambda m: protocol[m]["steps"])
    claims = paired_table(ok[usual & (ok["label"] != UNIFORM)],
                          {m: p for m, p in protocol.items() if m in set(ok["model"])})
    model = LONG["model"]
    seeds = LONG["seeds"] if not quick else protocol[model]["seeds"]
    long = ok[(ok["model"] == model) & ok["seed"].isin(list(seeds)) & ok["label"].isin(["baseline", UNIFORM])]
    long = long.assign(label=[lab + ("" if u else " [8 epochs]") for lab, u in zip(long["label"], usual[long.index])])
    length = (paired_table(long, {model: {**protocol[model], "seeds": tuple(seeds)}}) if len(long)
              else pd.DataFrame(columns=claims.columns))
    return claims, length


def plan_summary(plans: dict, model: str, label: str, *, quick: bool = False) -> dict:
    """What the stored plan of ``model``/``label`` grants: the mean over its layers of the granted
    sparsity and of the predicted noise ratio ``R`` (``Plan.noise``, from the calibration trace), its
    largest ``R``, and its formats. Empty for a plan without noise records (``Plan.uniform``)."""
    proto = protocol_of(model, quick)
    entry = plans.get(f"{model}/{label}/{json.dumps(proto['prepare'], sort_keys=True)}")
    if entry is None:
        return {}
    plan = entry["plan"]
    noise = pd.DataFrame(plan.get("noise") or [], columns=["layer", "sparsity", "predicted_noise"])
    r = pd.to_numeric(noise["predicted_noise"], errors="coerce").dropna()
    sp = pd.Series([lay.get("sparsity") for lay in plan["layers"]], dtype=float).fillna(0.0)
    return {"granted_sparsity": float(sp.mean()) if len(sp) else math.nan,
            "R_predicted": float(r.mean()) if len(r) else math.nan,
            "R_predicted_max": float(r.max()) if len(r) else math.nan,
            "formats": ", ".join(sorted({str(lay.get("format")) for lay in plan["layers"] if lay.get("format")})),
            "noise_bound": plan.get("noise_bound")}


def left(out: Path, *, quick: bool = False) -> int:
    """How many of the protocol's jobs have not finished in ``out``, over the models whose plans are
    there (a run starts by making every selected model's plans)."""
    tag = "_quick" if quick else ""
    plans = json.loads((out / f"noise_plans{tag}.json").read_text()) if (out / f"noise_plans{tag}.json").exists() else {}
    models = [m for m in PROTOCOL if any(k.startswith(f"{m}/") for k in plans)]
    if not models:
        return 0
    args = parse_args(["--out", str(out), "--models", *models] + (["--quick"] if quick else []))
    have = load_rows(out / f"noise_jobs{tag}.jsonl")
    return sum(j.key not in have for j in study_jobs(args))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny data, a few steps, two seeds (smoke test)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--workers", type=int, default=1, help="worker processes (one torch thread each; 0: in this process)")
    ap.add_argument("--models", nargs="+", default=list(PROTOCOL), choices=list(PROTOCOL))
    ap.add_argument("--remaining", action="store_true", help="print what is left and its estimated core hours")
    args = ap.parse_args(argv)
    args.out = Path(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = parse_args(argv)
    t0 = time.perf_counter()
    tag = "_quick" if args.quick else ""
    jobs = study_jobs(args)
    path = args.out / f"noise_jobs{tag}.jsonl"
    adopted = adopt_shared(jobs, path, args.out / f"scale_jobs{tag}.jsonl")
    if args.remaining:
        left = remaining(jobs, path)
        print(left.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
        return left
    df = run_jobs(jobs, path, workers=args.workers, desc="noise study")
    claims, length = tables(df, quick=args.quick)
    table = pd.concat([claims, length], ignore_index=True)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    write_json(args.out / f"noise_study{tag}.json", {
        "command": "python experiments/noise_study.py" + (" --quick" if args.quick else ""),
        "protocol": "docs/protocol-noise.md", "adopted_jobs": adopted, "wall_s": round(time.perf_counter() - t0, 1),
        "environment": environment(), "table": table.to_dict("records"), "jobs": df.to_dict("records")})
    return table


if __name__ == "__main__":
    main()
