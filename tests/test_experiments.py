"""Small versions of the study's experiments (experiments/*.py --quick): the committed
Fashion-MNIST subset, a few steps, one seed. They keep the scripts from rotting and check the
bookkeeping the full tables rest on; the accuracies of so short a training mean nothing."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def _load(name: str):
    sys.path.insert(0, str(EXPERIMENTS))
    spec = importlib.util.spec_from_file_location(f"exp_{name}", EXPERIMENTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("experiments")


def test_pruning_accuracy_quick(out):
    mod = _load("pruning_accuracy")
    table = mod.main(["--quick", "--out", str(out)])
    payload = json.loads((out / "pruning_accuracy.json").read_text())
    assert payload["command"].endswith("--quick") and payload["seeds"] == [0]
    assert sorted(set(table["target_sparsity"])) == sorted(mod.SPARSITIES)
    rules = table.groupby("target_sparsity")["threshold_rule"].apply(set)
    assert rules[0.85] == rules[0.9] == set(mod.RULES)
    # the exact-quantile rule hits its target on every tensor, so on the whole run
    exact = table[table["threshold_rule"] == "exact"]
    assert (exact["achieved_sparsity"] - exact["target_sparsity"]).abs().max() < 2e-3
    # achieved sparsity rises with the target; the baseline is not pruned
    lg = table[table["threshold_rule"] == "lognormal"].sort_values("target_sparsity")
    assert lg["achieved_sparsity"].is_monotonic_increasing
    base = table[table["target_sparsity"] == 0].iloc[0]
    assert base["acc_delta"] == 0 and base["underflow"] == 0
    assert 0 < base["acc_mean"] <= 100
    assert len(payload["jobs"]) == len(table)          # one seed: one job per row
    assert (out / "pruning_accuracy.png").stat().st_size > 10_000
    # a rerun trains nothing: every job is in the results file
    lines = (out / "jobs.jsonl").read_text().splitlines()
    mod.main(["--quick", "--out", str(out)])
    assert (out / "jobs.jsonl").read_text().splitlines() == lines


def test_lowprec_accuracy_quick(out):
    mod = _load("lowprec_accuracy")
    table = mod.main(["--quick", "--out", str(out)]).set_index("label")
    for name, _ in mod.FORMATS:
        from gradstats import FPFormat

        fmt = str(FPFormat.parse(name))
        assert f"{fmt} per-layer" in table.index
        assert (f"{fmt} global" in table.index) == (name in mod.GLOBAL)
    for bits in mod.WIDTHS:
        row = table.loc[f"FP{bits} recommended"]
        # every recommended format has the width asked for
        from gradstats import FPFormat

        assert all(FPFormat.parse(f).bits == bits for f in row["format"].split("/"))
    assert {"e2m1fn MX", "e2m1fn MX SR", "e2m1fn NVFP4", "e2m1fn NVFP4 SR"} <= set(table.index)
    jobs = json.loads((out / "lowprec_accuracy.json").read_text())["jobs"]
    scales = {j["label"]: j["scale"] for j in jobs if j["scaling"] == "global"}
    # global scales are powers of two
    assert all(float(s).hex().startswith("0x1.0000000000000p") for s in scales.values())
    # quantising never prunes more than everything, and float32 loses nothing
    assert table.loc["baseline", "underflow"] == 0
    assert ((table["underflow"] >= 0) & (table["underflow"] <= 1)).all()
    assert (out / "lowprec_accuracy.png").stat().st_size > 10_000


def test_push_quick(out):
    mod = _load("push")
    table = mod.main(["--quick", "--out", str(out)])
    assert len(table) == 4 + len(mod.CONFIGS) + len(mod.ALLOCATED)   # baseline, 3 pruning-only, the rest
    combo = table[(table["sparsity"] == 0.9) & (table["bits"] == 5)].iloc[0]
    assert combo["rounding"] == "stochastic" and combo["sparsity"] == 0.9
    assert table["holds"].dtype == bool
    # the allocated budgets: one target per planned layer, element-weighted to the budget
    alloc = table[table["label"].str.startswith("allocated")]
    assert len(alloc) == len(mod.ALLOCATED)
    import gradstats
    from gradstats.zoo.models import build_model

    planned = list(gradstats.Plan.uniform().resolve(build_model("cnn")))   # conv and linear, not the logits
    assert len(planned) == 3 and all(len(t.split("/")) == len(planned) for t in alloc["layer_targets"])
    # the pruning-only rows are the pruning experiment's jobs (shared results)
    keys = [json.loads(line)["key"] for line in (out / "jobs.jsonl").read_text().splitlines()]
    assert len(keys) == len(set(keys))


def test_distributions_quick(out):
    mod = _load("distributions")
    summary = mod.main(["--quick", "--out", str(out)])
    assert set(summary["model"]) == {"cnn", "mlp"} and set(summary["kind"]) == set(mod.KINDS)
    for col in ("lognormal_beats_normal", "lognormal_beats_laplace", "lognormal_best_significant"):
        assert summary[col].between(0, 1).all()
    for fam in mod.FAMILIES:
        assert summary[f"ks_median_{fam}"].between(0, 1).all()
    assert (summary["sigma_log2_min"] <= summary["sigma_log2_max"]).all()
    assert (summary["sigma_log2_min"] > 0).all()
    payload = json.loads((out / "distributions.json").read_text())
    assert payload["layer_verdicts"] and payload["timing"]["cnn"]["steps"] == 4
    assert (out / "distributions_ks.png").stat().st_size > 10_000


def test_recommend_accuracy_and_criteria_quick(out):
    """The paired comparison (every configuration against the baseline of its seed), then the
    criteria measured for each configuration and ranked against its accuracy loss."""
    mod = _load("recommend_accuracy")
    table = mod.main(["--quick", "--out", str(out), "--workers", "1"]).set_index("label")
    labels = ["baseline", "recommend(bits=6)", "recommend(bits=6, sparsity=0.85)", "Plan.uniform(sparsity=0.85)"]
    assert set(labels) <= set(table.index) and len(table) == 4 + 2 * len(mod.HAND) + 2
    assert table.loc["baseline", "diff_mean"] == 0 and (table["seeds"] == 1).all()
    assert (table["failed"] == 0).all()
    # the defaults prune at the target and leave the logits alone: 85% achieved on the planned layers
    assert abs(table.loc["Plan.uniform(sparsity=0.85)", "achieved_sparsity"] - 0.85) < 0.02
    crit = _load("criteria_correlation")
    corr = crit.main(["--quick", "--out", str(out)]).set_index("criterion")
    payload = json.loads((out / "criteria_correlation.json").read_text())
    rows = {r["label"]: r for r in payload["table"]}
    assert set(rows) == set(table.index) - {"baseline"} and set(corr.index) == set(crit.CRITERIA)
    assert corr["spearman_all"].between(-1, 1).all()
    # what the criteria must show whatever the losses: pruning alone does not round, stochastic
    # rounding is unbiased where nearest at the MSE scale is not, and the alignment is its witness
    prune = rows["Plan.uniform(sparsity=0.85)"]
    assert not prune["quantizes"] and prune["predicted_bias"] == 0 and prune["flushed"] == 0
    near, sr = rows["e3m2fn nearest, lognormal scale"], rows["e3m2fn stochastic, amax scale"]
    assert near["bias"] > 5 * sr["bias"] and near["predicted_bias"] > 0 == sr["predicted_bias"]
    assert near["bn_cos"] > sr["bn_cos"]


def test_results_document_is_current(tmp_path):
    """docs/RESULTS.md is exactly what experiments/report.py renders from the committed results."""
    mod = _load("report")
    root = EXPERIMENTS.parent
    text = mod.main(["--results", str(EXPERIMENTS / "results"), "--out", str(tmp_path / "RESULTS.md")])
    assert (root / "docs" / "RESULTS.md").read_text() == text
    for section in ("## 1. Distributions", "## 2. Accuracy under stochastic pruning",
                    "## 3. Accuracy with low-precision", "## 4. Past the study"):
        assert section in text
    assert "No results yet" not in text


def test_threshold_training_quick(out):
    """Per layer, element-weighted over the run under apply; the histogram rule (the default) is
    the closer of the two on every layer type even in so short a run."""
    mod = _load("threshold_training")
    table = mod.main(["--quick", "--out", str(out), "--workers", "1"]).set_index(["rule", "type"])
    payload = json.loads((out / "threshold_training.json").read_text())
    layers = payload["layers"]
    assert {r["type"] for r in layers} == {"conv", "linear", "attention"}
    assert not any(r["layer"] in ("fc2", "head") for r in layers)     # the output layers stay unpruned
    for kind in ("conv", "linear", "attention", "all layers"):
        assert table.loc[("histogram", kind), "mean_abs_miss"] < table.loc[("lognormal", kind), "mean_abs_miss"]
    assert table.loc[("histogram", "all layers"), "cases"] == len(layers) / 2
