"""The pure parts of experiments/bound_study.py: the matched control made from a bounded plan's
noise records, the study's jobs and their keys, what a rerun reuses, and the report's verdicts.
Nothing is calibrated or trained."""
from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from experiment_scripts import load_experiment as _load


@pytest.fixture(scope="module")
def bs():
    return _load("bound_study")


def bounded_plan(sparsity: dict[str, float]) -> dict:
    """A bounded plan as ``recommend(sparsity="auto")`` writes it: per layer its format, rounding,
    scale shift, granted sparsity and prediction, and a noise record per planned layer."""
    layers = [{"layer": n, "format": "e4m3fn", "rounding": "stochastic" if i % 2 else None,
               **({"scale_shift": 1} if i == 0 else {}), **({"sparsity": s} if s else {}),
               "predicted": {"error": 0.003, "sparsity": s, "threshold": 0.01}}
              for i, (n, s) in enumerate(sparsity.items())]
    layers = [{k: v for k, v in e.items() if v is not None} for e in layers]
    return {"schema": "gradstats.plan", "version": 1,
            "provenance": {"source": "/tmp/calib", "gradstats_version": "0", "created": "2026-01-01T00:00:00Z",
                           "generator": "recommend(bits=8, sparsity='auto', noise_bound=0.1)", "steps": [10, 46]},
            "defaults": {"format": None, "scale": "amax", "rounding": "nearest", "sparsity": 0.99,
                         "threshold_rule": "histogram"},
            "layers": layers, "output_layer": "fc", "prune_at": "auto", "noise_bound": 0.1,
            "checks": [{"layer": n, "ok": True} for n in sparsity],
            "noise": [{"layer": n, "requested_sparsity": 0.99, "sparsity": s,
                       "sparsity_reason": "noise bound" if s else "not pruned", "predicted_noise": 0.1}
                      for n, s in sparsity.items()]}


def test_matched_control_from_noise_records(bs):
    import gradstats

    plan = bounded_plan({"conv1": 0.6, "conv2": 0.0, "conv3": 0.2})
    weights = {"conv1": 100.0, "conv2": 50.0, "conv3": 300.0, "fc": 10.0}
    pruned, mean = bs.granted(plan, weights)
    assert pruned == {"conv1": 0.6, "conv3": 0.2}
    assert mean == pytest.approx((0.6 * 100 + 0.2 * 300) / 400)           # element-weighted: 0.3
    ctl = bs.matched_control(plan, weights, source="recommend(sparsity='auto', noise_bound=0.1)")
    by = {e["layer"]: e for e in ctl["layers"]}
    assert by["conv1"]["sparsity"] == by["conv3"]["sparsity"] == pytest.approx(0.3)
    assert "sparsity" not in by["conv2"]                                  # not pruned by the plan: as it was
    for e, f in zip(plan["layers"], ctl["layers"]):                       # every other field as the plan has it
        assert {k: v for k, v in e.items() if k not in ("sparsity", "predicted")} == \
               {k: v for k, v in f.items() if k != "sparsity"}
        assert "predicted" not in f
    assert ctl["defaults"] == {**plan["defaults"], "sparsity": pytest.approx(0.3)}
    assert (ctl["output_layer"], ctl["prune_at"]) == ("fc", "auto")
    assert not {"noise", "noise_bound", "checks"} & set(ctl)
    assert "matched uniform control" in ctl["provenance"]["generator"]
    p = gradstats.Plan.from_dict(ctl)                                     # a valid plan
    rules = p.resolve(["conv1", "conv2", "conv3"])
    assert rules["conv1"].sparsity == rules["conv3"].sparsity == pytest.approx(0.3)
    assert str(rules["conv2"].format) == "e4m3fn" and rules["conv2"].rounding == "stochastic"
    assert plan["layers"][0]["sparsity"] == 0.6                           # the bounded plan untouched
    with pytest.raises(ValueError, match="prunes no layer"):
        bs.matched_control(bounded_plan({"a": 0.0}), {"a": 1.0})
    with pytest.raises(ValueError, match="element count"):
        bs.granted(plan, {"conv1": 1.0})


def test_arms_and_their_order(bs):
    arms = bs.study_arms(bs.MODELS, None, bs.ARMS)
    count = pd.Series([a.model for a in arms]).value_counts().to_dict()
    assert count == {"resnet20": 8 * 9 + 1, "transformer": 8 * 9 + 1, "lstm": 8 * 3 + 1}
    assert {a.arm for a in arms if a.model == "lstm"} == {"repeat", "baseline", "auto", "nvfp4"}
    assert [a.tier for a in arms] == sorted(a.tier for a in arms)        # the repeats, then questions 1, 2
    assert [(a.model, a.seed, a.label) for a in arms[:3]] == [(m, 0, bs.REPEAT) for m in bs.MODELS]
    assert {(a.model, a.arm) for a in arms if a.tier == 1} == {
        (m, arm) for m in ("resnet20", "transformer") for arm in ("baseline", "bounded", "matched")}
    assert len({(a.model, a.seed, a.label) for a in arms}) == len(arms)
    assert [a.seed for a in bs.study_arms(["resnet20"], [7, 9], ["baseline"])] == [7]
    # a control needs its bounded plan made beside it
    sel = bs.study_arms(["transformer"], [3], ["matched"])
    assert bs.plan_labels(sel) == [bs.bounded_label(b) for b in bs.BOUNDS] + [bs.matched_label(b) for b in bs.BOUNDS]


def store_entry(bs, errors: dict | None = None) -> dict:
    from gradstats import Plan

    weights = {"conv1": 100.0, "conv2": 50.0, "conv3": 300.0}
    plans = {}
    for b in bs.BOUNDS:
        plans[bs.bounded_label(b)] = bounded_plan({"conv1": 0.2 + b, "conv2": 0.0, "conv3": b})
        plans[bs.matched_label(b)] = bs.matched_control(plans[bs.bounded_label(b)], weights)
    plans[bs.NVFP4] = Plan.uniform(format="nvfp4").to_dict()
    probe = {lab: {"R_predicted": 0.01 * i, "R_measured": 0.02 * i} for i, lab in enumerate(plans)}
    return {"plans": plans, "probe": probe, "errors": dict(errors or {}), "weights": weights, "plan_s": 60.0}


def test_job_keys_resume_and_adoption(bs, tmp_path):
    arms = bs.study_arms(["resnet20"], [0], bs.ARMS)
    err = "ValueError: bits must be an int or a non-empty list of ints (3..16), got 'auto'"
    store = {bs.store_key("resnet20", 0): store_entry(bs, {bs.AUTO: err})}
    jobs, failed = bs.study_jobs(arms, store, False)
    # the arm whose plan failed is not a job: it fails by name, with its error, and is tried again
    assert [(a.label, why) for a, why in failed] == [(bs.AUTO, err)]
    assert bs.missing_plans(arms, store, False) == [("resnet20", 0, bs.plan_labels(arms))]
    assert bs.missing_plans([a for a in arms if a.arm != "auto"], store, False) == []
    assert [j.label for j in jobs[:2]] == [bs.REPEAT, "baseline"]
    assert len(jobs) == 9 and len({j.key for j in jobs}) == 9
    # the baseline's key is every experiment's: the noise study's seed-0 baseline is this one; the
    # repeat, the same training under a key of its own, is trained to check that
    assert jobs[1].key == "baseline/resnet20/baseline/seed0/steps938/full"
    assert jobs[0].key == "baseline/resnet20/baseline [repeat]/seed0/steps938/full"
    assert all(j.key.startswith("bound/resnet20/") for j in jobs[2:])
    again, _ = bs.study_jobs(arms, json.loads(json.dumps(store)), False)   # stored and read back: the same keys
    assert [j.key for j in again] == [j.key for j in jobs]
    repeat, base, first = jobs[:3]
    m = next(j for j in jobs if j.label == bs.matched_label(0.1))
    assert m.info["target_sparsity"] == pytest.approx((0.3 * 100 + 0.1 * 300) / 400)
    assert m.info["granted_sparsity"] == next(j for j in jobs if j.label == bs.bounded_label(0.1)).info["granted_sparsity"]
    assert {"R_predicted", "R_measured", "formats"} <= set(m.info)

    # adoption: the baselines of the same key in the shared job files, once
    out = tmp_path
    row = {"key": base.key, "experiment": "scale", "label": "baseline", "model": "resnet20", "seed": 0,
           "steps": 938, "test_accuracy": 0.9112, "test_loss": 0.25, "wall_s": 300.0}
    other = {**row, "key": "noise/resnet20/recommend(bits=6)/seed0/steps938/full/plan-x", "label": "recommend(bits=6)"}
    (out / "noise_jobs.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(other) + "\n")
    path = out / "bound_jobs.jsonl"
    assert bs.adopt_baselines(arms, path, out, False) == 1
    assert bs.adopt_baselines(arms, path, out, False) == 0
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["key"] for r in rows] == [base.key] and rows[0]["adopted_from"] == base.key

    # resume: a finished job is reused, a torn last line ignored; the rest is pending
    with open(path, "a") as fh:
        fh.write(json.dumps({**row, "key": first.key, "experiment": "bound", "arm": "bounded", "wall_s": 250.0}) + "\n")
        fh.write('{"key": "torn')
    st = bs.status(arms, store, path, False)
    state = dict(zip(st["label"], st["state"]))
    assert state["baseline"] == "adopted" and state[first.label] == "done" and state[bs.REPEAT] == "pending"
    assert state[bs.AUTO] == "plan failed"
    assert sum(s == "pending" for a, s in zip(st["arm"], st["state"]) if a != "plans") == 7
    assert list(st.loc[st["arm"] == "plans", "seed"]) == [0]              # its calibration, to make the auto plan
    table = bs.summary(st).set_index("arm")
    assert table.loc["bounded", "left"] == 2 and table.loc["baseline", "adopted"] == 1
    # run_jobs with every job in the file trains nothing and returns each row under its own label
    done = [json.dumps({**row, "key": j.key, "experiment": "bound"}) for j in jobs if j not in (base, first)]
    with open(path, "a") as fh:
        fh.write("\n" + "\n".join(done) + "\n")
    before = path.read_text()
    df = bs.run_jobs(jobs, path, workers=0)
    assert path.read_text() == before and list(df["label"]) == [j.label for j in jobs]


def test_verdicts_and_contrast(bs):
    assert bs.growth_verdict(-0.5, -0.35, -0.3) == "**grows**, by more than the margin"
    assert bs.growth_verdict(-0.2, -0.05, -0.3) == "**grows**"
    assert bs.growth_verdict(-0.2, 0.1, -0.3) == "**does not grow** beyond the margin"
    assert bs.growth_verdict(-0.4, 0.1, -0.3) == "inconclusive"
    assert bs.comparison_verdict(0.1, 0.4, -0.3) == "**better**"
    assert bs.comparison_verdict(-0.4, -0.1, -0.3) == "**worse**"
    assert bs.comparison_verdict(-0.2, 0.25, -0.3) == "**equivalent**"
    assert bs.comparison_verdict(-0.5, 0.1, -0.3) == "inconclusive"
    assert bs.growth_verdict(math.nan, math.nan, -0.3) == "-"
    # the paired contrast of two arms: per-seed differences, mean and t interval
    rows = []
    for s, (a, b) in enumerate([(0.90, 0.89), (0.91, 0.895), (0.905, 0.90)]):
        for lab, acc in (("T", a), ("ref", b)):
            rows.append({"model": "resnet20", "label": lab, "seed": s, "test_accuracy": acc, "test_loss": 0.3,
                         "achieved_sparsity": 0.5, "underflow_fraction": 0.0, "overflow_fraction": 0.0,
                         "wall_s": 1.0, "diverged": False})
    proto = {"resnet20": {"metric": "accuracy", "margin": -0.3, "seeds": (0, 1, 2)}}
    t = bs.contrast(pd.DataFrame(rows), proto, "T", "ref").iloc[0]
    assert t["diff_mean"] == pytest.approx(1.0) and t["seeds"] == 3 and t["reference"] == "ref"
    assert t["ci_low"] < 1.0 < t["ci_high"]
    rho, lo, hi = bs.spearman_by_seed([1, 2, 3, 4, 5, 6], [1, 3, 2, 4, 6, 5], [0, 0, 1, 1, 2, 2], boot=50)
    assert rho == pytest.approx(0.8857, abs=1e-3) and lo <= rho <= hi


def test_the_answers_in_words_follow_the_tables():
    """Section 1.9's sentences carry each question's interval and verdict as the tables have them,
    one line per model, bold where the protocol's rule gave an answer."""
    rb = _load("report_bound")
    t = {"q1": pd.DataFrame([{"model": "resnet20", "contrast": "B=0.5 - B=0.02", "seeds": "8/8",
                              "diff": "-0.11 [-0.30, +0.08]", "verdict": "**does not grow** beyond the margin",
                              "primary": True},
                             {"model": "resnet20", "contrast": "B=0.1 - B=0.02", "seeds": "8/8",
                              "diff": "-0.07 [-0.19, +0.05]", "verdict": "inconclusive", "primary": False}]),
         "q2": pd.DataFrame([{"model": "transformer", "bound": b, "seeds": "8/8", "diff": d, "verdict": v}
                             for b, d, v in (("0.02", "-0.000 [-0.007, +0.006]", "**equivalent**"),
                                             ("0.1", "+0.004 [-0.005, +0.012]", "inconclusive"),
                                             ("0.5", "+0.013 [+0.006, +0.020]", "**better**"))]),
         "q2_answers": {"transformer": "yes"},
         "q3": pd.DataFrame([{"model": "lstm", "nvfp4": "-0.000 [-0.004, +0.004]: **no loss**",
                              "auto": "-0.000 [-0.009, +0.009]: **no loss**", "answer": "not asked (NVFP4 passes)"}]),
         "q4": pd.DataFrame([{"model": "transformer", "jobs": 48, "R_predicted": "0.68 [0.59, 0.77]",
                              "R_measured": "0.66 [0.59, 0.76]", "answer": "**yes**"}])}
    text = rb.answers(t)
    lines = text.splitlines()
    assert lines[0] == "1. Does the loss grow with the bound?"
    assert lines[1] == "   - ResNet-20: B=0.5 minus B=0.02 is -0.11 [-0.30, +0.08] points: **does not grow** beyond the margin."
    assert "B=0.1" not in lines[1] and len([x for x in lines if x.startswith("   - ResNet-20")]) == 1  # the primary only
    assert lines[3] == ("   - The transformer (nats): **yes**; B=0.02: -0.000 [-0.007, +0.006], equivalent; "
                        "B=0.1: +0.004 [-0.005, +0.012], inconclusive; B=0.5: +0.013 [+0.006, +0.020], better.")
    assert lines[5] == ("   - The LSTM (nats): **not asked (NVFP4 passes)**; NVFP4 -0.000 [-0.004, +0.004]: no loss; "
                        "`bits=\"auto\"` -0.000 [-0.009, +0.009]: no loss.")
    assert lines[7] == "   - The transformer: **yes**; rho 0.68 [0.59, 0.77] over 48 jobs (with the measured R: 0.66 [0.59, 0.76])."
