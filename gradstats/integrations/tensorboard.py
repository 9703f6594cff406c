"""TensorBoard: the statistics of a run as scalars and histograms, live or after the fact.

Per layer and step: ``gradstats/<layer>/mean_log2``, ``gradstats/<layer>/std_log2`` (of
``log2|g|`` over the non-zero entries), ``gradstats/<layer>/zero_fraction``,
``gradstats/<layer>/amax``, for each watched format ``gradstats/<layer>/underflow/<fmt>`` and
``gradstats/<layer>/overflow/<fmt>`` (:func:`gradstats.what_if`, from the statistics), and the
histogram ``gradstats/<layer>/log2_abs`` (the binade counts, one bucket per binade). Tags carry
the kind when it is not the neural gradient (``gradstats/wgrad/<layer>/...``). Every tag is under
``gradstats/`` and each value is at gradstats' own step (TensorBoard keeps a step per tag), so
the sink can share a log directory with the training's own ``SummaryWriter``: separate tags, its
own event file, nothing of either lost.

* live: ``gradstats.trace(model, "runs/x", sinks=[TensorBoardSink("tb/x", formats="e4m3fn,e2m1fn")])``
  (or ``sinks=`` of a trainer callback): written on the tracer's writer thread after each commit;
* offline: :func:`export_run` (CLI: ``gradstats tensorboard RUN --logdir DIR``).

Writes with ``torch.utils.tensorboard`` (needs the ``tensorboard`` package).

Example:
    >>> import tempfile, gradstats
    >>> logdir = tempfile.mkdtemp()
    >>> n = export_run(gradstats.zoo.data.data_dir() / "sample-run", logdir, formats=["e4m3fn"], layers="fc2")
    >>> from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    >>> acc = EventAccumulator(logdir, size_guidance={"scalars": 0}); _ = acc.Reload()
    >>> sorted(acc.Tags()["scalars"])[:2], len(acc.Scalars("gradstats/fc2/amax")) == len(gradstats.open_run(gradstats.zoo.data.data_dir() / "sample-run").steps)
    (['gradstats/fc2/amax', 'gradstats/fc2/mean_log2'], True)
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence, Union

import pandas as pd

from gradstats.integrations._metrics import check_formats, log2_histogram, merged_rows, run_stats, scalars, tag

if TYPE_CHECKING:
    from gradstats.scheme import Scheme

__all__ = ["TensorBoardSink", "export_run"]

log = logging.getLogger(__name__)


def _writer(logdir: Union[str, os.PathLike[str]]) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:                          # pragma: no cover - depends on the environment
        raise ImportError("gradstats.integrations.tensorboard needs the tensorboard package "
                          "(pip install tensorboard)") from exc
    return SummaryWriter(log_dir=str(logdir))


class TensorBoardSink:
    """A tracer sink (``trace(..., sinks=[...])``) that writes each committed step to TensorBoard.

    Args:
        logdir: the TensorBoard log directory.
        formats: formats whose what-if underflow and overflow fractions are logged (names, a
            comma-separated string, or None).
        granularity, rounding: of those what-if predictions (:func:`gradstats.what_if`: ``"mx"``,
            ``"nvfp4"``, a block size, a scheme; None: one scale per tensor).
        kinds: which kinds of tensors (default the neural gradients).
        histograms: log the ``log2|g|`` histograms too.
        rank: only this rank writes (None: every rank, each into ``logdir/rank<R>``).

    Example:
        >>> import tempfile, torch, gradstats
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4))
        >>> logdir = tempfile.mkdtemp()
        >>> with gradstats.trace(m, tempfile.mkdtemp(), sinks=[TensorBoardSink(logdir, formats="e4m3fn")]) as t:
        ...     m(torch.randn(8, 4)).square().sum().backward(); t.step()
        >>> from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        >>> acc = EventAccumulator(logdir); _ = acc.Reload(); "gradstats/0/underflow/e4m3fn" in acc.Tags()["scalars"]
        True
    """

    def __init__(self, logdir: Union[str, os.PathLike[str]], *, formats: Union[str, Iterable[Any], None] = None,
                 granularity: Union[str, int, Scheme, None] = None, rounding: str = "nearest", kinds: Sequence[str] = ("grad",),
                 histograms: bool = True, rank: Optional[int] = 0) -> None:
        self.logdir = os.fspath(logdir)
        self.formats = check_formats(formats)
        self.granularity, self.rounding = granularity, rounding
        self.kinds, self.histograms, self.rank = tuple(kinds), histograms, rank
        self._writers: dict[int, Any] = {}

    def _writer_for(self, rank: int) -> Any:
        if rank not in self._writers:
            path = self.logdir if self.rank is not None else os.path.join(self.logdir, f"rank{rank}")
            self._writers[rank] = _writer(path)
        return self._writers[rank]

    def write(self, stats: pd.DataFrame) -> None:
        """Log a committed statistics table (called by the tracer's writer)."""
        if not len(stats):
            return
        ranks = [self.rank] if self.rank is not None else sorted(stats["rank"].unique())
        for r in ranks:
            part = stats[stats["rank"] == r]
            if len(part):
                write_stats(self._writer_for(int(r)), part, formats=self.formats, granularity=self.granularity,
                            rounding=self.rounding, kinds=self.kinds, histograms=self.histograms)
                self._writer_for(int(r)).flush()

    def close(self) -> None:
        for w in self._writers.values():
            w.close()
        self._writers.clear()

    def __repr__(self) -> str:
        return f"TensorBoardSink({self.logdir!r}, formats={self.formats})"


def write_stats(writer: Any, stats: pd.DataFrame, *, formats: Sequence[str] = (), granularity: Union[str, int, Scheme, None] = None,
                rounding: str = "nearest", kinds: Sequence[str] = ("grad",), histograms: bool = True) -> int:
    """Write statistics rows to a ``SummaryWriter``; returns the number of scalar values written."""
    n = 0
    for kind in kinds:
        part = stats[stats["kind"] == kind]
        if not len(part):
            continue
        for r in scalars(part, formats=formats, granularity=granularity, rounding=rounding).itertuples():
            writer.add_scalar(tag(kind, r.layer, r.tag), r.value, global_step=int(r.step))
            n += 1
        if histograms:
            for step, layer, m in merged_rows(part):
                h = log2_histogram(m)
                if h is not None:
                    writer.add_histogram_raw(tag(kind, layer, "log2_abs"), global_step=step, **h)
    return n


def export_run(run: Any, logdir: Union[str, os.PathLike[str]], *, formats: Union[str, Iterable[Any], None] = None,
               granularity: Union[str, int, Scheme, None] = None, rounding: str = "nearest", kinds: Sequence[str] = ("grad",),
               layers: Union[None, str, Sequence[str]] = None, histograms: bool = True) -> int:
    """Write a run's statistics (every step, calls and ranks merged) into the TensorBoard log
    directory ``logdir``; returns the number of scalar values written. ``formats``: formats whose
    what-if fractions are logged too. Example: see the module."""
    r, st = run_stats(run, kinds, layers)
    w = _writer(logdir)
    try:
        n = write_stats(w, st, formats=check_formats(formats), granularity=granularity, rounding=rounding,
                        kinds=kinds, histograms=histograms)
    finally:
        w.close()
    log.info("gradstats: %d scalars of %s written to %s", n, r.path, logdir)
    return n
