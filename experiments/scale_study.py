"""The study at scale: what the default plans cost, judged by paired confidence intervals against a
non-inferiority margin stated in advance.

The protocol (also stated in ``docs/RESULTS.md``, before the tables):

* **Training.** The CNN with BatchNorm on full Fashion-MNIST (60k/10k), 3 epochs (1,407 SGD steps
  at batch 128, cosine schedule to zero); ResNet-20 on the same data, 2 epochs (938 steps); the
  character transformer (4 layers, d_model 128) on Shakespeare, 1,200 AdamW steps at batch 16
  (cosine after 30 warm-up steps). Convergence was not measured (no learning curve is recorded).
* **Pairing.** Every configuration is trained with the seeds of its model (CNN: 5, the others: 3);
  seed ``s`` fixes the initialisation and the minibatch order, for the baseline and every
  configuration alike, and the stochastic pruning and rounding streams.
* **Plans** are made once, from a calibration trace of the plain model (its first 50 steps, seed
  0), and kept in ``scale_plans.json``: later sittings train exactly the plans the first one made.
* **Test.** Per configuration the paired differences ``d_s = treatment_s - baseline_s`` (accuracy in
  points; for the transformer, ``baseline_loss_s - loss_s`` in nats, so that positive is better
  for both); their mean and a 95% confidence interval (t distribution, n-1 degrees of freedom).
  It passes when the interval's lower end is above the margin (-0.3 points of accuracy, -0.01
  nats of validation loss): *no loss* when it also reaches zero, *non-inferior* when it lies
  below zero (a loss smaller than the margin). The old "within one standard deviation of the
  baseline" is reported beside it for comparison with the earlier tables only.
* **Placement.** *default*: what ``Plan.uniform`` and ``recommend`` choose (every matmul layer
  but the output layer, from the first step); *study*: the convolutions' outputs only (the
  classifier in full precision), after a warm-up (pruning: half an epoch; formats: one epoch);
  *every layer*: the output layer included.

Jobs run in priority order (``--tiers``): tier A holds the study's two claims and the pushes past
them on every model, B the pruning table's other rows (on ResNet-20 and the transformer: 50% and
70% sparsity and ResNet-20 at 8 bits, added after their 85% and 90% rows had failed, to find where
they start to lose), C the hand-picked formats and placements (on ResNet-20 also 85% on half of its
layers at a time, added to test why its 85% row lost).
Every finished job is appended to ``scale_jobs.jsonl``; a rerun trains only what is missing, so
the study runs across several sittings. ``--remaining`` prints what is left and an estimate of
its time and trains nothing.

    python experiments/scale_study.py [--quick] [--out DIR] [--workers N] [--tiers A B C]
                                      [--models cnn resnet20 transformer] [--remaining]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pandas as pd  # noqa: E402
from _accuracy import (  # noqa: E402
    QUICK_PREPARE,
    RESULTS,
    Job,
    calibrate,
    environment,
    global_scale,
    load_rows,
    plan_digest,
    run_jobs,
    write_json,
)

EXPERIMENT = "scale"
CALIBRATION_STEPS = 50

#: per model: training steps, seeds, the metric and its margin, and the data and training settings
PROTOCOL = {
    "cnn": dict(steps=1407, epochs=3, seeds=(0, 1, 2, 3, 4), metric="accuracy", margin=-0.3,
                prepare={}, train={}, epoch_steps=469),
    "resnet20": dict(steps=938, epochs=2, seeds=(0, 1, 2), metric="accuracy", margin=-0.3,
                     prepare={}, train={}, epoch_steps=469),
    "transformer": dict(steps=1200, epochs=None, seeds=(0, 1, 2), metric="loss", margin=-0.01,
                        prepare={"d_model": 128, "n_layers": 4}, train={"batch_size": 16}, epoch_steps=300),
}
#: SGD (momentum 0.9) for the transformer's diagnosis rows: the best of 0.1 (validation loss 2.51),
#: 0.3 (2.47) and 1.0 (diverged at step 27), 1,200 steps, seed 0, the protocol's schedule and batch
TRANSFORMER_SGD_LR = 0.3
#: the control rerun at 0.1 (at 0.3 the baseline diverged on seeds 1 and 2): the same plans, tagged
#: ``[sgd, lr 0.1]`` and paired with ``baseline [sgd, lr 0.1]``
TRANSFORMER_SGD_RERUN_LR = 0.1
#: the quick version (tests): tiny data, a few steps, two seeds (a paired interval needs two)
QUICK = {
    "cnn": dict(steps=6, seeds=(0, 1), prepare=QUICK_PREPARE, train={}, epoch_steps=2, calibration_steps=3),
    "resnet20": dict(steps=3, seeds=(0, 1), prepare=QUICK_PREPARE, train={}, epoch_steps=1, calibration_steps=3),
    "transformer": dict(steps=4, seeds=(0, 1), prepare={"d_model": 32, "n_layers": 1}, train={"batch_size": 4},
                        epoch_steps=1, calibration_steps=3),
}


#: the larger scale where a GPU is available (``--gpu``; one prepared run within a 15-minute device
#: budget): the CNN for 8 epochs with 6 seeds, a ResNet-18 (CIFAR-style, Fashion-MNIST at 32x32) for
#: 4 epochs with 3 seeds; the devices' own results, not mixed with the CPU tables
PROTOCOL_GPU = {
    "cnn": dict(steps=3750, epochs=8, seeds=(0, 1, 2, 3, 4, 5), metric="accuracy", margin=-0.3,
                prepare={}, train={}, epoch_steps=469),
    "resnet18": dict(steps=1876, epochs=4, seeds=(0, 1, 2), metric="accuracy", margin=-0.3,
                     prepare={}, train={}, epoch_steps=469),
}


def protocol_of(args: argparse.Namespace, model: str) -> dict:
    """The protocol a command line asks for: CPU or GPU, full or quick (``--quick``), on ``--device``."""
    if args.gpu:
        proto = {**PROTOCOL_GPU[model]}
        if args.quick:
            proto.update(steps=3, seeds=(0, 1), prepare=dict(QUICK_PREPARE), epoch_steps=2, calibration_steps=2)
        if args.device != "cpu":
            proto["prepare"] = {**proto["prepare"], "device": args.device}
        if args.data_root and not args.quick:
            proto["prepare"] = {**proto["prepare"], "root": args.data_root}
        return proto
    return {**PROTOCOL[model], **(QUICK[model] if args.quick else {})}


def suffix(args: argparse.Namespace) -> str:
    """The results files' suffix: "", "_quick", "_gpu", "_gpu_quick"."""
    return ("_gpu" if args.gpu else "") + ("_quick" if args.quick else "")


@dataclass(frozen=True)
class Config:
    """One configuration of the study: its table, tier, label, how it is placed, and what it is."""

    model: str
    table: str          # "pruning", "lowprec", "push", "placement"
    tier: str           # "A", "B", "C"
    label: str
    placement: str = "default"
    sparsity: float | None = None
    bits: int | None = None
    block: str | None = None          # None (per tensor), "mx", "nvfp4"
    rule: str | None = None           # threshold rule, format choice
    rounding: str | None = None
    train: tuple = ()                 # training settings that differ from the protocol's, as items
    options: tuple = ()               # further recommend() arguments, as items
    plan_from: str | None = None      # the configuration whose stored plan this one trains


def baseline_of(label: str) -> str:
    """The baseline a configuration is paired with: ``"baseline"``, or for a label with a training
    tag (``"recommend(bits=6) [sgd]"``) the baseline trained the same way (``"baseline [sgd]"``)."""
    return "baseline" + (label[label.rindex(" ["):] if label.endswith("]") and " [" in label else "")


def configurations(model: str) -> list[Config]:
    """Every configuration of ``model``, in the order the jobs run."""
    C = lambda *a, **k: Config(model, *a, **k)  # noqa: E731
    base = [C("baseline", "A", "baseline")]
    headline = [
        C("pruning", "A", "Plan.uniform(sparsity=0.85)", sparsity=0.85, rule="histogram"),
        C("lowprec", "A", "recommend(bits=6)", bits=6),
        C("pruning", "A", "Plan.uniform(sparsity=0.9)", sparsity=0.9, rule="histogram"),
        C("lowprec", "A", "recommend(bits=4, granularity='nvfp4')", bits=4, block="nvfp4"),
    ]
    # the FP6 choice before the flush bound (recommend's default until the transformer's rows below
    # showed what it costs under Adam): on every model, beside the default
    before = C("lowprec", "A", "recommend(bits=6, flush_bound=None)", bits=6, options=(("flush_bound", None),))
    # the study's placement of the failing pruning claim: on ResNet-20 and the transformer every
    # planned layer is a convolution or has none, so this row isolates the warm-up (half an epoch)
    warm = C("placement", "A", "Plan.uniform(sparsity=0.85), study placement", placement="study", sparsity=0.85)
    # tier B on the two models that lose at 85%: where pruning starts to cost, and 8 bits
    lighter = [C("pruning", "B", f"Plan.uniform(sparsity={s})", sparsity=s, rule="histogram") for s in (0.5, 0.7)]
    if model == "resnet20":    # tier C: why 85% loses, half the layers at a time (nearest the input, the output)
        halves = [C("placement", "C", f"Plan.uniform(sparsity=0.85), {h}", placement=h, sparsity=0.85)
                  for h in ("input half", "output half")]
        return base + headline + [before, warm] + lighter + [C("lowprec", "B", "recommend(bits=8)", bits=8)] + halves
    if model == "transformer":    # why the earlier default failed here (rounding, width, optimizer), first
        sgd = (("optimizer", "sgd"), ("lr", TRANSFORMER_SGD_LR))
        diagnosis = [
            C("diagnosis", "A", "recommend(bits=6, rounding='stochastic')", bits=6, rounding="stochastic"),
            C("diagnosis", "A", "recommend(bits=8)", bits=8),
            C("diagnosis", "A", "baseline [sgd]", train=sgd),
            C("diagnosis", "A", "recommend(bits=6, flush_bound=None) [sgd]", bits=6, train=sgd,
              options=(("flush_bound", None),)),
            C("diagnosis", "A", "Plan.uniform(sparsity=0.85) [sgd]", sparsity=0.85, rule="histogram", train=sgd),
        ]
        rerun = (("optimizer", "sgd"), ("lr", TRANSFORMER_SGD_RERUN_LR))
        diagnosis += [dataclasses.replace(c, label=c.label.replace(" [sgd]", f" [sgd, lr {TRANSFORMER_SGD_RERUN_LR:g}]"),
                                          train=rerun, plan_from=None if is_baseline(c.label) else c.label)
                      for c in diagnosis if c.label.endswith(" [sgd]")]
        return base + headline[:3] + diagnosis + headline[3:] + [
            C("push", "A", "recommend(bits=6, sparsity=0.85)", sparsity=0.85, bits=6), before, warm] + lighter
    return base + headline + [before] + [
        # tier A: past the study
        C("push", "A", "recommend(bits=6, sparsity=0.85)", sparsity=0.85, bits=6),
        C("lowprec", "A", "recommend(bits=5, candidates='any')", bits=5, rule="any"),
        C("pruning", "A", "Plan.uniform(sparsity=0.95)", sparsity=0.95, rule="histogram"),
        C("lowprec", "A", "recommend(bits=4, granularity='mx')", bits=4, block="mx"),
        C("lowprec", "A", "recommend(bits=4)", bits=4),
        C("lowprec", "A", "recommend(bits=8)", bits=8),
        C("push", "A", "recommend(bits=4, granularity='nvfp4', sparsity=0.9)", sparsity=0.9, bits=4, block="nvfp4"),
        # tier B: the rest of the pruning table
        *[C("pruning", "B", f"Plan.uniform(sparsity={s})", sparsity=s, rule="histogram") for s in (0.5, 0.7, 0.8)],
        *[C("pruning", "B", f"Plan.uniform(sparsity={s}, threshold_rule='{r}')", sparsity=s, rule=r)
          for s in (0.85, 0.9) for r in ("lognormal", "exact", "normal", "laplace")],
        *[C("pruning", "B", f"allocated {s}", sparsity=s, rule="allocated") for s in (0.85, 0.9)],
        # tier C: the study's hand-picked FP6 and placement first (what the earlier table compared),
        # then the other hand-picked formats of the same width, one global scale, MX at 8 bits
        C("lowprec", "C", "e3m2fn nearest, lognormal scale", bits=6, rule="hand", rounding="nearest"),
        C("placement", "C", "Plan.uniform(sparsity=0.85), study placement", placement="study", sparsity=0.85),
        C("placement", "C", "recommend(bits=6), study placement", placement="study", bits=6),
        C("lowprec", "C", "e3m2fn stochastic, amax scale", bits=6, rule="hand", rounding="stochastic"),
        C("lowprec", "C", "e3m2fn nearest, one global scale", bits=6, rule="global", rounding="nearest"),
        C("placement", "C", "Plan.uniform(sparsity=0.85), every layer", placement="every layer", sparsity=0.85),
        C("placement", "C", "recommend(bits=6), every layer", placement="every layer", bits=6),
        C("lowprec", "C", "e2m3fn stochastic, amax scale", bits=6, rule="hand", rounding="stochastic"),
        C("lowprec", "C", "e2m1fn stochastic, amax scale", bits=4, rule="hand", rounding="stochastic"),
        C("lowprec", "C", "recommend(bits=8, granularity='mx')", bits=8, block="mx"),
    ]


def make_plan(cfg: Config, calib, layers: dict[str, list[str]]) -> tuple[dict, dict]:
    """``(Plan.to_dict(), apply keyword arguments)`` for a configuration (not the baseline)."""
    import gradstats
    from gradstats.pruning import allocate

    half = len(layers["default"]) // 2
    lay = {"default": None, "study": layers["conv"], "every layer": layers["every"],
           "input half": layers["default"][:half], "output half": layers["default"][half:]}[cfg.placement]
    out_kw = {"output_layer": False} if cfg.placement == "every layer" else {}
    apply_kw: dict = {}
    if cfg.placement == "study":      # pruning after half an epoch, formats after one
        apply_kw["warmup"] = layers["epoch_steps"] // (2 if cfg.bits is None else 1)
    if cfg.rule == "hand":
        fmt = cfg.label.split()[0]
        scale = "lognormal" if cfg.rounding == "nearest" else "amax"
        plan = gradstats.Plan.uniform(format=fmt, rounding=cfg.rounding, scale=scale, layers=layers["default"])
    elif cfg.rule == "global":
        fmt = cfg.label.split()[0]
        s = global_scale(fmt, calib, layers["default"])
        plan = gradstats.Plan.uniform(format=fmt, rounding="nearest", scale="fixed", scale_value=s,
                                      layers=layers["default"])
    elif cfg.rule == "allocated":
        st = calib.stats(kinds=["grad"])
        a = allocate(st[st["layer"].isin(layers["default"])], cfg.sparsity, layer_info=calib)
        plan = gradstats.Plan.uniform(layers=layers["default"]).with_allocation(a)
    elif cfg.bits is not None:
        kw: dict = {"granularity": cfg.block} if cfg.block else {}
        if cfg.rounding is not None:
            kw["rounding"] = cfg.rounding
        kw.update(dict(cfg.options))
        if cfg.rule == "any":          # no hardware has a 5-bit float: every split of 5 bits
            kw["candidates"] = "any"
        if cfg.sparsity is not None:
            kw["sparsity"] = cfg.sparsity
            kw.setdefault("noise_bound", None)     # section 1's protocol was run before the noise bound
        if lay is not None:
            kw["layers"] = lay
        plan = gradstats.recommend(calib, bits=cfg.bits, **kw, **out_kw)
    else:
        kw = {} if cfg.rule in (None, "histogram") else {"threshold_rule": cfg.rule}
        if lay is not None:
            kw["layers"] = lay
        plan = gradstats.Plan.uniform(sparsity=cfg.sparsity, **kw, **out_kw)
    return plan.to_dict(), apply_kw


def model_layers(model: str, prepare_kw: dict) -> dict:
    """The layer sets of the placements: default, the convolutions, every matmul layer (each in the
    model's order, input first)."""
    import gradstats
    from gradstats.zoo.training import prepare

    m = prepare(model, seed=0, **prepare_kw).model
    default = list(gradstats.Plan.uniform().resolve(m))
    every = list(gradstats.Plan.uniform(output_layer=False).resolve(m))
    conv = [n for n, mod in m.named_modules() if type(mod).__name__.startswith("Conv") and n in every] or default
    return {"default": default, "every": every, "conv": conv}


def plans_for(model: str, proto: dict, configs: list[Config], path: Path) -> dict[str, tuple[dict, dict]]:
    """The plans of ``configs``, made once from the calibration trace and kept in ``path`` (JSON):
    a later sitting reuses them, so that every seed of a configuration trains the same plan."""
    import torch

    store = json.loads(path.read_text()) if path.exists() else {}
    key = lambda cfg: f"{cfg.model}/{cfg.label}/{json.dumps(proto['prepare'], sort_keys=True)}"  # noqa: E731
    copies = [c for c in configs if c.plan_from and key(c) not in store
              and key(dataclasses.replace(c, label=c.plan_from)) in store]
    for c in copies:             # the same plan trained another way: the stored one, not a new calibration
        store[key(c)] = store[key(dataclasses.replace(c, label=c.plan_from))]
    missing = [c for c in configs if not is_baseline(c.label) and key(c) not in store]
    if missing:
        torch.set_num_threads(1)              # the calibration is then the same on every machine
        calib = calibrate(model, prepare_kw=proto["prepare"], steps=proto.get("calibration_steps", CALIBRATION_STEPS),
                          train_kw=proto["train"])
        layers = {**model_layers(model, proto["prepare"]), "epoch_steps": proto["epoch_steps"]}
        for cfg in missing:
            plan, apply_kw = make_plan(cfg, calib, layers)
            store[key(cfg)] = {"plan": plan, "apply": apply_kw}
        write_json(path, store)
    if copies:
        write_json(path, store)
    return {c.label: ((store[key(c)]["plan"], store[key(c)]["apply"]) if not is_baseline(c.label) else (None, {}))
            for c in configs}


def is_baseline(label: str) -> bool:
    """Whether a configuration's label names the plain model (the baseline, or one trained another way)."""
    return baseline_of(label) == label


def study_jobs(args: argparse.Namespace) -> list[Job]:
    """Every job of the selected models and tiers, in priority order: tier by tier, and within a
    tier configuration by configuration (the study's two claims first), model by model, seed by
    seed."""
    jobs: list[tuple[tuple, Job]] = []
    for model in args.models:
        proto = protocol_of(args, model)
        configs = [c for c in configurations(model) if c.tier in args.tiers or is_baseline(c.label)]
        plans = plans_for(model, proto, configs, args.out / f"scale_plans{suffix(args)}.json")
        for i, cfg in enumerate(configs):
            plan, apply_kw = plans[cfg.label]
            info = {"table": cfg.table, "tier": cfg.tier, "placement": cfg.placement, "target_sparsity": cfg.sparsity,
                    "bits": cfg.bits, "block": cfg.block, "rule": cfg.rule, "rounding": cfg.rounding}
            for s in proto["seeds"]:
                order = ("ABC".index(cfg.tier), i, args.models.index(model), s)
                jobs.append((order, Job(EXPERIMENT, cfg.label, model, s, proto["steps"], plan, info,
                                        dict(proto["prepare"]), apply_kw, {**proto["train"], **dict(cfg.train)})))
    return [j for _, j in sorted(jobs, key=lambda t: t[0])]


def remaining(jobs: list[Job], path: Path) -> pd.DataFrame:
    """What is left: per model and tier, the jobs not yet in ``path`` and their estimated core time
    (the median wall time of the finished jobs of the same model and length, with or without a
    plan; 1.2x the baseline's for a plan not yet timed)."""
    done = load_rows(path)
    rows = [{"model": j.model, "tier": j.info.get("tier", "A"), "planned": j.plan is not None,
             "steps": j.steps, "done": j.key in done,
             "wall_s": done[j.key].get("wall_s") if j.key in done else math.nan} for j in jobs]
    df = pd.DataFrame(rows)
    med = df[df["done"]].groupby(["model", "steps", "planned"])["wall_s"].median().to_dict()
    fallback = {"cnn": 0.09, "resnet20": 0.33, "transformer": 0.21, "resnet18": 0.05}  # s per step, measured

    def estimate(r) -> float:
        if (r["model"], r["steps"], r["planned"]) in med:
            return med[(r["model"], r["steps"], r["planned"])]
        if r["planned"] and (r["model"], r["steps"], False) in med:
            return 1.2 * med[(r["model"], r["steps"], False)]
        return fallback.get(r["model"], 0.3) * r["steps"] * (1.2 if r["planned"] else 1.0)

    df["estimate_s"] = df.apply(estimate, axis=1)
    left = df[~df["done"]]
    return (left.groupby(["model", "tier"]).agg(jobs=("done", "size"), core_hours=("estimate_s", "sum"))
            .assign(core_hours=lambda t: t["core_hours"] / 3600).reset_index())


def half_width(sd: float, n: int) -> float:
    """The half-width of the 95% t interval of a mean of ``n`` paired differences of standard
    deviation ``sd`` (NaN below two seeds)."""
    from scipy import stats as st

    return float(st.t.ppf(0.975, n - 1)) * sd / math.sqrt(n) if n > 1 else math.nan


def paired_table(df: pd.DataFrame, protocol: dict) -> pd.DataFrame:
    """Per (model, configuration): seeds, mean metric, the mean paired difference to the baseline
    with its 95% interval (t), *no loss* (the lower end above the margin), the old within-one-std
    column, and the achieved sparsity, underflow and saturation (size-weighted over training)."""
    rows = []
    ok = df[df["error"].isna()] if "error" in df else df
    for model, g in ok.groupby("model", sort=False):
        proto = protocol[model]
        loss = proto["metric"] == "loss"
        value = (g["test_loss"] if loss else 100 * g["test_accuracy"]).astype(float)
        g = g.assign(value=value)
        wide = g.pivot_table(index="seed", columns="label", values="value")
        for label in dict.fromkeys(g["label"]):
            if baseline_of(label) not in wide:
                continue
            base = wide[baseline_of(label)]
            bmean, bstd = float(base.mean()), float(base.std(ddof=1)) if len(base) > 1 else 0.0
            d = ((base - wide[label]) if loss else (wide[label] - base)).dropna()
            n = len(d)
            done = g[g["label"].isin([label, baseline_of(label)])].groupby("seed")["label"].nunique()
            finished = int((done == (1 if label == baseline_of(label) else 2)).sum())
            mean = float(d.mean()) if n else math.nan
            sd = float(d.std(ddof=1)) if n > 1 else math.nan
            half = half_width(sd, n)
            lo, hi = mean - half, mean + half
            gl = g[g["label"] == label]
            first = gl.iloc[0]
            vmean = float(wide[label].mean())
            within = (vmean <= bmean + bstd) if loss else (vmean >= bmean - bstd)
            rows.append({
                "model": model, "table": first.get("table", "baseline"), "tier": first.get("tier", "A"),
                "label": label, "placement": first.get("placement", "default"),
                "target_sparsity": first.get("target_sparsity"), "bits": first.get("bits"),
                "block": first.get("block"), "rule": first.get("rule"),
                "seeds": n, "seeds_planned": len(proto["seeds"]), "seeds_finished": finished,
                "metric": proto["metric"],
                "value_mean": vmean, "value_std": float(wide[label].std(ddof=1)) if n > 1 else math.nan,
                "diff_mean": mean, "diff_sd": sd, "ci_low": lo, "ci_high": hi, "margin": proto["margin"],
                "no_loss": (bool(lo > proto["margin"]) if n > 1 else None) if not is_baseline(label) else None,
                # the whole interval below the margin: a loss larger than the margin, at 95%
                "loss": (bool(hi < proto["margin"]) if n > 1 else None) if not is_baseline(label) else None,
                "within_1std": bool(within),
                "achieved_sparsity": float(gl["achieved_sparsity"].mean()),
                "underflow": float(gl["underflow_fraction"].mean()), "overflow": float(gl["overflow_fraction"].mean()),
                "wall_s": float(gl["wall_s"].sum()), "diverged": int(gl["diverged"].sum())})
    return pd.DataFrame(rows)


def aggressiveness(r: pd.Series) -> tuple:
    """How far a configuration goes: fewer bits and more sparsity rank higher (for "the most
    aggressive configuration that passed")."""
    bits = r["bits"] if r["bits"] == r["bits"] and r["bits"] is not None else 32
    sp = r["target_sparsity"] if r["target_sparsity"] == r["target_sparsity"] and r["target_sparsity"] is not None else 0
    return (32 - bits) / 28 + sp, -bits


def load_results(out: Path, *, quick: bool = False) -> tuple[pd.DataFrame, dict]:
    """The finished jobs of the study (the raw JSON lines, whatever has run so far) that belong to
    the current protocol, and the stored plans: what ``report.py`` renders."""
    jobs_path = out / ("scale_jobs_quick.jsonl" if quick else "scale_jobs.jsonl")
    plans_path = out / ("scale_plans_quick.json" if quick else "scale_plans.json")
    plans = json.loads(plans_path.read_text()) if plans_path.exists() else {}
    rows = list(load_rows(jobs_path).values())
    keep = []
    for r in rows:
        proto = {**PROTOCOL.get(r["model"], {}), **(QUICK.get(r["model"], {}) if quick else {})}
        labels = {c.label for c in configurations(r["model"])} if proto else set()
        if proto and r["steps"] == proto["steps"] and r["seed"] in proto["seeds"] and r["label"] in labels:
            plan = None if is_baseline(r["label"]) else stored_plan(plans, r["model"], r["label"])
            if plan is not None and not r["key"].endswith("plan-" + plan_digest(plan)):
                continue                 # trained on a plan the configuration no longer makes (stale)
            keep.append(r)
    df = pd.DataFrame(keep)
    if len(df) and "error" not in df:
        df["error"] = None
    return df, plans


def stored_plan(plans: dict, model: str, label: str) -> dict | None:
    """The ``Plan.to_dict()`` stored for ``(model, label)`` in a plans file, or None."""
    return next((v["plan"] for key, v in plans.items() if key.startswith(f"{model}/{label}/")), None)


def plan_formats(plans: dict, model: str, label: str) -> str:
    """The formats a stored plan puts on its layers ("e3m2fn", "e2m1fn/e3m2fn"; "-": none)."""
    plan = stored_plan(plans, model, label) or {}
    fmts = {e.get("format") for e in plan.get("layers", []) if e.get("format")}
    if plan.get("defaults", {}).get("format"):
        fmts.add(plan["defaults"]["format"])
    return "/".join(sorted(fmts)) or "-"


def plan_predictions(plans: dict, model: str, label: str) -> pd.DataFrame:
    """The per-layer predictions a stored recommended plan carries (error, bias, flushed...)."""
    plan = stored_plan(plans, model, label) or {}
    return pd.DataFrame([{"layer": e["layer"], "format": e.get("format"), **e["predicted"]}
                         for e in plan.get("layers", []) if "predicted" in e])


def criterion_ranking(table: pd.DataFrame, plans: dict) -> pd.DataFrame:
    """Per model: Spearman's rank correlation, over the recommended quantising plans trained with
    the protocol's optimizer, between the paired loss (minus the mean difference) and each criterion the plans predicted (mean over
    layers of the relative error, |bias| and flushed fraction), with ``n_<criterion>`` the plans
    that predicted it (those the correlation is over)."""
    from scipy import stats as st

    out = []
    sel = (table["table"].isin(["lowprec", "diagnosis"]) & table["label"].str.startswith("recommend")
           & (table["placement"] == "default") & (table["label"].map(baseline_of) == "baseline")
           & table["target_sparsity"].isna())            # quantising only, trained as the protocol says
    for model, g in table[sel].groupby("model"):
        rows = []
        for _, r in g.iterrows():
            pred = plan_predictions(plans, model, r["label"])
            if len(pred):
                col = lambda c: pred[c].abs().mean() if c in pred else math.nan  # noqa: E731
                rows.append({"loss": -r["diff_mean"], "error": col("error"), "bias": col("bias"),
                             "flushed": col("flushed")})
        d = pd.DataFrame(rows)
        if len(d) >= 3:
            rho = {}
            for c in ("error", "bias", "flushed"):
                dc = d[[c, "loss"]].dropna()
                rho[f"rho_{c}"] = float(st.spearmanr(dc[c], dc["loss"])[0]) if len(dc) >= 3 else math.nan
                rho[f"n_{c}"] = len(dc)                  # the plans that predicted this criterion
            out.append({"model": model, "plans": len(d), **rho})
    return pd.DataFrame(out)


def most_aggressive(table: pd.DataFrame) -> pd.DataFrame:
    """Per model: the configurations that passed the non-inferiority test, most aggressive first
    (fewest bits, then most sparsity; the placement study's rows excluded)."""
    ok = table[(table["no_loss"] == True) & (table["seeds"] == table["seeds_planned"])  # noqa: E712
               & (table["placement"] == "default")
               & (table["label"].map(baseline_of) == "baseline")].copy()   # trained as the protocol says
    ok["rank"] = ok.apply(lambda r: aggressiveness(r)[0], axis=1)
    return ok.sort_values(["model", "rank"], ascending=[True, False])


def plot_forest(table: pd.DataFrame, path: Path) -> Path:
    """One panel per model: each configuration's mean paired difference and 95% interval, the
    margin as a dashed line; intervals wholly above the margin are drawn in the passing colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = table[~table["label"].map(is_baseline) & (table["seeds"] > 1)]
    models = list(dict.fromkeys(t["model"]))
    if not models:                       # nothing beside the baseline has two seeds yet
        fig, ax = plt.subplots(figsize=(6, 1.5))
        ax.text(0.5, 0.5, "no configuration with two paired seeds yet", ha="center", va="center")
        ax.set_axis_off()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
    heights = [max(2.0, 0.28 * (t["model"] == m).sum() + 1.0) for m in models]
    fig, axes = plt.subplots(len(models), 1, figsize=(8.5, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, model in zip(axes[:, 0], models):
        g = t[t["model"] == model].iloc[::-1]
        y = range(len(g))
        unit = "nats (baseline loss - loss)" if g["metric"].iloc[0] == "loss" else "accuracy points"
        colours = ["#1b7837" if v is True else ("#b2182b" if lost is True else ("#e08214" if v is False else "#999999"))
                   for v, lost in zip(g["no_loss"], g["loss"])]
        margin = float(g["margin"].iloc[0])
        left = max(min(g["ci_low"].min(), margin) * 1.08, 10 * margin)   # far failures: clipped, labelled
        right = min(max(g["ci_high"].max(), -margin) * 1.08, -6 * margin)
        for yi, (_, r), c in zip(y, g.iterrows(), colours):
            lo_c, hi_c, m_c = max(r["ci_low"], left), min(r["ci_high"], right), min(max(r["diff_mean"], left), right)
            ax.plot([lo_c, hi_c], [yi, yi], color=c, lw=2, solid_capstyle="butt")
            ax.plot([m_c], [yi], "o", color=c, ms=4)
            if r["ci_low"] < left or r["ci_high"] > right:      # clipped: the numbers beside it
                ax.annotate(f"{r['diff_mean']:+.2f} [{r['ci_low']:+.2f}, {r['ci_high']:+.2f}] (clipped)",
                            (left, yi), xytext=(3, 3.5), textcoords="offset points", fontsize=6, color=c)
        ax.axvline(margin, ls="--", color="k", lw=1)
        # the margin named above the panel, where no interval can be under it (a legend could)
        ax.annotate(f"margin {margin:+g}", (margin, 1.0), xycoords=("data", "axes fraction"),
                    xytext=(0, 2), textcoords="offset points", ha="center", va="bottom", fontsize=7)
        ax.axvline(0, color="#888888", lw=0.8)
        ax.set_xlim(left, right)
        ax.set_ylim(-0.7, len(g) - 0.3)
        ax.set_yticks(list(y))
        ax.set_yticklabels([f"{lab} ({n}/{p} seeds)" if n < p else lab for lab, n, p in
                            zip(g["label"], g["seeds"], g["seeds_planned"])], fontsize=7)
        ax.set_title(f"{model}: paired difference to the baseline, 95% interval\n"
                     "green: passed (no loss; non-inferior where wholly below 0)\n"
                     "orange: loss not excluded; red: loss", fontsize=9, pad=12)
        ax.set_xlabel(unit, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def predicted_vs_achieved(df: pd.DataFrame, plans: dict, table: pd.DataFrame) -> pd.DataFrame:
    """Per (model, configuration, layer) of every planned job kind: what the plan predicted (the
    flushed fraction of a recommended format; the target sparsity of a pruning rule) beside what
    training achieved (underflow, achieved sparsity; size-weighted over the run, mean over seeds),
    and whether the configuration passed."""
    verdict = {(r["model"], r["label"]): r["no_loss"] if r["seeds"] == r["seeds_planned"] else None
               for _, r in table.iterrows()}          # pending: not judged
    rows = []
    for (model, label), g in df[~df["label"].map(is_baseline)].groupby(["model", "label"], sort=False):
        per = [j for j in g["layers"] if isinstance(j, dict)] if "layers" in g else []
        if not per:
            continue
        pred = plan_predictions(plans, model, label)
        pred = pred.set_index("layer") if len(pred) else pd.DataFrame()
        for layer in per[0]:
            vals = [p[layer] for p in per if layer in p]
            row = {"model": model, "label": label, "layer": layer, "passed": verdict.get((model, label)),
                   "target_sparsity": vals[0].get("target_sparsity"),
                   "achieved_sparsity": float(pd.Series([v["achieved_sparsity"] for v in vals]).mean()),
                   "underflow": float(pd.Series([v.get("underflow_fraction", math.nan) for v in vals]).mean()),
                   "predicted_flushed": float(pred.loc[layer, "flushed"]) if layer in pred.index and "flushed" in pred
                   else math.nan,
                   "format": pred.loc[layer, "format"] if layer in pred.index else None}
            rows.append(row)
    return pd.DataFrame(rows)


def plot_predicted(pva: pd.DataFrame, path: Path) -> Path:
    """Two panels: per layer, the flushed fraction a recommended plan predicted against the
    underflow its training measured, and the target sparsity against the achieved one; configurations
    that did not pass the test in red, those that passed in green, pending in grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.4))
    colour = lambda v: "#1b7837" if v is True else ("#b2182b" if v is False else "#999999")  # noqa: E731
    marks = {"cnn": "o", "resnet20": "s", "transformer": "^"}
    # formats alone (with pruning, the pruned values never reach the format to be flushed)
    q = pva[pva["predicted_flushed"].notna() & pva["target_sparsity"].isna()] if len(pva) else pva
    pr = pva[pva["target_sparsity"].notna() & pva["predicted_flushed"].isna()] if len(pva) else pva
    for ax, d, x, y, title in ((axes[0], q, "predicted_flushed", "underflow", "recommended formats: flushed fraction"),
                               (axes[1], pr, "target_sparsity", "achieved_sparsity", "pruning: sparsity")):
        for model, g in d.groupby("model") if len(d) else []:
            ax.scatter(g[x], g[y], c=[colour(v) for v in g["passed"]], marker=marks.get(model, "o"), s=22,
                       alpha=0.8, edgecolors="none")
            ax.scatter([], [], c="#555555", marker=marks.get(model, "o"), s=22, label=model)
        ax.plot([0, 1], [0, 1], color="#888888", lw=0.8, ls="--")
        ax.set_xlim(-0.02, 1.02)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("predicted (plan)" if x == "predicted_flushed" else "target")
        ax.set_ylabel("measured in training (size-weighted, mean over seeds)")
        ax.set_title(title, fontsize=9)
        if len(d):
            ax.legend(fontsize=7, title="red: did not pass; green: no loss", title_fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny data and steps, two seeds (the tests)")
    ap.add_argument("--out", default=str(RESULTS), help="directory of the results")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (one torch thread each; 0: in this process)")
    ap.add_argument("--tiers", nargs="+", default=["A", "B", "C"], choices=["A", "B", "C"])
    ap.add_argument("--models", nargs="+", default=None, choices=sorted(set(PROTOCOL) | set(PROTOCOL_GPU)),
                    help="default: every model of the protocol")
    ap.add_argument("--gpu", action="store_true", help="the larger-scale protocol for a GPU (PROTOCOL_GPU)")
    ap.add_argument("--device", default="cuda", help="with --gpu: the device to train on (default cuda)")
    ap.add_argument("--data-root", default=None, help="with --gpu: a directory with the Fashion-MNIST IDX files "
                    "(where the Debian package is not installed)")
    ap.add_argument("--remaining", action="store_true", help="print what is left to train and its estimated time")
    args = ap.parse_args(argv)
    known = PROTOCOL_GPU if args.gpu else PROTOCOL
    args.models = args.models or list(known)
    if any(m not in known for m in args.models):
        ap.error(f"--models: the {'GPU ' if args.gpu else ''}protocol has {sorted(known)}, got {args.models}")
    args.out = Path(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = parse_args(argv)
    jobs_path = args.out / f"scale_jobs{suffix(args)}.jsonl"
    t0 = time.perf_counter()
    jobs = study_jobs(args)
    left = remaining(jobs, jobs_path)
    print(f"# {len(jobs)} jobs; remaining:" if len(left) else f"# {len(jobs)} jobs, all finished")
    if len(left):
        print(left.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
        print(f"# total remaining: {int(left['jobs'].sum())} jobs, about {left['core_hours'].sum():.1f} core-hours "
              f"({left['core_hours'].sum() / max(args.workers, 1):.1f} h with {args.workers} workers)", flush=True)
    if args.remaining:
        return left
    df = run_jobs(jobs, jobs_path, workers=args.workers, desc="scale study")
    protocol = {m: protocol_of(args, m) for m in args.models}
    table = paired_table(df, protocol)
    print(table[["model", "label", "seeds", "value_mean", "diff_mean", "ci_low", "ci_high", "no_loss"]]
          .to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    write_json(args.out / f"scale_study{suffix(args)}.json", {
        "command": "python experiments/scale_study.py" + (" --gpu" if args.gpu else "") + (" --quick" if args.quick else ""),
        "protocol": {m: {k: v for k, v in p.items() if k != "prepare" or v} for m, p in protocol.items()},
        "calibration_steps": CALIBRATION_STEPS, "tiers": args.tiers,
        "wall_s": round(time.perf_counter() - t0, 1), "environment": environment(),
        "table": table.to_dict("records"), "jobs": df.to_dict("records")})
    return table


if __name__ == "__main__":
    main()
