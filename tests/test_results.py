"""One result convention: every result has ``to_dict()`` and ``to_dataframe()``, ``summary()`` (where a
result has one) returns a DataFrame and ``str()`` the text, and every result kind with a figure has ``plot()``."""
from __future__ import annotations

import json
import tempfile

import pandas as pd
import pytest
import torch

import gradstats
from gradstats import fpanalysis, pruning
from gradstats.ops import prune_quantize
from gradstats.zoo.data import data_dir

SAMPLE = data_dir() / "sample-run"


def _results():
    g = torch.Generator().manual_seed(0)
    x = torch.exp(-9 + 1.5 * torch.randn(20_000, generator=g)) * torch.randn(20_000, generator=g).sign()
    stats = gradstats.tensor_stats(x)
    plan = gradstats.recommend(SAMPLE, bits=8)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    applied = gradstats.apply(model, gradstats.Plan.uniform(format="e4m3fn"))   # the output layer stays exact
    model(torch.randn(8, 4)).square().sum().backward()
    applied.remove()
    best = fpanalysis.best_format(8, mu=-9.0, sigma=1.5)
    return {
        "FitResult": (gradstats.fit(x), True),
        "ErrorResult": (fpanalysis.expected_error("e4m3fn", mu=-9.0, sigma=1.5), False),
        "ScaleResult": (fpanalysis.optimal_scale("e4m3fn", mu=-9.0, sigma=1.5), False),
        "BestFormat": (best, True),
        "FormatChoice": (best.choices(0)[0], False),
        "CrossoverTable": (fpanalysis.crossover_table(bits=[6], sigma_max=3.0), True),
        "HistogramChoice": (fpanalysis.best_format_from_stats(8, stats), False),
        "Allocation": (pruning.allocate(gradstats.open_run(SAMPLE), 0.8), True),
        "Plan": (plan, False),
        "Applied": (applied, False),
        "CompressCounts": (prune_quantize(x, 1e-4, "e4m3fn")[1], False),
        "Analysis": (gradstats.report.analyse(SAMPLE, bits=[8], sparsities=[0.9], progress=False), False),
    }


@pytest.fixture(scope="module")
def results():
    return _results()


@pytest.mark.parametrize("name", ["FitResult", "ErrorResult", "ScaleResult", "BestFormat", "FormatChoice",
                                  "CrossoverTable", "HistogramChoice", "Allocation", "Plan", "Applied",
                                  "CompressCounts", "Analysis"])
def test_every_result_has_the_one_convention(results, name):
    obj, has_plot = results[name]
    assert type(obj).__name__ == name
    d = obj.to_dict()
    assert isinstance(d, dict) and d
    json.dumps(d, default=str)                       # plain data
    df = obj.to_dataframe()
    assert isinstance(df, pd.DataFrame) and len(df) > 0
    if hasattr(obj, "summary"):
        assert isinstance(obj.summary(), pd.DataFrame), f"{name}.summary() must return a DataFrame"
        assert isinstance(str(obj), str) and len(str(obj)) > 0
    assert hasattr(obj, "plot") == has_plot or has_plot is False


def test_run_summary_is_a_dataframe():
    assert isinstance(gradstats.open_run(SAMPLE).summary(), pd.DataFrame)


def test_a_written_report_follows_it_too():
    rep = gradstats.report.report(SAMPLE, tempfile.mkdtemp(), bits=[8], sparsities=[0.9], figures=False,
                                  progress=False)
    assert isinstance(rep.summary(), pd.DataFrame) and "wrote to" in str(rep)
    assert isinstance(rep.to_dataframe(), pd.DataFrame) and rep.to_dict()["out_dir"]
