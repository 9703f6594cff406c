"""Tests of ``gradstats fit``."""
from __future__ import annotations

import re

import pandas as pd
import pytest
import torch

import gradstats
from gradstats.cli import main
from gradstats.cli.fit import parse_steps
from gradstats.fitting import layer_verdicts


@pytest.fixture(scope="module")
def run_path(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("runs") / "mlp"
    model = torch.nn.Sequential(torch.nn.Linear(12, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48),
                                torch.nn.ReLU(), torch.nn.Linear(48, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradstats.trace(model, path, sample_every=2) as tracer:
        for _ in range(4):
            x, y = torch.randn(96, 12), torch.randint(0, 5, (96,))
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tracer.step()
    return path


def test_parse_steps():
    have = [0, 1, 2, 3, 10, 20]
    assert parse_steps(None, have) is None
    assert parse_steps(["1", "3"], have) == [1, 3]
    assert parse_steps(["0:4:2", "20"], have) == [0, 2, 20]
    assert parse_steps(["2:"], have) == [2, 3, 10, 20]
    assert parse_steps(["1,2"], have) == [1, 2]
    for bad in ("x", "1:2:3:4", "0:10:0"):
        with pytest.raises(ValueError, match="bad --steps"):
            parse_steps([bad], have)


def test_fit_command_writes_parquet_and_prints_verdicts(run_path, tmp_path, capsys):
    out = tmp_path / "fits.parquet"
    assert main(["fit", str(run_path), "-o", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    df = pd.read_parquet(out)
    run = gradstats.open_run(run_path)
    assert len(df) == len(run.layers) * 4 * 3
    assert set(df.source) == {"samples", "stats"} and (df.status == "ok").all()
    for layer in run.layers:
        assert layer in text
    assert "lognormal wins" in text and "median KS" in text and "wrote" in text
    v = layer_verdicts(df)
    assert list(v.layer) == run.layers
    assert (v[["wins_lognormal", "wins_normal", "wins_laplace"]].sum(axis=1) == 4).all()
    assert (v["margin_loglik"] >= 0).all()
    ok = df[(df.family == "lognormal") & (df.ks_method == "exact")]  # exact KS where samples exist
    assert v["ks_lognormal"].iloc[0] == pytest.approx(ok[ok.layer == run.layers[0]]["ks"].median())
    assert (v["ks_from"] == "samples").all()
    assert "exact KS (samples)" in text and "KS bound midpoints (statistics)" in text


def test_fit_command_selection_and_stats_only(run_path, tmp_path, capsys):
    out = tmp_path / "sel.parquet"
    run = gradstats.open_run(run_path)
    first = run.layers[0]
    assert main(["fit", str(run_path), "--layers", first, "--steps", "1:3", "--stats-only",
                 "-o", str(out), "--no-progress"]) == 0
    df = pd.read_parquet(out)
    assert set(df.layer) == {first} and set(df.step) == {1, 2} and set(df.source) == {"stats"}
    capsys.readouterr()


def test_fit_command_errors(run_path, capsys):
    assert main(["fit", str(run_path), "--steps", "zz", "--no-progress"]) == 2
    assert "bad --steps" in capsys.readouterr().err
    assert main(["fit", str(run_path), "--layers", "nope*", "--no-progress"]) == 2
    assert "no layer matches" in capsys.readouterr().err
    assert main(["fit", str(run_path.parent / "missing"), "--no-progress"]) == 2


class _DeadLayer(torch.nn.Module):
    """``dead``'s output is multiplied by 0: its neural gradient is identically zero."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.dead, self.fc2 = torch.nn.Linear(8, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        return self.fc2(h + self.dead(h) * 0)


@pytest.fixture(scope="module")
def dead_run(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("runs") / "dead"
    model = _DeadLayer()
    with gradstats.trace(model, path, sample_every=2) as tracer:
        for _ in range(3):
            model(torch.randn(64, 8)).square().mean().backward()
            tracer.step()
    return path


def test_fit_command_reports_a_layer_that_cannot_be_fitted(dead_run, tmp_path, capsys):
    out = tmp_path / "fits.parquet"
    assert main(["fit", str(dead_run), "-o", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    df = pd.read_parquet(out)
    dead, alive = df[df.layer == "dead"], df[df.layer != "dead"]
    assert len(dead) == 3 * 3 and dead["status"].str.startswith("error: ").all()
    assert dead[["mu", "sigma", "ks", "loglik"]].isna().all().all() and not dead["best"].any()
    assert (alive.status == "ok").all()
    assert "3 group(s) could not be fitted" in text
    assert re.search(r"dead \(grad\), steps 0, 1, 2 .*: error: .*no non-zero finite value", text)
    assert "fc1" in text and "fc2" in text and "lognormal wins" in text


def test_fit_command_when_nothing_fits(dead_run, capsys):
    assert main(["fit", str(dead_run), "--layers", "re:d.*", "--no-progress"]) == 1
    text = capsys.readouterr().out
    assert "no group could be fitted" in text and "no non-zero finite value" in text
