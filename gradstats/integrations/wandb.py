"""Weights & Biases: the statistics of a run logged per step, live or after the fact.

The same values as :mod:`gradstats.integrations.tensorboard` (per layer: ``mean_log2``,
``std_log2``, ``zero_fraction``, ``amax``, what-if ``underflow/<fmt>`` and ``overflow/<fmt>`` for
watched formats, and the ``log2_abs`` histogram of the binade counts), under keys
``gradstats/<layer>/<name>`` (``gradstats/<kind>/<layer>/<name>`` for kinds other than the neural
gradient): one ``gradstats`` section beside the user's own keys.

Each row carries gradstats' step as ``gradstats/step``, declared as the step metric of
``gradstats/*`` (``define_metric``); rows are logged without ``step=``, so they never conflict
with the run's own step (a Hugging Face ``Trainer`` reporting to W&B, a loop calling
``wandb.log``): W&B drops no row. Rows the sink cannot log (no active run yet, a failing
``log``) are kept and logged with the next step that can be, with one warning in the log; what
is still unlogged when the tracer closes is counted in a warning (``log_run`` logs a run after
the fact).

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

import logging
import os
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence, Union

import numpy as np
import pandas as pd

from gradstats.integrations._metrics import (
    PREFIX,
    STEP_KEY,
    check_formats,
    log2_histogram,
    merged_rows,
    run_stats,
    scalars,
    tag,
)

if TYPE_CHECKING:
    from gradstats.scheme import Scheme

__all__ = ["WandbSink", "log_run", "step_payloads"]

log = logging.getLogger(__name__)


def _wandb() -> Any:
    try:
        import wandb
    except ImportError as exc:                          # pragma: no cover - depends on the environment
        raise ImportError("gradstats.integrations.wandb needs the wandb package (pip install wandb)") from exc
    return wandb


def step_payloads(stats: pd.DataFrame, *, formats: Sequence[str] = (), granularity: Union[str, int, Scheme, None] = None,
                  rounding: str = "nearest", kinds: Sequence[str] = ("grad",),
                  histograms: bool = True) -> dict[int, dict[str, Any]]:
    """``{step: {key: value}}`` as logged to W&B (without the ``gradstats/step`` key the sink adds);
    histograms as ``wandb.Histogram`` (binade edges in log2 units), only when ``histograms`` and
    wandb is importable.

    Example:
        >>> import torch
        >>> from gradstats.stats import tensor_stats
        >>> row = dict(tensor_stats(torch.tensor([0.5, 2.0])), step=0, layer="fc", call=0, rank=0, kind="grad")
        >>> sorted(step_payloads(pd.DataFrame([row]), histograms=False)[0])
        ['gradstats/fc/amax', 'gradstats/fc/mean_log2', 'gradstats/fc/std_log2', 'gradstats/fc/zero_fraction']
    """
    out: dict[int, dict[str, Any]] = {}
    for kind in kinds:
        part = stats[stats["kind"] == kind] if "kind" in stats else stats
        if not len(part):
            continue
        for r in scalars(part, formats=formats, granularity=granularity, rounding=rounding).itertuples():
            out.setdefault(int(r.step), {})[tag(kind, r.layer, r.tag)] = float(r.value)
        if histograms:
            wandb = _wandb()
            for step, layer, m in merged_rows(part):
                h = log2_histogram(m)
                if h is not None:
                    edges = np.array([h["bucket_limits"][0] - 1.0, *h["bucket_limits"]])
                    out.setdefault(step, {})[tag(kind, layer, "log2_abs")] = wandb.Histogram(
                        np_histogram=(np.asarray(h["bucket_counts"]), edges))
    return out


class WandbSink:
    """A tracer sink (``trace(..., sinks=[...])``) that logs each committed step into a W&B run
    (``wandb_run``, default the active one, ``wandb.run``). Only ``rank`` logs (None: every rank).
    Arguments as :func:`log_run`; ``max_pending``: how many steps are kept while they cannot be
    logged (the oldest are given up beyond it, counted in the closing warning).

    Keys are ``gradstats/...`` with gradstats' step as ``gradstats/step`` (the step metric of
    ``gradstats/*``); rows are logged without ``step=``, beside whatever else logs into the run.

    Example:
        >>> import tempfile, torch, gradstats, wandb
        >>> run = wandb.init(mode="disabled")
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4))
        >>> with gradstats.trace(m, tempfile.mkdtemp(), sinks=[WandbSink(run, histograms=False)]) as t:
        ...     m(torch.randn(8, 4)).square().sum().backward(); t.step()
        >>> run.finish()
    """

    def __init__(self, wandb_run: Any = None, *, formats: Union[str, Iterable[Any], None] = None,
                 granularity: Union[str, int, Scheme, None] = None, rounding: str = "nearest", kinds: Sequence[str] = ("grad",),
                 histograms: bool = True, rank: Optional[int] = 0, max_pending: int = 10_000) -> None:
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 0:
            raise ValueError(f"max_pending must be an int >= 0 (steps kept while W&B cannot log them), "
                             f"got {max_pending!r}")
        self.wandb_run = wandb_run
        self.formats = check_formats(formats)
        self.granularity, self.rounding, self.kinds = granularity, rounding, tuple(kinds)
        self.histograms, self.rank, self.max_pending = histograms, rank, max_pending
        self._pending: dict[int, dict[str, Any]] = {}
        self._defined: set[int] = set()         # ids of the W&B runs gradstats' step metric is declared in
        self._warned = False
        self.given_up = 0                       # steps dropped beyond max_pending
        self.logged = 0                         # rows logged

    def write(self, stats: pd.DataFrame) -> None:
        """Log a committed statistics table (called by the tracer's writer); what cannot be logged
        now is kept for the next call."""
        if self.rank is not None:
            stats = stats[stats["rank"] == self.rank]
        if len(stats):
            for step, payload in step_payloads(stats, formats=self.formats, granularity=self.granularity,
                                               rounding=self.rounding, kinds=self.kinds,
                                               histograms=self.histograms).items():
                self._pending.setdefault(step, {}).update(payload)
        if self._pending:
            self._flush()

    def _flush(self) -> None:
        target = self.wandb_run if self.wandb_run is not None else _wandb().run
        if target is None:
            self._cannot("no active W&B run (call wandb.init(...) first or pass wandb_run=)")
            return
        try:
            if id(target) not in self._defined:
                target.define_metric(STEP_KEY, hidden=True)
                target.define_metric(f"{PREFIX}/*", step_metric=STEP_KEY)
                self._defined.add(id(target))
            for step in sorted(self._pending):
                target.log({**self._pending[step], STEP_KEY: step})
                del self._pending[step]
                self.logged += 1
        except Exception as exc:                        # kept, and tried again with the next step
            self._cannot(f"logging into the W&B run failed: {type(exc).__name__}: {exc}")

    def _cannot(self, why: str) -> None:
        if not self._warned:
            log.warning("gradstats: WandbSink cannot log step(s) %s now: %s; they are kept and logged once it "
                        "can", sorted(self._pending)[:5], why)
            self._warned = True
        while len(self._pending) > self.max_pending:
            del self._pending[min(self._pending)]
            self.given_up += 1

    def close(self) -> None:
        """Log what is still pending (called when the tracer closes); warn about what cannot be."""
        if self._pending:
            self._flush()
        lost = len(self._pending) + self.given_up
        if lost:
            log.warning("gradstats: %d step(s) of statistics were not logged to W&B (no active run, or its log "
                        "failed: see the warning above); log the run after the fact with "
                        "gradstats.integrations.wandb.log_run(run_dir, wandb_run=...)", lost)
            self._pending.clear()

    def __repr__(self) -> str:
        return f"WandbSink(formats={self.formats})"


def log_run(run: Any, *, wandb_run: Any = None, formats: Union[str, Iterable[Any], None] = None,
            granularity: Union[str, int, Scheme, None] = None, rounding: str = "nearest", kinds: Sequence[str] = ("grad",),
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
        sink = WandbSink(wandb_run, formats=formats, granularity=granularity, rounding=rounding, kinds=kinds,
                         histograms=histograms, rank=None)
        sink.write(st)
        sink.close()
    finally:
        if own:
            wandb_run.finish()
    return wandb_run
