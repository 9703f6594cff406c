"""The writing side of the tracer: rows of further tables, and the commits of what the hooks
recorded (statistics rows, device vectors, samples, tables) to the run's writer, batched by
``flush_secs``, with the byte budget and the run's manifest. :class:`gradstats.tracer.Tracer` is made
of it and of :class:`gradstats.tracer.capture.Capture`.

Example:
    >>> Commit.MAX_PENDING_ROWS
    4096
"""
from __future__ import annotations

import json
import logging
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from torch import nn

from gradstats._version import __version__
from gradstats.layers import module_types
from gradstats.ops.engine import using
from gradstats.ops.host import Outbox
from gradstats.run import FORMAT_VERSION, RunWriter, atomic_write_json
from gradstats.stats import VectorRows
from gradstats.tracer.capture import sharded_parameters
from gradstats.wrappers import unwrap

log = logging.getLogger(__name__)

#: the tables of the noise records (:mod:`gradstats.tracer.noise`): not steps of the run by themselves
NOISE_TABLES = ("noise", "noise_graph", "noise_gain")


class Commit:
    """The commits of a :class:`gradstats.tracer.Tracer` (its state is set up by the tracer's
    constructor; declared here for the reader)."""

    path: Path
    model: nn.Module
    modules: dict[str, nn.Module]
    rank: int
    world_size: int
    current_step: int
    max_bytes: int | None
    flush_secs: float
    config: Any
    _lock: threading.Lock
    _writer: RunWriter | None
    _rows: VectorRows
    _row_keys: list[tuple[int, str, str, int]]
    _pending: list[tuple[int, str, str, int, torch.Tensor]]
    _pending_samples: dict[str, tuple[torch.Tensor, int]]
    _outbox: Outbox
    _pending_tables: dict[str, list[dict[str, Any]]]
    _shapes: dict[str, list[int]]
    _written_shapes: dict[str, list[int]]
    _last_commit: float
    _sampling_stopped: bool
    _active_step: int | None
    _reported_uncalled: bool
    _created: str

    def flush(self) -> None:
        """Commit every closed step now and block until it is on disk."""
        if self._writer is not None:
            self._flush(self.current_step, force=True)
            self._writer.wait()

    def log_rows(self, table: str, rows: Iterable[dict[str, Any]]) -> None:
        """Add rows (plain values) to a further table of the run, written with the current
        step (or the step a row names); ``gradstats.apply(..., log_to=tracer)`` logs what it did
        this way, the alarms (:mod:`gradstats.alarms`) what they found.
        Read back with ``open_run(path).table(table)``."""
        rows = [{"step": self.current_step, **r, "rank": self.rank} for r in rows]   # a row may name its step
        with self._lock:
            self._pending_tables.setdefault(table, []).extend(rows)

    #: pending statistics rows beyond which a step commits whatever the time
    MAX_PENDING_ROWS = 4096

    def _flush(self, step: int, *, force: bool = False) -> None:
        with using(self.config.engine):     # the trace's engine (TraceConfig.engine; None: GRADSTATS_ENGINE's)
            self._flush_on(step, force=force)

    def _flush_on(self, step: int, *, force: bool) -> None:
        if not (force or self._pending_samples
                or len(self._pending) + len(self._rows) >= self.MAX_PENDING_ROWS
                or time.monotonic() - self._last_commit >= self.flush_secs):
            return              # batch closed steps into one commit (see flush_secs)
        self._last_commit = time.monotonic()
        with self._lock:
            rows, row_keys, self._row_keys = self._rows.take(), self._row_keys, []
            pending, self._pending = self._pending, []
            samples, self._pending_samples = self._pending_samples, {}
            self._outbox.collect()      # one wait for the device's copies of them (none on the CPU)
            tables, self._pending_tables = self._pending_tables, {}
        new_shapes = bool(set(self._shapes) - set(self._written_shapes))
        if not row_keys and not pending and not samples and not tables:
            if new_shapes:
                self._write_manifest()
            return
        assert self._writer is not None
        keys = row_keys + [p[:4] for p in pending]
        steps = sorted({k[0] for k in keys} | {int(k.split("|", 1)[0]) for k in samples}
                       | {int(r["step"]) for name, trows in tables.items() if name not in NOISE_TABLES for r in trows})
        if not steps:
            if not force:        # noise records alone make no step: they ride with the next commit
                with self._lock:
                    for name, trows in tables.items():
                        self._pending_tables[name] = trows + self._pending_tables.get(name, [])
                return
            steps = sorted({int(r.get("of_step", r["step"])) for trows in tables.values() for r in trows})
        fl = self._writer.new_flush(steps)
        fl.tables = tables
        if keys:   # the table is built on the writer thread (Flush.vectors)
            fl.keys = [(s, self.rank, layer, kind, call) for s, layer, kind, call in keys]
            if pending:
                rows = np.concatenate([rows, np.stack([p[4].numpy() for p in pending])])   # the outbox's host tensors
            fl.vectors = rows
        if samples:
            total = RunWriter.sample_bytes(v for v, _ in samples.values())
            if self.max_bytes is not None and self._writer.bytes_committed_or_queued + total > self.max_bytes:
                self._sampling_stopped = True
                self._active_step = None
                msg = (f"gradstats: the run at {self.path} reached its byte budget max_bytes="
                       f"{self.max_bytes}; sampling stops here (statistics go on)")
                log.warning(msg)
                warnings.warn(msg, stacklevel=3)
            else:
                for key, (v, n_total) in samples.items():
                    fl.samples[key] = v          # on the host (the outbox's)
                    fl.sample_totals[key] = [int(v.numel()), int(n_total)]
        if not fl.keys and not fl.samples and not fl.tables:
            return
        self._writer.submit(fl)
        if new_shapes:
            self._write_manifest()

    def _read_previous_manifest(self) -> dict[str, Any] | None:
        try:
            m = json.loads((self.path / "manifest.json").read_text())
            return m if isinstance(m, dict) else None
        except (OSError, ValueError):
            return None

    def _write_manifest(self) -> None:
        if self.rank != 0:
            return
        root = unwrap(self.model)
        layers = []
        for name, module in self.modules.items():
            if name not in self._shapes and self._reported_uncalled:
                continue                # selected but not called: nothing of it is in the run
            layers.append({"name": name, "type": type(module).__name__,
                           "bases": list(module_types(module)[1:]),
                           **({"sharded": True} if sharded_parameters(module) else {}),
                           "output_shape": self._shapes.get(name),
                           "params": sum(p.numel() for p in module.parameters(recurse=False))})
        prev = getattr(self, "_previous", None)
        if prev:                        # a resumed run keeps the layers its earlier sessions traced
            ours = {e["name"] for e in layers}
            layers = [e for e in prev.get("layers", []) if e.get("name") not in ours] + layers
        manifest = {
            "format_version": FORMAT_VERSION,
            "gradstats_version": __version__,
            "torch_version": torch.__version__,
            "created": prev.get("created", self._created) if prev else self._created,
            "model_class": type(root).__name__,
            "model_params": sum(p.numel() for p in root.parameters()),
            "world_size": self.world_size,
            "capture": self.config.capture_record(),
            "layers": layers,
        }
        uncalled = dict((prev.get("uncalled") or {}) if prev else {})
        uncalled.update(getattr(self, "_uncalled", {}))
        traced = {e.get("name") for e in layers}
        uncalled = {n: t for n, t in uncalled.items() if n not in traced}
        if uncalled:      # modules whose weights got gradients but were never called (Capture._find_uncalled)
            manifest["uncalled"] = uncalled
        if getattr(self, "_compiled", False):      # taps of a compiled model ran (gradstats.tracer.taps)
            manifest["compiled"] = {
                "noise": "the per-call noise terms (noise) and the propagation (noise_graph, noise_gain) are not "
                         "recorded under torch.compile (they need each layer's input and a second backward "
                         "pass); the pair terms are",
                "calls": "a module called several times per step numbers its gradients' calls in backward order"}
        atomic_write_json(self.path / "manifest.json", manifest)
        self._written_shapes = dict(self._shapes)
