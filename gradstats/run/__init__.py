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
    ([0, 1], True)"""
from __future__ import annotations

from gradstats.run.format import (
                                  FORMAT_VERSION,
                                  KEY_COLUMNS,
                                  RunCorruptError,
                                  atomic_write_bytes,
                                  atomic_write_json,
                                  file_metadata,
                                  sample_key,
)
from gradstats.run.reader import (
                                  REPLICA_KINDS,
                                  Run,
                                  RunDamageWarning,
                                  as_run,
                                  last_committed_step,
                                  open_run,
                                  read_commits,
)
from gradstats.run.writer import Flush, RunWriter, rows_to_table, vectors_to_table

__all__ = ["Run", "open_run", "as_run", "RunCorruptError", "RunDamageWarning", "RunWriter", "Flush", "FORMAT_VERSION",
           "KEY_COLUMNS", "REPLICA_KINDS", "read_commits", "last_committed_step", "rows_to_table", "vectors_to_table",
           "file_metadata", "sample_key", "atomic_write_bytes", "atomic_write_json"]
