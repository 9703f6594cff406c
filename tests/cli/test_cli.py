"""The command line: trace, info, demo wiring, errors."""
from __future__ import annotations

import subprocess
import sys

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
