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
n_blocks``); elsewhere (a GPU, other block sizes) from a uniform random sample of 2048 blocks
per tensor by default (``block_sample=``, drawn with replacement; None counts every block, at a
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

from gradstats.formats import FPFormat, parse

__all__ = ["block_stats", "blocks_stats", "kernel_block_stats", "flushed_blocks", "RANGE_BINS", "BLOCK_SIZES"]

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


def flushed_blocks(rows: Iterable[Mapping[str, Any]] | Mapping[str, Any], fmt: FPFormat | str, *,
                   scale_format: str = "e8m0") -> dict[str, float]:
    """Bounds on the fraction of the non-zero blocks in which round-to-nearest with block scales
    (``"e8m0"``: MX; ``"e4m3"``: NVFP4-style, the block's largest entry mapped to the format's
    maximum) flushes at least one non-zero entry to zero, from block statistics rows: ``low`` (blocks
    whose range is surely too wide) and ``high`` (blocks whose range may be), and the midpoint
    ``estimate``.

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
    f = parse(fmt)
    if scale_format not in ("e8m0", "e4m3"):
        raise ValueError(f"scale_format must be 'e8m0' (MX) or 'e4m3' (NVFP4), got {scale_format!r}")
    rows = [rows] if isinstance(rows, Mapping) else list(rows)
    hist = np.sum([np.asarray(r["range_hist"], dtype=np.int64) for r in rows], axis=0) if rows else np.zeros(RANGE_BINS)
    total = float(hist.sum())
    if total == 0:
        return {"low": 0.0, "high": 0.0, "estimate": 0.0, "blocks": 0}
    L = math.log2(f.min_subnormal) - 1
    r = np.arange(RANGE_BINS)
    if scale_format == "e8m0":
        sure = possible = r >= f.emax + 1 - L
    else:
        sure, possible = r >= math.log2(f.max) + 1 - L, r > math.log2(f.max) - 1 - L
    low = float(hist[sure].sum()) / total
    high = float(hist[possible].sum()) / total
    return {"low": low, "high": high, "estimate": (low + high) / 2, "blocks": int(total)}
