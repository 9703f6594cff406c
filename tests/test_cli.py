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
