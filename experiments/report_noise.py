"""Sections 1.7 and 1.8 of docs/RESULTS.md: the noise ratio R against the study's results, and the
study's claims re-measured with the noise bound (the prospective protocol of
``docs/protocol-noise.md``). Rendered by ``experiments/report.py``; every sentence with a number
is computed from the committed results.
"""
from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pandas as pd

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import report as R  # noqa: E402


def _module(name: str):
    return importlib.import_module(name)


def section_noise_ranking(results: dict) -> str:
    """1.7: the noise ratio R of each pruning row of 1.2, predicted and measured at the calibration,
    against the row's loss (``experiments/noise_ranking.py``)."""
    s = _module("noise_ranking").summary(results)
    t = pd.DataFrame(sorted(s["rows"], key=lambda r: r["measured"]))
    t["predicted"] = [f"{v:.3g}" for v in t["predicted"]]
    t["measured"] = [f"{v:.3g}" for v in t["measured"]]
    rho = {k: "{:.2f} [{:.2f}, {:.2f}]".format(*s[k]) for k in ("predicted", "measured", "agreement")}
    return ("\n### 1.7 The noise ratio ranks the pruning rows\n\n"
            "The noise ratio R of a plan (`docs/noise.md`): the noise it adds to each layer's weight gradient over "
            "that gradient's own minibatch noise, the mean over the plan's layers, for each row of 1.2 with the plan "
            "that row trained: predicted from a repeat of the calibration trace (the plain model's first 50 steps, "
            "seed 0, with the noise records; `gradstats.predicted_noise`) and measured on the calibrated model "
            "(`gradstats.noise_probe`, 8 batches x 2 draws). *Loss in margins*: minus the paired difference over "
            "the model's margin. Command: `python experiments/noise_ranking.py`.\n\n"
            + R.md_table(t, {"model": "model", "label": "configuration", "loss_margins": "loss in margins",
                             "predicted": "R predicted", "measured": "R measured", "verdict": "verdict"},
                         {"loss_margins": 2})
            + f"\n\nSpearman's rho against the loss over the {len(t)} rows (bootstrap 95% interval): R predicted "
              f"{rho['predicted']}, R measured {rho['measured']}; predicted against measured {rho['agreement']}. "
              f"Rows that passed reach a measured R of {s['passed_max']:.2f}; rows that lost start at "
              f"{s['lost_min']:.2f}. The nominal sparsity does not rank them (the CNN passes at 95%, the "
              "transformer loses at 70%). `recommend` bounds the predicted R at 0.02 by default "
              "(`docs/noise.md` says why).\n")


def _length_reading(lt: pd.DataFrame, uniform: str) -> str:
    """Question 4 in words, once both lengths of the pruned row (label ``uniform``) have their
    verdict: the loss at 2 and at 8 epochs, and whether the longer training removed it."""
    pruned = lt[lt["label"].str.startswith(uniform) & (lt["seeds_finished"] >= lt["seeds_planned"])]
    short = pruned[~pruned["label"].str.contains("epochs")]
    long_ = pruned[pruned["label"].str.contains("8 epochs")]
    if len(short) != 1 or len(long_) != 1:
        return ""
    a, b = short.iloc[0], long_.iloc[0]
    if b["ci_high"] < 0:
        outcome = "it narrows the loss but does not remove it" if b["diff_mean"] > a["diff_mean"] else \
            "the loss does not narrow"
    else:
        outcome = "its interval reaches zero: the longer training removes the loss it can see"
    return (f"\nAt 8 epochs the pruned training's paired difference is {b['delta']} points {b['ci']}, against "
            f"{a['delta']} {a['ci']} at 2 epochs: {outcome}.\n")


def noise_study_rows(res: Path, *, quick: bool = False) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """The finished jobs of the noise study and its two tables (claims, training length), each row
    of the claims with what its plan grants (``noise_study.plan_summary``)."""
    ns = _module("noise_study")
    tag = "_quick" if quick else ""
    jobs = pd.DataFrame(_module("_accuracy").load_rows(res / f"noise_jobs{tag}.jsonl").values())
    if not len(jobs):
        return jobs, pd.DataFrame(), pd.DataFrame()
    claims, length = ns.tables(jobs, quick=quick)
    path = res / f"noise_plans{tag}.json"
    plans = json.loads(path.read_text()) if path.exists() else {}
    extra = pd.DataFrame([ns.plan_summary(plans, m, lab, quick=quick) for m, lab in zip(claims["model"], claims["label"])],
                         index=claims.index, columns=["granted_sparsity", "R_predicted", "R_predicted_max", "formats",
                                                      "noise_bound"])
    return jobs, pd.concat([claims, extra], axis=1), length


def ranking_rows(ranking: dict, claims: pd.DataFrame) -> list[dict]:
    """Every pruning row with a predicted R and a paired difference on at least two seeds: section
    1.2's (``noise_ranking.json``) and the noise study's bounded plans; ``loss_margins`` is minus
    the mean paired difference over the model's margin."""
    rows = [{"model": r["model"], "label": r["label"], "R": r["predicted"], "seeds": None, "source": "1.2",
             "loss_margins": -r["delta"] / abs(_module("scale_study").PROTOCOL[r["model"]]["margin"])}
            for model in ranking.values() for r in model]
    for _, r in claims.iterrows():
        sp = r.get("granted_sparsity")
        if R._is_base(r["label"]) or not (sp == sp and sp and sp > 0) or r["seeds"] < 2 or r["R_predicted"] != r["R_predicted"]:
            continue
        rows.append({"model": r["model"], "label": r["label"], "R": float(r["R_predicted"]), "seeds": int(r["seeds"]),
                     "source": "1.8", "loss_margins": -float(r["diff_mean"]) / abs(float(r["margin"]))})
    return rows


def plot_ranking(rows: list[dict], path: Path, bound: float = 0.02) -> Path:
    """Every pruning row: its plan's predicted R against its loss in margins, per model; section
    1.2's rows filled, the noise study's open; the default bound and one margin of loss marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"cnn": "#4d9221", "resnet20": "#c51b7d", "transformer": "#2166ac", "lstm": "#e08214"}
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for model in dict.fromkeys(r["model"] for r in rows):
        for source, face in (("1.2", colours.get(model, "#555555")), ("1.8", "none")):
            g = [r for r in rows if r["model"] == model and r["source"] == source]
            if g:
                ax.scatter([r["R"] for r in g], [r["loss_margins"] for r in g], s=30, marker="o",
                           facecolors=face, edgecolors=colours.get(model, "#555555"), linewidths=1.2,
                           label=f"{model} ({'study, 1.2' if source == '1.2' else 'bounded plans, 1.8'})")
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=1.0)
    top = max(r["loss_margins"] for r in rows)
    ax.set_ylim(min(min(r["loss_margins"] for r in rows) - 0.5, -1.0), top * 2.5 if top > 1 else 3.0)
    ax.axvline(bound, color="#888888", lw=0.8, ls="--")
    ax.text(bound, ax.get_ylim()[1], f" bound {bound:g}", fontsize=7, va="top", color="#555555")
    ax.axhline(1.0, color="#b2182b", lw=0.8, ls=":")
    ax.text(ax.get_xlim()[0], 1.0, " loss = one margin", fontsize=7, va="bottom", color="#b2182b")
    ax.axhline(0.0, color="#cccccc", lw=0.6)
    ax.set_xlabel("predicted noise ratio R of the plan (mean over its layers, calibration trace)")
    ax.set_ylabel("loss in margins (paired, mean over seeds)")
    ax.set_title("Every pruning row: predicted R against the loss it cost", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


_NAMES = {"resnet20": "ResNet-20", "transformer": "the transformer", "lstm": "the LSTM", "cnn": "the CNN"}
_AUTO, _FIXED, _FP6 = "recommend(sparsity='auto')", "recommend(sparsity=0.85)", "recommend(bits=6)"


def _stored(plans: dict, model: str, label: str) -> dict | None:
    return next((v["plan"] for k, v in plans.items() if k.startswith(f"{model}/{label}/")), None)


def _noise(plans: dict, model: str, label: str) -> pd.DataFrame:
    """The noise records (``Plan.noise``) of a stored plan, R and pruning_noise as numbers (NaN: none)."""
    t = pd.DataFrame((_stored(plans, model, label) or {}).get("noise") or [],
                     columns=["layer", "predicted_noise", "pruning_noise"])
    return t.assign(**{c: pd.to_numeric(t[c], errors="coerce") for c in ("predicted_noise", "pruning_noise")})


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _predates(plans: dict, models: list[str]) -> str:
    """What the stored plans bounded (they predate the whole-plan bound): the pruning plans' largest
    ``pruning_noise`` and per model their largest whole-plan R; the unbounded ``bits=6`` plans'
    largest R; a layer the plans hold no R for."""
    pr = {m: _noise(plans, m, _FIXED) for m in models}
    prune_max = max(max(pr[m]["pruning_noise"].max(), _noise(plans, m, _AUTO)["pruning_noise"].max()) for m in models)
    whole = [f"{pr[m]['predicted_noise'].max():.2g} on {_NAMES.get(m, m)}"
             + (" (its stem)" if i == 0 and pr[m]["predicted_noise"].idxmax() == 0 else "") for i, m in enumerate(models)]
    fp6 = [f"{_noise(plans, m, _FP6)['predicted_noise'].max():.2g}" for m in models]
    text = (" The plans predate the whole-plan bound: the two pruning plans (8 bits per tensor, `recommend`'s default "
            f"width) bounded the noise their pruning adds (`pruning_noise`, at most {prune_max:.4f}), not the whole "
            f"plan's: a layer's whole predicted R reached {_and(whole)}; `recommend(bits=6)` was made with no bound "
            f"(its largest R {_and(fp6)}).")
    for m in models:
        missing = pr[m][pr[m]["predicted_noise"].isna()]
        if len(missing):
            what = "recurrent layer" if m == "lstm" else "layer " + _and(list(missing["layer"]))
            rest = {1: "one", 2: "two", 3: "three"}.get(len(pr[m]) - len(missing), str(len(pr[m]) - len(missing)))
            text += f" The plans hold no predicted R for {_NAMES.get(m, m)}'s {what}; its *R* is the mean over the other {rest}."
    return text


def _one_plan(plans: dict, jobs: pd.DataFrame, claims: pd.DataFrame) -> str:
    """``sparsity='auto'`` and ``sparsity=0.85`` where the bound makes them one plan (the same layers,
    formats and roundings, every granted sparsity under 0.85): how close the stored plans are, and
    how far their trainings landed apart ("auto" minus 0.85 per seed). Empty where they differ."""
    gaps, apart, flips = {}, [], []
    for model in dict.fromkeys(claims["model"]):
        a, b = (_stored(plans, model, lab) for lab in (_AUTO, _FIXED))
        if a is None or b is None:
            continue
        a, b = ({e["layer"]: e for e in p["layers"]} for p in (a, b))
        same = set(a) == set(b) and all((a[k].get("format"), a[k].get("rounding")) == (b[k].get("format"), b[k].get("rounding"))
                                        for k in a)
        if not same or max(float(e.get("sparsity") or 0) for e in b.values()) >= 0.85:
            return ""
        gap = max(abs(float(a[k].get("sparsity") or 0) - float(b[k].get("sparsity") or 0)) for k in a)
        gaps.setdefault(f"{math.ceil(gap * 1000 - 1e-9) / 1000:g}", []).append(_NAMES.get(model, model))
        rows = claims[claims["model"] == model].set_index("label")
        if rows.loc[_AUTO, "verdict"] != rows.loc[_FIXED, "verdict"]:
            flips.append(_NAMES.get(model, model))
        j = jobs[(jobs["model"] == model) & jobs["label"].isin([_AUTO, _FIXED])]
        j = j[j["steps"] == j.loc[j["label"] == _AUTO, "steps"].iloc[0]]
        acc = bool(j["test_accuracy"].notna().all()) and model in ("resnet20", "cnn")
        w = j.assign(v=j["test_accuracy"] * 100 if acc else -j["test_loss"]).pivot_table(index="seed", columns="label", values="v")
        d = w[_AUTO] - w[_FIXED]
        apart.append(f"{_NAMES.get(model, model)} {d.mean():+.2f} points ({d.min():+.2f} to {d.max():+.2f} per seed)" if acc
                     else f"{_NAMES.get(model, model)} {d.mean():+.3f} nats")
    if not gaps:
        return ""
    within = ", ".join(f"{g} on {_and(ms)}" if i else f"{g} of each other on {_and(ms)}" for i, (g, ms) in enumerate(gaps.items()))
    return (f"\n`{_AUTO}` and `{_FIXED}` are one plan on each of these models: the bound granted every layer less "
            "than 0.85, and the two stored plans have the same formats and roundings and per-layer sparsities within "
            f"{within} (`noise_plans.json`). Each model's two rows are that plan trained twice on the same seeds, so "
            "their opposite verdicts" + (f" on {' and on '.join(flips)}" if flips else "") + " are two draws of one "
            "configuration, the training's noise, not evidence about \"auto\". How far the two draws landed apart "
            "(\"auto\" minus 0.85, mean over seeds): " + ", ".join(apart) + ".\n")


def _exact_losses(rows: list[dict], res: Path) -> list[dict]:
    """The 1.2 rows' loss in margins from the exact paired differences of the jobs (``noise_ranking.json``
    holds them as rounded in 1.2's table); the rows of this section have theirs already."""
    ss = _module("scale_study")
    df, _ = ss.load_results(res)
    exact = {(r.model, r.label): r.diff_mean for r in ss.paired_table(df, ss.PROTOCOL).itertuples()}
    return [{**r, "loss_margins": -exact[(r["model"], r["label"])] / abs(ss.PROTOCOL[r["model"]]["margin"])}
            if r["source"] == "1.2" and (r["model"], r["label"]) in exact else r for r in rows]


def _findings(claims: pd.DataFrame) -> str:
    """Per model, the mean sparsity its bounded plans reached, and whether it trained with no loss."""
    out = []
    for model, g in claims.groupby("model", sort=False):
        pr = g[g["target_sparsity"].notna() & ~g["label"].map(R._is_base)]  # the pruning plans
        if not len(pr):
            continue
        parts = [f"`{r['label']}` reached a sparsity of {r['achieved_sparsity']:.2f}: {r['verdict']}"
                 for _, r in pr.iterrows()]
        out.append(f"- **{model}**: " + "; ".join(parts) + ".")
    return "\n".join(out)


def section_noise_study(res: Path, *, quick: bool = False, figures: Path | None = None) -> tuple[str, float]:
    """1.8: the claims re-measured with the noise bound, whatever has finished; and the core seconds
    of its jobs (a job adopted from section 1 counts there)."""
    ns = _module("noise_study")
    head = ("\n### 1.8 The claims re-measured with the noise bound (prospective)\n\n"
            "The protocol `docs/protocol-noise.md` was committed before any of these trainings ran. "
            "It covers the default `recommend(calibration, sparsity=0.85)`, bounded at a predicted R of 0.02, "
            "`recommend(sparsity=\"auto\")`, the most the bound allows, and `recommend(bits=6)`. The models are "
            "ResNet-20 (6 seeds), the transformer (8 seeds) and a character LSTM new to the study (8 seeds, "
            "margin -0.01 nats). The plans are made once from each model's calibration trace: the plain model's "
            "first 50 steps, seed 0, with the noise records. The test is section 1's. *achieved*: the fraction "
            "of zeros in the planned layers' gradients under the plan, size-weighted over every call of the "
            "training (zeros of the gradient itself included). *granted*: the plan's mean over layers. "
            "*R*: the plan's mean predicted noise ratio. Command: `python experiments/noise_study.py` "
            "(resumable; `--remaining` prints what is left).\n\n")
    jobs, claims, length = noise_study_rows(res, quick=quick)
    plans_path = res / f"noise_plans{'_quick' if quick else ''}.json"
    plans = json.loads(plans_path.read_text()) if plans_path.exists() else {}
    models = [m for m in dict.fromkeys(claims["model"]) if _stored(plans, m, _FIXED) and _stored(plans, m, _FP6)] \
        if len(claims) else []
    if models and not quick:
        head = head.replace("and `recommend(bits=6)`. ", "and `recommend(bits=6)`." + _predates(plans, models) + " ", 1)
    if not len(claims):
        return head + "No results yet.\n", 0.0
    own = jobs[jobs["experiment"] == ns.EXPERIMENT] if "experiment" in jobs else jobs
    t = R._scale_rows(claims)
    t["seeds_of"] = [f"{int(a)}/{int(b)}" for a, b in zip(t["seeds"], t["seeds_planned"])]
    t["granted"] = t["granted_sparsity"].map(lambda v: "-" if v != v else f"{v:.2f}")
    t["achieved"] = t["achieved_sparsity"].map(lambda v: "-" if v != v else f"{v:.2f}")
    t["R"] = t["R_predicted"].map(lambda v: "-" if v != v else f"{v:.3f}")
    cols = {"model": "model", "label": "configuration", "seeds_of": "seeds", "value": "metric (mean ± sd)",
            "delta": "paired diff", "ci": "95% CI", "verdict": "verdict", "granted": "granted", "achieved": "achieved",
            "R": "R"}
    text = head + R.md_table(t, cols)
    left = ns.left(res, quick=quick)
    if len(length):
        lt = R._scale_rows(length)
        lt["seeds_of"] = [f"{int(a)}/{int(b)}" for a, b in zip(lt["seeds"], lt["seeds_planned"])]
        text += ("\n**Training length** (question 4): ResNet-20, `Plan.uniform(sparsity=0.85)` against the baseline of "
                 "the same length, seeds 0-2. The 2-epoch rows are section 1's.\n\n"
                 + R.md_table(lt, {"label": "configuration", "seeds_of": "seeds", "value": "accuracy % (mean ± sd)",
                                   "delta": "paired diff", "ci": "95% CI", "verdict": "verdict"}))
        text += _length_reading(lt, ns.UNIFORM)
    ranking_path = res / "noise_ranking.json"
    if ranking_path.exists() and not quick:
        rounded = ranking_rows(json.loads(ranking_path.read_text()), t)
        rows = _exact_losses(rounded, res)
        rho, lo, hi = _module("noise_ranking").spearman([r["R"] for r in rows], [r["loss_margins"] for r in rows])
        rho_r, lo_r, hi_r = _module("noise_ranking").spearman([r["R"] for r in rounded],
                                                              [r["loss_margins"] for r in rounded])
        new = sum(r["source"] == "1.8" for r in rows)
        text += (f"\nSpearman's rho of the predicted R against the loss in margins, over the {len(rows)} pruning rows "
                 f"of 1.2 and this section ({new} of them new, each on "
                 f"{'the seeds finished so far' if left else 'all its seeds'}): **{rho:.3f}** "
                 f"[{lo:.2f}, {hi:.2f}] (bootstrap 95%; the losses from the exact paired differences of "
                 "`scale_jobs.jsonl` and `noise_jobs.jsonl`, with `noise_ranking.spearman`; from 1.2's differences "
                 f"as rounded in its table it reads {rho_r:.2f} [{lo_r:.2f}, {hi_r:.2f}]).\n\n"
                 "![predicted R against loss](../experiments/results/noise_ranking.png)\n")
        plot_ranking(rows, (figures or res) / "noise_ranking.png")
    findings = _findings(t)
    if findings:
        text += "\nWhat the bounded plans reached:\n\n" + findings + "\n"
        if not quick:
            text += _one_plan(plans, jobs, claims.assign(verdict=t["verdict"]))
    core = float(own["wall_s"].sum()) if len(own) else 0.0
    text += (f"\n*Cost so far*: {len(own)} jobs of this protocol, {core / 3600:.2f} core hours (the wall time of each job, "
             "one torch thread each; it grows when other work shares the machine's 2 cores; the jobs adopted from "
             "section 1 count there). "
             + (f"{left} jobs remain; a row with fewer seeds than planned is *pending*." if left else
                "Every job of the protocol has run.") + "\n")
    return text, core
