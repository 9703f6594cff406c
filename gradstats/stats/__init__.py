"""Streaming statistics of one gradient tensor: the one home of the sufficient statistics.

For a tensor ``g`` the statistics are (all in float32 arithmetic on ``g``'s own device,
whatever its dtype):

========================  =================================================================
``n``                     number of elements
``n_zero``                exact zeros (a point mass, never put into the logs)
``n_nonfinite``           inf and NaN (counted, excluded from everything else)
``sum``                   sum of ``g`` over finite entries
``sum_abs``               sum of ``|g|`` over finite entries
``sum_sq``                sum of ``g**2`` over finite entries
``sum_ln_abs``            sum of ``ln|g|`` over non-zero finite entries
``sum_ln_abs_sq``         sum of ``ln(|g|)**2`` over non-zero finite entries
``min_abs``, ``max_abs``  smallest and largest non-zero finite ``|g|`` (NaN when there is none)
``hist``                  counts of ``floor(log2|g|)`` over non-zero finite entries, one bin per
                          float32 binade from ``HIST_MIN_EXP`` (-149, subnormals) to
                          ``HIST_MAX_EXP`` (127): ``hist[i]`` counts values in
                          ``[2**(HIST_MIN_EXP + i), 2**(HIST_MIN_EXP + i + 1))``
``top_abs``               the ``TOP_K`` (64) largest non-zero finite ``|g|``, descending, NaN where
                          the tensor has fewer (``top_abs[0] == max_abs``): the few entries that
                          decide saturation and the error of a low-precision format
========================  =================================================================

On the CPU a fused C kernel (:mod:`gradstats.ops.native`, ``stats.c``: hand-vectorised for AVX-512,
portable C elsewhere; timings in ``bench/RESULTS.md``) computes them when a C compiler is
available; elsewhere, and as the reference, a sequence of torch reductions. The counts,
extremes, binade counts and top magnitudes are exact on every path; the sums agree to float32
rounding.

The sums are sufficient for the lognormal MLE (``mu = sum_ln_abs / n_nz``) and mergeable:
statistics of several batches, calls, steps or ranks combine with :func:`merge_stats`.

Example:
    >>> import torch
    >>> from gradstats.stats import tensor_stats
    >>> s = tensor_stats(torch.tensor([0.0, 1.0, -2.0, float("inf")]))
    >>> s["n"], s["n_zero"], s["n_nonfinite"], s["sum_abs"], s["max_abs"]
    (4, 1, 1, 3.0, 2.0)
    >>> int(s["hist"][0 - HIST_MIN_EXP]), int(s["hist"][1 - HIST_MIN_EXP])  # binades of 1.0 and 2.0
    (1, 1)
"""
from __future__ import annotations

import ctypes
import functools
import math
import sys
from typing import TYPE_CHECKING, Any, Iterable, Mapping, TypedDict

import numpy as np

if TYPE_CHECKING:
    import torch

#: lowest binade of float32: the smallest subnormal is 2**-149
HIST_MIN_EXP = -149
#: highest binade of float32: the largest finite value is just below 2**128
HIST_MAX_EXP = 127
#: number of histogram bins
HIST_BINS = HIST_MAX_EXP - HIST_MIN_EXP + 1

#: integer-valued statistics
COUNT_FIELDS = ("n", "n_zero", "n_nonfinite")
#: float-valued sums (mergeable by addition)
SUM_FIELDS = ("sum", "sum_abs", "sum_sq", "sum_ln_abs", "sum_ln_abs_sq")
#: every scalar statistic, in schema order (``hist`` and ``top_abs`` follow them)
SCALAR_FIELDS = COUNT_FIELDS + SUM_FIELDS + ("min_abs", "max_abs")
#: how many of the largest magnitudes ``top_abs`` keeps
TOP_K = 64
#: length of a statistics vector (:func:`tensor_stats_vector`)
VECTOR_LEN = len(SCALAR_FIELDS) + HIST_BINS + TOP_K



class StatsRow(TypedDict, total=False):
    """The statistics row of one tensor (or of several, merged with :func:`merge_stats`): what
    :func:`tensor_stats` returns, what a run stores per (step, layer, kind, call, rank) and what
    every analysis reads (thresholds, format choice, what-if, fits from statistics). A plain ``dict``
    at run time; rows read from a run carry their key columns too. ``top_abs`` is absent from rows
    of runs written before it existed."""

    n: int
    n_zero: int
    n_nonfinite: int
    sum: float
    sum_abs: float
    sum_sq: float
    sum_ln_abs: float
    sum_ln_abs_sq: float
    min_abs: float
    max_abs: float
    hist: np.ndarray
    top_abs: np.ndarray


_SUBNORMAL_FIELD = 0
_NONFINITE_FIELD = 255
_TINY = 2.0 ** -149  # smallest float32 subnormal


def _histogram(a: torch.Tensor, field: torch.Tensor, counts: torch.Tensor,
               n_sub_present: bool) -> torch.Tensor:
    """Binade histogram of the non-zero finite entries of ``a = |x|`` from the counts of the
    biased exponent ``field``; subnormals (field 0) are binned by a second, masked pass."""
    import torch

    hist = counts.new_zeros(HIST_BINS)
    # normal numbers: biased exponent field f in 1..254 is binade f - 127
    hist[1 - 127 - HIST_MIN_EXP: 255 - 127 - HIST_MIN_EXP] = counts[1:255]
    if n_sub_present:
        sub = (field == _SUBNORMAL_FIELD) & (a > 0)
        _, e = torch.frexp(torch.where(sub, a, 1.0))
        idx = torch.where(sub, e - 1 - HIST_MIN_EXP, HIST_BINS)
        hist += torch.bincount(idx.reshape(-1), minlength=HIST_BINS + 1)[:HIST_BINS]
    return hist


def _reduce(x: torch.Tensor) -> torch.Tensor:
    """All statistics of a flat float32 tensor as one float64 vector (on ``x``'s device).

    Layout: ``SCALAR_FIELDS``, ``HIST_BINS`` counts, then ``TOP_K`` top magnitudes. Sums are computed in float32 and
    only the results are widened; counts are exact. On the CPU, tensors without inf/NaN take
    a path of plain arithmetic passes (boolean masks and ``log(0)`` are slow there).
    """
    import torch

    n = x.numel()
    f64 = torch.float64
    if n == 0:
        scalars = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, math.nan, math.nan], dtype=f64)
        return torch.cat([scalars, torch.zeros(HIST_BINS, dtype=f64),
                          torch.full((TOP_K,), math.nan, dtype=f64)]).to(x.device)
    a = x.abs()
    bits = a.view(torch.int32)
    # the biased exponent field of |x|: 0 for zeros and subnormals, 255 for inf/NaN
    field = bits >> 23
    counts = torch.bincount(field, minlength=256)
    on_cpu = x.device.type == "cpu"
    if on_cpu and int(counts[_NONFINITE_FIELD]) == 0:
        s = torch.sign(a)  # 0 for zeros, 1 otherwise
        acc = f64 if n > 2 ** 24 else torch.float32  # integer-exact count
        n_nz = s.sum(dtype=acc).to(f64)
        n_zero = n - n_nz
        n_nonfinite = torch.zeros((), dtype=f64)
        lg = torch.log(a.clamp_min(_TINY)).mul_(s)
        xs, as_ = x, a
        # smallest positive |x|: non-negative floats order as their bit patterns; zeros
        # (bits 0) become the largest int32 through the wrap of bits - 1
        m = ((bits - 1) & 0x7FFFFFFF).min() + 1
        amin = m.reshape(1).view(torch.float32)[0]
        has_sub = int(counts[_SUBNORMAL_FIELD]) > int(n_zero)
    else:
        finite = field != _NONFINITE_FIELD
        nz = finite & (a > 0)
        n_nonfinite = counts[_NONFINITE_FIELD].to(f64)
        n_zero = (a == 0).sum().to(f64)
        n_nz = n - n_zero - n_nonfinite
        xs = torch.where(finite, x, 0.0)
        as_ = torch.where(finite, a, 0.0)
        lg = torch.log(torch.where(nz, a, 1.0))
        amin = torch.where(nz, a, math.inf).min()
        has_sub = (not on_cpu) or int(counts[_SUBNORMAL_FIELD]) > int(n_zero)
    hist = _histogram(a, field, counts, has_sub)
    # sums of squares through torch's own (cascade) reduction, not ``torch.dot``: BLAS dot
    # products accumulate per SIMD lane, with an error that grows with n and differs by CPU
    sum_lg = lg.sum().to(f64)
    sum_lg_sq = lg.square_().sum().to(f64)   # ``lg`` is ours: square it in place
    sum_sq = xs.square().sum().to(f64)
    nan = torch.tensor(math.nan, dtype=f64, device=x.device)
    has_nz = n_nz > 0
    scalars = torch.stack([
        torch.tensor(float(n), dtype=f64, device=x.device),
        torch.as_tensor(n_zero, dtype=f64, device=x.device),
        n_nonfinite.to(device=x.device),
        xs.sum().to(f64),
        as_.sum().to(f64),
        sum_sq,
        sum_lg,
        sum_lg_sq,
        torch.where(has_nz, amin.to(f64), nan),
        torch.where(has_nz, as_.max().to(f64), nan),
    ])
    top = torch.full((TOP_K,), math.nan, dtype=f64, device=x.device)
    vals = as_.topk(min(TOP_K, n)).values.to(f64)   # zeros (and non-finite, set to 0) sort last
    top[: vals.numel()] = torch.where(vals > 0, vals, nan)
    return torch.cat([scalars, hist.to(f64), top])


@functools.lru_cache(maxsize=2)
def _native_kernel(portable: bool = False):
    """``gs_stats_f32`` of the C kernel (None without a compiler); ``portable``: the build
    without its AVX-512 block loop (what CPUs without AVX-512 run)."""
    from gradstats.ops.native import function

    return function("stats", "gs_stats_f32",
                    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                     ctypes.c_int, ctypes.c_int, ctypes.c_void_p], defines=("GS_PORTABLE",) if portable else ())


def has_native_kernel() -> bool:
    """Whether the fused C kernel is available here (a C compiler was found and it compiled)."""
    return _native_kernel() is not None


def kernel_applies(x: torch.Tensor) -> bool:
    """Whether :func:`write_stats` can take ``x`` as it is: a non-empty contiguous float32 CPU
    tensor, and the C kernel available. (What a tracer checks before claiming a row.)"""
    import torch

    return (x.is_cpu and x.dtype is torch.float32 and x.is_contiguous() and x.numel() > 0
            and _native_kernel() is not None)


def write_stats(x: torch.Tensor, address: int, *, full: bool = True, blocks: np.ndarray | None = None) -> None:
    """Write the statistics vector of ``x`` (see :func:`tensor_stats_vector`) at ``address``:
    ``VECTOR_LEN`` float64 values that the caller owns, such as a row of :class:`VectorRows`.
    The C kernel writes every field in place: no allocation, no tensor operation, the least a
    capture in a training step can cost. ``x`` must satisfy :func:`kernel_applies`.
    ``full=False``: the scalar fields only (the rest is left as it was). ``blocks``: a
    C-contiguous int64 array of shape ``(2, 1 + RANGE_BINS)`` that the same pass fills with the
    per-block statistics of blocks of 16 and 32 (:func:`gradstats.stats.blocks.kernel_block_stats`
    reads them; overwritten).

    Example:
        >>> import torch
        >>> rows = VectorRows()
        >>> x = torch.tensor([0.0, 1.0, -2.0])
        >>> if kernel_applies(x):
        ...     write_stats(x, rows.claim())
        ...     assert rows.take()[0, :3].tolist() == [3.0, 1.0, 0.0]
    """
    import torch

    if not kernel_applies(x):
        raise ValueError("write_stats needs a non-empty contiguous float32 CPU tensor and the C "
                         "kernel (see kernel_applies); use tensor_stats_vector for anything else")
    bh = None
    if blocks is not None:
        from gradstats.stats.blocks import BLOCK_SIZES, RANGE_BINS

        shape = (len(BLOCK_SIZES), 1 + RANGE_BINS)
        if not (isinstance(blocks, np.ndarray) and blocks.dtype == np.int64 and blocks.shape == shape
                and blocks.flags.c_contiguous and blocks.flags.writeable):
            raise ValueError(f"blocks must be a writeable C-contiguous int64 numpy array of shape {shape} "
                             f"(blocks of {BLOCK_SIZES}: zero blocks, then {RANGE_BINS} range bins)")
        blocks[...] = 0                  # the kernel adds to it
        bh = blocks.ctypes.data
    k = len(SCALAR_FIELDS)
    if full:
        _native_kernel()(x.data_ptr(), x.numel(), address, address + 8 * k, address + 8 * (k + HIST_BINS),
                         TOP_K, torch.get_num_threads(), bh)
    else:
        _native_kernel()(x.data_ptr(), x.numel(), address, None, None, 0, torch.get_num_threads(), bh)


class VectorRows:
    """Statistics vectors to be written in place (:func:`write_stats`), gathered into one
    array: rows of ``VECTOR_LEN`` float64 in pages that never move once made, so a row claimed
    stays valid while later rows are claimed.

    Example:
        >>> rows = VectorRows()
        >>> address = rows.claim()           # the first row's address
        >>> len(rows), rows.take().shape, len(rows)
        (1, (1, 351), 0)
    """

    PAGE = 64

    def __init__(self) -> None:
        self._pages: list[np.ndarray] = []
        self._addresses: list[int] = []
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def claim(self) -> int:
        """The address of a new row (its contents are undefined until written)."""
        page, i = divmod(self._n, self.PAGE)
        if page == len(self._pages):
            self._pages.append(np.empty((self.PAGE, VECTOR_LEN)))
            self._addresses.append(self._pages[-1].ctypes.data)
        self._n += 1
        return self._addresses[page] + i * VECTOR_LEN * 8

    def take(self) -> np.ndarray:
        """The rows claimed so far as one ``(n, VECTOR_LEN)`` array; the store is empty after."""
        n, pages = self._n, self._pages
        self._pages, self._addresses, self._n = [], [], 0
        if not pages:
            return np.empty((0, VECTOR_LEN))
        return np.concatenate(pages)[:n] if len(pages) > 1 else pages[0][:n]


def tensor_stats_vector(g: torch.Tensor, *, full: bool = True) -> torch.Tensor:
    """Statistics of ``g`` as one float64 vector on ``g``'s device (no host synchronisation
    on CUDA). Layout: ``SCALAR_FIELDS``, the ``HIST_BINS`` histogram counts, then the ``TOP_K``
    largest magnitudes. ``full=False``: the scalar statistics only (the histogram and top parts
    are NaN), which the CPU kernel computes faster (what a refresh of the lognormal and bell
    models needs: :func:`gradstats.apply`).

    Use :func:`vector_to_stats` to turn it into a dict. The tracer keeps the vectors of device
    tensors on the device and converts them in one batch when it flushes; those of CPU tensors
    the kernel writes in place into rows (:func:`write_stats`, :class:`VectorRows`).

    Example:
        >>> import torch
        >>> v = tensor_stats_vector(torch.ones(3))
        >>> v.shape[0] == VECTOR_LEN == len(SCALAR_FIELDS) + HIST_BINS + TOP_K, float(v[0])
        (True, 3.0)
        >>> bool(tensor_stats_vector(torch.ones(3), full=False)[len(SCALAR_FIELDS):].isnan().all())
        True
    """
    import torch

    x = g.detach()
    if x.dtype != torch.float32:
        x = x.float()
    x = x.reshape(-1)
    x = x.contiguous() if x.is_cpu else x
    if kernel_applies(x):
        out = torch.empty(VECTOR_LEN, dtype=torch.float64)
        write_stats(x, out.data_ptr(), full=full)
        if not full:
            out[len(SCALAR_FIELDS):] = math.nan
        return out
    v = _reduce(x)
    if not full:
        v[len(SCALAR_FIELDS):] = math.nan
    return v


def vector_to_stats(v: torch.Tensor | np.ndarray) -> StatsRow:
    """Turn a vector from :func:`tensor_stats_vector` into a :class:`StatsRow` (on the host)."""
    torch = sys.modules.get("torch")             # a tensor exists only once torch is imported
    arr = v.detach().cpu().numpy() if torch is not None and isinstance(v, torch.Tensor) else np.asarray(v)
    k = len(SCALAR_FIELDS)
    out: dict[str, Any] = {}
    for i, name in enumerate(SCALAR_FIELDS):
        out[name] = int(arr[i]) if name in COUNT_FIELDS else float(arr[i])
    out["hist"] = arr[k:k + HIST_BINS].astype(np.int64)
    out["top_abs"] = arr[k + HIST_BINS:k + HIST_BINS + TOP_K].astype(np.float32)
    return StatsRow(**out)  # type: ignore[typeddict-item]


def tensor_stats(g: torch.Tensor) -> StatsRow:
    """Statistics of one tensor as a :class:`StatsRow` (see the module docstring for the fields).

    Example:
        >>> import torch
        >>> s = tensor_stats(torch.tensor([0.5, -0.5, 0.0]))
        >>> s["n_zero"], round(s["sum_ln_abs"], 6)
        (1, -1.386294)
    """
    import torch

    if not isinstance(g, torch.Tensor):
        raise ValueError(f"tensor_stats expects a torch.Tensor, got {type(g).__name__}")
    if not (g.is_floating_point()):
        raise ValueError(f"tensor_stats expects a floating-point tensor, got dtype {g.dtype}")
    return vector_to_stats(tensor_stats_vector(g))


def n_nonzero(stats: StatsRow | Mapping[str, Any]) -> int:
    """Number of non-zero finite entries (the support of the lognormal fit)."""
    return int(stats["n"]) - int(stats["n_zero"]) - int(stats["n_nonfinite"])


def merge_stats(rows: Iterable[StatsRow | Mapping[str, Any]]) -> StatsRow:
    """Combine statistics of disjoint pieces of data (batches, calls, ranks) exactly:
    counts and sums add, minima and maxima combine, histograms add, and the largest magnitudes
    are the ``TOP_K`` largest of all rows' (rows without ``top_abs``, from runs written before
    it existed, make the merged row go without it too).

    Example:
        >>> import torch
        >>> a, b = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 4.0])
        >>> m = merge_stats([tensor_stats(a), tensor_stats(b)])
        >>> m["n"], m["n_zero"], m["sum_abs"], m["max_abs"]
        (4, 1, 7.0, 4.0)
    """
    rows = list(rows)
    if not rows:
        raise ValueError("merge_stats needs at least one statistics row")
    out: dict[str, Any] = {}
    for f in COUNT_FIELDS:
        out[f] = int(sum(int(r[f]) for r in rows))
    for f in SUM_FIELDS:
        out[f] = float(math.fsum(float(r[f]) for r in rows))
    mins = [float(r["min_abs"]) for r in rows if not math.isnan(float(r["min_abs"]))]
    maxs = [float(r["max_abs"]) for r in rows if not math.isnan(float(r["max_abs"]))]
    out["min_abs"] = min(mins) if mins else math.nan
    out["max_abs"] = max(maxs) if maxs else math.nan
    out["hist"] = np.sum([np.asarray(r["hist"], dtype=np.int64) for r in rows], axis=0)
    if all(_has_top(r) for r in rows):
        out["top_abs"] = merge_top([r["top_abs"] for r in rows])
    return StatsRow(**out)  # type: ignore[typeddict-item]


def _has_top(row: Mapping[str, Any]) -> bool:
    v = row.get("top_abs") if hasattr(row, "get") else None
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def merge_top(tops: Iterable[Any], k: int = TOP_K) -> np.ndarray:
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


def lognormal_moments(stats: StatsRow | Mapping[str, Any]) -> tuple[float, float]:
    """``(mu, sigma)`` of ``ln|g|`` (the MLE) from the sums; NaN when there are no non-zero
    finite entries.

    Example:
        >>> import torch
        >>> lognormal_moments(tensor_stats(torch.tensor([1.0, math.e ** 2])))
        (1.0, 1.0)
    """
    m = n_nonzero(stats)
    if m <= 0:
        return math.nan, math.nan
    mu = float(stats["sum_ln_abs"]) / m
    var = max(float(stats["sum_ln_abs_sq"]) / m - mu * mu, 0.0)
    return mu, math.sqrt(var)


def split_top(counts: Any, top: Any, *, min_exp: int = HIST_MIN_EXP) -> tuple[np.ndarray, np.ndarray]:
    """Take a row's largest magnitudes ``top`` (positive, finite) out of its binade counts: returns
    ``(rest, top_sorted)``, the counts of the other entries and ``top`` ascending. The one reading of
    ``hist`` with ``top_abs`` that the histogram rule (:class:`gradstats.pruning.LogHistogram`) and the
    format analysis (:class:`gradstats.fpanalysis.HistogramLaw`) share. ``ValueError`` when ``top`` is
    not the largest entries of the tensor the counts describe.

    Example:
        >>> import torch
        >>> row = tensor_stats(torch.tensor([0.5, 1.0, 1.5, 3.0]))
        >>> rest, top = split_top(row["hist"], [3.0, 1.5])
        >>> int(rest.sum()), top.tolist()
        (2, [1.5, 3.0])
    """
    h = np.asarray(counts, dtype=np.float64).reshape(-1).copy()
    t = np.sort(np.asarray(top, dtype=np.float64).reshape(-1))
    if t.size == 0:
        return h, t
    _, ex = np.frexp(t)                                  # exact floor(log2 t) + 1, even at powers of two
    j = ex.astype(np.int64) - 1 - min_exp
    if j.min() < 0 or j.max() >= h.size:
        raise ValueError(f"top values {t[-3:].tolist()} lie outside the histogram's binades "
                         f"[2^{min_exp}, 2^{min_exp + h.size}): pass the largest |g| of the same tensor")
    np.subtract.at(h, j, 1.0)
    if (h < 0).any() or h[j.min() + 1:].any():
        raise ValueError(f"top ({t.size} values) is not the {t.size} largest |g| of the tensor the histogram "
                         "counts (more values in a binade than it holds, or a larger value missing)")
    return h, t
