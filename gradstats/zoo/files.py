"""Where the built-in data lives and how its files are read: the committed ``data/`` directory
(:func:`data_dir`) and IDX files (the MNIST format, :func:`read_idx`). The datasets are in
:mod:`gradstats.zoo.data` (images, and the entry point :func:`~gradstats.zoo.data.load_data`) and
:mod:`gradstats.zoo.text` (characters).

Example:
    >>> from gradstats.zoo.files import data_dir, read_idx
    >>> read_idx(data_dir() / "fashion-mnist" / "t10k-images-idx3-ubyte.gz").shape
    (1000, 28, 28)
"""
from __future__ import annotations

import functools
import gzip
import os
import struct
from pathlib import Path

import numpy as np

DATA_ENV = "GRADSTATS_DATA"
"""Environment variable naming the directory that holds the committed data (``data/``)."""
FULL_SET = "full Debian set"
SUBSET = "committed subset"

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


# ----------------------------------------------------------------------------- locating data
def data_dir() -> Path | None:
    """The directory holding the committed data: ``$GRADSTATS_DATA``, else ``data/`` beside the
    package (a source checkout), else the copy a wheel installs inside the package
    (``gradstats/_data``).

    Returns ``None`` only when none exists (a build made without the data).

    Example:
        >>> (data_dir() / "fashion-mnist").is_dir()
        True
    """
    env = os.environ.get(DATA_ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"{DATA_ENV}={env!r} is not a directory")
        return path
    package = Path(__file__).resolve().parents[1]          # gradstats/
    for path in (package.parent / "data", package / "_data"):
        if path.is_dir() and (path / "fashion-mnist").is_dir():
            return path
    return None


def _find(directory: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (directory / name).is_file():
            return directory / name
    return None


# ----------------------------------------------------------------------------- IDX files
def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (the MNIST format), gzip-compressed or not, into a numpy array.

    Checks the magic number (two zero bytes, a type code, the number of dimensions)
    and that the payload size matches the header; raises ``ValueError`` naming the
    file otherwise.

    Example:
        >>> labels = read_idx(data_dir() / "fashion-mnist" / "t10k-labels-idx1-ubyte.gz")
        >>> labels.shape, labels.dtype
        ((1000,), dtype('uint8'))
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"IDX file not found: {path}")
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise ValueError(f"{path}: corrupt or truncated gzip data ({exc})") from None
    if len(raw) < 4:
        raise ValueError(f"{path}: too short to be an IDX file ({len(raw)} bytes)")
    zero, code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or code not in _IDX_DTYPES or ndim == 0:
        raise ValueError(
            f"{path}: bad IDX magic number 0x{raw[:4].hex()} (expected 0x0000 then a type code in "
            f"{sorted(_IDX_DTYPES)} and a dimension count, e.g. 0x00000803 for images)"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = np.dtype(_IDX_DTYPES[code])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(
            f"{path}: IDX payload is {len(raw) - header} bytes but the header {shape} of {dtype} "
            f"needs {expected} (truncated or corrupt file)"
        )
    return np.frombuffer(raw, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


@functools.lru_cache(maxsize=8)
def _read_idx_cached(path: str, mtime_ns: int, size: int) -> np.ndarray:
    arr = read_idx(path)
    arr.setflags(write=False)
    return arr


def _read(path: Path) -> np.ndarray:
    st = path.stat()
    return _read_idx_cached(str(path), st.st_mtime_ns, st.st_size)
