"""The command line: trace, info, demo wiring, errors."""
from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest
import torch

import gradstats
from gradstats.cli import main


def test_trace_then_info(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["trace", "--model", "mlp", "--data", "fashion-mnist", "--steps", "6", "--every", "2",
                 "--sample-every", "0,4", "--samples", "100", "--batch-size", "32", "--out", str(out)]) == 0
    run = gradstats.open_run(out)
    assert run.steps == [0, 2, 4]
    assert sorted(run.sample_index()["step"].unique()) == [0, 4]
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "MLP" in text and "std_log2" in text and "steps 0..4 (3 captured)" in text


def test_errors_are_messages_not_tracebacks(tmp_path):
    res = subprocess.run([sys.executable, "-m", "gradstats", "info", str(tmp_path / "nope")],
                         capture_output=True, text=True)
    assert res.returncode == 2
    assert "no run directory" in res.stderr and "Traceback" not in res.stderr
    res = subprocess.run([sys.executable, "-m", "gradstats", "trace", "--model", "mlp", "--data", "cifar",
                          "--steps", "1", "--out", str(tmp_path / "r")], capture_output=True, text=True)
    assert res.returncode == 2 and "unknown --data 'cifar'" in res.stderr


def test_help_lists_commands():
    res = subprocess.run([sys.executable, "-m", "gradstats", "--help"], capture_output=True, text=True)
    assert res.returncode == 0
    for cmd in ("demo", "trace", "info"):
        assert cmd in res.stdout


def test_trace_into_an_existing_run_resumes_or_refuses(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["trace", "--model", "mlp", "--data", "digits", "--steps", "3", "--sample-every", "none",
            "--batch-size", "16", "--out", str(out)]
    assert main(args) == 0
    assert main(args) == 2                                   # refused, with the way out named
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume" in err and "start_step" in err
    assert main(args + ["--resume"]) == 0
    run = gradstats.open_run(out)
    assert run.steps == [0, 1, 2, 3, 4, 5]
    assert not run.stats().duplicated(["step", "rank", "layer", "kind", "call"]).any()


def test_trace_rejects_bad_values_before_loading_data(tmp_path, monkeypatch, capsys):
    import gradstats.cli.trace as cli_trace

    def no_loading(*a, **k):
        raise AssertionError("the data was loaded before the arguments were checked")

    monkeypatch.setattr(cli_trace, "load_data", no_loading)
    for bad, said in ((["--steps", "-3"], "--steps must be a positive"),
                      (["--every", "0"], "--every must be"), (["--kinds", "grad,grads"], "--kinds"),
                      (["--start-step", "-1"], "--start-step")):
        assert main(["trace", "--model", "mlp", "--out", str(tmp_path / "r"), *bad]) == 2
        assert said in capsys.readouterr().err


def test_export_a_saved_plan(tmp_path, capsys):
    import json

    import gradstats
    from gradstats.cli import main

    run = gradstats.zoo.data.data_dir() / "sample-run"
    plan = gradstats.recommend(run, bits=8)
    plan.save(tmp_path / "plan.json")
    assert main(["export", str(tmp_path / "plan.json"), "--to", "torchao", "--model", str(run),
                 "-o", str(tmp_path / "ao.json")]) == 0
    assert "torchao export of" in capsys.readouterr().out
    doc = json.loads((tmp_path / "ao.json").read_text())
    assert doc["target"] == "torchao.float8" and set(doc["configs"]) | set(doc["skipped"]) == {e.layer for e in plan.entries}
    assert main(["export", str(tmp_path / "plan.json")]) == 0
    assert json.loads(capsys.readouterr().out)["target"] == "json"
    assert main(["export", str(tmp_path / "missing.json")]) == 2


def test_info_of_a_kind_the_run_does_not_hold(capsys):
    run = gradstats.zoo.data.data_dir() / "sample-run"      # grad, act and weight statistics
    assert main(["info", str(run), "--kind", "wgrad"]) == 2
    err = capsys.readouterr().err
    assert "the run holds no 'wgrad' statistics: it has 'act', 'grad', 'weight'" in err
    assert "nan" not in capsys.readouterr().out


def test_export_without_model_names_the_option(tmp_path, capsys):
    plan = gradstats.recommend(gradstats.zoo.data.data_dir() / "sample-run", bits=8)
    plan.save(tmp_path / "plan.json")
    assert main(["export", str(tmp_path / "plan.json"), "--to", "torchao"]) == 2
    err = capsys.readouterr().err
    assert "--to torchao needs each layer's module type: pass --model RUN" in err and "model=" not in err
    gradstats.Plan.uniform(format="e4m3fn").save(tmp_path / "uniform.json")
    assert main(["export", str(tmp_path / "uniform.json")]) == 2
    err = capsys.readouterr().err
    assert "pattern entries ['*']" in err and "--model RUN" in err and "model=" not in err


def test_recommend_help_names_every_layer_type_it_plans():
    res = subprocess.run([sys.executable, "-m", "gradstats", "recommend", "--help"], capture_output=True, text=True)
    text = " ".join(res.stdout.split())
    assert "conv and linear" not in text and "LSTM" in text and "attention" in text


def test_a_warning_under_a_progress_bar_gets_its_own_line(tmp_path, capsys, monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with gradstats.trace(model, tmp_path / "run", sample_every=None) as tr:   # no raw samples
        model(torch.randn(8, 4)).square().sum().backward()
        tr.step()
    monkeypatch.setenv("GRADSTATS_PROGRESS", "1")               # a bar on pytest's captured (non-terminal) stream
    handler = logging.StreamHandler(sys.stderr)                 # the console handler main() sets up
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [handler])
    assert main(["figures", str(tmp_path / "run"), "-o", str(tmp_path / "f"), "--only", "sparsity"]) == 0
    err = capsys.readouterr().err
    assert "figures:" in err                                    # the bar was drawn
    # the warning starts a line of its own: not glued after the bar's text
    assert re.search(r"(^|[\r\n])figure sparsity skipped", err), err


def test_recommend_bounds_the_noise_and_says_so(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["trace", "--model", "mlp", "--data", "fashion-mnist", "--steps", "6", "--every", "1",
                 "--sample-every", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["recommend", str(out), "--sparsity", "auto", "--all-layers", "-o", str(tmp_path / "p.json")]) == 0
    text = capsys.readouterr().out
    assert "noise_R" in text and "within the noise bound 0.02" in text
    plan = gradstats.Plan.load(tmp_path / "p.json")
    assert plan.noise_bound == 0.02 and plan.noise
    assert main(["recommend", str(out), "--sparsity", "0.9", "--noise-bound", "none", "--all-layers",
                 "-o", str(tmp_path / "q.json")]) == 0
    assert gradstats.Plan.load(tmp_path / "q.json").noise_bound is None
    with pytest.raises(SystemExit):
        main(["recommend", str(out), "--sparsity", "most"])
    assert "expected a sparsity in [0, 1) or 'auto'" in capsys.readouterr().err
