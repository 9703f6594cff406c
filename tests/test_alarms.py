"""Alarms while tracing: all-zero gradients for several steps, non-finite values, and watched formats
that would flush a layer to zero; each logged once per layer, recorded in the run."""
from __future__ import annotations

import logging

import pytest
import torch

import gradstats
from gradstats.alarms import Alarms


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _train(path, losses, **kw):
    model = _net()
    with gradstats.trace(model, path, flush_secs=0, sample_every=None, **kw) as t:
        for i, f in enumerate(losses):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i))
            f(model, x).backward()
            t.step()
    return gradstats.open_run(path)


def ok(m, x):
    return m(x).square().mean()


def zero(m, x):
    return (m(x) * 0.0).sum()


def nan(m, x):
    return m(x).sum() * float("nan")


def test_zero_gradients_for_several_steps(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="gradstats.alarms"):
        run = _train(tmp_path / "run", [ok, zero, zero, zero, zero, ok])        # default: 3 steps in a row
    a = run.table("alarms")
    assert sorted(a["layer"]) == ["0", "2"] and set(a["alarm"]) == {"zero"} and (a["step"] == 3).all()
    assert sum("all-zero gradient" in r.getMessage() for r in caplog.records) == 2      # once per layer
    assert run.summary().set_index("layer")["alarms"].to_dict() == {"0": "zero", "2": "zero"}
    # two zero steps are not enough
    assert not len(_train(tmp_path / "short", [ok, zero, zero, ok]).table("alarms"))


def test_non_finite_values(tmp_path):
    run = _train(tmp_path / "run", [ok, nan, nan])
    a = run.table("alarms")
    assert set(a["alarm"]) == {"nonfinite"} and (a["step"] == 1).all() and len(a) == 2


def test_a_watched_format_that_would_flush_the_layer(tmp_path):
    def wide(m, x):           # a gradient spread over many binades
        return (m(x) * torch.exp(3 * torch.randn(16, 4, generator=torch.Generator().manual_seed(9)))).sum()

    run = _train(tmp_path / "run", [wide, wide], alarms=Alarms(watch="e2m1fn,e5m2", flush_bound=0.3))
    a = run.table("alarms")
    assert "flush:e2m1fn" in set(a["alarm"]) and "flush:e5m2" not in set(a["alarm"])
    w = gradstats.what_if(run, "e2m1fn").set_index(["step", "layer"])
    for r in a.itertuples():
        assert r.value == pytest.approx(w.loc[(r.step, r.layer), "underflow"]) and r.value > 0.3


def test_off_and_bad_arguments(tmp_path):
    assert not len(_train(tmp_path / "run", [zero] * 4, alarms=False).table("alarms"))
    with pytest.raises(ValueError, match="alarms must be True"):
        gradstats.trace(_net(), tmp_path / "x", alarms="yes")
    with pytest.raises(ValueError, match="zero_steps must be a positive int"):
        Alarms(zero_steps=0)
    with pytest.raises(ValueError, match="flush_bound must be a fraction"):
        Alarms(flush_bound=2)


def test_one_vocabulary_for_the_tracer_and_apply():
    """Every kind is declared once in gradstats.alarms.KINDS: the tracer's alarms and apply's alerts
    are its kinds raised by each stage, in the order summaries list them."""
    import sys

    from gradstats import alarms

    assert alarms.ALARM_KINDS == ("zero", "nonfinite", "flush")
    assert alarms.ALERT_KINDS == ("nonfinite", "overflow", "gain", "underflow", "drift", "sparsity", "zero_gradient")
    assert set(alarms.ALARM_KINDS) | set(alarms.ALERT_KINDS) == set(alarms.KINDS)
    assert all(k.meaning and set(k.raised_by) <= {"trace", "apply"} for k in alarms.KINDS.values())
    import gradstats.apply  # noqa: F401  (the module, not the verb)
    assert sys.modules["gradstats.apply"].ALERT_KINDS == alarms.ALERT_KINDS


def test_an_alarm_record_is_the_rows_of_both_tables(tmp_path):
    from gradstats.alarms import Alarm

    run = _train(tmp_path / "run", [zero] * 3, alarms=Alarms(zero_steps=2))
    first = run.table("alarms").drop(columns="rank").iloc[0].to_dict()      # the writer adds the rank
    rec = Alarm(first["alarm"], first["layer"], first["message"], step=int(first["step"]), tensor=first["kind"],
                value=first["value"])
    assert rec.row() == {**first, "step": int(first["step"])}
    assert Alarm("sparsity", "fc", "too sparse", seq=4).alert_row() == \
        {"layer": "fc", "seq": 4, "kind": "sparsity", "message": "too sparse"}
    with pytest.raises(ValueError, match="unknown alarm kind 'zeros'"):
        Alarm("zeros", "fc", "x")
