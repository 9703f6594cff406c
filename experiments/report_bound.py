"""Section 1.9 of docs/RESULTS.md: what the noise bound is worth, the prospective study of
``docs/protocol-bound.md`` (``experiments/bound_study.py``). Rendered by ``experiments/report.py``
from the committed jobs (``bound_jobs.jsonl``, ``bound_plans.json``); the tables are the study's
own report (``bound_study.report``), the answers in words are computed from the same tables.
"""
from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

import pandas as pd

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

NAMES = {"resnet20": "ResNet-20", "transformer": "the transformer", "lstm": "the LSTM"}
UNITS = {"resnet20": "points", "transformer": "nats", "lstm": "nats"}


def _plain(verdict: str) -> str:
    return verdict.replace("**", "")


def plot_arms(arms: pd.DataFrame, protocol: dict, path: Path) -> Path:
    """Per model, every arm's paired difference with the baseline and its 95% interval: the bounded
    plans (filled) and their matched controls (open) at each bound, then ``bits="auto"`` and uniform
    NVFP4; the margin dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import bound_study as bs
    import matplotlib.pyplot as plt

    models = [m for m in bs.MODELS if m in set(arms["model"])]
    width = [1.0 if bs.MODEL_ARMS[m] == bs.ARMS else 0.5 for m in models]
    fig, axes = plt.subplots(1, len(models), figsize=(1.2 + 3.4 * sum(width), 3.6), squeeze=False,
                             gridspec_kw={"width_ratios": width})
    slots = [(f"B={b:g}", bs.bounded_label(b), bs.matched_label(b)) for b in bs.BOUNDS]
    slots += [("bits='auto'", bs.AUTO, None), ("NVFP4", bs.NVFP4, None)]
    for ax, model in zip(axes[0], models):
        g = arms[arms["model"] == model].set_index("label")
        mine = [s for s in slots if s[1] in g.index]
        for x, (name, main, control) in enumerate(mine):
            for lab, dx, face, marker in ((main, -0.12 if control else 0.0, "#2166ac", "o"),
                                          (control, 0.12, "none", "s")):
                if lab is None or lab not in g.index or g.loc[lab, "ci_low"] != g.loc[lab, "ci_low"]:
                    continue
                r = g.loc[lab]
                ax.errorbar(x + dx, r["diff_mean"], yerr=[[r["diff_mean"] - r["ci_low"]], [r["ci_high"] - r["diff_mean"]]],
                            fmt=marker, mfc=face, mec="#2166ac", ecolor="#2166ac", ms=6, capsize=3, lw=1.1)
        ax.set_xticks(range(len(mine)), [s[0] for s in mine], rotation=30, fontsize=7)
        margin = protocol[model]["margin"]
        ax.axhline(0.0, color="#bbbbbb", lw=0.7)
        ax.axhline(margin, color="#b2182b", lw=0.8, ls="--")
        ax.text(-0.5, margin, "margin", fontsize=7, color="#b2182b", ha="left", va="bottom")
        ax.set_title(f"{NAMES[model][0].upper() + NAMES[model][1:]}\npaired difference, {UNITS[model]}", fontsize=8)
        lo, hi = ax.get_ylim()
        ax.set_ylim(min(lo, 1.2 * margin), max(hi, -0.2 * margin))
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlim(-0.6, len(mine) - 0.4)
    axes[0][0].set_ylabel("plan - baseline (positive: better), 95% CI", fontsize=7)
    handles = [plt.Line2D([], [], marker="o", color="#2166ac", ls="", label="recommend(noise_bound=B) / bits='auto' / NVFP4"),
               plt.Line2D([], [], marker="s", mfc="none", mec="#2166ac", ls="", label="matched uniform control")]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def answers(t: dict) -> str:
    """The four answers in words, one line per model, from ``bound_study.study_tables``."""
    def cap(model: str) -> str:
        return NAMES[model][0].upper() + NAMES[model][1:]

    q1 = [f"   - {cap(r['model'])}: B=0.5 minus B=0.02 is {r['diff']} {UNITS[r['model']]}: {r['verdict']}."
          for _, r in t["q1"][t["q1"]["primary"]].iterrows()]
    q2 = []
    for model, ans in t["q2_answers"].items():
        g = t["q2"][t["q2"]["model"] == model]
        q2.append(f"   - {cap(model)} ({UNITS[model]}): **{ans}**; " + "; ".join(
            f"B={r['bound']}: {r['diff']}, {_plain(r['verdict'])}" for _, r in g.iterrows()) + ".")
    q3 = [f"   - {cap(r['model'])} ({UNITS[r['model']]}): **{_plain(r['answer'])}**; NVFP4 {_plain(r['nvfp4'])}; `bits=\"auto\"` "
          f"{_plain(r['auto'])}." for _, r in t["q3"].iterrows()]
    q4 = [f"   - {cap(r['model'])}: **{_plain(r['answer'])}**; rho {r['R_predicted']} over {r['jobs']} jobs "
          f"(with the measured R: {r['R_measured']})." for _, r in t["q4"].iterrows()]
    probe = []
    arms = t.get("arms")
    if arms is not None and {"R_predicted", "R_measured"} <= set(arms.columns):
        for model, g in arms.dropna(subset=["R_predicted", "R_measured"]).groupby("model", sort=False):
            g = g[g["R_measured"] > 0]
            if len(g):
                ratio = g["R_predicted"] / g["R_measured"]
                probe.append(f"{NAMES[model]} {ratio.min():.2f}-{ratio.max():.2f} ({len(g)} arms)")
    tail = (["The plans' predicted R over the R the probe measured on them (each arm's means over its seeds): "
             + "; ".join(probe) + "."] if probe else [])
    bits = auto_bits(t.get("store") or {})
    if bits:
        tail += ["", "What `bits=\"auto\"` chose (`plan.storage()`: mean bits per gradient value, element-weighted, a "
                 "layer left in full precision counted at 16; uniform NVFP4 is 4.5): " + "; ".join(
                     f"{NAMES[m]} {min(v):.1f}-{max(v):.1f} over its {len(v)} seeds (median {statistics.median(v):.1f})"
                     for m, v in bits.items()) + "."]
    return "\n".join(["1. Does the loss grow with the bound?", *q1,
                      "2. Does a bounded plan beat its matched uniform control?", *q2,
                      "3. Does `bits=\"auto\"` lose nothing where uniform NVFP4 loses?", *q3,
                      "4. Does the predicted R rank the losses within each model?", *q4, "", *tail]) + "\n"


def auto_bits(store: dict) -> dict[str, list[float]]:
    """Per model, the mean bits per gradient value of each seed's stored ``bits="auto"`` plan."""
    import bound_study as bs

    from gradstats import Plan

    out: dict[str, list[float]] = {}
    for key, entry in store.items():
        plan = (entry.get("plans") or {}).get(bs.AUTO)
        storage = Plan.from_dict(plan).storage() if plan else None
        if storage:
            out.setdefault(key.split("/")[0], []).append(float(storage["mean_bits"]))
    return {m: out[m] for m in bs.MODELS if m in out}


def section_bound_study(res: Path, *, figures: Path | None = None) -> tuple[str, float]:
    """1.9: the study's tables and answers, whatever has finished; and the core seconds of its own
    jobs (the adopted baselines count in the studies that trained them)."""
    import bound_study as bs

    head = ("\n### 1.9 What the noise bound is worth (prospective)\n\n"
            "The protocol `docs/protocol-bound.md` was committed before any of these trainings ran; its deviations "
            "are recorded there, as they happened. Per model and seed, every plan is made from that seed's "
            "calibration trace (the plain model's first 50 steps): `recommend(calibration, sparsity=\"auto\", "
            "noise_bound=B)` for B = 0.02 (the default), 0.1 and 0.5; beside each a *matched uniform control* with "
            "the same rules and the same expected number of zeros per step, spread evenly over the layers the "
            "bounded plan prunes; `recommend(calibration, bits=\"auto\")` and `Plan.uniform(format=\"nvfp4\")`. "
            "ResNet-20 (2 epochs) and the transformer train every arm on 8 seeds, the LSTM the last two. "
            "*R predicted*: the plan's mean predicted noise ratio over its layers; *R measured*: `noise_probe` "
            "on the plan at its calibration model (8 batches x 2 draws). The test and verdicts are section 1's. "
            "Command: `python experiments/bound_study.py --jobs 2` (resumable; `--dry-run` prints what is left, "
            "`--report` writes `experiments/results/bound_study.txt`).\n")
    t = bs.study_tables(res)
    body = bs.report(res, tables=t)
    if "arms" not in t:
        return head + "\nNo results yet.\n", 0.0
    body = body.split("\n## Reuse check", 1)[1]
    body = "\n#### Reuse check" + re.sub(r"^## ", "#### ", body, flags=re.M)
    figure = (figures or res) / "bound_study.png"
    plot_arms(t["arms"], t["protocol"], figure)
    text = (head + "\n![every arm against the baseline](../experiments/results/bound_study.png)\n\n"
            + answers(t) + body)
    own = t["jobs"][t["jobs"]["adopted_from"].isna()] if "adopted_from" in t["jobs"] else t["jobs"]
    return text, float(own["wall_s"].sum()) + sum(float(e.get("plan_s", 0.0)) for e in t["store"].values())
