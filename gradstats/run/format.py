"""The run's on-disk format: its version, key columns, checksums, atomic writes and sample keys
(``docs/run-format.md``); what the writer and the reader share."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradstats.stats import HIST_MIN_EXP, TOP_K

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


#: version of the on-disk format written by this module
FORMAT_VERSION = 1


KEY_COLUMNS = ("step", "rank", "layer", "kind", "call")


_PART = re.compile(r"^r(\d+)-(\d+)\.json$")


class RunCorruptError(ValueError):
    """A file of a run is missing, truncated or does not match its recorded checksum."""


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
