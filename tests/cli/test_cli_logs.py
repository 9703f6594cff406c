"""What the command line writes to a log file: no progress-bar redraws off a terminal, each long
stage said once, and warnings that name their plan, layer and what was done."""
from __future__ import annotations

import contextlib
import io
import logging
import os
import re

import pytest

import gradstats
from gradstats._progress import ENV
from gradstats.cli import main

SAMPLE = gradstats.zoo.data.data_dir() / "sample-run"

#: what tqdm writes when it draws or redraws a bar: a carriage return, or "NN%|" of the bar itself
BAR = re.compile(r"\r|\d+%\|")


@pytest.fixture(scope="module")
def report_log(tmp_path_factory) -> tuple[str, str]:
    """``gradstats report SAMPLE`` as ``gradstats report ... > log 2>&1`` runs it: progress bars
    not turned off, stdout and stderr StringIO streams (not terminals), the console log handler
    that ``main`` sets up at INFO. Returns (stdout, stderr)."""
    out_dir = tmp_path_factory.mktemp("report")
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    level, env = root.level, os.environ.pop(ENV, None)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            assert main(["report", str(SAMPLE), "-o", str(out_dir), "--no-figures"]) == 0
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        if env is not None:
            os.environ[ENV] = env
    return out.getvalue(), err.getvalue()


def test_no_bar_redraws_off_a_terminal(report_log):
    out, err = report_log
    assert not BAR.search(out) and not BAR.search(err), err[:2000]
    assert "layer" in out and "FP4" in out                       # the results are printed as before


def test_each_long_stage_says_once_what_it_does(report_log):
    _, err = report_log
    lines = err.splitlines()
    for stage in ("analysing 6 layer(s) of the run", "analyse: fitting 6 layer(s)", "fitting 24 group(s)",
                  "analyse: planning sparsity 0.85, 0.9 at 8, 6, 4 bits", "analyse: measuring the plans' errors"):
        said = [line for line in lines if stage in line]
        assert len(said) == 1 and said[0].startswith("INFO "), (stage, said)


def test_a_failed_check_warns_once_per_plan_naming_layers_and_action(report_log):
    """On the sample run the FP4 plans' checks fail for conv1 and conv2: one warning per plan,
    which names the plan, then per layer the rule that failed, why, and what it is changed to."""
    _, err = report_log
    warnings = [w for w in re.split(r"\n(?=[A-Z]+ )", err) if w.startswith("WARNING gradstats.plan.checks")]
    assert len(warnings) == 2, warnings                                      # FP4 at 0.85 and at 0.9
    for w, sparsity in zip(warnings, ("0.85", "0.9")):
        head, *layers = w.splitlines()
        assert f"recommend(bits=4, sparsity={sparsity})" in head and "2 of 3 planned layer(s)" in head, head
        assert [line.split(":")[0].strip() for line in layers] == ["conv1", "conv2"], layers
        for line in layers:
            assert "failed at step 196" in line and "magnitude gain" in line       # what failed
            assert re.search(r"-> (changed to|no choice passed)", line), line       # what was done
