"""The analysis and report pipeline (gradstats.report), the report/figures subcommands, and the
demo end to end on a tiny setting."""
from __future__ import annotations

import json
import logging
import math
import re
import subprocess
import sys

import pandas as pd
import pytest
import torch

import gradstats
from gradstats.cli import main
from gradstats.cli.demo import sample_steps
from gradstats.report import analyse, report

SAMPLE = gradstats.zoo.data.data_dir() / "sample-run"


@pytest.fixture(scope="module")
def analysis():
    return analyse(SAMPLE)


def test_table_has_every_layer_and_the_plans_the_planned_ones(analysis):
    t = analysis.table
    assert list(t["layer"]) == ["conv1", "bn1", "conv2", "bn2", "fc1", "fc2"]
    planned = t[t["planned"]]
    assert list(planned["layer"]) == ["conv1", "conv2", "fc1"]  # convolutions and linear layers; fc2, the logits, stays exact
    for b in (8, 6, 4):
        fmts = [gradstats.FPFormat.parse(f) for f in planned[f"fp{b}"]]
        assert all(f.bits == b for f in fmts)
        assert (planned[f"fp{b}_error"] > 0).all()
    assert t.loc[~t["planned"], "fp8"].isna().all()
    assert set(analysis.plans) == {0.85, 0.9} and all(set(p) == {8, 6, 4} for p in analysis.plans.values())
    assert analysis.plan() is analysis.plans[0.85][8]


def test_thresholds_reach_their_targets_under_the_model(analysis):
    from gradstats import pruning
    from gradstats.plan.recommend import layer_moments

    planned = analysis.table[analysis.table["planned"]]
    assert len(planned) and "fc2" not in set(planned["layer"])       # the output layer stays exact
    rows = layer_moments(SAMPLE, steps=analysis.plan_step, layers=list(planned["layer"])).to_dict("records")
    for r, st in zip(planned.to_dict("records"), rows):
        for s in (0.85, 0.9):
            # the default (histogram) rule at the layer's statistics of the plan step
            a = r[f"threshold_{round(100 * s)}"]
            assert a == pytest.approx(float(pruning.threshold(s, st)), rel=1e-12)
            # and the sparsity it reaches on the layer's own binade histogram is the target
            assert float(pruning.expected_sparsity(a, st, threshold_rule="histogram")) == pytest.approx(
                max(s, r["zero_fraction"]), abs=2e-3)
        assert r["threshold_90"] >= r["threshold_85"]


def test_std_and_verdicts_come_from_the_run(analysis):
    from gradstats.plan.recommend import layer_moments

    m = layer_moments(SAMPLE, steps=analysis.plan_step, layers=["conv2"]).iloc[0]
    row = analysis.table.set_index("layer").loc["conv2"]
    assert row["std_log2"] == pytest.approx(m["sigma"] / math.log(2), rel=1e-12)
    assert analysis.plan_step == 196 and analysis.fit_steps == [0, 64, 128, 196]
    assert row["verdict"] == "lognormal" and row["fitted_steps"] == 4
    assert row["ks_lognormal"] < row["ks_normal"] and row["ks_lognormal"] < row["ks_laplace"]
    assert set(analysis.fits["step"]) == {0, 64, 128, 196} and (analysis.fits["source"] == "samples").all()


def test_summary_and_dict(analysis):
    text = str(analysis)
    head = text.splitlines()[0]
    for col in ("std log2|g|", "best fit", "KS lognormal", "thr 85%", "thr 90%", "FP8", "FP6", "FP4"):
        assert col in head
    assert re.search(r"conv2 .* e\dm\dfn 2\^-?\d+", text)
    d = analysis.to_dict()
    json.dumps(d, allow_nan=False)  # plain data
    assert [r["layer"] for r in d["layers"]][:2] == ["conv1", "bn1"] and set(d["plans"]) == {"85", "90"}


def test_the_terminal_footnote_names_the_threshold_rule_the_plans_use(analysis):
    rules = {p.defaults.threshold_rule for ps in analysis.plans.values() for p in ps.values()}
    assert rules == {"histogram"}
    text = str(analysis)
    assert "thresholds: stochastic pruning, histogram rule" in text and "lognormal rule" not in text


def test_report_writes_plans_tables_and_markdown(tmp_path):
    import torch  # noqa: F401

    from gradstats.zoo.models import build_model

    rep = report(SAMPLE, tmp_path, sparsities=[0.9], bits=[6], figures=False)
    plan = gradstats.Plan.load(rep.files["plan"])
    resolved = plan.resolve(build_model("cnn"))
    assert sorted(resolved) == ["conv1", "conv2", "fc1"]
    assert all(r.format.bits == 6 and r.sparsity == 0.9 for r in resolved.values())
    assert (tmp_path / "plans" / "fp6-s90.json").is_file()
    md = rep.markdown.read_text()
    assert "| layer |" in md and "fp6-s90.json" in md and "## Predicted and measured" in md
    assert rep.figures == {} and "![" not in md
    assert (tmp_path / "layers.csv").read_text().startswith("layer,type,")


def test_bad_input():
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        analyse(SAMPLE, sparsities=[1.0])
    with pytest.raises(ValueError, match="at least one"):
        analyse(SAMPLE, bits=[])
    with pytest.raises(ValueError, match="no plan for"):
        analyse(SAMPLE, bits=[8], sparsities=[0.9]).plan(bits=4)
    with pytest.raises(ValueError):
        sample_steps(0, 1, 1)


def test_sample_steps():
    assert sample_steps(300, 2, 4) == [0, 100, 198, 298]
    assert sample_steps(5, 1, 2) == [0, 4]
    assert sample_steps(3, 5, 4) == [0]


def test_cli_report_and_figures(tmp_path, capsys):
    assert main(["report", str(SAMPLE), "-o", str(tmp_path / "r"), "--bits", "8", "--sparsity", "0.85",
                 "--no-figures", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "FP8" in out and "plan.json" in out
    assert main(["figures", str(SAMPLE), "-o", str(tmp_path / "f"), "--only", "moments", "format_map",
                 "--no-progress"]) == 0
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == ["format_map.png", "moments.png"]
    res = subprocess.run([sys.executable, "-m", "gradstats", "report", str(tmp_path / "nope"), "-o",
                          str(tmp_path / "x")], capture_output=True, text=True)
    assert res.returncode == 2 and "no run directory" in res.stderr and "Traceback" not in res.stderr


def test_demo_end_to_end_tiny(tmp_path, capsys):
    """The whole main job on a tiny setting: train and trace, fit, thresholds, formats, plans,
    figures, report, summary."""
    out = tmp_path / "demo"
    assert main(["demo", "--steps", "4", "--every", "1", "--sample-steps", "2", "--samples", "4096",
                 "--data", "subset", "--subset", "256", "--test-subset", "100", "--batch-size", "32",
                 "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "committed subset" in text  # says which data it used
    assert "thr 85%" in text and "FP4" in text and "done in" in text
    run = gradstats.open_run(out / "run")
    assert run.steps == [0, 1, 2, 3] and sorted(run.sample_index()["step"].unique()) == [0, 3]
    assert sorted(run.stats()["kind"].unique()) == ["act", "grad", "weight"]
    assert gradstats.Plan.load(out / "plan.json").defaults.sparsity == 0.85
    assert len(list((out / "plans").glob("*.json"))) == 6
    md = (out / "report.md").read_text()
    images = re.findall(r"!\[[^]]*\]\(([^)]+)\)", md)
    assert len(images) >= 8 and all((out / p).is_file() and (out / p).stat().st_size > 5000 for p in images)
    assert "data: Fashion-MNIST, committed subset" in md


# ----------------------------------------------------------------------------- runs of any model
class _DeadLayer(torch.nn.Module):
    """``dead``'s output is multiplied by 0: its neural gradient is identically zero."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.dead, self.fc2 = torch.nn.Linear(8, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        return self.fc2(h + self.dead(h) * 0)


class _Attention(torch.nn.Module):
    """``nn.MultiheadAttention`` uses its ``out_proj`` weights functionally: that module is never
    called, so it has no statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.att = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h, _ = self.att(h, h, h)
        return self.head(torch.tanh(h)).mean(1)


def _trace(model: torch.nn.Module, path, shape: tuple[int, ...], steps: int = 3):
    torch.manual_seed(0)
    with gradstats.trace(model, path, sample_every=1) as tracer:
        for _ in range(steps):
            model(torch.randn(*shape)).square().mean().backward()
            tracer.step()
    return path


@pytest.fixture(scope="module")
def dead_run(tmp_path_factory):
    return _trace(_DeadLayer(), tmp_path_factory.mktemp("runs") / "dead", (64, 8))


@pytest.fixture(scope="module")
def attention_run(tmp_path_factory):
    return _trace(_Attention(), tmp_path_factory.mktemp("runs") / "attention", (16, 5, 8))


def test_report_says_which_groups_failed_and_why(dead_run, tmp_path):
    rep = report(dead_run, tmp_path, bits=[8], sparsities=[0.85], figures=False)
    a = rep.analysis
    t = a.table.set_index("layer")
    assert list(t.index) == ["fc1", "dead", "fc2"]
    assert t.loc["dead", "fit_status"] == "failed" and t.loc["dead", "failed_steps"] == 3
    assert "no non-zero finite value" in t.loc["dead", "fit_error"]
    assert (t.loc[["fc1", "fc2"], "fit_status"] == "ok").all() and (t.loc[["fc1", "fc2"], "failed_steps"] == 0).all()
    # fc2 is the output layer: left in full precision like the dead layer, for another reason
    assert not t.loc["dead", "planned"] and t.loc["fc1", "planned"] and not t.loc["fc2", "planned"]
    assert list(a.failures["layer"]) == ["dead"] and a.failures["steps"].iloc[0] == [0, 1, 2]
    text = str(a)
    assert re.search(r"^dead .* failed", text, re.M)
    assert "not fitted" in text and re.search(r"dead, steps 0, 1, 2: error: .*no non-zero finite value", text)
    md = rep.markdown.read_text()
    assert "## Groups not fitted" in md and "no non-zero finite value" in md
    fits = pd.read_parquet(rep.files["fits"])
    assert fits[fits.layer == "dead"]["status"].str.startswith("error: ").all()
    layers = pd.read_csv(rep.files["layers"])
    assert {"fit_status", "failed_steps", "fit_error"} <= set(layers.columns)
    json.dumps(a.to_dict(), allow_nan=False)
    assert a.to_dict()["failures"][0]["layer"] == "dead"


def test_report_skips_layers_without_gradient_statistics(attention_run, tmp_path, caplog):
    run = gradstats.open_run(attention_run)
    with caplog.at_level(logging.WARNING, logger="gradstats.report"):
        rep = report(attention_run, tmp_path, bits=[8], sparsities=[0.85], figures=False)
    a = rep.analysis
    assert "att.out_proj" not in list(a.table["layer"]) and {"inp", "att", "head"} <= set(a.table["layer"])
    # the attention module stands for its out_proj (a matmul layer); head: the output layer
    assert sorted(e.layer for e in a.plan().entries) == ["att", "inp"]
    if "att.out_proj" in run.layers:  # a tracer that selects modules never called lists it
        assert "no 'grad' statistics" in a.skipped["att.out_proj"]
        assert re.search(r"skipped.*att\.out_proj.*no 'grad' statistics", str(a), re.S)
        assert "att.out_proj" in rep.markdown.read_text()
        assert any("att.out_proj" in r.getMessage() for r in caplog.records)


def test_report_skips_a_listed_layer_that_has_no_statistics(dead_run, tmp_path, caplog):
    """A run whose manifest lists a layer that never recorded anything (older tracers selected
    modules that are never called)."""
    import shutil

    path = tmp_path / "run"
    shutil.copytree(dead_run, path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["layers"].insert(1, {"name": "ghost", "type": "Linear", "output_shape": None, "params": 10})
    (path / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="gradstats.report"):
        a = analyse(path, bits=[8], sparsities=[0.85])
    assert "ghost" not in list(a.table["layer"]) and "no 'grad' statistics" in a.skipped["ghost"]
    assert "ghost" in str(a) and any("ghost" in r.getMessage() for r in caplog.records)
    assert main(["report", str(path), "-o", str(tmp_path / "r"), "--bits", "8", "--sparsity", "0.85",
                 "--no-figures", "--no-progress"]) == 0
    assert "ghost" in (tmp_path / "r" / "report.md").read_text()


def test_report_layers_selects_with_the_tracer_patterns(attention_run, tmp_path, capsys):
    a = analyse(attention_run, bits=[8], sparsities=[0.85], layers=["inp", "re:h.a+d"])
    assert list(a.table["layer"]) == ["inp", "head"] and set(a.fits["layer"]) == {"inp", "head"}
    assert sorted(e.layer for e in a.plan().entries) == ["inp"]       # head: the output layer
    assert set(a.errors["layer"]) <= {"inp", "head"} and len(a.errors)
    assert list(analyse(attention_run, bits=[8], sparsities=[0.85], layers="at*").table["layer"]) == ["att"]
    with pytest.raises(ValueError, match="no layer matches"):
        analyse(attention_run, layers="nope*")
    with pytest.raises(ValueError, match="callable"):
        analyse(attention_run, layers=lambda name, module: True)
    assert main(["report", str(attention_run), "-o", str(tmp_path / "r"), "--layers", "inp", "re:he.*",
                 "--bits", "8", "--sparsity", "0.85", "--no-figures", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^inp ", out, re.M) and re.search(r"^head ", out, re.M) and not re.search(r"^att ", out, re.M)
    assert main(["report", str(attention_run), "-o", str(tmp_path / "x"), "--layers", "nope*", "--no-progress"]) == 2
    assert "no layer matches" in capsys.readouterr().err


def test_report_with_a_damaged_sample_file(dead_run, tmp_path):
    """The damaged step is reported; the plans and the measured errors use an intact one."""
    import shutil

    path = tmp_path / "run"
    shutil.copytree(dead_run, path)
    idx = gradstats.open_run(path).sample_index()
    rel = idx[idx.step == 2]["file"].iloc[0]
    data = bytearray((path / rel).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / rel).write_bytes(bytes(data))
    rep = report(path, tmp_path / "out", bits=[8], sparsities=[0.85], figures=False)
    a = rep.analysis
    dam = a.failures[a.failures["status"].str.startswith("damaged: ")]
    assert set(dam["layer"]) == {"fc1", "dead", "fc2"} and all(s == [2] for s in dam["steps"])
    assert a.plan_step == 1 and set(a.errors["step"]) == {1}
    t = a.table.set_index("layer")
    assert t.loc["fc1", "fit_status"] == "partial" and t.loc["fc1", "failed_steps"] == 1
    assert "damaged" in t.loc["fc1", "fit_error"] and rel in str(a)
    assert "damaged" in rep.markdown.read_text()
