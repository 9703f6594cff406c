"""TensorBoard: a run's statistics exported after the fact and written live by a tracer sink, read
back with TensorBoard's own event reader."""
from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

import gradstats  # noqa: E402
from gradstats.integrations.tensorboard import TensorBoardSink, export_run  # noqa: E402
from gradstats.stats import lognormal_moments  # noqa: E402


def _read(logdir) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 4))


def _train(path, steps=3, **kw):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradstats.trace(model, path, optimizer=opt, flush_secs=0, **kw):
        for i in range(steps):
            x = torch.randn(32, 16, generator=torch.Generator().manual_seed(i))
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    return gradstats.open_run(path)


def test_export_reads_back_with_the_values_of_the_run(tmp_path):
    run = _train(tmp_path / "run")
    n = export_run(run, tmp_path / "tb", formats="e4m3fn,e2m1fn")
    acc = _read(tmp_path / "tb")
    tags = set(acc.Tags()["scalars"])
    for layer in ("0", "2", "4"):
        for t in ("mean_log2", "std_log2", "zero_fraction", "amax", "underflow/e4m3fn", "overflow/e2m1fn"):
            assert f"gradstats/{layer}/{t}" in tags
    assert n == len(run.steps) * 3 * (4 + 2 * 2)
    st = run.stats(kinds=["grad"])
    row = st[(st.layer == "2") & (st.step == 1)].iloc[0]
    mu, sigma = lognormal_moments(row)
    got = {e.step: e.value for e in acc.Scalars("gradstats/2/mean_log2")}
    assert sorted(got) == run.steps and math.isclose(got[1], mu / math.log(2), rel_tol=1e-6)
    w = gradstats.what_if(run, "e2m1fn").set_index(["step", "layer"])
    under = {e.step: e.value for e in acc.Scalars("gradstats/2/underflow/e2m1fn")}
    assert math.isclose(under[1], w.loc[(1, "2"), "underflow"], rel_tol=1e-6, abs_tol=1e-7)
    hist = acc.Histograms("gradstats/2/log2_abs")
    assert len(hist) == len(run.steps)
    h = hist[1].histogram_value
    assert int(h.num) == int(row["n"] - row["n_zero"]) and sum(h.bucket) == h.num
    assert h.min <= mu / math.log(2) <= h.max


def test_the_live_sink_writes_what_the_export_writes(tmp_path):
    run = _train(tmp_path / "run", sinks=[TensorBoardSink(tmp_path / "live", formats=["e4m3fn"])])
    export_run(run, tmp_path / "offline", formats=["e4m3fn"])
    live, offline = _read(tmp_path / "live"), _read(tmp_path / "offline")
    assert set(live.Tags()["scalars"]) == set(offline.Tags()["scalars"])
    for tag in ("gradstats/0/amax", "gradstats/4/underflow/e4m3fn", "gradstats/2/std_log2"):
        a, b = live.Scalars(tag), offline.Scalars(tag)
        assert [e.step for e in a] == [e.step for e in b] == [0, 1, 2]
        np.testing.assert_allclose([e.value for e in a], [e.value for e in b], rtol=1e-6)


def test_beside_the_users_own_summary_writer_on_the_same_logdir_nothing_is_lost(tmp_path):
    """The training logs into the same log directory with its own SummaryWriter (per micro-batch,
    two a step, and a tag of its own named like a layer's statistic): gradstats' tags are its own,
    under gradstats/, at its own steps, every one of them there, and the user's series untouched."""
    from torch.utils.tensorboard import SummaryWriter

    logdir = tmp_path / "tb"
    user = SummaryWriter(str(logdir))
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mine = {}
    with gradstats.trace(model, tmp_path / "run", optimizer=opt, flush_secs=0,
                         sinks=[TensorBoardSink(logdir, histograms=False)]):
        for i in range(30):
            opt.zero_grad()
            for k in range(2):
                x = torch.randn(32, 16, generator=torch.Generator().manual_seed(2 * i + k))
                loss = model(x).square().mean()
                loss.backward()
                user.add_scalar("loss", loss.item(), global_step=2 * i + k)
                mine[2 * i + k] = float(model[0].weight.detach().abs().max())
                user.add_scalar("0/amax", mine[2 * i + k], global_step=2 * i + k)      # the user's own
            opt.step()
    user.close()
    run = gradstats.open_run(tmp_path / "run")
    assert run.steps == list(range(30))
    acc = _read(logdir)
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "0/amax"} <= tags
    assert [e.step for e in acc.Scalars("loss")] == list(range(60))
    np.testing.assert_allclose([e.value for e in acc.Scalars("0/amax")], [mine[s] for s in range(60)], rtol=1e-6)
    ours = {t for t in tags if t.startswith("gradstats/")}
    assert ours == {f"gradstats/{layer}/{t}" for layer in ("0", "2", "4")
                    for t in ("mean_log2", "std_log2", "zero_fraction", "amax")}
    st = run.stats(kinds=["grad"])
    for t in ours:
        assert [e.step for e in acc.Scalars(t)] == run.steps, t
    amax = st[st.layer == "0"].groupby("step")["max_abs"].max()
    np.testing.assert_allclose([e.value for e in acc.Scalars("gradstats/0/amax")], amax.to_numpy(), rtol=1e-6)


def test_a_failing_sink_never_costs_the_run(tmp_path, caplog):
    class Broken:
        calls = 0

        def write(self, stats):
            Broken.calls += 1
            raise RuntimeError("disk full")

    with caplog.at_level(logging.WARNING, logger="gradstats.run"):
        run = _train(tmp_path / "run", steps=4, sinks=[Broken()])
    assert run.steps == [0, 1, 2, 3] and Broken.calls == 1
    assert sum("left out of the rest of the run" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ValueError, match="write\\(stats\\) method"):
        gradstats.trace(_net(), tmp_path / "other", sinks=[object()])


def test_the_command_line(tmp_path, capsys):
    from gradstats.cli import main

    run = _train(tmp_path / "run", steps=2)
    assert main(["tensorboard", str(run.path), "--logdir", str(tmp_path / "tb"), "--formats", "e5m2",
                 "--no-histograms"]) == 0
    assert "scalars written" in capsys.readouterr().out
    acc = _read(tmp_path / "tb")
    assert "gradstats/0/underflow/e5m2" in acc.Tags()["scalars"] and not acc.Tags()["histograms"]
    assert main(["tensorboard", str(run.path), "--logdir", str(tmp_path / "x"), "--layers", "nope"]) == 2


def test_block_scaled_what_if_columns_take_what_what_if_takes(tmp_path, capsys):
    """``granularity=`` of the sinks and ``--granularity``/``--block`` of the command are what-if's: the logged
    underflow is ``what_if``'s at the same granularity (MX blocks here), and differs from the per-tensor one."""
    from gradstats.cli import main

    run = _train(tmp_path / "run", steps=2)
    export_run(run, tmp_path / "mx", formats="e2m1fn", granularity="mx", histograms=False)
    w = gradstats.what_if(run, "e2m1fn", granularity="mx").set_index(["step", "layer"])
    under = {e.step: e.value for e in _read(tmp_path / "mx").Scalars("gradstats/2/underflow/e2m1fn")}
    assert math.isclose(under[1], w.loc[(1, "2"), "underflow"], rel_tol=1e-6, abs_tol=1e-7)
    per_tensor = gradstats.what_if(run, "e2m1fn").set_index(["step", "layer"]).loc[(1, "2"), "underflow"]
    assert not math.isclose(under[1], per_tensor, rel_tol=1e-3)
    assert main(["tensorboard", str(run.path), "--logdir", str(tmp_path / "cli"), "--formats", "e2m1fn",
                 "--block", "32", "--no-histograms"]) == 0
    cli = {e.step: e.value for e in _read(tmp_path / "cli").Scalars("gradstats/2/underflow/e2m1fn")}
    assert cli == pytest.approx(under, rel=1e-6)
    capsys.readouterr()
    assert main(["tensorboard", str(run.path), "--logdir", str(tmp_path / "y"), "--granularity", "mx",
                 "--block", "32"]) == 2
    assert "not both" in capsys.readouterr().err
