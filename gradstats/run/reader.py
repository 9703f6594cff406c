"""Reading a run: its commit records, the committed steps, and :class:`Run` (statistics, samples, tables,
verification), :func:`open_run` and :func:`as_run`."""
from __future__ import annotations

import json
import logging
import math
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np
import pandas as pd

from gradstats.run.format import (
    _PART,
    FORMAT_VERSION,
    KEY_COLUMNS,
    RunCorruptError,
    _parse_sample_key,
    _sha256,
    sample_key,
)
from gradstats.stats import STATISTICS, merge_stats

if TYPE_CHECKING:
    import pyarrow.dataset as pads
    import torch

log = logging.getLogger(__name__)

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
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"open_run() needs the path of a run directory (a str or pathlib.Path, the one "
                             f"gradstats.trace(model, path) wrote), got {type(path).__name__}")
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
        self._sample_index: pd.DataFrame | None = None
        self._sample_rows: dict[tuple[str, str, int], list[tuple[int, int, str]]] | None = None
        self._tables: dict[str, pd.DataFrame] = {}
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
            cols = [*KEY_COLUMNS, *(s.name for s in STATISTICS)]
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
        if name not in self._tables:       # read once per run (refresh() reads again); callers get a copy
            frames = [t for c in self._commits for t in self._read_parquet(c, f"{name}/", on_error)]
            df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
            if not any(k.startswith(f"{name}/") for k in self._damaged):
                self._tables[name] = df       # (a table with damaged parts is read again: it warns again)
            return df.copy()
        return self._tables[name].copy()

    # -- samples
    def sample_index(self) -> pd.DataFrame:
        """Which raw samples exist: step, rank, layer, kind, call, n_samples, n_total, file."""
        if self._sample_index is None:
            self._sample_index = self._read_sample_index()
        return self._sample_index.copy()

    def _read_sample_index(self) -> pd.DataFrame:
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
        return torch_cat_flat(self._sample_parts(layer, step, kind=kind, call=call, rank=rank))

    def sample_matrix(self, layer: str, step: int, *, kind: str = "grad", call: int = 0,
                      rank: int | None = None) -> torch.Tensor:
        """The stored sample of one call as recorded: for a gradient, whole groups of tokens of the
        channels-last matrix ``(tokens, channels)`` that both gradient GEMMs read
        (:func:`gradstats.ops.layout.gemm_matrix`), so that block-scaled formats can be replayed on it
        block for block (runs recorded before samples kept their layout give 1-D values). The ranks'
        samples are stacked along the tokens.

        Example:
            >>> import gradstats, tempfile, torch
            >>> m = torch.nn.Conv2d(1, 8, 3)
            >>> with gradstats.trace(m, tempfile.mkdtemp(), sample_every=1) as t:
            ...     m(torch.randn(2, 1, 6, 6)).sum().backward(); t.step()
            >>> gradstats.open_run(t.path).sample_matrix("(root)", 0).shape    # 2 x 4 x 4 tokens, 8 channels
            torch.Size([32, 8])
        """
        import torch

        parts = self._sample_parts(layer, step, kind=kind, call=call, rank=rank)
        if len({tuple(p.shape[1:]) for p in parts}) > 1:
            raise ValueError(f"the samples of layer {layer!r} at step {step} differ in shape between ranks: "
                             "read them one rank at a time (rank=...)")
        return torch.cat(parts).to(torch.float32)

    def _sample_parts(self, layer: str, step: int, *, kind: str = "grad", call: int | None = 0,
                      rank: int | None = None) -> list:
        """The stored parts (one per rank and call) of :meth:`samples`."""
        from safetensors import safe_open

        if call is not None and (isinstance(call, bool) or not isinstance(call, int) or call < 0):
            raise ValueError(f"call must be a call number >= 0 or None (all calls), got {call!r}")
        if self._sample_index is None:
            self._sample_index = self._read_sample_index()
        if self._sample_rows is None:
            by: dict[tuple[str, str, int], list[tuple[int, int, str]]] = {}
            for r in self._sample_index.itertuples():
                by.setdefault((r.layer, r.kind, int(r.step)), []).append((int(r.rank), int(r.call), r.file))
            self._sample_rows = by
        sel = [t for t in self._sample_rows.get((layer, kind, int(step)), []) if call is None or t[1] == call]
        if rank is not None:
            sel = [t for t in sel if t[0] == rank]
        elif kind in REPLICA_KINDS and sel and layer not in self.sharded_layers:
            sel = [t for t in sel if t[0] == min(u[0] for u in sel)]
        if not sel:
            idx = self.sample_index()
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
        for rk, cl, rel in sorted(sel):
            p = self._check(rel, by_file[(rk, rel)])
            with safe_open(str(p), framework="pt") as f:
                parts.append(f.get_tensor(sample_key(int(step), layer, kind, cl)))
        return parts

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
        # the rows of each layer and step (in table order), turned into records in one pass: a
        # DataFrame per group and step costs ~100x more (``gradstats info`` spent its time there)
        groups: dict[str, dict[Any, list[dict[str, Any]]]] = {}
        for rec in df.to_dict("records"):
            groups.setdefault(rec["layer"], {}).setdefault(rec["step"], []).append(rec)
        rows = []
        for layer in self.layers:
            by_step = groups.get(layer, {})
            per_step = []
            for step in sorted(by_step):
                m = merge_stats(by_step[step])
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


def torch_cat_flat(parts: list) -> "torch.Tensor":
    """The samples' parts as one float32 1-D tensor (each part flattened in its stored order)."""
    import torch

    return torch.cat([p.reshape(-1) for p in parts]).to(torch.float32)
