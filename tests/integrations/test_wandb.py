"""W&B: a run's statistics logged after the fact and live, with W&B in offline mode (nothing leaves
the machine); what reaches ``run.log`` is captured and compared with the run."""
from __future__ import annotations

import math

import pytest
import torch

wandb = pytest.importorskip("wandb")
import gradstats  # noqa: E402
from gradstats.integrations.wandb import WandbSink, log_run  # noqa: E402
from gradstats.stats import lognormal_moments  # noqa: E402


@pytest.fixture()
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    return tmp_path


def _capture(wr):
    logged: list[tuple[int, dict]] = []
    real = wr.log

    def log(payload, step=None, **kw):
        logged.append((step, dict(payload)))
        return real(payload, step=step, **kw)

    wr.log = log
    return logged


def _train(path, steps=3, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    with gradstats.trace(model, path, flush_secs=0, **kw) as t:
        for i in range(steps):
            model(torch.randn(16, 8, generator=torch.Generator().manual_seed(i))).square().mean().backward()
            t.step()
    return gradstats.open_run(path)


def test_log_run_offline(offline):
    run = _train(offline / "run")
    wr = wandb.init(project="gradstats-test", mode="offline", dir=str(offline))
    logged = _capture(wr)
    log_run(run, wandb_run=wr, formats="e4m3fn")
    wr.finish()
    assert [s for s, _ in logged] == run.steps
    step1 = dict(logged)[1]
    st = run.stats(kinds=["grad"])
    mu, _ = lognormal_moments(st[(st.layer == "0") & (st.step == 1)].iloc[0])
    assert math.isclose(step1["0/mean_log2"], mu / math.log(2), rel_tol=1e-6)
    w = gradstats.what_if(run, "e4m3fn", steps=[1]).set_index("layer")
    assert math.isclose(step1["2/underflow/e4m3fn"], w.loc["2", "underflow"], rel_tol=1e-6, abs_tol=1e-9)
    assert isinstance(step1["0/log2_abs"], wandb.Histogram)
    assert list((offline / "wandb").glob("offline-run-*/run-*.wandb"))      # written to disk, offline


def test_the_live_sink_logs_every_step_into_the_active_run(offline):
    wr = wandb.init(project="gradstats-test", mode="offline", dir=str(offline))
    logged = _capture(wr)
    run = _train(offline / "run", steps=4, sinks=[WandbSink(formats=["e2m1fn"], histograms=False)])
    wr.finish()
    assert [s for s, _ in logged] == run.steps == [0, 1, 2, 3]
    assert {"0/amax", "2/overflow/e2m1fn"} <= set(logged[0][1])


def test_without_an_active_run_the_sink_says_so(offline):
    with pytest.raises(ValueError, match="no active W&B run"):
        WandbSink().write(_train(offline / "run", steps=1).stats())
