"""The statistics of a tensor, each declared once: its name, its kind (how it is stored), how it
is computed from a tensor and how two rows merge. Everything else follows from :data:`STATISTICS`:
the layout of a statistics vector (:data:`LAYOUT`, :data:`VECTOR_LEN`), :func:`gradstats.stats.merge_stats`,
the conversion of a vector into a row, the Parquet columns of a run's statistics table
(:mod:`gradstats.run.writer`) and the scalar offsets that the C kernel (``ops/native/stats.c``,
its ``GS_F_*`` defines) writes to, which a test checks against this declaration.

Adding a statistic: one :class:`Statistic` in :data:`STATISTICS` with its ``compute`` (a function of
the reference pass, :class:`gradstats.stats.reference.Pass`) and, if the one-pass C sweep must produce
it, the C kernel's part; then its tests.

Example:
    >>> [s.name for s in STATISTICS][:3]
    ['n', 'n_zero', 'n_nonfinite']
    >>> LAYOUT["hist"], VECTOR_LEN
    (slice(10, 287, None), 351)
    >>> MERGES["min"]([2.0, float("nan"), 1.0])
    1.0
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch

#: lowest binade of float32: the smallest subnormal is 2**-149
HIST_MIN_EXP = -149
#: highest binade of float32: the largest finite value is just below 2**128
HIST_MAX_EXP = 127
#: number of histogram bins
HIST_BINS = HIST_MAX_EXP - HIST_MIN_EXP + 1
#: how many of the largest magnitudes ``top_abs`` keeps
TOP_K = 64


def _nan_extreme(pick: Callable[[list[float]], float]) -> Callable[[Sequence[Any]], float]:
    def merge(values: Sequence[Any]) -> float:
        vals = [float(v) for v in values if not math.isnan(float(v))]
        return pick(vals) if vals else math.nan
    return merge


def merge_top(tops: Sequence[Any], k: int = TOP_K) -> np.ndarray:
    """The ``k`` largest of several ``top_abs`` arrays (NaN padding ignored), descending and
    padded with NaN: the top magnitudes of the union of the pieces, exactly.

    Example:
        >>> merge_top([np.array([4.0, 1.0, np.nan]), np.array([3.0, 2.0, np.nan])], k=3).tolist()
        [4.0, 3.0, 2.0]
    """
    vals = np.concatenate([np.asarray(t, dtype=np.float32).reshape(-1) for t in tops])
    vals = np.sort(vals[np.isfinite(vals)])[::-1][:k]
    out = np.full(k, np.nan, dtype=np.float32)
    out[: vals.size] = vals
    return out


#: how the values of one statistic in several rows combine into the value of their union: exact
#: integer addition (``count``), correctly rounded float addition (``sum``), the extremes with NaN
#: (no entry) ignored (``min``, ``max``), element-wise count addition (``hist``), the largest
#: ``TOP_K`` (``top``)
MERGES: dict[str, Callable[[Sequence[Any]], Any]] = {
    "count": lambda values: int(sum(int(v) for v in values)),
    "sum": lambda values: float(math.fsum(float(v) for v in values)),
    "min": _nan_extreme(min),
    "max": _nan_extreme(max),
    "hist": lambda values: np.sum([np.asarray(v, dtype=np.int64) for v in values], axis=0),
    "top": lambda values: merge_top(values),
}

#: the numpy dtype a row (and a run's column) holds for each kind of merge
_DTYPES = {"count": "int64", "sum": "float64", "min": "float64", "max": "float64", "hist": "int64",
           "top": "float32"}


@dataclass(frozen=True)
class Statistic:
    """One statistic of a tensor.

    Args:
        name: its key in a row and its column in a run.
        merge: how rows combine, a key of :data:`MERGES` (it also fixes the stored dtype).
        compute: the statistic of the tensor behind a reference pass, as a float64-able tensor of
            ``length`` values (``length == 1``: a 0-d or 1-element tensor).
        empty: its value for a tensor without entries.
        length: 1 for a scalar, else the length of the array.
        optional: rows of runs written before it existed go without it (and so do rows merged with them).
        doc: what it is.

    Example:
        >>> STATISTICS[0].dtype, STATISTICS[0].scalar
        ('int64', True)
    """

    name: str
    merge: str
    compute: Callable[[Any], "torch.Tensor"]    # of a reference pass (gradstats.stats.reference.Pass)
    empty: float = 0.0
    length: int = 1
    optional: bool = False
    doc: str = ""

    def __post_init__(self) -> None:
        if self.merge not in MERGES:
            raise ValueError(f"statistic {self.name!r}: merge must be one of {sorted(MERGES)}, got {self.merge!r}")
        if self.length < 1:
            raise ValueError(f"statistic {self.name!r}: length must be at least 1, got {self.length}")

    @property
    def dtype(self) -> str:
        """The numpy dtype of its values in a row and in a run's column."""
        return _DTYPES[self.merge]

    @property
    def scalar(self) -> bool:
        return self.length == 1

    def from_vector(self, values: np.ndarray) -> Any:
        """Its value in a row, from its ``length`` float64 values of a statistics vector."""
        if self.scalar:
            return int(values[0]) if self.dtype == "int64" else float(values[0])
        return np.asarray(values).astype(self.dtype)

    def present(self, row: Mapping[str, Any]) -> bool:
        """Whether ``row`` holds it (rows read from old runs may lack an optional one, or hold NaN)."""
        v = row.get(self.name) if hasattr(row, "get") else None
        return v is not None and not (isinstance(v, float) and math.isnan(v))


#: every statistic, in the order of a statistics vector and of a run's columns (the scalars
#: first, as the C kernel writes them)
STATISTICS: tuple[Statistic, ...] = (
    Statistic("n", "count", lambda p: p.n, doc="number of elements"),
    Statistic("n_zero", "count", lambda p: p.n_zero, doc="exact zeros (a point mass, never put into the logs)"),
    Statistic("n_nonfinite", "count", lambda p: p.n_nonfinite,
              doc="inf and NaN (counted, excluded from everything else)"),
    Statistic("sum", "sum", lambda p: p.xs.sum(), doc="sum of g over finite entries"),
    Statistic("sum_abs", "sum", lambda p: p.as_.sum(), doc="sum of |g| over finite entries"),
    Statistic("sum_sq", "sum", lambda p: p.xs.square().sum(), doc="sum of g**2 over finite entries"),
    Statistic("sum_ln_abs", "sum", lambda p: p.log_sums[0], doc="sum of ln|g| over non-zero finite entries"),
    Statistic("sum_ln_abs_sq", "sum", lambda p: p.log_sums[1],
              doc="sum of ln(|g|)**2 over non-zero finite entries"),
    Statistic("min_abs", "min", lambda p: p.min_abs, empty=math.nan,
              doc="smallest non-zero finite |g| (NaN when there is none)"),
    Statistic("max_abs", "max", lambda p: p.max_abs, empty=math.nan,
              doc="largest non-zero finite |g| (NaN when there is none)"),
    Statistic("hist", "hist", lambda p: p.hist, length=HIST_BINS,
              doc="counts of floor(log2|g|) over non-zero finite entries, one bin per float32 binade "
                  "from HIST_MIN_EXP"),
    Statistic("top_abs", "top", lambda p: p.top, empty=math.nan, length=TOP_K, optional=True,
              doc="the TOP_K largest non-zero finite |g|, descending, NaN where the tensor has fewer"),
)

#: statistics by name
BY_NAME: dict[str, Statistic] = {s.name: s for s in STATISTICS}


def _layout(stats: Sequence[Statistic]) -> dict[str, slice]:
    out, at = {}, 0
    for s in stats:
        out[s.name] = slice(at, at + s.length)
        at += s.length
    return out


#: where each statistic lies in a statistics vector
LAYOUT: dict[str, slice] = _layout(STATISTICS)
#: length of a statistics vector (:func:`gradstats.stats.tensor_stats_vector`)
VECTOR_LEN = sum(s.length for s in STATISTICS)
#: every scalar statistic, in vector order (the C kernel writes them at these offsets)
SCALAR_FIELDS = tuple(s.name for s in STATISTICS if s.scalar)
#: integer-valued statistics
COUNT_FIELDS = tuple(s.name for s in STATISTICS if s.merge == "count")
#: float-valued sums (mergeable by addition)
SUM_FIELDS = tuple(s.name for s in STATISTICS if s.merge == "sum")

if SCALAR_FIELDS != tuple(s.name for s in STATISTICS[: len(SCALAR_FIELDS)]):
    raise ValueError("the scalar statistics must come first in STATISTICS (the C kernel writes them as a block)")
