"""Capture neural gradients (dL/d layer output) of any PyTorch model into a run on disk:
:func:`trace` and :class:`Tracer`, configured by :class:`TraceConfig`.

The tracer is made of its capture side (:mod:`gradstats.tracer.capture`: the hooks and what they
record), its writing side (:mod:`gradstats.tracer.commit`: commits to the run and its manifest) and
its options (:mod:`gradstats.tracer.config`); :mod:`gradstats.tracer.tracing` puts them together.

Example:
    >>> import tempfile, torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    >>> with trace(model, tempfile.mkdtemp(), config=TraceConfig(sample_every=None)) as t:
    ...     model(torch.randn(3, 4)).sum().backward(); t.step()
    >>> t.config.sample_every is None
    True
"""
from __future__ import annotations

from gradstats.tracer.capture import first_grad_tensor, sample_indices, sharded_parameters
from gradstats.tracer.commit import NOISE_TABLES
from gradstats.tracer.config import KINDS, LayerSelect, Schedule, TraceConfig, module_selector
from gradstats.tracer.tracing import Tracer, trace

__all__ = ["KINDS", "NOISE_TABLES", "LayerSelect", "Schedule", "TraceConfig", "Tracer", "first_grad_tensor",
           "module_selector", "sample_indices", "sharded_parameters", "trace"]
