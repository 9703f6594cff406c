"""Weights & Biases: the statistics of a run logged per step, live or after the fact.

The same values as :mod:`gradstats.integrations.tensorboard` (per layer: ``mean_log2``,
``std_log2``, ``zero_fraction``, ``amax``, what-if ``underflow/<fmt>`` and ``overflow/<fmt>`` for
watched formats, and the ``log2_abs`` histogram of the binade counts), under keys
``<layer>/<name>`` (``<kind>/<layer>/<name>`` for kinds other than the neural gradient), at the
run's step numbers.

* offline, after training: ``log_run(run, project="x")`` (or into a W&B run you started:
  ``log_run(run, wandb_run=wandb.run)``);
* live: ``gradstats.trace(model, "runs/x", sinks=[WandbSink(formats="e4m3fn")])``, logging into
  the active W&B run (``wandb.init`` first) from the tracer's writer thread.

W&B's own modes apply (``mode="offline"`` or ``WANDB_MODE=offline`` keeps everything local).

Example:
    >>> import tempfile, gradstats
    >>> run = log_run(gradstats.zoo.data.data_dir() / "sample-run", layers="fc2", mode="disabled")
    >>> run is not None
    True
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np
import pandas as pd

from gradstats.integrations._metrics import check_formats, log2_histogram, merged_rows, run_stats, scalars

__all__ = ["WandbSink", "log_run", "step_payloads"]


def _wandb() -> Any:
    try:
        import wandb
    except ImportError as exc:                          # pragma: no cover - depends on the environment
        raise ImportError("gradstats.integrations.wandb needs the wandb package (pip install wandb)") from exc
    return wandb


def step_payloads(stats: pd.DataFrame, *, formats: Sequence[str] = (), block_size: Optional[int] = None,
                  rounding: str = "nearest", kinds: Sequence[str] = ("grad",),
                  histograms: bool = True) -> dict[int, dict[str, Any]]:
    """``{step: {key: value}}`` as logged to W&B; histograms as ``wandb.Histogram`` (binade edges
    in log2 units), only when ``histograms`` and wandb is importable.

    Example:
        >>> import torch
        >>> from gradstats.stats import tensor_stats
        >>> row = dict(tensor_stats(torch.tensor([0.5, 2.0])), step=0, layer="fc", call=0, rank=0, kind="grad")
        >>> sorted(step_payloads(pd.DataFrame([row]), histograms=False)[0])
        ['fc/amax', 'fc/mean_log2', 'fc/std_log2', 'fc/zero_fraction']
    """
    out: dict[int, dict[str, Any]] = {}
    for kind in kinds:
        part = stats[stats["kind"] == kind] if "kind" in stats else stats
        if not len(part):
            continue
        pre = "" if kind == "grad" else f"{kind}/"
        for r in scalars(part, formats=formats, block_size=block_size, rounding=rounding).itertuples():
            out.setdefault(int(r.step), {})[f"{pre}{r.layer}/{r.tag}"] = float(r.value)
        if histograms:
            wandb = _wandb()
            for step, layer, m in merged_rows(part):
                h = log2_histogram(m)
                if h is not None:
                    edges = np.array([h["bucket_limits"][0] - 1.0, *h["bucket_limits"]])
                    out.setdefault(step, {})[f"{pre}{layer}/log2_abs"] = wandb.Histogram(
                        np_histogram=(np.asarray(h["bucket_counts"]), edges))
    return out


class WandbSink:
    """A tracer sink (``trace(..., sinks=[...])``) that logs each committed step into a W&B run
    (``wandb_run``, default the active one, ``wandb.run``). Only ``rank`` logs (None: every rank).
    Arguments as :func:`log_run`.

    Example:
        >>> import tempfile, torch, gradstats, wandb
        >>> run = wandb.init(mode="disabled")
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4))
        >>> with gradstats.trace(m, tempfile.mkdtemp(), sinks=[WandbSink(run, histograms=False)]) as t:
        ...     m(torch.randn(8, 4)).square().sum().backward(); t.step()
        >>> run.finish()
    """

    def __init__(self, wandb_run: Any = None, *, formats: Union[str, Iterable[Any], None] = None,
                 block_size: Optional[int] = None, rounding: str = "nearest", kinds: Sequence[str] = ("grad",),
                 histograms: bool = True, rank: Optional[int] = 0) -> None:
        self.wandb_run = wandb_run
        self.formats = check_formats(formats)
        self.block_size, self.rounding, self.kinds = block_size, rounding, tuple(kinds)
        self.histograms, self.rank = histograms, rank

    def write(self, stats: pd.DataFrame) -> None:
        if self.rank is not None:
            stats = stats[stats["rank"] == self.rank]
        if not len(stats):
            return
        target = self.wandb_run if self.wandb_run is not None else _wandb().run
        if target is None:
            raise ValueError("WandbSink: no active W&B run; call wandb.init(...) first or pass wandb_run=")
        for step, payload in sorted(step_payloads(stats, formats=self.formats, block_size=self.block_size,
                                                  rounding=self.rounding, kinds=self.kinds,
                                                  histograms=self.histograms).items()):
            target.log(payload, step=step)

    def __repr__(self) -> str:
        return f"WandbSink(formats={self.formats})"


def log_run(run: Any, *, wandb_run: Any = None, formats: Union[str, Iterable[Any], None] = None,
            block_size: Optional[int] = None, rounding: str = "nearest", kinds: Sequence[str] = ("grad",),
            layers: Union[None, str, Sequence[str]] = None, histograms: bool = True, **init: Any) -> Any:
    """Log a run's statistics, step by step, into W&B: into ``wandb_run`` if given (left open),
    else into a new run started with ``wandb.init(**init)`` (``project=``, ``mode=``, ``dir=``,
    ...; finished here). Returns the W&B run. Example: see the module."""
    r, st = run_stats(run, kinds, layers)
    wandb = _wandb()
    own = wandb_run is None
    if own:
        init.setdefault("config", {"gradstats_run": os.fspath(r.path), "model_class": r.manifest.get("model_class")})
        wandb_run = wandb.init(**init)
    try:
        WandbSink(wandb_run, formats=formats, block_size=block_size, rounding=rounding, kinds=kinds,
                  histograms=histograms, rank=None).write(st)
    finally:
        if own:
            wandb_run.finish()
    return wandb_run
