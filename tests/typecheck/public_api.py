"""The public API as a user's typed code calls it: ``mypy`` checks this file against the package's
signatures (``make typecheck``, part of ``make test``), and ``tests/test_typing.py`` runs it.

Each line binds a result to the type the documentation promises, so a signature that loses its hints
or changes its return type fails the type check.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pandas as pd
import torch

from gradstats.apply import Applied, apply
from gradstats.fitting import FitResult, fit, fit_run
from gradstats.formats import FPFormat, parse
from gradstats.fpanalysis import best_format, best_format_from_stats, crossover_table
from gradstats.fpanalysis.what_if import predict_from_stats, what_if
from gradstats.ops import hard_prune, prune_quantize, quantize, stochastic_prune
from gradstats.plan import Plan, PlanEntry, Rule
from gradstats.plan.recommend import layer_moments, recommend, recommend_each
from gradstats.pruning import allocate, threshold
from gradstats.run import Run, as_run, open_run
from gradstats.run.select import select_layers, select_steps
from gradstats.stats import StatsRow, merge_stats, tensor_stats
from gradstats.tracer import Tracer, trace
from gradstats.zoo.data import data_dir


def main() -> None:
    fmt: FPFormat = parse("e4m3fn")
    x = torch.randn(4096)
    q: torch.Tensor = quantize(x, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(0))
    p: torch.Tensor = stochastic_prune(x, 0.5, generator=torch.Generator().manual_seed(0))
    h: torch.Tensor = hard_prune(x, 0.5)
    y, counts = prune_quantize(x, 0.5, "e4m3fn")
    assert q.shape == p.shape == h.shape == y.shape == x.shape and counts.n == x.numel()
    assert counts.zeros == int((y == 0).sum()) > 0                     # values below 0.5 are pruned

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with trace(model, tempfile.mkdtemp()) as t:
        tracer: Tracer = t
        for _ in range(2):
            model(torch.randn(32, 8)).logsumexp(1).mean().backward()
            tracer.step()
    run: Run = open_run(t.path)
    assert as_run(run) is run and select_layers(run.layers, "*") == run.layers
    assert select_steps(run.steps, range(0, 2)) == run.steps
    stats: pd.DataFrame = run.stats()
    assert len(stats) > 0

    result: FitResult = fit(x)
    fits: pd.DataFrame = fit_run(run, progress=False)
    row: StatsRow = tensor_stats(x)
    merged: StatsRow = merge_stats([row, row])
    n: int = merged["n"]
    a = float(threshold(0.8, row))
    pick = best_format_from_stats(8, merged)
    w_row: dict[str, float] = predict_from_stats(row, "e4m3fn")
    assert n == 2 * x.numel() and pick.format.bits == 8 and "underflow" in w_row
    assert result.best == "normal" and len(fits) > 0 and a > 0        # x is Gaussian

    plan: Plan = recommend(run, bits=8, sparsity=0.5)
    plans: dict[int, Plan] = recommend_each(run, bits=[8, 6])
    moments: pd.DataFrame = layer_moments(run)
    uniform: Plan = Plan.uniform(format="e4m3fn", sparsity=0.5)
    entry = PlanEntry("0", sparsity=0.9)
    rule: Rule = uniform.with_entries(entry).resolve(model)["0"]
    assert rule.sparsity == 0.9 and len(plans) == 2 and len(moments) > 0

    handle: Applied = apply(model, plan)
    model(torch.randn(32, 8)).logsumexp(1).mean().backward()
    handle.remove()

    best = best_format(8, mu=-9.0, sigma=1.5)
    table = crossover_table(bits=[6], sigma_max=3.0)
    w: pd.DataFrame = what_if(run, ["e4m3fn", "e2m1fn"])
    alloc = allocate(run, 0.8)
    assert str(best.choices()[0].format) == "e4m3fn" and {r["bits"] for r in table.ranges} == {6} and len(w) > 0
    assert alloc.layers == run.layers and abs(alloc.achieved - 0.8) < 1e-6
    data: Path | None = data_dir()
    assert data is not None and (data / "fashion-mnist").is_dir()       # the checkout's data/


if __name__ == "__main__":
    main()
