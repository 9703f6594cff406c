"""Per-block statistics of a tensor: how wide each block of ``B`` consecutive entries is, the
number that decides what block-scaled formats (OCP MX: 32 entries per E8M0 scale; NVFP4: 16 per
E4M3 scale) do to it.

For a block size ``B`` (entries in memory order, the last block padded with zeros) a tensor gives
``n_blocks``, ``n_zero_blocks`` (all entries zero) and ``range_hist``: over the other blocks, the
count of each *dynamic range* ``floor(log2 max|x|) - floor(log2 min|x|)`` over the block's
non-zero entries, in binades (``0..RANGE_BINS - 1``, the last bin holding everything wider).
``gradstats.trace(..., blocks=(16, 32))`` records them per captured gradient into the run's
``"blocks"`` table (opt-in). On the CPU the statistics kernel counts every block of 16 and of 32
in the same pass as the other statistics (:func:`kernel_block_stats`: exact, ``n_sampled ==
n_blocks``); elsewhere (a GPU, other block sizes) from a uniform random sample of 512 blocks
per tensor and orientation by default (``block_sample=``, drawn with replacement; None counts every block, at a
few passes over the tensor): the fractions it gives then carry a sampling error of at most 1.1
points (one standard error). Exponents are read from the float32 bit pattern: float32 subnormals
(and inf, NaN) count as zeros.

What a block-scaled format flushes follows from the range (:func:`flushed_blocks`): with the
block's largest entry at the top of the format, an entry ``r`` binades below it is flushed when
``r`` exceeds the format's span below its maximum; the histogram's integer binades bound the
fraction of blocks with a flushed entry from both sides.

Example:
    >>> import torch
    >>> s = block_stats(torch.tensor([1.0, 2.0 ** -12, 0.0, 0.0, 3.0, 3.0, 0.0, 0.0]), 4)
    >>> s["n_blocks"], s["n_sampled"], s["n_zero_blocks"], s["range_hist"][:3], s["range_hist"][12]
    (2, 2, 0, [1, 0, 0], 1)
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import numpy as np
import torch

from gradstats.formats import FPFormat
from gradstats.ops import layout as _layout
from gradstats.scheme import Scheme

__all__ = ["block_stats", "blocks_stats", "kernel_block_stats", "flushed_blocks", "oriented_block_stats", "flush_probability",
           "block_flush_probability", "flushed_entries", "RANGE_BINS", "BLOCK_SIZES", "BELOW_BINS", "ORIENTATIONS"]

#: bins of the dynamic-range histogram (binades 0..RANGE_BINS-1; the last one open)
RANGE_BINS = 64
#: the block sizes of the formats users target: NVFP4 16, OCP MX 32 (those the statistics kernel
#: counts in its own pass, in this order)
BLOCK_SIZES = (16, 32)


def kernel_block_stats(counts: np.ndarray, numel: int, block_sizes: Iterable[int] = BLOCK_SIZES) -> list[dict[str, Any]]:
    """The rows of :func:`blocks_stats` (every block counted) from the counts the statistics kernel
    wrote (:func:`gradstats.stats.write_stats` with ``blocks=``: per size in :data:`BLOCK_SIZES`, the
    blocks without a normal entry, then the :data:`RANGE_BINS` range counts), for ``block_sizes``
    (a subset of :data:`BLOCK_SIZES`).

    Example:
        >>> import torch
        >>> from gradstats.stats import kernel_applies, write_stats, VectorRows
        >>> x = torch.tensor([1.0, 2.0 ** -12, 0.0, 0.0] * 8 + [0.0] * 32)
        >>> counts = np.zeros((2, 1 + RANGE_BINS), np.int64)
        >>> rows = VectorRows()
        >>> if kernel_applies(x):
        ...     write_stats(x, rows.claim(), blocks=counts)
        ...     assert kernel_block_stats(counts, x.numel()) == blocks_stats(x, (16, 32))
    """
    out = []
    for b in block_sizes:
        if b not in BLOCK_SIZES:
            raise ValueError(f"the statistics kernel counts blocks of {BLOCK_SIZES} only, got {b!r}")
        c = counts[BLOCK_SIZES.index(b)]
        n = -(-int(numel) // b)
        out.append({"n_blocks": n, "n_sampled": n, "n_zero_blocks": int(c[0]),
                    "range_hist": [int(v) for v in c[1:]]})
    return out


def block_stats(x: torch.Tensor, block_size: int, *, sample: int | None = None,
                generator: torch.Generator | None = None) -> dict[str, Any]:
    """``n_blocks``, ``n_sampled``, ``n_zero_blocks`` and ``range_hist`` (a list of
    :data:`RANGE_BINS` counts) of ``x`` in blocks of ``block_size`` consecutive entries (see the
    module doc). ``sample``: count that many blocks drawn uniformly at random (with replacement)
    only, at a cost that does not grow with the tensor; None: every block. Example: see the module."""
    return blocks_stats(x, (block_size,), sample=sample, generator=generator)[0]


def blocks_stats(x: torch.Tensor, block_sizes: Iterable[int], *, sample: int | None = None,
                 generator: torch.Generator | None = None) -> list[dict[str, Any]]:
    """:func:`block_stats` for several block sizes at once: when every size divides the largest,
    one sample of the largest blocks serves them all (each smaller block of a sampled block is then a
    sampled block of its size).

    Example:
        >>> [s["n_blocks"] for s in blocks_stats(torch.ones(64), (16, 32))]
        [4, 2]
    """
    sizes = list(block_sizes)
    for b in sizes:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"block_size must be a positive int, got {b!r}")
    if sample is not None and (isinstance(sample, bool) or not isinstance(sample, int) or sample < 1):
        raise ValueError(f"sample must be a positive number of blocks or None, got {sample!r}")
    top = max(sizes)
    if any(top % b for b in sizes):                     # no common sample: one size at a time
        return [blocks_stats(x, (b,), sample=sample, generator=generator)[0] for b in sizes]
    with torch.no_grad():
        a = x.detach().reshape(-1)
        pad = (-a.numel()) % top
        if pad:
            a = torch.nn.functional.pad(a, (0, pad))
        blocks = a.view(-1, top)
        n_top = blocks.shape[0]
        sampled = sample is not None and n_top * top > sample * min(sizes)
        if sampled:
            k = max(1, -(-sample * min(sizes) // top))      # enough large blocks for `sample` of the smallest
            gen = generator if generator is not None else torch.Generator(device=blocks.device).manual_seed(0)
            idx = torch.randint(0, n_top, (k,), generator=gen, device=blocks.device)
            blocks = blocks[idx]
        bits = blocks.float().view(torch.int32) & 0x7FFFFFFF
        expo = bits >> 23                                   # biased float32 exponent: 0 zero (or subnormal), 255 inf/nan
        expo = torch.where(expo == 255, 0, expo)
        out = []
        for b in sizes:
            e = expo.reshape(-1, b)
            hi = e.amax(dim=1)
            lo = torch.where(e > 0, e, 255).amin(dim=1)
            live = hi > 0
            r = (hi - lo)[live].clamp_(0, RANGE_BINS - 1).to(torch.int64)
            hist = torch.bincount(r, minlength=RANGE_BINS)
            n = e.shape[0]
            n_real = -(-x.numel() // b)
            padding = 0 if sampled else n - n_real          # whole blocks of the padding to the largest size
            out.append({"n_blocks": int(n_real), "n_sampled": int(n - padding),
                        "n_zero_blocks": int(n - int(live.sum()) - padding), "range_hist": hist.cpu().tolist()})
        return out


def flushed_blocks(rows: Iterable[Mapping[str, Any]] | Mapping[str, Any], fmt: Scheme | FPFormat | str, *,
                   orientation: str = "rows") -> dict[str, float]:
    """Bounds on the fraction of the non-zero blocks in which round-to-nearest with block scales
    (``fmt``: a block-scaled scheme or its name, such as ``"nvfp4"``, or a format in MX blocks: E8M0
    scales; NVFP4's E4M3 scales map the block's largest entry to the format's maximum:
    :attr:`~gradstats.scheme.Scheme.block_top_log2`) flushes at least one non-zero entry to zero, from
    block statistics rows: ``low`` (blocks
    whose range is surely too wide) and ``high`` (blocks whose range may be), and the midpoint
    ``estimate``. ``orientation``: only the rows of blocks that run so (:data:`ORIENTATIONS`; a row
    without an ``orientation``, from a run recorded before blocks had one, counts as ``"rows"``: its
    blocks ran in memory order, the same blocks when the last dim is a multiple of the block size).

    With ``floor(log2 max) = E`` and the smallest non-zero entry in binade ``E - r``, and ``L`` the
    binade of half the format's smallest subnormal (round-to-nearest flushes below ``2**L``): under
    MX the scale is ``2**(E - emax)``, so that entry is flushed exactly when ``r >= emax + 1 - L``
    (``low == high``; an entry exactly on a power of two at ``r = emax - L`` ties to zero as well);
    under NVFP4 the block's maximum is mapped to the format's maximum, so flushed surely when
    ``r >= log2(max) + 1 - L`` and possibly when ``r > log2(max) - 1 - L``.

    Example:
        >>> import torch
        >>> x = torch.ones(64); x[::16] = 2.0 ** -10          # one tiny entry in every block of 16
        >>> flushed_blocks(block_stats(x, 16), "e2m1fn")["low"]
        1.0
    """
    s = _in_blocks(fmt)
    f = s.element
    check_orientation(orientation)
    rows = [rows] if isinstance(rows, Mapping) else list(rows)
    rows = [r for r in rows if _orientation_of(r) == orientation]
    hist = np.sum([np.asarray(r["range_hist"], dtype=np.int64) for r in rows], axis=0) if rows else np.zeros(RANGE_BINS)
    total = float(hist.sum())
    if total == 0:
        return {"low": 0.0, "high": 0.0, "estimate": 0.0, "blocks": 0}
    L = math.log2(f.min_subnormal) - 1
    r = np.arange(RANGE_BINS)
    top = s.block_top_log2                  # the block's maximum, scaled: in binade emax (E8M0), at max (E4M3)
    sure = r >= top + 1 - L
    possible = sure if s.tensor_scale is None else r > top - 1 - L
    low = float(hist[sure].sum()) / total
    high = float(hist[possible].sum()) / total
    return {"low": low, "high": high, "estimate": (low + high) / 2, "blocks": int(total)}


#: how a block-scaled GEMM consumes a gradient viewed as its channels-last matrix ``(M, K)``
#: (:mod:`gradstats.ops.layout`, the one home of the layout): ``"rows"``, blocks of ``B`` channels;
#: ``"columns"``, blocks of ``B`` tokens (the weight-gradient GEMM's orientation); ``"2d"``, ``B x B`` tiles
ORIENTATIONS = _layout.ORIENTATIONS
check_orientation = _layout.check_orientation
#: bins of the histogram of entries by binades below their block's maximum (the last one open)
BELOW_BINS = 64


def _in_blocks(fmt: Scheme | FPFormat | str) -> Scheme:
    """The block-scaled scheme an estimator models: a scheme (or its name) with blocks as it is, a format
    (or a scheme without blocks) in MX blocks, E8M0 scales (the block size is the histograms' own)."""
    s = Scheme.of(fmt, what="block flush estimate")
    return s if s.block_size is not None else s.replace(block_size=32)


def _orientation_of(row: Mapping[str, Any]) -> str:
    o = row.get("orientation")
    return o if isinstance(o, str) else "rows"


def _block_index(shape: tuple[int, int], b: int, orientation: str, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices ``(n, entries)`` into a ``(M, K)`` row-major tensor of the blocks numbered
    ``blocks`` of an orientation, and which of them lie inside the tensor (the rest: padding)."""
    M, K = shape
    dev = blocks.device
    k = torch.arange(b, device=dev)
    if orientation == "rows":
        nk = -(-K // b)
        r, c = blocks // nk, (blocks % nk) * b
        col = c[:, None] + k[None, :]
        return r[:, None] * K + col, col < K
    if orientation == "columns":
        rb, c = (blocks // K) * b, blocks % K
        row = rb[:, None] + k[None, :]
        return row * K + c[:, None], row < M
    nk = -(-K // b)
    r0, c0 = (blocks // nk) * b, (blocks % nk) * b
    row = (r0[:, None] + k[None, :])[:, :, None]
    col = (c0[:, None] + k[None, :])[:, None, :]
    return (row * K + col).reshape(blocks.numel(), -1), ((row < M) & (col < K)).reshape(blocks.numel(), -1)


def oriented_block_stats(x: torch.Tensor, block_size: int, orientation: str = "rows", *, sample: int | None = None,
                         generator: torch.Generator | None = None,
                         tensor_max: torch.Tensor | float | None = None) -> dict[str, Any]:
    """Per-block statistics of ``x`` in blocks as a GEMM consumes it (:data:`ORIENTATIONS`; ``x``
    viewed as ``(M, K)``, ``K`` its last dim): the keys of :func:`block_stats` (``range_hist`` of
    these blocks) and ``below_hist``, the non-zero entries counted by how many binades each sits
    below its block's maximum, ``floor(log2 max|x|) - floor(log2|x|)`` (:data:`BELOW_BINS`, the last
    bin open): what :func:`flushed_entries` turns into the fraction of entries a block-scaled format
    flushes; and ``top_hist``, the non-zero entries counted by how many binades their block's maximum
    sits below the tensor's, ``floor(log2 max|x|) - floor(log2 max|block|)``: where NVFP4's e4m3
    block scale, under a float32 scale from the tensor's maximum, underflows and flushes the whole
    block (``tensor_max``: the tensor's largest finite magnitude where the caller has it, else
    computed here). ``sample``: that many blocks of rows or columns, ``sample // block_size`` tiles (the
    same number of entries), drawn uniformly with replacement; None: every block.

    Example:
        >>> x = torch.tensor([[1.0, 1.0], [2.0 ** -8, 2.0 ** -8]])
        >>> oriented_block_stats(x, 2, "rows")["below_hist"][:9], oriented_block_stats(x, 2, "columns")["below_hist"][:9]
        ([4, 0, 0, 0, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0, 0, 0, 2])
        >>> oriented_block_stats(x, 2, "rows")["top_hist"][:9]
        [2, 0, 0, 0, 0, 0, 0, 0, 2]
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    check_orientation(orientation)
    if sample is not None and (isinstance(sample, bool) or not isinstance(sample, int) or sample < 1):
        raise ValueError(f"sample must be a positive number of blocks or None, got {sample!r}")
    with torch.no_grad():
        a = x.detach().reshape(-1)
        K = int(x.shape[-1]) if x.dim() else 1
        shape = (a.numel() // max(K, 1), K)
        n = _layout.n_blocks(*shape, block_size, orientation)
        k = sample if sample is None or orientation != "2d" else max(1, sample // block_size)
        sampled = k is not None and n > k
        if sampled:
            gen = generator if generator is not None else torch.Generator(device=a.device).manual_seed(0)
            which = torch.randint(0, n, (k,), generator=gen, device=a.device)
        else:
            which = torch.arange(n, device=a.device)
        idx, inside = _block_index(shape, block_size, orientation, which)
        v = a[idx.clamp_(max=max(a.numel() - 1, 0))] if a.numel() else torch.zeros(idx.shape, device=a.device)
        e = (v.float().view(torch.int32) & 0x7FFFFFFF) >> 23
        e = torch.where((e == 255) | ~inside, 0, e)         # inf, NaN and padding count as zeros
        hi = e.amax(dim=1)
        lo = torch.where(e > 0, e, 255).amin(dim=1)
        live = hi > 0
        # one count over both histograms, a spare bin each for what is left out (no masked copies)
        r = torch.where(live, (hi - lo).clamp_(0, RANGE_BINS - 1), RANGE_BINS)
        below = torch.where(e > 0, (hi[:, None] - e).clamp_(0, BELOW_BINS - 1), BELOW_BINS)
        tmax = (finite_max(a) if tensor_max is None else
                torch.as_tensor(tensor_max, dtype=torch.float32, device=a.device).reshape(()))
        top_e = (tmax.float().view(torch.int32) >> 23)        # the tensor maximum's binade (biased)
        top = torch.where(e > 0, (top_e - hi)[:, None].clamp(0, BELOW_BINS - 1), BELOW_BINS)
        o1, o2 = RANGE_BINS + 1, RANGE_BINS + BELOW_BINS + 2
        c = torch.bincount(torch.cat([r, below.reshape(-1) + o1, top.reshape(-1) + o2]).to(torch.int64),
                           minlength=o2 + BELOW_BINS + 1).cpu().tolist()
        return {"n_blocks": int(n), "n_sampled": int(which.numel()), "n_zero_blocks": int(which.numel() - int(live.sum())),
                "range_hist": c[:RANGE_BINS], "below_hist": c[o1:o1 + BELOW_BINS], "top_hist": c[o2:o2 + BELOW_BINS]}


def finite_max(x: torch.Tensor) -> torch.Tensor:
    """The largest finite magnitude of ``x`` (float32, 0-d, on its device; 0 when it has none): one
    pass, a second only when ``x`` holds an inf or NaN.

    Example:
        >>> finite_max(torch.tensor([1.0, -3.0, float("inf")])).item()
        3.0
    """
    if not x.numel():
        return torch.zeros((), dtype=torch.float32, device=x.device)
    m = x.detach().abs().amax().float()
    if bool(torch.isfinite(m)):
        return m
    a = x.detach().float().abs()
    return torch.where(torch.isfinite(a), a, 0.0).amax()


def flush_probability(fmt: Scheme | FPFormat | str, *, rounding: str = "nearest") -> np.ndarray:
    """The probability that a non-zero entry ``d`` binades below its block's maximum
    (``d = 0..BELOW_BINS - 1``, the index of ``below_hist``) is flushed to zero by block scaling
    (``fmt``: a block-scaled scheme or its name, or a format in MX blocks; the scale's rule:
    :attr:`~gradstats.scheme.Scheme.block_top_log2`).

    E8M0 (MX): the scale ``2**(floor(log2 max) - emax)`` is a power of two, so the scaled entry
    keeps its mantissa and sits in binade ``emax - d`` of the format. Under round-to-nearest it is
    flushed exactly when that binade lies wholly below half the smallest subnormal ``u1``:
    ``d >= emax - log2(u1) + 2`` (an entry in the binade just above, ``[u1/2, u1)``, rounds up to
    ``u1``, save a tie exactly at ``u1/2``, which rounds to zero: an entry whose mantissa is exactly 1,
    not counted). Under stochastic rounding an entry ``y < u1`` is flushed with probability ``1 - y/u1``,
    averaged over its position within its binade taken as log-uniform.
    E4M3 (NVFP4): the block's maximum is mapped to the format's maximum, so an entry becomes
    ``fmt.max * 2**(-d + f_x - f_m)``, with ``f_x``, ``f_m`` the entry's and the maximum's positions
    within their binades, taken as independent and log-uniform (``f_x - f_m`` triangular on
    ``(-1, 1)``); the e4m3 rounding of the block scale (within 6%) and blocks whose scale underflows
    e4m3 are left out.

    Example:
        >>> p = flush_probability("e2m1fn")                     # emax 2, u1 = 0.5: flushed from d = 5
        >>> p[:7].tolist()
        [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    """
    s = _in_blocks(fmt)
    f = s.element
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    u1 = float(f.min_subnormal)
    g = (np.arange(256) + 0.5) / 256                     # positions within a binade (midpoints)
    log_top = s.block_top_log2                           # where the block's maximum lands
    if s.tensor_scale is None:
        pos = g                                          # E8M0: the entry's position (the maximum's binade kept)
    else:
        pos = (g[:, None] - g[None, :]).reshape(-1)      # f_x - f_m
    d = np.arange(BELOW_BINS, dtype=np.float64)
    y = np.exp2(log_top - d[:, None] + pos[None, :])     # the scaled entries
    if rounding == "nearest":
        p = (y < u1 / 2).astype(np.float64)
    else:
        p = np.clip(1.0 - y / u1, 0.0, 1.0)
    return p.mean(axis=1)


def block_flush_probability(fmt: Scheme | FPFormat | str) -> np.ndarray:
    """The probability that a block whose maximum sits ``D`` binades below the tensor's
    (``D = 0..BELOW_BINS - 1``, the index of ``top_hist``) is flushed whole because its scale
    underflows (``fmt``: a block-scaled scheme or its name, or a format in MX blocks). E4M3 (NVFP4): the block scale ``e4m3(m / (fmt.max * t))`` with the float32
    tensor scale ``t = max|x| / (fmt.max * 448)`` is ``448 m / max|x|`` rounded to e4m3fn, zero below
    half its smallest subnormal ``2**-9``, with the two maxima's positions within their binades taken
    as independent and log-uniform (:attr:`~gradstats.scheme.Scheme.block_scale_floor_log2`). E8M0 (MX): zeros
    (its scales reach ``2**-127``).

    Example:
        >>> p = block_flush_probability("nvfp4")
        >>> p[17].item(), p[21].item()
        (0.0, 1.0)
    """
    floor = _in_blocks(fmt).block_scale_floor_log2
    if floor is None:
        return np.zeros(BELOW_BINS)
    g = (np.arange(256) + 0.5) / 256
    pos = (g[:, None] - g[None, :]).reshape(-1)                      # f_m - f_t
    d = np.arange(BELOW_BINS, dtype=np.float64)
    return ((pos[None, :] - d[:, None]) < floor).mean(axis=1).astype(np.float64)   # log2(m / max|x|) below it


def flushed_entries(below_hist: Iterable[int] | np.ndarray, fmt: Scheme | FPFormat | str, *, rounding: str = "nearest",
                    top_hist: Iterable[int] | np.ndarray | None = None) -> Any:
    """The fraction of the non-zero entries that block scaling flushes to zero (the expected fraction
    under stochastic rounding), from a ``below_hist`` (:func:`oriented_block_stats`; several rows'
    summed): ``below_hist @ flush_probability(...) / sum(below_hist)``; 0.0 without entries. With a
    ``top_hist`` (NVFP4's two-level scale), the entries of blocks flushed whole
    (:func:`block_flush_probability`) count too, the rest as before. Rows of histograms
    (``(R, BELOW_BINS)``) give an array of ``R`` fractions. ``fmt``: a block-scaled scheme or its name, or a
    format in MX blocks.

    Example:
        >>> flushed_entries(oriented_block_stats(torch.tensor([[1.0, 2.0 ** -8]]), 2)["below_hist"], "e2m1fn")
        0.5
        >>> flushed_entries(np.eye(BELOW_BINS)[[0, 9]], "e2m1fn").tolist()
        [0.0, 1.0]
    """
    h = np.asarray(below_hist, dtype=np.float64)
    if h.ndim not in (1, 2) or h.shape[-1] != BELOW_BINS:
        raise ValueError(f"below_hist must hold {BELOW_BINS} counts (entries by binades below their block's "
                         f"maximum), or rows of them, got shape {h.shape}")

    def share(counts: np.ndarray, prob: np.ndarray) -> np.ndarray:
        total = counts.sum(axis=-1)
        return np.where(total > 0, counts @ prob / np.where(total > 0, total, 1.0), 0.0)

    s = _in_blocks(fmt)
    out = share(h, flush_probability(s, rounding=rounding))
    if top_hist is not None:
        whole = share(np.asarray(top_hist, dtype=np.float64), block_flush_probability(s))
        out = whole + (1.0 - whole) * out
    return float(out) if h.ndim == 1 else out
