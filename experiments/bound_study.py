"""Does the noise bound earn its keep? The prospective protocol of ``docs/protocol-bound.md``
(committed before any of its trainings).

* **Models.** ResNet-20 on Fashion-MNIST and the character transformer, as ``noise_study`` trains
  them (its ``PROTOCOL``: section 1's 938 SGD steps; 1,200 AdamW steps at batch 16), seeds 0-7; the
  character LSTM (same data and training as the transformer) for the ``bits="auto"`` arm, seeds 0-7.
* **Calibration, per seed.** Seed ``s``'s plain model, its first 50 steps traced with
  ``sample_every=[10, 22, 34, 46]`` (``_accuracy.calibrate_task``); every plan of seed ``s`` is made
  from that trace and trained with seed ``s``. The plans are made once and kept in
  ``bound_plans.json`` with what the probe measured.
* **Arms.** ``recommend(calib, sparsity="auto", noise_bound=B)`` for B in 0.02, 0.1, 0.5; beside
  each its matched control (:func:`matched_control`: the same rules, the bounded plan's
  element-weighted mean granted sparsity on every layer it prunes); ``recommend(calib, bits="auto")``
  and ``Plan.uniform(format="nvfp4")`` (output layer exact); the baseline.
* **Probe.** Every plan trained is probed at its calibration model: the predicted noise ratio R
  (``gradstats.predicted_noise`` on the trace) and the measured one (``gradstats.noise_probe``,
  8 batches x 2 draws), each the mean over the plan's layers, recorded in its job's row.
* **Test.** ``scale_study.paired_table`` (section 1's paired differences, mean and 95% t interval)
  against the baseline and between arms; :func:`report` answers the protocol's four questions.

Jobs run in priority order: the reuse check (seed 0's baseline of each model trained again, as
``baseline [repeat]``, to be compared with the adopted one), tier 1 (ResNet-20 and the transformer:
the bounded plans, their controls and the baselines, seed by seed), then tier 2 (``bits="auto"``,
uniform NVFP4, the LSTM). Every finished job is appended to ``bound_jobs.jsonl``; the baselines of
the same seeds already trained (``noise_jobs.jsonl``, ``scale_jobs.jsonl``: the same key, so the same
training) are copied in, not trained again (``--no-adopt``: trained); a rerun trains only what is
missing. An arm whose plan cannot be made (an exception from ``recommend``) fails loudly, job by
job, and is tried again on the next run.

    python experiments/bound_study.py [--models ...] [--seeds ...] [--arms ...] [--jobs N] [--limit N]
                                      [--dry-run] [--report] [--no-adopt] [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from _accuracy import RESULTS, Job, _digest, calibrate_task, load_rows, run_jobs, write_json  # noqa: E402
from noise_study import CALIBRATION_STEPS, SAMPLE_EVERY, adopt_shared  # noqa: E402
from noise_study import protocol_of as noise_protocol  # noqa: E402
from scale_study import paired_table  # noqa: E402

log = logging.getLogger("bound_study")

EXPERIMENT = "bound"
MODELS = ("resnet20", "transformer", "lstm")
SEEDS = tuple(range(8))
BOUNDS = (0.02, 0.1, 0.5)
ARMS = ("repeat", "baseline", "bounded", "matched", "auto", "nvfp4")
#: the arms each model trains (the LSTM: the bits="auto" question alone)
MODEL_ARMS = {"resnet20": ARMS, "transformer": ARMS, "lstm": ("repeat", "baseline", "auto", "nvfp4")}
AUTO = "recommend(bits='auto')"
NVFP4 = "Plan.uniform(format='nvfp4')"
#: the reuse check: the first seed's baseline trained again under its own key, first of all, to be
#: compared with the baseline adopted from the earlier studies (the same training: the same numbers)
REPEAT = "baseline [repeat]"
PROBE_BATCHES, PROBE_DRAWS = 8, 2
#: the job files whose baselines of the same key this study adopts (trained by the same code)
SHARED = ("noise_jobs", "scale_jobs")
#: seconds of one job (one torch thread) where this study has not yet timed its own: the medians of
#: the committed rows of the same model and kind (``noise_jobs.jsonl``; NVFP4: ``scale_jobs.jsonl``'s
#: ``recommend(bits=4, granularity='nvfp4')``; bits="auto" as NVFP4; the LSTM's NVFP4 as the
#: transformer's scaled by their 6-bit rows), see docs/protocol-bound.md, "Cost"
ESTIMATE_S = {
    ("resnet20", "baseline"): 292, ("resnet20", "bounded"): 270, ("resnet20", "matched"): 270,
    ("resnet20", "auto"): 1197, ("resnet20", "nvfp4"): 1197,
    ("transformer", "baseline"): 619, ("transformer", "bounded"): 1094, ("transformer", "matched"): 1094,
    ("transformer", "auto"): 967, ("transformer", "nvfp4"): 967,
    ("lstm", "baseline"): 113, ("lstm", "auto"): 654, ("lstm", "nvfp4"): 654,
}
#: seconds to calibrate one seed of a model and make and probe its plans (the pilot's, 6 Dec.: wall time
#: on the shared machine)
PLAN_ESTIMATE_S = {"resnet20": 455, "transformer": 102, "lstm": 22}


# --------------------------------------------------------------------------- the arms
def bounded_label(bound: float) -> str:
    return f"recommend(sparsity='auto', noise_bound={bound:g})"


def matched_label(bound: float) -> str:
    return f"matched uniform, noise_bound={bound:g}"


@dataclass(frozen=True)
class Arm:
    """One job to be: a model, a seed and an arm (``bound``: the noise bound of a bounded plan or of
    the plan a control is matched to)."""

    model: str
    seed: int
    arm: str
    label: str
    bound: float | None = None
    tier: int = 1

    @property
    def planned(self) -> bool:
        return self.arm not in ("baseline", "repeat")


def protocol_of(model: str, quick: bool = False) -> dict:
    """The model's protocol: ``noise_study``'s (steps, data, training, calibration, metric, margin),
    seeds 0-7 (quick: its two seeds)."""
    proto = noise_protocol(model, quick)
    return {**proto, "seeds": proto["seeds"] if quick else SEEDS}


def model_arms(model: str, seed: int, arms: Iterable[str] = ARMS, *, quick: bool = False) -> list[Arm]:
    """The arms of ``model`` selected by ``arms``, for one seed (the repeat: on the first seed alone)."""
    first = 2 if model == "lstm" else 1
    out = []
    for arm in (a for a in ARMS if a in set(arms) and a in MODEL_ARMS[model]):
        if arm == "repeat":
            if seed == protocol_of(model, quick)["seeds"][0]:
                out.append(Arm(model, seed, arm, REPEAT, None, 0))
        elif arm == "baseline":
            out.append(Arm(model, seed, arm, "baseline", None, first))
        elif arm in ("bounded", "matched"):
            make = bounded_label if arm == "bounded" else matched_label
            out += [Arm(model, seed, arm, make(b), b, first) for b in BOUNDS]
        else:
            out.append(Arm(model, seed, arm, AUTO if arm == "auto" else NVFP4, None, 2))
    return out


def study_arms(models: Iterable[str], seeds: Iterable[int] | None, arms: Iterable[str], *,
               quick: bool = False) -> list[Arm]:
    """Every selected job, in priority order: tier (0: the repeats), seed, model, arm (see the
    module's docstring)."""
    models = [m for m in MODELS if m in set(models)]
    out = []
    for model in models:
        own = protocol_of(model, quick)["seeds"]
        for s in (own if seeds is None else [s for s in seeds if s in own]):
            out += model_arms(model, s, arms, quick=quick)
    return sorted(out, key=lambda a: (a.tier, a.seed, models.index(a.model), ARMS.index(a.arm), a.bound or 0))


def plan_labels(arms: Iterable[Arm]) -> list[str]:
    """The plans these arms train, with the bounded plan each control is matched to, in the order
    they are made (a control after its bounded plan)."""
    want = {a.label for a in arms if a.planned}
    want |= {bounded_label(a.bound) for a in arms if a.arm == "matched"}
    order = [bounded_label(b) for b in BOUNDS] + [matched_label(b) for b in BOUNDS] + [AUTO, NVFP4]
    return [lab for lab in order if lab in want]


def bound_of(label: str) -> float | None:
    """The noise bound a bounded plan's or a control's label names (None: neither)."""
    for b in BOUNDS:
        if label in (bounded_label(b), matched_label(b)):
            return b
    return None


# --------------------------------------------------------------------------- the matched control
def granted(plan: Mapping[str, Any], weights: Mapping[str, float]) -> tuple[dict[str, float], float]:
    """``({layer: granted sparsity}, mean)`` of a plan's noise records (``Plan.noise``, as
    ``recommend`` fills it): the layers it prunes (granted sparsity above zero) and their mean
    granted sparsity weighted by ``weights`` (each layer's neural-gradient elements)."""
    pruned = {r["layer"]: float(r["sparsity"]) for r in plan.get("noise") or () if (r.get("sparsity") or 0) > 0}
    if not pruned:
        raise ValueError("the plan prunes no layer (no noise record grants a sparsity above zero): nothing to match")
    missing = [lay for lay in pruned if not weights.get(lay)]
    if missing:
        raise ValueError(f"no element count for the pruned layer(s) {missing}")
    w = np.array([float(weights[lay]) for lay in pruned])
    s = np.array(list(pruned.values()))
    return pruned, float((w * s).sum() / w.sum())


def matched_control(plan: Mapping[str, Any], weights: Mapping[str, float], *, source: str = "") -> dict[str, Any]:
    """The matched control of a bounded plan (a ``Plan.to_dict()`` with noise records): every rule
    as the plan has it (formats, rounding, scales and scale shifts, defaults, output layer,
    ``prune_at``), and on every layer the plan prunes the one sparsity that is the plan's mean
    granted sparsity weighted by the layers' neural-gradient elements (:func:`granted`): the same
    layers pruned, the same expected number of zeros, spread uniformly instead of where the bound
    put them. Its predictions, checks and noise records (the bounded plan's) are left out."""
    pruned, mean = granted(plan, weights)
    layers = []
    for e in plan["layers"]:
        e = {k: v for k, v in e.items() if k != "predicted"}
        if e["layer"] in pruned:
            e["sparsity"] = mean
        layers.append(e)
    named = {e["layer"] for e in layers}
    if set(pruned) - named:
        raise ValueError(f"pruned layer(s) {sorted(set(pruned) - named)} have no entry of their own to carry the "
                         "control's sparsity")
    defaults = dict(plan["defaults"])
    if defaults.get("sparsity") is not None:
        defaults["sparsity"] = mean
    prov = dict(plan.get("provenance") or {})
    prov["generator"] = (f"matched uniform control of {source or prov.get('generator')}: sparsity {mean:.6f} "
                         f"(element-weighted mean granted) on its {len(pruned)} pruned layers")
    drop = ("noise", "noise_bound", "checks", "provenance", "layers", "defaults")
    return {**{k: v for k, v in plan.items() if k not in drop}, "provenance": prov, "defaults": defaults,
            "layers": layers}


# --------------------------------------------------------------------------- plans and probes
def store_key(model: str, seed: int, quick: bool = False) -> str:
    return f"{model}/seed{seed}/{json.dumps(protocol_of(model, quick)['prepare'], sort_keys=True)}"


def element_weights(run: Any) -> dict[str, float]:
    """Per layer, the neural-gradient elements the calibration trace saw (summed over its steps and
    calls): the weights of the matched control's mean."""
    st = run.stats(kinds=["grad"])
    return {str(k): float(v) for k, v in st.groupby("layer")["n"].sum().items()}


def fingerprint(run: Any) -> str:
    """A digest of a calibration trace's statistics: a calibration repeated in a later sitting (for
    a plan first made there) is checked to be the one the other plans came from."""
    st = run.stats(kinds=["grad"])
    cols = ["layer", "step", "call", "n", "n_zero", "sum_abs", "sum_sq"]
    return _digest(st.sort_values(["layer", "step", "call"])[cols].to_numpy().tolist())


def code_state(labels: Iterable[str]) -> dict[str, dict]:
    """Per plan label, the code that made it: the commit, and whether ``gradstats/`` differed from it
    (a plan made from uncommitted code says so)."""
    import subprocess

    root = HERE.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "gradstats"], cwd=root,
                                    capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = None, None
    return {lab: {"commit": commit, "gradstats_uncommitted": dirty} for lab in labels}


def build_plan(label: str, calib: Any, made: Mapping[str, dict], weights: Mapping[str, float]) -> dict:
    """The ``Plan.to_dict()`` an arm trains, from the calibration trace (``made``: this seed's plans
    so far; a control needs its bounded plan)."""
    import gradstats

    b = bound_of(label)
    if b is not None and label == bounded_label(b):
        return gradstats.recommend(calib, sparsity="auto", noise_bound=b).to_dict()
    if b is not None:                     # its matched control
        plan = matched_control(made[bounded_label(b)], weights, source=bounded_label(b))
        return gradstats.Plan.from_dict(plan).to_dict()          # validated
    if label == AUTO:
        return gradstats.recommend(calib, bits="auto").to_dict()
    if label == NVFP4:
        return gradstats.Plan.uniform(format="nvfp4").to_dict()
    raise ValueError(f"no such arm: {label!r}")


def probe(task: Any, calib: Any, plan: dict, batches: list, *, steps: Iterable[int], seed: int) -> dict:
    """The plan's noise ratio R at its calibration model: predicted from the trace and measured by
    the probe (``PROBE_DRAWS`` draws per batch), the mean and the largest over its layers, and per
    layer ``[predicted, measured]`` (None where the probe measures no weight gradient)."""
    import gradstats
    from gradstats.zoo.training import loss_fn

    p = gradstats.Plan.from_dict(plan)
    pred = gradstats.predicted_noise(calib, p, steps=list(steps)).to_dataframe().set_index("layer")["noise"]
    meas = gradstats.noise_probe(task.model, batches, p, lambda m, b: loss_fn(m(b[0]), b[1]), draws=PROBE_DRAWS,
                                 seed=seed).to_dataframe().set_index("layer")["ratio"]
    num = lambda v: None if v is None or v != v else float(v)  # noqa: E731
    return {"R_predicted": num(pred.mean()), "R_predicted_max": num(pred.max()),
            "R_measured": num(meas.mean()), "R_measured_max": num(meas.max()), "probe_layers": len(meas),
            "layers": {lay: [num(pred.get(lay)), num(meas.get(lay))] for lay in dict.fromkeys([*pred.index, *meas.index])}}


def make_plans(model: str, seed: int, labels: list[str], quick: bool, have: dict | None = None) -> dict:
    """Calibrate seed ``seed`` of ``model`` and make and probe the plans of ``labels`` it lacks
    (``have``: the stored entry); the entry to store. A plan that cannot be made is an error of the
    entry (not stored as a plan: tried again next time)."""
    import torch
    from noise_ranking import probe_batches

    torch.set_num_threads(1)              # the calibration is then the same on every machine and sitting
    logging.getLogger("gradstats").setLevel(logging.ERROR)      # recommend's check tables: in plan.checks
    t0 = time.perf_counter()
    proto = protocol_of(model, quick)
    steps = proto.get("sample_every", SAMPLE_EVERY)
    task, calib = calibrate_task(model, prepare_kw=proto["prepare"], steps=proto.get("calibration_steps",
                                 CALIBRATION_STEPS), train_kw=proto["train"], sample_every=steps, seed=seed)
    have = have or {}
    entry = {"plans": dict(have.get("plans", {})), "probe": dict(have.get("probe", {})), "errors": {},
             "weights": element_weights(calib), "fingerprint": fingerprint(calib),
             "plan_s": float(have.get("plan_s", 0.0)), "code": {**dict(have.get("code", {})), **code_state(labels)}}
    if have.get("fingerprint") not in (None, entry["fingerprint"]):
        log.warning("%s seed %d: the calibration differs from the one its stored plans came from", model, seed)
        entry["calibration_differs"] = True
    for label in labels:
        if label in entry["plans"]:
            continue
        try:
            entry["plans"][label] = build_plan(label, calib, entry["plans"], entry["weights"])
        except Exception as exc:          # the arm fails, loudly; the others go on
            entry["errors"][label] = f"{type(exc).__name__}: {exc}"
            log.error("FAILED to make the plan %s of %s seed %d: %s", label, model, seed, entry["errors"][label])
    batch_size = proto["train"].get("batch_size", task.hparams.get("batch_size", 128))
    batches = probe_batches(task, PROBE_BATCHES, batch_size)
    for label in labels:
        if label in entry["plans"] and label not in entry["probe"]:
            entry["probe"][label] = probe(task, calib, entry["plans"][label], batches, steps=steps, seed=seed)
    entry["plan_s"] = round(entry["plan_s"] + time.perf_counter() - t0, 1)
    return entry


def missing_plans(arms: list[Arm], store: Mapping[str, dict], quick: bool) -> list[tuple[str, int, list[str]]]:
    """``(model, seed, labels)`` of every model and seed whose plans (or probes) are not all stored,
    in the arms' order."""
    out: dict[tuple[str, int], list[str]] = {}
    for a in arms:
        if (a.model, a.seed) in out or not a.planned:
            continue
        labels = plan_labels([b for b in arms if (b.model, b.seed) == (a.model, a.seed)])
        entry = store.get(store_key(a.model, a.seed, quick), {})
        if any(lab not in entry.get("plans", {}) or lab not in entry.get("probe", {}) for lab in labels):
            out[(a.model, a.seed)] = labels
    return [(m, s, labs) for (m, s), labs in out.items()]


def plans_for(arms: list[Arm], path: Path, *, quick: bool, workers: int) -> dict:
    """The plans store (``path``), with every plan of ``arms`` made that can be: one calibration per
    model and seed, in worker processes (``workers``; 0: here), each entry stored as it ends."""
    store = json.loads(path.read_text()) if path.exists() else {}
    todo = missing_plans(arms, store, quick)
    if not todo:
        return store

    def keep(model: str, seed: int, entry: dict) -> None:
        store[store_key(model, seed, quick)] = entry
        write_json(path, store)
        log.info("plans of %s seed %d: %d made, %d failed (%.0f s)", model, seed, len(entry["plans"]),
                 len(entry["errors"]), entry["plan_s"])

    args = [(m, s, labs, quick, store.get(store_key(m, s, quick))) for m, s, labs in todo]
    if workers <= 0:
        import torch

        threads = torch.get_num_threads()
        try:
            for a in args:
                keep(a[0], a[1], make_plans(*a))
        finally:
            torch.set_num_threads(threads)
        return store
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(max_workers=min(workers, len(args)), mp_context=mp.get_context("spawn")) as pool:
        futures = {pool.submit(make_plans, *a): a for a in args}
        for fut in as_completed(futures):
            keep(futures[fut][0], futures[fut][1], fut.result())
    return store


# --------------------------------------------------------------------------- jobs
def job_of(arm: Arm, plan: dict | None, quick: bool, extra: Mapping[str, Any] | None = None) -> Job:
    """The training job of an arm (its plan: None for the baseline)."""
    proto = protocol_of(arm.model, quick)
    info = {"arm": arm.arm, "noise_bound": arm.bound, "tier": arm.tier, **(extra or {})}
    return Job(EXPERIMENT, arm.label, arm.model, arm.seed, proto["steps"], plan, info, dict(proto["prepare"]), {},
               dict(proto["train"]))


def plan_info(arm: Arm, entry: Mapping[str, Any]) -> dict:
    """What a job's row records of its plan: the probe's R (predicted, measured; mean and largest
    over the plan's layers), the pruned layers' element-weighted mean granted sparsity and their
    count, and the formats."""
    plan = entry["plans"][arm.label]
    pr = {k: v for k, v in entry["probe"].get(arm.label, {}).items() if k != "layers"}
    info: dict[str, Any] = {**pr, "formats": ", ".join(sorted({str(e["format"]) for e in plan["layers"]
                                                               if e.get("format")} |
                                                              ({str(plan["defaults"]["format"])}
                                                               if plan["defaults"].get("format") else set())))}
    if arm.arm in ("bounded", "matched"):       # a control grants what its bounded plan grants, spread evenly
        pruned, mean = granted(entry["plans"][bounded_label(arm.bound)], entry["weights"])
        info.update(granted_sparsity=mean, pruned_layers=len(pruned))
        if arm.arm == "matched":
            info["target_sparsity"] = mean
    return info


def study_jobs(arms: list[Arm], store: Mapping[str, dict], quick: bool) -> tuple[list[Job], list[tuple[Arm, str]]]:
    """The jobs of ``arms`` whose plans are stored, in order, and ``(arm, why)`` for those whose plan
    is not (its error, or not made yet)."""
    jobs, failed = [], []
    for a in arms:
        if not a.planned:
            jobs.append(job_of(a, None, quick))
            continue
        entry = store.get(store_key(a.model, a.seed, quick), {})
        if a.label in entry.get("plans", {}):
            jobs.append(job_of(a, entry["plans"][a.label], quick, plan_info(a, entry)))
        else:
            failed.append((a, entry.get("errors", {}).get(a.label, "plan not made yet")))
    return jobs, failed


def adopt_baselines(arms: list[Arm], path: Path, out: Path, quick: bool) -> int:
    """Copy into ``path`` the baselines of the same key already trained (``SHARED`` job files):
    ``noise_study.adopt_shared`` on the baseline jobs alone."""
    base = [job_of(a, None, quick) for a in arms if a.arm == "baseline"]
    tag = "_quick" if quick else ""
    return sum(adopt_shared(base, path, out / f"{name}{tag}.jsonl") for name in SHARED)


def status(arms: list[Arm], store: Mapping[str, dict], path: Path, quick: bool) -> pd.DataFrame:
    """Per job: done, adopted or pending, and its seconds (its own, or the estimate); per model and
    seed without stored plans, the calibration's estimate (``arm`` "plans")."""
    done = load_rows(path)
    jobs, failed = study_jobs(arms, store, quick)
    own = pd.DataFrame([r for r in done.values() if r.get("experiment") == EXPERIMENT and not r.get("adopted_from")])
    med = own.groupby(["model", "arm"])["wall_s"].median().to_dict() if len(own) and "arm" in own else {}
    rows = []
    for j in jobs:
        r = done.get(j.key)
        kind = "baseline" if j.info["arm"] == "repeat" else j.info["arm"]
        est = med.get((j.model, kind), ESTIMATE_S[(j.model, kind)])
        rows.append({"model": j.model, "arm": j.info["arm"], "label": j.label, "seed": j.seed,
                     "state": "pending" if r is None else "adopted" if r.get("adopted_from") else "done",
                     "seconds": est if r is None else float(r.get("wall_s") or 0.0)})
    for a, why in failed:
        rows.append({"model": a.model, "arm": a.arm, "label": a.label, "seed": a.seed,
                     "state": "no plan" if why == "plan not made yet" else "plan failed",
                     "seconds": ESTIMATE_S[(a.model, a.arm)]})
    for m, s, _ in missing_plans(arms, store, quick):
        rows.append({"model": m, "arm": "plans", "label": "calibration, plans, probes", "seed": s, "state": "pending",
                     "seconds": PLAN_ESTIMATE_S[m]})
    df = pd.DataFrame(rows, columns=["model", "arm", "label", "seed", "state", "seconds"])
    order = {k: i for i, k in enumerate(("plans",) + ARMS)}
    return df.sort_values(["model", "arm", "seed"], key=lambda c: c.map(MODELS.index) if c.name == "model" else
                          c.map(order) if c.name == "arm" else c, kind="stable").reset_index(drop=True)


def summary(st: pd.DataFrame) -> pd.DataFrame:
    """Per model and arm: jobs, how many are done, adopted and left, and the core hours left."""
    left = ~st["state"].isin(["done", "adopted"])
    g = st.assign(left=left, left_h=st["seconds"].where(left, 0.0) / 3600).groupby(["model", "arm"], sort=False)
    return g.agg(jobs=("seed", "size"), done=("state", lambda s: int((s == "done").sum())),
                 adopted=("state", lambda s: int((s == "adopted").sum())), left=("left", "sum"),
                 core_hours_left=("left_h", "sum")).reset_index()


# --------------------------------------------------------------------------- the report
def contrast(df: pd.DataFrame, protocol: dict, treatment: str, reference: str) -> pd.DataFrame:
    """``paired_table``'s row of ``treatment`` paired with ``reference`` (in its baseline's place)
    per model: the mean of the per-seed differences (positive: ``treatment`` better) and its 95% t
    interval, on the seeds where both finished."""
    sub = df[df["label"].isin([treatment, reference])]
    if not len(sub):
        return pd.DataFrame()
    sub = sub.assign(label=sub["label"].map({treatment: treatment, reference: "baseline"}))
    t = paired_table(sub, protocol)
    t = t[t["label"] == treatment].copy()
    t["reference"] = reference
    return t


def growth_verdict(lo: float, hi: float, margin: float) -> str:
    """Question 1, on ``loose - tight`` (positive: the looser bound better): **grows** when the
    interval lies below zero (*by more than the margin* when wholly below it); **does not grow**
    (beyond the margin) when its lower end is above the margin and it reaches zero; else
    inconclusive.

        >>> growth_verdict(-0.5, -0.35, -0.3), growth_verdict(-0.2, 0.1, -0.3), growth_verdict(-0.4, 0.1, -0.3)
        ('**grows**, by more than the margin', '**does not grow** beyond the margin', 'inconclusive')
    """
    if not (lo == lo and hi == hi):
        return "-"
    if hi < 0:
        return "**grows**, by more than the margin" if hi < margin else "**grows**"
    return "**does not grow** beyond the margin" if lo > margin else "inconclusive"


def comparison_verdict(lo: float, hi: float, margin: float) -> str:
    """Questions 2 and 3, on ``treatment - reference`` (positive: the treatment better): **better**
    (the interval above zero), **worse** (below zero), **equivalent** (within plus or minus the
    margin, holding zero), else inconclusive.

        >>> comparison_verdict(0.1, 0.4, -0.3), comparison_verdict(-0.2, 0.25, -0.3), comparison_verdict(-0.5, 0.1, -0.3)
        ('**better**', '**equivalent**', 'inconclusive')
    """
    if not (lo == lo and hi == hi):
        return "-"
    if lo > 0:
        return "**better**"
    if hi < 0:
        return "**worse**"
    return "**equivalent**" if (lo > margin and hi < -margin) else "inconclusive"


def paired_rows(df: pd.DataFrame, protocol: dict) -> pd.DataFrame:
    """Every planned job with its seed's baseline: ``diff`` (positive: the plan better; points of
    accuracy or nats) and ``loss_margins`` (minus the difference over the model's margin)."""
    out = []
    for model, g in df.groupby("model", sort=False):
        proto = protocol[model]
        loss = proto["metric"] == "loss"
        value = (g["test_loss"] if loss else 100 * g["test_accuracy"]).astype(float)
        g = g.assign(value=value)
        base = g[g["label"] == "baseline"].set_index("seed")["value"]
        for _, r in g[g["label"] != "baseline"].iterrows():
            if r["seed"] in base.index and r["value"] == r["value"] and base[r["seed"]] == base[r["seed"]]:
                d = (base[r["seed"]] - r["value"]) if loss else (r["value"] - base[r["seed"]])
                out.append({**r.to_dict(), "diff": d, "loss_margins": -d / abs(proto["margin"])})
    return pd.DataFrame(out)


def spearman_by_seed(x, y, seeds, boot: int = 4000, rng_seed: int = 0) -> tuple[float, float, float]:
    """Spearman's rho of ``x`` against ``y`` and a bootstrap 95% interval that resamples seeds
    (every job of a drawn seed together: the jobs of one seed share its baseline and calibration).

        >>> rho, lo, hi = spearman_by_seed([1, 2, 3, 4, 5, 6], [1, 3, 2, 4, 6, 5], [0, 0, 1, 1, 2, 2], boot=200)
        >>> round(rho, 3), lo <= rho <= hi
        (0.886, True)
    """
    from scipy.stats import spearmanr

    x, y, seeds = np.asarray(x, float), np.asarray(y, float), np.asarray(seeds)
    if len(x) < 3:
        return math.nan, math.nan, math.nan
    rho = float(spearmanr(x, y).statistic)
    groups = [np.flatnonzero(seeds == s) for s in np.unique(seeds)]
    rng = np.random.default_rng(rng_seed)
    bs = []
    for _ in range(boot):
        i = np.concatenate([groups[k] for k in rng.integers(0, len(groups), len(groups))])
        if len(set(x[i])) > 1 and len(set(y[i])) > 1:
            bs.append(spearmanr(x[i], y[i]).statistic)
    if not bs:
        return rho, math.nan, math.nan
    lo, hi = np.nanpercentile(bs, [2.5, 97.5])
    return rho, float(lo), float(hi)


def _ci(r) -> str:
    k = 3 if r["metric"] == "loss" else 2
    return "-" if r["ci_low"] != r["ci_low"] else f"{r['diff_mean']:+.{k}f} [{r['ci_low']:+.{k}f}, {r['ci_high']:+.{k}f}]"


def _judged(r) -> bool:
    return r["seeds"] >= r["seeds_planned"]


def finished_rows(out: Path, *, quick: bool = False) -> tuple[pd.DataFrame, dict]:
    """The finished jobs of the whole protocol in ``out`` (the jobs of the stored plans: a row of a
    plan no longer stored is not this protocol's), with their arms' info, and the plans store."""
    tag = "_quick" if quick else ""
    path = out / f"bound_plans{tag}.json"
    store = json.loads(path.read_text()) if path.exists() else {}
    done = load_rows(out / f"bound_jobs{tag}.jsonl")
    jobs, _ = study_jobs(study_arms(MODELS, None, ARMS, quick=quick), store, quick)
    rows = [{**done[j.key], "experiment": j.experiment, "label": j.label, **j.info} for j in jobs if j.key in done]
    df = pd.DataFrame(rows)
    if len(df) and "error" not in df:
        df["error"] = None
    return df, store


def reuse_check(df: pd.DataFrame, quick: bool = False) -> str:
    """The reuse check in words: per model, the repeated first-seed baseline against the adopted one
    (the same training, so the same test loss and accuracy, to the last digit)."""
    lines = []
    for model in MODELS:
        seed = protocol_of(model, quick)["seeds"][0]
        g = df[(df["model"] == model) & (df["seed"] == seed)]
        rep, base = g[g["label"] == REPEAT], g[g["label"] == "baseline"]
        if not len(rep) or not len(base):
            lines.append(f"- {model}: pending")
            continue
        a, b = rep.iloc[0], base.iloc[0]
        same = a["test_loss"] == b["test_loss"] and a["test_accuracy"] == b["test_accuracy"]
        adopted = isinstance(b.get("adopted_from"), str)
        lines.append(f"- {model}, seed {seed}: repeated, test loss {a['test_loss']:.8g} and accuracy "
                     f"{a['test_accuracy']:.8g}; the baseline ({'adopted' if adopted else 'trained here'}) "
                     f"{b['test_loss']:.8g} and {b['test_accuracy']:.8g}: "
                     + ("**reproduced**" if same else "**differs**" + (": the adopted baselines of this model are not "
                        "this study's training; delete them and rerun with --no-adopt (docs/protocol-bound.md, "
                        "\"Baselines reused\")" if adopted else "")))
    return "\n## Reuse check\n\n" + "\n".join(lines) + "\n"


def arm_table(ok: pd.DataFrame, protocol: dict) -> pd.DataFrame:
    """Every arm of the finished jobs ``ok`` against its seed's baseline (``paired_table`` with
    section 1's verdicts), with the arm's mean predicted and measured R and granted sparsity."""
    import report as R

    vs = R._scale_rows(paired_table(ok, {m: p for m, p in protocol.items() if m in set(ok["model"])}))
    r_means = ok.groupby(["model", "label"])[[c for c in ("R_predicted", "R_measured", "granted_sparsity")
                                             if c in ok]].mean()
    for c in r_means.columns:
        vs[c] = [r_means[c].get((m, lab), math.nan) for m, lab in zip(vs["model"], vs["label"])]
    return vs


def study_tables(out: Path, *, quick: bool = False) -> dict[str, Any]:
    """The protocol's tables from whatever has finished in ``out``: ``arms`` (every arm against the
    baseline), ``q1``-``q4`` (one per question, each row with its verdict), ``q2_answers`` (per
    model), and the finished rows (``jobs``, ``ok``: without errors and repeats), ``store``,
    ``protocol``. Empty tables where nothing has finished."""
    df, store = finished_rows(out, quick=quick)
    protocol = {m: protocol_of(m, quick) for m in MODELS}
    t: dict[str, Any] = {"jobs": df, "store": store, "protocol": protocol}
    if not len(df):
        return t
    ok = df[df["error"].isna() & (df["label"] != REPEAT)]
    vs = arm_table(ok, protocol)
    t.update(ok=ok, arms=vs)

    # question 1: the loss against the bound
    rows = []
    for model in ("resnet20", "transformer"):
        for loose in BOUNDS[1:]:
            c = contrast(ok[ok["model"] == model], protocol, bounded_label(loose), bounded_label(BOUNDS[0]))
            for _, r in c.iterrows():
                rows.append({"model": model, "contrast": f"B={loose:g} - B={BOUNDS[0]:g}",
                             "seeds": f"{r['seeds']}/{r['seeds_planned']}", "diff": _ci(r),
                             "verdict": growth_verdict(r["ci_low"], r["ci_high"], r["margin"]) if _judged(r)
                             else f"pending ({r['seeds']}/{r['seeds_planned']} seeds)",
                             "primary": loose == BOUNDS[-1]})
    t["q1"] = pd.DataFrame(rows, columns=["model", "contrast", "seeds", "diff", "verdict", "primary"])

    # question 2: the bounded plan against its matched control
    rows = []
    for model in ("resnet20", "transformer"):
        for b in BOUNDS:
            c = contrast(ok[ok["model"] == model], protocol, bounded_label(b), matched_label(b))
            for _, r in c.iterrows():
                rows.append({"model": model, "bound": f"{b:g}", "seeds": f"{r['seeds']}/{r['seeds_planned']}",
                             "diff": _ci(r), "verdict": comparison_verdict(r["ci_low"], r["ci_high"], r["margin"])
                             if _judged(r) else f"pending ({r['seeds']}/{r['seeds_planned']} seeds)"})
    q2 = pd.DataFrame(rows, columns=["model", "bound", "seeds", "diff", "verdict"])
    answers = {}
    for model, g in q2.groupby("model", sort=False):
        v = list(g["verdict"])
        if len(v) < len(BOUNDS) or any(x.startswith("pending") for x in v):
            answers[model] = "pending"
            continue
        better, worse = sum(x == "**better**" for x in v), sum(x == "**worse**" for x in v)
        answers[model] = ("yes" if better and not worse else "mixed" if better and worse else
                          "no" if worse or all(x == "**equivalent**" for x in v) else "inconclusive")
    t["q2"], t["q2_answers"] = q2, answers

    # question 3: bits="auto" where uniform NVFP4 loses
    rows = []
    for model in MODELS:
        row = {"model": model}
        for lab, key in ((NVFP4, "nvfp4"), (AUTO, "auto")):
            r = vs[(vs["model"] == model) & (vs["label"] == lab)]
            row[key] = f"{r.iloc[0]['delta']} {r.iloc[0]['ci']}: {r.iloc[0]['verdict']}" if len(r) else "-"
            row[key + "_pass"] = None if not len(r) or not _judged(r.iloc[0]) else bool(r.iloc[0]["no_loss"])
            row[key + "_loss"] = None if not len(r) or not _judged(r.iloc[0]) else bool(r.iloc[0]["loss"])
        c = contrast(ok[ok["model"] == model], protocol, AUTO, NVFP4)
        row["auto_vs_nvfp4"] = _ci(c.iloc[0]) if len(c) else "-"
        if row["nvfp4_pass"] is None or row["auto_pass"] is None:
            row["answer"] = "pending"
        elif row["nvfp4_pass"]:
            row["answer"] = "not asked (NVFP4 passes)"
        else:
            row["answer"] = "**yes**" if row["auto_pass"] else "**no**" if row["auto_loss"] else "inconclusive"
        rows.append(row)
    t["q3"] = pd.DataFrame(rows)

    # question 4: does R rank the losses within each model
    pr = paired_rows(ok, protocol)
    rows = []
    for model in MODELS:
        g = pr[pr["model"] == model] if len(pr) else pr
        if not len(g) or "R_predicted" not in g:
            continue
        row = {"model": model, "jobs": len(g), "arms": g["label"].nunique()}
        for key in ("R_predicted", "R_measured"):
            gg = g[g[key].notna()]
            rho, lo, hi = spearman_by_seed(gg[key], gg["loss_margins"], gg["seed"])
            row[key] = "-" if rho != rho else f"{rho:.2f} [{lo:.2f}, {hi:.2f}]"
            row[key + "_rho"], row[key + "_lo"], row[key + "_hi"] = rho, lo, hi
        arm = g.groupby("label").agg(R=("R_predicted", "mean"), loss=("loss_margins", "mean")).dropna()
        if len(arm) >= 3:
            from noise_ranking import spearman

            rho, lo, hi = spearman(arm["R"], arm["loss"])
            row["arm_level"] = f"{rho:.2f} [{lo:.2f}, {hi:.2f}]"
        else:
            row["arm_level"] = "-"
        lo, hi = row["R_predicted_lo"], row["R_predicted_hi"]
        complete = all(_judged(r) for _, r in vs[(vs["model"] == model) & ~vs["label"].map(_is_base)].iterrows())
        row["answer"] = ("pending" if not complete else "-" if lo != lo else "**yes**" if lo > 0 else
                         "**inverse**" if hi < 0 else "**no**")
        rows.append(row)
    t["q4"] = pd.DataFrame(rows)
    return t


def _is_base(label: str) -> bool:
    import report as R

    return R._is_base(label)


def report(out: Path, *, quick: bool = False, tables: dict[str, Any] | None = None) -> str:
    """The protocol's tables and its four answers, from whatever has finished in ``out`` (or from
    ``tables``, ``study_tables(out)`` made already)."""
    import report as R

    t = study_tables(out, quick=quick) if tables is None else tables
    df, store = t["jobs"], t["store"]
    head = ("# The noise bound's study (docs/protocol-bound.md)\n\n"
            "Paired differences with the baseline (or the reference arm) of the same seed: mean and 95% t interval "
            "(section 1's test, `scale_study.paired_table`); positive is better (accuracy points for ResNet-20, "
            "nats of validation loss for the transformer and the LSTM). Margins: -0.3 points, -0.01 nats.\n")
    if not len(df):
        return head + "\nNo results yet.\n"
    failed_jobs = df[df["error"].notna()]
    vs = t["arms"].copy()
    vs["seeds_of"] = [f"{int(a)}/{int(b)}" for a, b in zip(vs["seeds"], vs["seeds_planned"])]
    fmt = lambda v, k=3: "-" if v is None or v != v else f"{v:.{k}f}"  # noqa: E731
    for c in ("R_predicted", "R_measured", "granted_sparsity"):
        vs[c + "_s"] = vs[c].map(fmt) if c in vs else "-"
    vs["achieved"] = vs["achieved_sparsity"].map(lambda v: fmt(v, 2))
    text = head + reuse_check(df, quick) + "\n## Every arm against the baseline\n\n" + R.md_table(vs, {
        "model": "model", "label": "configuration", "seeds_of": "seeds", "value": "metric (mean ± sd)",
        "delta": "paired diff", "ci": "95% CI", "verdict": "verdict", "granted_sparsity_s": "granted (el.-weighted)",
        "achieved": "achieved", "R_predicted_s": "R predicted", "R_measured_s": "R measured"})
    q1, q2, q3, q4 = t["q1"], t["q2"], t["q3"], t["q4"]
    text += ("\n## 1. Does the loss grow with the bound?\n\nPaired, the looser bound's plan minus the default's "
             f"(B={BOUNDS[0]:g}) on the same seed; the primary contrast is B={BOUNDS[-1]:g}. *grows*: the interval "
             "below zero.\n\n" + (R.md_table(q1, {"model": "model", "contrast": "contrast", "seeds": "seeds",
                                                   "diff": "paired diff [95% CI]", "verdict": "verdict",
                                                   "primary": "primary"}) if len(q1) else "No pairs yet.\n"))
    answers = [f"{m}: " + (a if a == "pending" else f"**{a}**") for m, a in t["q2_answers"].items()]
    text += ("\n## 2. Does a bounded plan beat its matched uniform control?\n\nPaired, the bounded plan minus its "
             "control (the same rules, the bounded plan's element-weighted mean granted sparsity on every layer "
             "it prunes). Per model: *yes* when better at one bound or more and worse at none; *no* when worse at "
             "one or more and better at none, or equivalent at all three; *mixed*, *inconclusive* otherwise.\n\n"
             + (R.md_table(q2, {"model": "model", "bound": "noise bound", "seeds": "seeds",
                                "diff": "bounded - control [95% CI]", "verdict": "verdict"}) if len(q2)
                else "No pairs yet.\n")
             + ("\nAnswer: " + "; ".join(answers) + ".\n" if answers else ""))
    text += ("\n## 3. Does bits=\"auto\" lose nothing where uniform NVFP4 loses?\n\nEach against the baseline. Asked "
             "on the models where NVFP4 fails the non-inferiority test (its lower end at or below the margin): "
             "*yes* when bits=\"auto\" passes it (no loss or non-inferior), *no* when its verdict is loss.\n\n"
             + R.md_table(q3, {"model": "model", "nvfp4": "Plan.uniform(format='nvfp4')", "auto": "recommend(bits='auto')",
                               "auto_vs_nvfp4": "auto - nvfp4 [95% CI]", "answer": "answer"}))
    text += ("\n## 4. Does the predicted R rank the losses within each model?\n\nSpearman's rho of each planned job's R "
             "(its plan's mean over layers, at its calibration) against its paired loss in margins, over the model's "
             "jobs; 95% interval from a bootstrap of seeds (4,000 draws). *yes*: the predicted R's interval above "
             "zero. *arm level*: the arms' mean R against their mean loss (bootstrap over arms).\n\n"
             + (R.md_table(q4, {"model": "model", "jobs": "jobs", "arms": "arms", "R_predicted": "rho, R predicted",
                                "R_measured": "rho, R measured", "arm_level": "arm level (predicted)",
                                "answer": "answer"}) if len(q4) else "No planned jobs yet.\n"))

    own = df[df["adopted_from"].isna()] if "adopted_from" in df else df
    core = float(own["wall_s"].sum()) + sum(float(e.get("plan_s", 0.0)) for e in store.values())
    st = status(study_arms(MODELS, None, ARMS, quick=quick), store, out / f"bound_jobs{'_quick' if quick else ''}.jsonl",
                quick)
    errors = sorted({f"{lab}: {msg}" for e in store.values() for lab, msg in e.get("errors", {}).items()})
    text += (f"\n*Cost so far*: {len(own)} jobs trained by this study and {len(store)} calibrations, {core / 3600:.2f} "
             f"core hours (wall time, one torch thread each); {int((st['state'] == 'adopted').sum())} baselines adopted. "
             f"{int((~st['state'].isin(['done', 'adopted'])).sum())} jobs left, about "
             f"{st.loc[~st['state'].isin(['done', 'adopted']), 'seconds'].sum() / 3600:.1f} core hours.\n")
    if len(failed_jobs):
        text += f"\n{len(failed_jobs)} job(s) failed in training: " + "; ".join(
            f"{r['model']} {r['label']} seed {r['seed']}: {r['error']}" for _, r in failed_jobs.iterrows()) + "\n"
    if errors:
        text += "\nPlans that could not be made (tried again on the next run): " + "; ".join(errors) + "\n"
    differs = [k for k, e in store.items() if e.get("calibration_differs")]
    if differs:
        text += ("\nA later sitting's calibration differed from the one the earlier plans came from: "
                 + ", ".join(differs) + "\n")
    return text


# --------------------------------------------------------------------------- command line
def require_full_data(models: Iterable[str], quick: bool) -> None:
    """The full protocol of an image model trains on the full Fashion-MNIST (its jobs' keys say
    ``full``, and the adopted baselines were trained on it); where only the committed subset is
    installed the loader would fall back to it with a warning: refuse instead."""
    if quick or not set(models) & {"resnet20"}:
        return
    from gradstats.zoo.data import load_fashion_mnist

    try:
        load_fashion_mnist(split="test", source="full")
    except Exception as exc:
        raise SystemExit(f"the full Fashion-MNIST set is not installed ({exc}); the ResNet-20 jobs need it "
                         "(apt-get install dataset-fashion-mnist)") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds to run (default: the protocol's, 0-7)")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--jobs", type=int, default=2, help="worker processes, one torch thread each (0: in this process)")
    ap.add_argument("--limit", type=int, default=None, help="train at most this many of the pending jobs (0: plans only)")
    ap.add_argument("--dry-run", action="store_true", help="print what is done and left, and its core hours; "
                                                           "calibrate and train nothing")
    ap.add_argument("--report", action="store_true", help="write the tables (bound_study.txt) and train nothing")
    ap.add_argument("--quick", action="store_true", help="tiny data, a few steps, two seeds (smoke test)")
    ap.add_argument("--no-adopt", action="store_true", help="adopt no baseline from the earlier studies' job files "
                                                            "(the protocol's fallback if a reuse check fails)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    args.out = Path(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("gradstats").setLevel(logging.ERROR)
    tag = "_quick" if args.quick else ""
    path, plans_path, txt = (args.out / f"bound_jobs{tag}.jsonl", args.out / f"bound_plans{tag}.json",
                             args.out / f"bound_study{tag}.txt")
    if args.report:
        text = report(args.out, quick=args.quick)
        txt.write_text(text)
        print(text)
        return 0
    arms = study_arms(args.models, args.seeds, args.arms, quick=args.quick)
    if args.dry_run:                  # what a run would adopt, in a copy of the jobs file: nothing is written
        import shutil
        import tempfile

        store = json.loads(plans_path.read_text()) if plans_path.exists() else {}
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / path.name
            if path.exists():
                shutil.copy(path, copy)
            adopt_baselines(arms, copy, args.out, args.quick)
            st = status(arms, store, copy, args.quick)
        table = summary(st)
        print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
        jobs, plans = st[st["arm"] != "plans"], st[st["arm"] == "plans"]
        left = ~jobs["state"].isin(["done", "adopted"])
        print(f"{len(jobs)} jobs: {int((jobs['state'] == 'done').sum())} done, {int((jobs['state'] == 'adopted').sum())} "
              f"adopted, {int(left.sum())} to train; {len(plans)} calibrations to make; "
              f"{table['core_hours_left'].sum():.1f} core hours left")
        return 0
    require_full_data(args.models, args.quick)
    adopted = 0 if args.no_adopt else adopt_baselines(arms, path, args.out, args.quick)
    if adopted:
        log.info("%d baselines adopted from %s", adopted, ", ".join(f"{n}{tag}.jsonl" for n in SHARED))
    store = plans_for(arms, plans_path, quick=args.quick, workers=args.jobs)
    jobs, failed = study_jobs(arms, store, args.quick)
    for a, why in failed:
        log.error("FAILED: %s seed %d, %s not trained: %s", a.model, a.seed, a.label, why)
    done = load_rows(path)
    pending = [j for j in jobs if j.key not in done]
    if args.limit is not None:
        pending = pending[:args.limit]
    if pending:
        t0 = time.perf_counter()
        run_jobs([j for j in jobs if j.key in done] + pending, path, workers=args.jobs, desc="bound study")
        log.info("%d jobs trained in %.0f s", len(pending), time.perf_counter() - t0)
    text = report(args.out, quick=args.quick)
    txt.write_text(text)
    print(text)
    if failed:
        log.error("%d job(s) could not be made (their plans failed): see above; a rerun tries them again", len(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
