"""Writing a run: flushes of statistics and samples, each committed atomically by its commit record
(the tracer's writer thread)."""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from queue import Queue
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
import pandas as pd

from gradstats.run.format import (
    _PART,
    _sha256,
    atomic_write_bytes,
    atomic_write_json,
    file_metadata,
)
from gradstats.run.reader import read_commits
from gradstats.stats import LAYOUT, STATISTICS

if TYPE_CHECKING:
    import pyarrow as pa
    import torch

log = logging.getLogger(__name__)


@dataclass
class Flush:
    """What one flush of one rank writes: statistics rows and sample tensors."""

    rank: int
    seq: int
    steps: list[int]
    #: statistics still as vectors (rows of :func:`gradstats.stats.tensor_stats_vector`, an
    #: ``(rows, VECTOR_LEN)`` array) with their keys ``(step, rank, layer, kind, call)``: turned
    #: into a table on the writer thread
    keys: list[tuple[int, int, str, str, int]] = field(default_factory=list)
    vectors: np.ndarray | None = None
    samples: dict[str, torch.Tensor] = field(default_factory=dict)
    sample_totals: dict[str, int] = field(default_factory=dict)
    #: further tables by name (e.g. "applied": what gradstats.apply did), rows of plain values
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: the tracing session that wrote it and the step that session started at: a later session
    #: of the same rank that starts at step k supersedes this one's steps >= k (a resumed run)
    session: str | None = None
    start_step: int | None = None


def _stats_table(keys: Sequence[tuple[int, int, str, str, int]], values: dict[str, np.ndarray]):
    """The one home of the statistics table's schema: key columns ``(step, rank, layer, kind,
    call)`` per row, then a column per statistic of :data:`gradstats.stats.STATISTICS` in its
    declared dtype (``values[name]``: an ``R x length`` array; an optional statistic may be
    absent), a fixed-size list for an array statistic, as an Arrow table."""
    import pyarrow as pa

    step, rank, layer, kind, call = (list(c) for c in zip(*keys)) if len(keys) else ([],) * 5
    cols: dict[str, Any] = {
        "step": pa.array(step, pa.int64()), "rank": pa.array(rank, pa.int32()),
        "layer": pa.array(layer, pa.string()), "kind": pa.array(kind, pa.string()),
        "call": pa.array(call, pa.int32()),
    }
    for st in STATISTICS:
        if st.name not in values:
            if not st.optional:
                raise ValueError(f"statistics rows lack {st.name!r}, which every row must hold")
            continue
        v = np.asarray(values[st.name]).reshape(len(keys), st.length).astype(st.dtype)
        cols[st.name] = pa.array(v[:, 0]) if st.scalar else \
            pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), st.length)
    return pa.table(cols).replace_schema_metadata(file_metadata("stats"))


def rows_to_table(rows: Sequence[dict[str, Any]]) -> "pa.Table":
    """Statistics rows (dicts with the key columns and the statistics; an optional one, such as
    ``top_abs``, only when every row has it) as an Arrow table with the run's schema."""
    keys = [(int(r["step"]), int(r["rank"]), str(r["layer"]), str(r["kind"]), int(r["call"])) for r in rows]
    values: dict[str, np.ndarray] = {}
    for st in STATISTICS:
        if not all(st.name in r for r in rows) or (st.optional and not rows):
            if st.optional:
                continue
            raise ValueError(f"statistics rows lack {st.name!r}, which every row must hold (rows of "
                             "gradstats.stats.tensor_stats or merge_stats have it)")
        dt = np.float64 if st.scalar else st.dtype
        values[st.name] = np.array([np.asarray(r[st.name], dtype=dt).reshape(st.length) for r in rows],
                                   dtype=dt).reshape(len(rows), st.length)
    return _stats_table(keys, values)


def vectors_to_table(keys: Sequence[tuple[int, int, str, str, int]], vectors: np.ndarray) -> "pa.Table":
    """Statistics vectors (rows of :func:`gradstats.stats.tensor_stats_vector`, stacked) with
    their keys ``(step, rank, layer, kind, call)`` as an Arrow table with the run's schema:
    columns sliced from the matrix (:data:`gradstats.stats.LAYOUT`), no Python object per row (the
    writer thread builds every commit this way, holding the interpreter as briefly as it can)."""
    return _stats_table(keys, {st.name: vectors[:, LAYOUT[st.name]] for st in STATISTICS})


def _side_table(name: str, rows: Sequence[dict[str, Any]]):
    """A further table's rows as Arrow, with the statistics' key types (``step`` int64, ``rank``
    int32) and the run's file metadata."""
    import pyarrow as pa

    df = pd.DataFrame(rows)
    if "step" in df:
        df["step"] = df["step"].astype("int64")
    if "rank" in df:
        df["rank"] = df["rank"].astype("int32")
    t = pa.Table.from_pandas(df, preserve_index=False)
    return t.replace_schema_metadata({**(t.schema.metadata or {}), **file_metadata(name)})


class RunWriter:
    """Writes flushes of one rank into a run directory, on a background thread.

    ``submit`` hands a :class:`Flush` over and returns at once; ``close`` (or ``wait``)
    blocks until everything submitted is committed. Errors of the writer thread are raised
    at the next ``submit``/``wait``.
    """

    def __init__(self, path: Path, rank: int, *, max_bytes: int | None = None,
                 session: str | None = None, start_step: int | None = None, sinks: Sequence[Any] = ()) -> None:
        self.path = Path(path)
        self.rank = rank
        #: objects with ``write(stats: DataFrame)`` (and optionally ``close()``), handed every
        #: committed statistics table on this thread, after its commit (see :func:`gradstats.trace`)
        self.sinks = list(sinks)
        self._sink_failed: set[int] = set()
        self.max_bytes = max_bytes
        #: written into every commit record (see :class:`Flush`); the tracer sets them
        self.session = session
        self.start_step = start_step
        self.bytes_written = 0
        self._bytes_queued = 0        # sample bytes submitted but not yet written
        self._bytes_lock = threading.Lock()
        for sub in ("stats", "samples", "commits"):
            (self.path / sub).mkdir(parents=True, exist_ok=True)
        self._seq = self._next_seq()
        # a resumed run's byte budget counts what its earlier sessions wrote
        self.bytes_written = sum(int(f.get("bytes", 0)) for c in read_commits(self.path)
                                 if int(c["rank"]) == rank for f in c["files"].values())
        self._queue: Queue[Flush | None] = Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="gradstats-writer", daemon=True)
        self._thread.start()

    def _next_seq(self) -> int:
        seqs = [int(m.group(2)) for p in (self.path / "commits").iterdir()
                if (m := _PART.match(p.name)) and int(m.group(1)) == self.rank]
        return max(seqs, default=-1) + 1

    def new_flush(self, steps: list[int]) -> Flush:
        fl = Flush(rank=self.rank, seq=self._seq, steps=steps, session=self.session,
                   start_step=self.start_step)
        self._seq += 1
        return fl

    @staticmethod
    def sample_bytes(samples: Iterable[torch.Tensor]) -> int:
        """Bytes the sample tensors take in a run."""
        return sum(v.numel() * v.element_size() for v in samples)

    @property
    def bytes_committed_or_queued(self) -> int:
        """Bytes written so far plus the sample bytes of flushes still queued: what a byte
        budget has to count while the writer thread lags behind the training."""
        with self._bytes_lock:
            return self.bytes_written + self._bytes_queued

    def submit(self, flush: Flush) -> None:
        self._raise()
        with self._bytes_lock:
            self._bytes_queued += self.sample_bytes(flush.samples.values())
        self._queue.put(flush)

    def wait(self) -> None:
        self._queue.join()
        self._raise()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        for sink in self.sinks:
            if hasattr(sink, "close"):
                try:
                    sink.close()
                except Exception as exc:           # a sink never costs the run
                    log.warning("gradstats: closing the sink %r failed: %s", sink, exc)
        self._raise()

    def _to_sinks(self, table: Any) -> None:
        """Hand a committed statistics table to every sink; a failing sink is reported once and
        left out from then on (the run on disk is complete whatever a sink does)."""
        if not self.sinks:
            return
        df = table.to_pandas()
        for i, sink in enumerate(self.sinks):
            if i in self._sink_failed:
                continue
            try:
                sink.write(df)
            except Exception as exc:
                self._sink_failed.add(i)
                log.warning("gradstats: the sink %r failed and is left out of the rest of the run: %s", sink, exc)

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"gradstats could not write to the run at {self.path}: {err}") from err

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(item)
            except BaseException as exc:  # reported to the training thread
                self._error = exc
            finally:
                self._queue.task_done()

    def _write(self, fl: Flush) -> None:
        import pyarrow.parquet as pq
        from safetensors.torch import save as st_save

        name = f"r{fl.rank}-{fl.seq:06d}"
        files: dict[str, dict[str, Any]] = {}
        table = None
        if fl.keys:
            rel = f"stats/part-{name}.parquet"
            tmp = self.path / "stats" / f".part-{name}.parquet.tmp"
            # dictionary encoding only where values repeat (layer and kind names): on the
            # statistics' floats and counts it costs most of the write and saves nothing
            table = vectors_to_table(fl.keys, fl.vectors)
            pq.write_table(table, tmp, compression="zstd", use_dictionary=["layer", "kind"])
            os.replace(tmp, self.path / rel)
            files[rel] = {"bytes": (self.path / rel).stat().st_size, "sha256": _sha256(self.path / rel)}
        samples_meta: dict[str, int] = {}
        if fl.samples:
            data = st_save({k: v.contiguous() for k, v in fl.samples.items()})
            rel = f"samples/part-{name}.safetensors"
            atomic_write_bytes(self.path / rel, data)
            files[rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            samples_meta = dict(fl.sample_totals)
        for tname, trows in fl.tables.items():
            if not trows:
                continue
            (self.path / tname).mkdir(exist_ok=True)
            rel = f"{tname}/part-{name}.parquet"
            tmp = self.path / tname / f".part-{name}.parquet.tmp"
            pq.write_table(_side_table(tname, trows), tmp)
            os.replace(tmp, self.path / rel)
            files[rel] = {"bytes": (self.path / rel).stat().st_size, "sha256": _sha256(self.path / rel)}
        with self._bytes_lock:
            self.bytes_written += sum(f["bytes"] for f in files.values())
            self._bytes_queued -= self.sample_bytes(fl.samples.values())
        record = {"rank": fl.rank, "seq": fl.seq, "steps": sorted(set(fl.steps)), "files": files,
                  "sample_totals": samples_meta}
        if fl.session is not None:
            record["session"], record["start_step"] = fl.session, fl.start_step
        atomic_write_json(self.path / "commits" / f"{name}.json", record)
        if table is not None:
            self._to_sinks(table)
