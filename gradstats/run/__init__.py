"""Runs on disk: the directory a tracer writes and every later stage reads.

Layout (documented in ``docs/run-format.md``)::

    RUN/
      manifest.json                        format version, versions, model, layers, capture config
      stats/part-r{rank}-{seq:06d}.parquet  statistics rows of one flush (a Parquet dataset)
      samples/part-r{rank}-{seq:06d}.safetensors  raw samples of one flush
      commits/r{rank}-{seq:06d}.json       the commit record of one flush: its files, sizes, sha256

Every file is written under a temporary name and renamed atomically, and a flush counts only
once its commit record exists (written last), so a writer killed at any moment leaves a run
whose committed steps all read back. Checksums in the commit records detect corrupted or
truncated files; a damaged file is named in the error and the rest of the run stays readable.

Example:
    >>> import tempfile, torch
    >>> import gradstats
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    >>> path = tempfile.mkdtemp()
    >>> with gradstats.trace(model, path, sample_every=1) as tracer:
    ...     for _ in range(2):
    ...         model(torch.randn(8, 4)).square().mean().backward()
    ...         tracer.step()
    >>> run = gradstats.open_run(path)
    >>> run.steps, run.samples(run.layers[0], 0).shape[0] > 0
    ([0, 1], True)
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from queue import Queue
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.dataset as pads
import torch

from gradstats.stats import COUNT_FIELDS, HIST_BINS, HIST_MIN_EXP, SCALAR_FIELDS, TOP_K, merge_stats

log = logging.getLogger(__name__)

#: version of the on-disk format written by this module
FORMAT_VERSION = 1
KEY_COLUMNS = ("step", "rank", "layer", "kind", "call")
_PART = re.compile(r"^r(\d+)-(\d+)\.json$")


class RunCorruptError(ValueError):
    """A file of a run is missing, truncated or does not match its recorded checksum."""


# --------------------------------------------------------------------------- files


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and an atomic rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def sample_key(step: int, layer: str, kind: str, call: int) -> str:
    return f"{step}|{kind}|{call}|{layer}"


def _parse_sample_key(key: str) -> tuple[int, str, int, str]:
    step, kind, call, layer = key.split("|", 3)
    return int(step), kind, int(call), layer


# --------------------------------------------------------------------------- writer


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


def file_metadata(table: str) -> dict[bytes, bytes]:
    """The key-value metadata of every Parquet file of a run (``table``: ``"stats"``, ``"applied"``,
    ...): the run format version, the gradstats version, and for the statistics how to read
    ``hist`` (bin ``i`` counts the entries with ``floor(log2|g|) == hist_min_exp + i``)."""
    from gradstats._version import __version__

    meta = {"gradstats.format_version": str(FORMAT_VERSION), "gradstats.version": __version__,
            "gradstats.table": table}
    if table == "stats":
        meta.update({"gradstats.hist_min_exp": str(HIST_MIN_EXP), "gradstats.hist_log_base": "2",
                     "gradstats.top_k": str(TOP_K)})
    return {k.encode(): v.encode() for k, v in meta.items()}


def _stats_table(keys: Sequence[tuple[int, int, str, str, int]], scalars: np.ndarray, hist: np.ndarray,
                 top: np.ndarray | None):
    """The one home of the statistics table's schema: key columns ``(step, rank, layer, kind,
    call)`` per row, the ``SCALAR_FIELDS`` (an ``R x len(SCALAR_FIELDS)`` array), ``hist``
    (``R x HIST_BINS``) and, unless None, ``top_abs`` (``R x TOP_K``), as an Arrow table."""
    import pyarrow as pa

    step, rank, layer, kind, call = (list(c) for c in zip(*keys)) if len(keys) else ([],) * 5
    cols: dict[str, Any] = {
        "step": pa.array(step, pa.int64()), "rank": pa.array(rank, pa.int32()),
        "layer": pa.array(layer, pa.string()), "kind": pa.array(kind, pa.string()),
        "call": pa.array(call, pa.int32()),
    }
    scalars = np.asarray(scalars, dtype=np.float64).reshape(len(keys), len(SCALAR_FIELDS))
    for i, f in enumerate(SCALAR_FIELDS):
        col = scalars[:, i]
        cols[f] = pa.array(col.astype(np.int64) if f in COUNT_FIELDS else col)
    hist = np.asarray(hist).reshape(len(keys), HIST_BINS).astype(np.int64)
    cols["hist"] = pa.FixedSizeListArray.from_arrays(pa.array(hist.reshape(-1)), HIST_BINS)
    if top is not None:
        top = np.asarray(top).reshape(len(keys), TOP_K).astype(np.float32)
        cols["top_abs"] = pa.FixedSizeListArray.from_arrays(pa.array(top.reshape(-1)), TOP_K)
    return pa.table(cols).replace_schema_metadata(file_metadata("stats"))


def rows_to_table(rows: Sequence[dict[str, Any]]) -> "pa.Table":
    """Statistics rows (dicts with the key columns, the scalar fields, ``hist`` and, when every
    row has it, ``top_abs``) as an Arrow table with the run's schema."""
    keys = [(int(r["step"]), int(r["rank"]), str(r["layer"]), str(r["kind"]), int(r["call"])) for r in rows]
    scalars = np.array([[r[f] for f in SCALAR_FIELDS] for r in rows], dtype=np.float64)
    hist = np.stack([np.asarray(r["hist"], dtype=np.int64) for r in rows]) if rows else \
        np.zeros((0, HIST_BINS), np.int64)
    top = np.stack([np.asarray(r["top_abs"], dtype=np.float32) for r in rows]) \
        if rows and all("top_abs" in r for r in rows) else None
    return _stats_table(keys, scalars, hist, top)


def vectors_to_table(keys: Sequence[tuple[int, int, str, str, int]], vectors: np.ndarray) -> "pa.Table":
    """Statistics vectors (rows of :func:`gradstats.stats.tensor_stats_vector`, stacked) with
    their keys ``(step, rank, layer, kind, call)`` as an Arrow table with the run's schema:
    columns sliced from the matrix, no Python object per row (the writer thread builds every
    commit this way, holding the interpreter as briefly as it can)."""
    k, h = len(SCALAR_FIELDS), len(SCALAR_FIELDS) + HIST_BINS
    return _stats_table(keys, vectors[:, :k], vectors[:, k:h], vectors[:, h:h + TOP_K])


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


# --------------------------------------------------------------------------- reader


#: kinds whose tensor is the same on every rank of a data-parallel run (after the all-reduce)
REPLICA_KINDS = ("weight", "wgrad")


class RunDamageWarning(UserWarning):
    """A file of a run was found damaged; the rest of the run is read without it."""


def read_commits(path: Path, problem: Any = None) -> list[dict[str, Any]]:
    """The commit records of a run directory, in name order (rank, then sequence), each with
    ``_limit``: the step from which a later tracing session of the same rank supersedes it (a
    resumed run; ``None`` when nothing does). ``problem(msg)`` is told of damaged records."""
    commits: list[dict[str, Any]] = []
    cdir = Path(path) / "commits"
    for p in sorted(cdir.iterdir()) if cdir.is_dir() else []:
        if not _PART.match(p.name):
            continue
        try:
            rec = json.loads(p.read_text())
            if not isinstance(rec, dict) or not isinstance(rec["files"], dict):
                raise KeyError("files")
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as exc:
            if problem is not None:
                problem(f"commit record {p} is damaged ({exc!r}); its flush is skipped")
            continue
        commits.append(rec)
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for c in commits:
        by_rank.setdefault(int(c["rank"]), []).append(c)
    for recs in by_rank.values():
        cut: float = math.inf
        later: tuple[Any, Any] = (None, None)      # (session, start step) of the commit after
        for c in sorted(recs, key=lambda c: int(c["seq"]), reverse=True):
            if later[0] is not None and c.get("session") != later[0] and later[1] is not None:
                cut = min(cut, int(later[1]))      # a later session restarted at that step
            c["_limit"] = None if math.isinf(cut) else int(cut)
            later = (c.get("session"), c.get("start_step"))
    return commits


def _live_steps(c: dict[str, Any]) -> list[int]:
    """The steps of a commit record that no later session superseded."""
    limit = c.get("_limit")
    return [int(s) for s in c["steps"] if limit is None or int(s) < limit]


def last_committed_step(path: str | os.PathLike[str]) -> int | None:
    """The last step any commit record of the run at ``path`` holds (``None`` for a run with
    none): where :func:`gradstats.trace` with ``resume=True`` continues. Reads the commit
    records only (no file is checked).

    Example:
        >>> import tempfile
        >>> last_committed_step(tempfile.mkdtemp()) is None
        True
    """
    steps = [s for c in read_commits(Path(path)) for s in _live_steps(c)]
    return max(steps) if steps else None


def _strip_keys(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in KEY_COLUMNS}


class Run:
    """A run directory opened for reading (see :func:`open_run`).

    Attributes:
        path: the directory.
        manifest: the parsed ``manifest.json``.
        layers: names of the traced layers, in model order.
        steps: committed steps, sorted, less those whose statistics file is damaged (the
            steps that :meth:`stats` returns, plus steps of flushes that hold no statistics).
        ranks: ranks that committed data.
        problems: what was found damaged so far, one message each (also warned once).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"no run directory at {self.path}; pass the directory that "
                                    "gradstats.trace(model, path) wrote")
        mpath = self.path / "manifest.json"
        if not mpath.exists():
            raise RunCorruptError(f"{mpath} is missing: {self.path} is not a gradstats run "
                                  "(or its tracer never started)")
        try:
            manifest = json.loads(mpath.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RunCorruptError(f"{mpath} is not valid JSON ({exc}); the run's manifest is damaged") from exc
        if not isinstance(manifest, dict):
            raise RunCorruptError(f"{mpath} holds a JSON {type(manifest).__name__}, not an object: "
                                  "the run's manifest is damaged or not a gradstats manifest")
        self.manifest: dict[str, Any] = manifest
        version = self.manifest.get("format_version")
        if version != FORMAT_VERSION:
            raise RunCorruptError(f"{mpath} has format_version {version!r}; this gradstats reads "
                                  f"version {FORMAT_VERSION}")
        self.problems: list[str] = []
        self.refresh()

    # -- discovery
    def refresh(self) -> "Run":
        """Re-read the commit records (a run still being written grows)."""
        self.problems = []
        self._commits: list[dict[str, Any]] = read_commits(self.path, self._problem)
        self._stats_cache: pd.DataFrame | None = None
        self._verified: set[str] = set()
        #: damaged files found so far: relative path -> the error (kept for on_error="raise")
        self._damaged: dict[str, RunCorruptError] = {}
        self._steps: list[int] | None = None
        return self

    def _problem(self, msg: str) -> None:
        if msg in self.problems:
            return
        self.problems.append(msg)
        warnings.warn(msg, RunDamageWarning, stacklevel=3)

    @property
    def layers(self) -> list[str]:
        return [entry["name"] for entry in self.manifest.get("layers", [])]

    @property
    def steps(self) -> list[int]:
        if self._steps is None:
            steps: set[int] = set()
            for c in self._commits:
                files = c["files"]
                stats_files = [r for r in files if r.startswith("stats/")]
                # a flush whose statistics file is damaged has lost its steps (its samples, if
                # sound, still read through samples()): steps agree with stats()
                if not stats_files or all([self._sound(r, files[r]) for r in stats_files]):
                    steps.update(_live_steps(c))
            self._steps = sorted(steps)
        return self._steps

    @property
    def ranks(self) -> list[int]:
        return sorted({int(c["rank"]) for c in self._commits})

    @property
    def sharded_layers(self) -> list[str]:
        """Layers whose parameters were sharded across ranks (FSDP2 ``fully_shard``): their
        ``weight`` and ``wgrad`` rows are per-rank shards.

        Example:
            >>> import gradstats
            >>> gradstats.open_run(gradstats.zoo.data.data_dir() / "sample-run").sharded_layers
            []
        """
        return [e["name"] for e in self.manifest.get("layers", []) if e.get("sharded")]

    def layer_info(self) -> pd.DataFrame:
        """One row per traced layer: name, type, output shape, parameter count."""
        return pd.DataFrame(self.manifest.get("layers", []))

    # -- integrity
    def _check(self, rel: str, meta: dict[str, Any]) -> Path:
        p = self.path / rel
        if rel in self._verified:
            return p
        if rel in self._damaged:
            raise self._damaged[rel]
        try:
            if not p.exists():
                raise RunCorruptError(f"{p} is missing (listed in a commit record of the run)")
            size = p.stat().st_size
            if size != meta["bytes"]:
                raise RunCorruptError(f"{p} is truncated or damaged: {size} bytes on disk, "
                                      f"{meta['bytes']} recorded")
            if _sha256(p) != meta["sha256"]:
                raise RunCorruptError(f"{p} does not match its recorded sha256 checksum: the file is damaged")
        except RunCorruptError as exc:
            self._damaged[rel] = exc
            raise
        self._verified.add(rel)
        return p

    def _sound(self, rel: str, meta: dict[str, Any]) -> bool:
        """Whether a file checks out; a damaged one is reported once (``problems``)."""
        try:
            self._check(rel, meta)
            return True
        except RunCorruptError as exc:
            self._problem(f"{exc}; the rest of the run is read without it")
            return False

    def verify(self) -> list[str]:
        """Check every file's size and checksum; returns the list of problems (empty when sound)."""
        bad = []
        for c in self._commits:
            for rel, meta in c["files"].items():
                try:
                    self._check(rel, meta)
                except RunCorruptError as exc:
                    bad.append(str(exc))
        return bad

    def _read_parquet(self, c: dict[str, Any], prefix: str, on_error: str) -> list[pd.DataFrame]:
        """The tables of one commit whose path starts with ``prefix``, limited to its live steps."""
        import pyarrow.parquet as pq

        frames = []
        for rel, meta in c["files"].items():
            if not rel.startswith(prefix):
                continue
            try:
                df = pq.read_table(self._check(rel, meta)).to_pandas()
            except RunCorruptError as exc:
                if on_error == "raise":
                    raise
                self._problem(f"{exc}; the rest of the run is read without it")
                continue
            limit = c.get("_limit")
            if limit is not None and "step" in df.columns:
                df = df[df["step"] < limit]
            frames.append(df)
        return frames

    # -- statistics
    def stats(self, *, kinds: Iterable[str] | None = None, merge_ranks: bool = False,
              on_error: str = "warn") -> pd.DataFrame:
        """Statistics as a DataFrame, one row per step, rank, layer, kind and call.

        Columns: ``step, rank, layer, kind, call``, the fields of :mod:`gradstats.stats`,
        ``hist`` (an int64 array of binade counts per row) and ``top_abs`` (the largest
        magnitudes; NaN in rows of runs written before it was recorded). With ``merge_ranks=True`` the
        ranks of a distributed run are combined exactly (rank becomes -1): neural gradients
        and activations are shards of the global batch and add up; weights and weight
        gradients (``REPLICA_KINDS``) are the same tensor on every rank after the all-reduce,
        so the lowest rank's row stands for all, except in layers whose parameters are sharded
        (:attr:`sharded_layers`, FSDP2): there each rank holds a shard, and the shards add up.
        A damaged file is skipped with a warning naming it (``on_error="warn"``) or raises ``RunCorruptError`` (``on_error="raise"``),
        also when an earlier read already found it.
        """
        if on_error not in ("warn", "raise"):
            raise ValueError(f"on_error must be 'warn' or 'raise', got {on_error!r}")
        if self._stats_cache is None:
            tables = [t for c in self._commits for t in self._read_parquet(c, "stats/", on_error)]
            cols = [*KEY_COLUMNS, *SCALAR_FIELDS, "hist", "top_abs"]
            df = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=cols)
            df = df.sort_values(list(KEY_COLUMNS), kind="stable").reset_index(drop=True)
            self._stats_cache = df
        elif on_error == "raise":
            for c in self._commits:
                for rel in c["files"]:
                    if rel.startswith("stats/") and rel in self._damaged:
                        raise self._damaged[rel]
        df = self._stats_cache
        if kinds is not None:
            df = df[df["kind"].isin(list(kinds))].reset_index(drop=True)
        if merge_ranks and len(df):
            rows = []
            sharded = self.sharded_layers
            for key, g in df.groupby(["step", "layer", "kind", "call"], sort=True):
                recs = g.to_dict("records")
                replica = key[2] in REPLICA_KINDS and key[1] not in sharded
                m = _strip_keys(min(recs, key=lambda r: r["rank"])) if replica else merge_stats(recs)
                rows.append({"step": key[0], "rank": -1, "layer": key[1], "kind": key[2],
                             "call": key[3], **m})
            df = pd.DataFrame(rows)
        return df.copy()

    def files(self, table: str = "stats") -> list[Path]:
        """The committed Parquet files of a table (``"stats"``, ``"applied"``, ``"alarms"``, ...),
        in commit order: what another reader (DuckDB, polars, pyarrow) should read, rather than a
        glob, which also sees a file whose commit record a crash never wrote. Rows a resumed
        session superseded are still in those files: :meth:`dataset` leaves them out.

        Example:
            >>> import gradstats
            >>> run = gradstats.open_run(gradstats.zoo.data.data_dir() / "sample-run")
            >>> len(run.files("stats")) > 0, run.files("stats")[0].suffix
            (True, '.parquet')
        """
        if table in ("samples", "commits") or not table.isidentifier():
            raise ValueError(f"{table!r} is not a Parquet table of a run; try 'stats' or a table name such as "
                             "'applied' or 'alarms'")
        return [self.path / rel for c in self._commits for rel in c["files"] if rel.startswith(f"{table}/")]

    def dataset(self, table: str = "stats") -> "pads.Dataset":
        """A ``pyarrow.dataset.Dataset`` of a table's committed rows: over :meth:`files` when no
        tracing session superseded another's steps, else of the rows that stand (in memory).
        Scan it, filter it, or hand it to DuckDB (``duckdb.from_arrow(run.dataset())``) or polars
        (``polars.scan_pyarrow_dataset(run.dataset())``).

        Example:
            >>> import gradstats
            >>> run = gradstats.open_run(gradstats.zoo.data.data_dir() / "sample-run")
            >>> run.dataset().count_rows() == len(run.stats())
            True
        """
        import pyarrow as pa
        import pyarrow.dataset as ds

        files = self.files(table)
        if any(c.get("_limit") is not None for c in self._commits):
            df = self.stats() if table == "stats" else self.table(table)
            return ds.dataset(pa.Table.from_pandas(df, preserve_index=False))
        if not files:
            return ds.dataset(pa.table({}))
        return ds.dataset([str(f) for f in files], format="parquet")

    def table(self, name: str, *, on_error: str = "warn") -> pd.DataFrame:
        """A further table of the run by name, e.g. ``"applied"`` (what :func:`gradstats.apply`
        did per layer and step when given ``log_to=``). Empty when the run has none."""
        if name in ("stats", "samples", "commits") or not name.isidentifier():
            raise ValueError(f"{name!r} is not a table name; use stats(), samples() for those")
        if on_error not in ("warn", "raise"):
            raise ValueError(f"on_error must be 'warn' or 'raise', got {on_error!r}")
        frames = [t for c in self._commits for t in self._read_parquet(c, f"{name}/", on_error)]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    # -- samples
    def sample_index(self) -> pd.DataFrame:
        """Which raw samples exist: step, rank, layer, kind, call, n_samples, n_total, file."""
        rows = []
        for c in self._commits:
            totals = c.get("sample_totals", {})
            limit = c.get("_limit")
            for rel in c["files"]:
                if not rel.startswith("samples/"):
                    continue
                for key, (n_samp, n_tot) in totals.items():
                    step, kind, call, layer = _parse_sample_key(key)
                    if limit is not None and step >= limit:
                        continue
                    rows.append({"step": step, "rank": c["rank"], "layer": layer, "kind": kind,
                                 "call": call, "n_samples": n_samp, "n_total": n_tot, "file": rel})
        cols = [*KEY_COLUMNS, "n_samples", "n_total", "file"]
        return pd.DataFrame(rows, columns=cols).sort_values(list(KEY_COLUMNS)).reset_index(drop=True)

    def samples(self, layer: str, step: int, *, kind: str = "grad", call: int | None = 0,
                rank: int | None = None) -> torch.Tensor:
        """Raw sampled values (signed, float32, 1-D) of one layer at one step.

        ``call``: which call of the layer in that step (a module called twice per step records
        calls 0 and 1), or ``None`` for all of them concatenated in call order. With
        ``rank=None`` the samples of all ranks are concatenated in rank order (weights and
        weight gradients, the same on every rank, are taken from the lowest rank only).

        Example:
            >>> import gradstats, tempfile, torch
            >>> m = torch.nn.Linear(3, 3)
            >>> with gradstats.trace(m, tempfile.mkdtemp(), sample_every=1) as t:
            ...     for _ in range(2):
            ...         m(m(torch.randn(4, 3))).sum().backward(); t.step()
            >>> run = gradstats.open_run(t.path)
            >>> [run.samples("(root)", 1, call=c).numel() for c in (0, 1, None)]
            [12, 12, 24]
        """
        from safetensors import safe_open

        if call is not None and (isinstance(call, bool) or not isinstance(call, int) or call < 0):
            raise ValueError(f"call must be a call number >= 0 or None (all calls), got {call!r}")
        idx = self.sample_index()
        sel = idx[(idx.layer == layer) & (idx.kind == kind) & (idx.step == step)]
        if call is not None:
            sel = sel[sel.call == call]
        if rank is not None:
            sel = sel[sel["rank"] == rank]
        elif kind in REPLICA_KINDS and len(sel) and layer not in self.sharded_layers:
            sel = sel[sel["rank"] == sel["rank"].min()]
        if not len(sel):
            if layer not in self.layers:
                raise ValueError(f"layer {layer!r} is not in this run; its layers are {self.layers}")
            have = idx[(idx.layer == layer) & (idx.kind == kind)]
            calls = {int(s): sorted(set(g.call.tolist())) for s, g in have.groupby("step", sort=True)}
            where = f"steps {list(calls)}"
            if any(c != [0] for c in calls.values()):
                where += " with calls " + ", ".join(f"{c} at step {s}" for s, c in calls.items())
            what = f"call {call}" if call is not None else "any call"
            raise ValueError(f"no {kind!r} samples of layer {layer!r} at step {step} ({what}"
                             f"{'' if rank is None else f', rank {rank}'}); {kind!r} samples of that "
                             f"layer exist at {where}")
        by_file = {(c["rank"], rel): c["files"][rel] for c in self._commits for rel in c["files"]
                   if rel.startswith("samples/")}
        parts = []
        for r in sel.sort_values(["rank", "call"]).itertuples():
            p = self._check(r.file, by_file[(r.rank, r.file)])
            with safe_open(str(p), framework="pt") as f:
                parts.append(f.get_tensor(sample_key(int(r.step), layer, kind, int(r.call))))
        return torch.cat(parts).to(torch.float32)

    def summary(self, *, kind: str = "grad") -> pd.DataFrame:
        """One row per layer: type, output shape, steps captured, and over all captured steps
        (calls and ranks merged per step) the median zero fraction and the median mean and
        std of ``log2|g|`` of the non-zero entries; plus the last step's values and the alarms
        raised on the layer while tracing (:mod:`gradstats.alarms`; comma-separated, ``""``: none).

        Example:
            >>> import gradstats, tempfile, torch
            >>> m = torch.nn.Sequential(torch.nn.Linear(3, 3))
            >>> with gradstats.trace(m, tempfile.mkdtemp()) as t:
            ...     m(torch.randn(4, 3)).sum().backward(); t.step()
            >>> list(gradstats.open_run(t.path).summary().columns[:3])
            ['layer', 'type', 'output_shape']
        """
        from gradstats.stats import lognormal_moments

        info = {e["name"]: e for e in self.manifest.get("layers", [])}
        df = self.stats(kinds=[kind], merge_ranks=len(self.ranks) > 1)
        alarms: dict[str, list[str]] = {}
        at = self.table("alarms")
        if len(at) and {"layer", "kind", "alarm"} <= set(at.columns):
            for r in at[at["kind"] == kind].itertuples():
                alarms.setdefault(r.layer, [])
                if r.alarm not in alarms[r.layer]:
                    alarms[r.layer].append(r.alarm)
        rows = []
        for layer in self.layers:
            g = df[df["layer"] == layer]
            per_step = []
            for step, gs in g.groupby("step", sort=True):
                m = merge_stats(gs.to_dict("records"))
                mu, sigma = lognormal_moments(m)
                per_step.append((step, m["n_zero"] / max(m["n"], 1), mu / math.log(2), sigma / math.log(2)))
            arr = np.array([p[1:] for p in per_step]) if per_step else np.full((1, 3), np.nan)
            med = np.median(arr, axis=0)
            last = arr[-1]
            e = info.get(layer, {})
            rows.append({"layer": layer, "type": e.get("type"), "output_shape": e.get("output_shape"),
                         "params": e.get("params"), "steps": len(per_step),
                         "zero_fraction": med[0], "mean_log2": med[1], "std_log2": med[2],
                         "last_mean_log2": last[1], "last_std_log2": last[2],
                         "alarms": ", ".join(alarms.get(layer, []))})
        return pd.DataFrame(rows)

    def __repr__(self) -> str:
        return (f"Run({str(self.path)!r}, layers={len(self.layers)}, steps={len(self.steps)}, "
                f"ranks={self.ranks or [0]})")


def as_run(run: Any) -> Run:
    """``run`` itself if it is a :class:`Run`, else the run at that path (:func:`open_run`): what every
    stage that reads a run accepts.

    Example:
        >>> from gradstats.zoo.data import data_dir
        >>> r = as_run(data_dir() / "sample-run")
        >>> as_run(r) is r
        True
    """
    if isinstance(run, Run):
        return run
    if isinstance(run, (str, os.PathLike)):
        return open_run(run)
    raise ValueError(f"run must be a gradstats Run or the path of a run directory, got {type(run).__name__}")


def open_run(path: str | os.PathLike[str]) -> Run:
    """Open a run directory written by :func:`gradstats.trace` (also while it is being written).

    Example:
        >>> import gradstats, tempfile, pytest
        >>> try:
        ...     gradstats.open_run(tempfile.mkdtemp())
        ... except ValueError as e:
        ...     print("not a run")
        not a run
    """
    return Run(path)
