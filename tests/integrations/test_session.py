"""The lifecycle the trainer callbacks share (gradstats.integrations._session.TrainingSession): its
tracer options are one TraceConfig, checked when the callback is made."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import gradstats
from gradstats.integrations._session import TRACE_OPTIONS, TrainingSession
from gradstats.tracer import TraceConfig


def test_trace_options_are_the_config_and_checked_at_once(tmp_path):
    assert set(TRACE_OPTIONS) == {f.name for f in dataclasses.fields(TraceConfig)} - {"resume", "start_step"}
    with pytest.raises(ValueError, match="every must be a positive int period"):
        TrainingSession(tmp_path / "r", every=0)                   # not at begin(), after the trainer set up
    s = TrainingSession(tmp_path / "r", every=2, sample_every=None, noise=False)
    assert s.trace_config == TraceConfig(every=2, sample_every=None, noise=False)
    m = torch.nn.Linear(3, 2)
    s.begin(m, step=4)
    for _ in range(3):
        m(torch.randn(2, 3)).sum().backward(); s.optimizer_step()
    assert s.tracer.config.start_step == 4 and s.tracer.config.every == 2
    s.end()
    assert gradstats.open_run(tmp_path / "r").steps == [4, 6]
