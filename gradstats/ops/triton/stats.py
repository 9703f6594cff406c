"""Triton kernel of the statistics vector (:data:`gradstats.stats.fields.LAYOUT`): one read of the
tensor on the device, no host synchronisation, the same numbers as the C kernel
(``ops/native/stats.c``, :func:`gradstats.stats.kernel.write_stats`).

One launch reads ``x`` once, in its own dtype (float32, bfloat16 or float16, widened to float32 in
registers). Each program takes a tile of :data:`BLOCK` entries and writes its partials: the zero and
non-finite counts, the float32 sums of ``x``, ``|x|``, ``x**2``, ``ln|x|`` and ``ln**2|x|``, the least
and largest ``|x|`` (as bit patterns: non-negative floats order like their bits) and the tile's
``TOP_K`` largest non-zero finite magnitudes (the tile's ``TOP_K``-th largest found bit by bit, 31
counts, then the entries above it and copies of it: exact with ties, no sort). The binade counts and the per-block counts (blocks of
16 and 32 in memory order, as the C kernel's ``bh``) are counted per tile (``tl.histogram``) and added
into one small int64 buffer with ``tl.atomic_add``. A second launch, one program, combines the
partials (73 values per tile of 4096) in chunks and writes the vector (and the block counts) itself:
counts and float64 sums over the tiles, the extremes, the histogram, and the ``TOP_K`` largest of all
tiles' candidates (the ``TOP_K``-th largest found a byte at a time, four histograms of the candidates;
those above it gathered, ranked and written in descending order, copies of it after them). One call is
these two launches and two allocations (the zero-filled scratch of counts and partials, and the vector
unless ``out`` is given): no other ATen op, none waits for the device.

Classification is done on the float32 bit pattern: exact zeros are excluded from the logs, the
extremes, the histogram and the top magnitudes; inf and NaN are counted and excluded from everything
else. Subnormals are binned and logged from their mantissa bits (the exponent field of the
int -> float32 conversion of the mantissa), so no float arithmetic touches them and a device that
flushes subnormals gives the same counts. ``ln|x|`` is ``e ln 2 + ln m`` with the C kernel's
polynomial for ``ln m``, ``m`` in ``[sqrt(1/2), sqrt(2))``. Counts, extremes, histogram, top
magnitudes and block counts equal the C kernel's on ``x.float()``; the sums agree to float32
rounding (each tile sums in float32, the tiles in float64).

The kernel is built on first use (``triton.jit`` is applied then), so setting ``TRITON_INTERPRET=1``
before the first call suffices to run it on the CPU (``tests/ops/test_stats_triton.py``).

Example (CUDA, or the CPU with ``TRITON_INTERPRET=1`` set before the first call):
    >>> import torch
    >>> from gradstats.ops.triton import use_triton
    >>> x = torch.tensor([0.0, 1.0, -2.0, float("inf")])
    >>> if use_triton(x.device.type):
    ...     v = stats_vector(x)
    ...     assert v[:3].tolist() == [4.0, 1.0, 1.0] and v[9].item() == 2.0
"""
from __future__ import annotations

import functools

import torch

try:  # the kernel body refers to ``tl``; it is only compiled when Triton is installed
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the installation
    tl = None

from gradstats.ops.triton import interpreting, use_triton

__all__ = ["supports", "stats_vector", "BLOCK"]

#: entries per program (a power of two and a multiple of 32, so blocks of 16 and 32 never straddle two)
BLOCK = 4096
# The statistics vector this module writes, as the C kernel's defines have it (ops come before the
# statistics stage, which declares them: tests/ops/test_stats_triton.py checks these against
# gradstats.stats.fields and gradstats.stats.blocks): the scalars n, n_zero, n_nonfinite, sum,
# sum_abs, sum_sq, sum_ln_abs, sum_ln_abs_sq, min_abs, max_abs; the binade counts from 2**HIST_MIN_EXP;
# the TOP_K largest magnitudes. Blocks of 16 and 32: zero blocks, then RANGE_BINS range counts.
#: the scalar statistics, in the order of the vector (the declaration's SCALAR_FIELDS; a test checks)
SCALARS = ("n", "n_zero", "n_nonfinite", "sum", "sum_abs", "sum_sq", "sum_ln_abs", "sum_ln_abs_sq", "min_abs",
           "max_abs")
N_SCALARS = len(SCALARS)
HIST_MIN_EXP = -149
HIST_BINS = 277
TOP_K = 64
VECTOR_LEN = N_SCALARS + HIST_BINS + TOP_K
BLOCK_SIZES = (16, 32)
RANGE_BINS = 64
#: int32 partials per program: n_zero, n_nonfinite, min |x| bits, max |x| bits, then the top TOP_K bits
_NI = 4 + TOP_K
#: float32 partials per program: sum, sum_abs, sum_sq, sum_ln_abs, sum_ln_abs_sq
_NF = 5
#: the shared int64 counts: the binade histogram (its bins padded to a power of two), then the
#: per-block counts of blocks of 16 and of 32 (zero blocks, then the range bins)
_HBINS = 512
_RBINS = 128
_NB = 1 + RANGE_BINS
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the combine reads the tiles' scalar partials _ROWS tiles at a time, their candidates _CHUNK at a time
_ROWS = 512
_CHUNK = 1024


def supports(x: torch.Tensor) -> bool:
    """Whether :func:`stats_vector` takes ``x``: a non-empty contiguous float32, bfloat16 or float16
    tensor on a device Triton runs on here (CUDA; the CPU under ``TRITON_INTERPRET=1``).

    Example:
        >>> import torch
        >>> supports(torch.zeros(0)), supports(torch.zeros(3, dtype=torch.float64))
        (False, False)
    """
    return (x.dtype in _DTYPES and x.numel() > 0 and x.is_contiguous()
            and use_triton(x.device.type))


# The body uses only Triton's builtins (tl.reduce and tl.associative_scan with the standard
# library's combine functions, which are what tl.sum, tl.max, tl.min and tl.cumsum call): the
# interpreter runs them whether or not TRITON_INTERPRET was set when Triton was first imported.
def _stats_src(x_ptr, pi_ptr, pf_ptr, cnt_ptr, n,
               BLOCK: tl.constexpr, TOP: tl.constexpr, NI: tl.constexpr, NF: tl.constexpr,
               HBINS: tl.constexpr, NHIST: tl.constexpr, RBINS: tl.constexpr, NB: tl.constexpr,
               MIN_EXP: tl.constexpr, BF16: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    raw = tl.load(x_ptr + offs, mask=mask, other=0.0)                 # the padding reads as zeros
    if BF16:  # widened by its bits (exact for bfloat16 subnormals, which the interpreter would flush)
        x = (raw.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = raw.to(tl.float32)
    b = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF                      # |x| as bits
    f = b >> 23                                                       # biased exponent field
    fin = f != 255
    nz = fin & (b != 0)
    sub = f == 0
    n_zero = tl.reduce(((b == 0) & mask).to(tl.int32), 0, tl.standard._sum_combine)
    n_nonfin = tl.reduce((fin == 0).to(tl.int32), 0, tl.standard._sum_combine)
    # sums over the finite entries, in float32
    v = tl.where(fin, x, 0.0)
    s = tl.reduce(v, 0, tl.standard._sum_combine)
    sa = tl.reduce(tl.abs(v), 0, tl.standard._sum_combine)
    ss = tl.reduce(v * v, 0, tl.standard._sum_combine)
    # binade and ln|x| from the bits: a subnormal's from its mantissa m (|x| = m 2**-149) as
    # float32 (exact: m < 2**23)
    mb = (b & 0x7FFFFF).to(tl.float32).to(tl.int32, bitcast=True)
    bs = tl.where(sub, mb, b)
    e = (bs >> 23) - 127 + tl.where(sub, MIN_EXP, 0)                  # floor(log2 |x|)
    mant = ((bs & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)   # in [1, 2)
    big = mant > 1.41421356
    mant = tl.where(big, mant * 0.5, mant)
    fm = mant - 1.0
    f2 = fm * fm
    p = tl.full(fm.shape, -0.07634228467941284, tl.float32)
    p = tl.fma(p, fm, 0.12761472165584564)
    p = tl.fma(p, fm, -0.13160234689712524)
    p = tl.fma(p, fm, 0.14201775193214417)
    p = tl.fma(p, fm, -0.16623353958129883)
    p = tl.fma(p, fm, 0.20001226663589478)
    p = tl.fma(p, fm, -0.250008225440979)
    p = tl.fma(p, fm, 0.3333333134651184)
    ln = tl.fma((e + big.to(tl.int32)).to(tl.float32), 0.6931471805599453,
                tl.fma(f2 * fm, p, tl.fma(f2, -0.5, fm)))
    ln = tl.where(nz, ln, 0.0)
    sl = tl.reduce(ln, 0, tl.standard._sum_combine)
    sl2 = tl.reduce(ln * ln, 0, tl.standard._sum_combine)
    minb = tl.reduce(tl.where(nz, b, 0x7FFFFFFF), 0, tl.standard._elementwise_min)
    maxb = tl.reduce(tl.where(fin, b, 0), 0, tl.standard._elementwise_max)
    # the tile's TOP largest non-zero finite |x| (bits): t, the TOP-th largest (0 if fewer), found
    # bit by bit; the entries above it (fewer than TOP) and copies of t fill the TOP slots
    cand = tl.where(nz, b, 0)
    t = tl.full((), 0, tl.int32)
    for i in tl.static_range(31):
        c = t | (1 << (30 - i))
        t = tl.where(tl.reduce((cand >= c).to(tl.int32), 0, tl.standard._sum_combine) >= TOP, c, t)
    above = cand > t
    slot = tl.associative_scan(above.to(tl.int32), 0, tl.standard._sum_combine) - 1
    n_above = tl.reduce(above.to(tl.int32), 0, tl.standard._sum_combine)
    # the tile's partials
    pi = pi_ptr + pid * NI
    tl.store(pi, n_zero)
    tl.store(pi + 1, n_nonfin)
    tl.store(pi + 2, minb)
    tl.store(pi + 3, maxb)
    tl.store(pi + 4 + slot, cand, mask=above)
    j = tl.arange(0, TOP)
    tl.store(pi + 4 + j, tl.full((TOP,), 0, tl.int32) + t, mask=j >= n_above)
    pf = pf_ptr + pid * NF
    tl.store(pf, s)
    tl.store(pf + 1, sa)
    tl.store(pf + 2, ss)
    tl.store(pf + 3, sl)
    tl.store(pf + 4, sl2)
    # binade counts: the tile's histogram (excluded entries in the last, unused bin), added
    hbin = tl.where(nz, e - MIN_EXP, HBINS - 1)
    h = tl.histogram(hbin, HBINS)
    hk = tl.arange(0, HBINS)
    tl.atomic_add(cnt_ptr + hk, h.to(tl.int64), mask=(hk < NHIST) & (h > 0))
    # blocks of 16 and 32 in memory order: exponent fields of the normal finite entries
    fe = tl.where((f == 0) | (f == 255), 0, f)
    fe16 = tl.reshape(fe, (BLOCK // 16, 16))
    hi16 = tl.reduce(fe16, 1, tl.standard._elementwise_max)
    lo16 = tl.reduce(tl.where(fe16 > 0, fe16, 255), 1, tl.standard._elementwise_min)
    hi32 = tl.reduce(tl.reshape(hi16, (BLOCK // 32, 2)), 1, tl.standard._elementwise_max)
    lo32 = tl.reduce(tl.reshape(lo16, (BLOCK // 32, 2)), 1, tl.standard._elementwise_min)
    start16 = pid * BLOCK + tl.arange(0, BLOCK // 16) * 16
    start32 = pid * BLOCK + tl.arange(0, BLOCK // 32) * 32
    r16 = tl.where(hi16 == 0, 0, 1 + tl.minimum(hi16 - lo16, NB - 2))
    r32 = tl.where(hi32 == 0, 0, 1 + tl.minimum(hi32 - lo32, NB - 2))
    g16 = tl.histogram(tl.where(start16 < n, r16, RBINS - 1), RBINS)
    g32 = tl.histogram(tl.where(start32 < n, r32, RBINS - 1), RBINS)
    rk = tl.arange(0, RBINS)
    tl.atomic_add(cnt_ptr + HBINS + rk, g16.to(tl.int64), mask=(rk < NB) & (g16 > 0))
    tl.atomic_add(cnt_ptr + HBINS + NB + rk, g32.to(tl.int64), mask=(rk < NB) & (g32 > 0))


def _combine_src(pi_ptr, pf_ptr, cnt_ptr, sel_ptr, out_ptr, out_s, blk_ptr, blk_s0, blk_s1, n, tiles,
                 TOP: tl.constexpr, NI: tl.constexpr, NF: tl.constexpr, HBINS: tl.constexpr,
                 NHIST: tl.constexpr, NB: tl.constexpr, NSCAL: tl.constexpr, BW: tl.constexpr, ROWS: tl.constexpr,
                 CH: tl.constexpr, BLOCKS: tl.constexpr):
    # one program: the tiles' partials, ROWS tiles at a time, in int64 and float64
    r = tl.arange(0, ROWS).to(tl.int64)
    n_zero = tl.full((), 0, tl.int64)
    n_nonfin = tl.full((), 0, tl.int64)
    minb = tl.full((), 0x7FFFFFFF, tl.int32)
    maxb = tl.full((), 0, tl.int32)
    s0 = tl.full((), 0.0, tl.float64)
    s1 = tl.full((), 0.0, tl.float64)
    s2 = tl.full((), 0.0, tl.float64)
    s3 = tl.full((), 0.0, tl.float64)
    s4 = tl.full((), 0.0, tl.float64)
    for start in range(0, tiles, ROWS):
        rows = r + start
        m = rows < tiles
        pi = pi_ptr + rows * NI
        pf = pf_ptr + rows * NF
        n_zero += tl.reduce(tl.load(pi, mask=m, other=0).to(tl.int64), 0, tl.standard._sum_combine)
        n_nonfin += tl.reduce(tl.load(pi + 1, mask=m, other=0).to(tl.int64), 0, tl.standard._sum_combine)
        minb = tl.minimum(minb, tl.reduce(tl.load(pi + 2, mask=m, other=0x7FFFFFFF), 0,
                                          tl.standard._elementwise_min))
        maxb = tl.maximum(maxb, tl.reduce(tl.load(pi + 3, mask=m, other=0), 0, tl.standard._elementwise_max))
        s0 += tl.reduce(tl.load(pf, mask=m, other=0.0).to(tl.float64), 0, tl.standard._sum_combine)
        s1 += tl.reduce(tl.load(pf + 1, mask=m, other=0.0).to(tl.float64), 0, tl.standard._sum_combine)
        s2 += tl.reduce(tl.load(pf + 2, mask=m, other=0.0).to(tl.float64), 0, tl.standard._sum_combine)
        s3 += tl.reduce(tl.load(pf + 3, mask=m, other=0.0).to(tl.float64), 0, tl.standard._sum_combine)
        s4 += tl.reduce(tl.load(pf + 4, mask=m, other=0.0).to(tl.float64), 0, tl.standard._sum_combine)
    nn = n.to(tl.int64)
    nnz = nn - n_zero - n_nonfin
    lo = tl.where(nnz > 0, minb.to(tl.float32, bitcast=True).to(tl.float64), float("nan"))
    hi = tl.where(nnz > 0, maxb.to(tl.float32, bitcast=True).to(tl.float64), float("nan"))
    j = tl.arange(0, 16)
    sc = tl.where(j == 0, nn.to(tl.float64), tl.where(j == 1, n_zero.to(tl.float64), tl.where(
        j == 2, n_nonfin.to(tl.float64), tl.where(j == 3, s0, tl.where(j == 4, s1, tl.where(
            j == 5, s2, tl.where(j == 6, s3, tl.where(j == 7, s4, tl.where(j == 8, lo, hi)))))))))
    tl.store(out_ptr + j.to(tl.int64) * out_s, sc, mask=j < NSCAL)          # the ten scalars
    hk = tl.arange(0, HBINS).to(tl.int64)
    h = tl.load(cnt_ptr + hk, mask=hk < NHIST, other=0)
    tl.store(out_ptr + (NSCAL + hk) * out_s, h.to(tl.float64), mask=hk < NHIST)
    if BLOCKS:  # the counts of blocks of 16 and of 32, in the caller's strides
        bk = tl.arange(0, BW).to(tl.int64)
        bm = bk < 2 * NB
        bc = tl.load(cnt_ptr + HBINS + bk, mask=bm, other=0)
        tl.store(blk_ptr + (bk // NB) * blk_s0 + (bk % NB) * blk_s1, bc, mask=bm)
    # the TOP largest of all tiles' candidates (bits, 0 for none): t, the TOP-th largest, a byte at a
    # time from the top (a histogram of the next byte among the candidates that match t's bytes so far)
    total = tiles.to(tl.int64) * TOP
    c = tl.arange(0, CH).to(tl.int64)
    b = tl.arange(0, 512)
    t = tl.full((), 0, tl.int32)
    k = tl.full((), TOP, tl.int32)                     # how many of the TOP are still to place at t's prefix
    for p in tl.static_range(4):
        hist = tl.full((512,), 0, tl.int32)
        for start in range(0, total, CH):
            q = c + start
            m = q < total
            cand = tl.load(pi_ptr + (q // TOP) * NI + 4 + q % TOP, mask=m, other=0)
            if p > 0:
                m = m & ((cand >> (32 - 8 * p)) == (t >> (32 - 8 * p)))
            hist += tl.histogram(tl.where(m, (cand >> (24 - 8 * p)) & 255, 511), 512)
        hist = tl.where(b < 256, hist, 0)
        geq = tl.reduce(hist, 0, tl.standard._sum_combine) - tl.associative_scan(
            hist, 0, tl.standard._sum_combine) + hist     # candidates with this byte or a larger one
        d = tl.reduce(tl.where((geq >= k) & (b < 256), b, -1), 0, tl.standard._elementwise_max)
        k -= tl.reduce(tl.where(b == d, geq - hist, 0), 0, tl.standard._sum_combine)
        t = t | (d << (24 - 8 * p))
    # the candidates above t (fewer than TOP), gathered into sel, then ranked and written descending;
    # copies of t (NaN when t is 0: fewer than TOP non-zero magnitudes) fill the rest
    n_above = tl.full((), 0, tl.int32)
    for start in range(0, total, CH):
        q = c + start
        m = q < total
        cand = tl.load(pi_ptr + (q // TOP) * NI + 4 + q % TOP, mask=m, other=0)
        above = m & (cand > t)
        slot = n_above + tl.associative_scan(above.to(tl.int32), 0, tl.standard._sum_combine) - 1
        tl.store(sel_ptr + slot, cand, mask=above & (slot < TOP))
        n_above += tl.reduce(above.to(tl.int32), 0, tl.standard._sum_combine)
    tl.debug_barrier()                                 # sel, written by other threads of this program
    i = tl.arange(0, TOP)
    valid = i < n_above
    v = tl.load(sel_ptr + i, mask=valid, other=-1)
    before = (v[None, :] > v[:, None]) | ((v[None, :] == v[:, None]) & (i[None, :] < i[:, None]))
    rank = tl.reduce((before & valid[None, :]).to(tl.int32), 1, tl.standard._sum_combine)
    top = out_ptr + (NSCAL + NHIST) * out_s
    tl.store(top + rank.to(tl.int64) * out_s, v.to(tl.float32, bitcast=True).to(tl.float64), mask=valid)
    fill = tl.where(t > 0, t.to(tl.float32, bitcast=True).to(tl.float64), float("nan"))
    tl.store(top + i.to(tl.int64) * out_s, tl.full((TOP,), 0.0, tl.float64) + fill, mask=i >= n_above)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):  # noqa: ARG001 - the cache key: Triton decides at decoration
    import triton

    return (triton.jit(_stats_src, do_not_specialize=["n"]),
            triton.jit(_combine_src, do_not_specialize=["n", "tiles"]))


def _check(x: torch.Tensor, out: torch.Tensor | None, blocks: torch.Tensor | None) -> None:
    if x.dtype not in _DTYPES:
        raise ValueError(f"stats_vector needs a float32, bfloat16 or float16 tensor, got {x.dtype}; "
                         "convert it first (x.float())")
    if x.numel() == 0:
        raise ValueError("stats_vector needs a non-empty tensor; the statistics of an empty one are "
                         "the fields' empty values (gradstats.stats.reference.reduce)")
    if not x.is_contiguous():
        raise ValueError("stats_vector reads x in memory order and needs a contiguous tensor; pass "
                         "x.contiguous()")
    if out is not None and not (out.dtype == torch.float64 and out.shape == (VECTOR_LEN,)
                                and out.device == x.device):
        raise ValueError(f"out must be a float64 tensor of shape ({VECTOR_LEN},) on {x.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if blocks is not None and not (blocks.dtype == torch.int64 and blocks.shape == (2, _NB)
                                   and blocks.device == x.device):
        raise ValueError(f"blocks must be an int64 tensor of shape (2, {_NB}) on {x.device} (blocks of "
                         f"16 and 32: zero blocks, then {RANGE_BINS} range bins), got {blocks.dtype} "
                         f"{tuple(blocks.shape)} on {blocks.device}")


def stats_vector(x: torch.Tensor, *, out: torch.Tensor | None = None,
                 blocks: torch.Tensor | None = None) -> torch.Tensor:
    """The float64 statistics vector of ``x`` (``VECTOR_LEN`` values in the layout of
    :data:`gradstats.stats.fields.LAYOUT`) on ``x``'s device, from one read of ``x`` and without a
    host synchronisation. ``x``: any shape, contiguous, float32, bfloat16 or float16 (the statistics
    of its values as float32), non-empty (:func:`supports`). ``out``: a float64 tensor of
    ``VECTOR_LEN`` on ``x``'s device (a row of a larger buffer) written and returned. ``blocks``: an
    int64 tensor of shape ``(2, 1 + RANGE_BINS)`` on ``x``'s device, overwritten with the per-block
    counts of blocks of 16 and of 32 as the C kernel writes them
    (:func:`gradstats.stats.blocks.kernel_block_stats` reads them).

    Example (CUDA, or the CPU with ``TRITON_INTERPRET=1`` set before the first call):
        >>> import torch
        >>> x = torch.tensor([[0.5, -4.0], [0.0, 1e-42]])
        >>> if supports(x):
        ...     v = stats_vector(x)
        ...     assert v[:3].tolist() == [4.0, 1.0, 0.0] and v[9].item() == 4.0
    """
    _check(x, out, blocks)
    xf = x.detach().reshape(-1)                        # a view: x is contiguous
    n = xf.numel()
    dev = x.device
    grid = -(-n // BLOCK)
    # one zero-filled scratch buffer: the int64 counts the tiles add into, then (as int32) the
    # combine's TOP_K slots and the tiles' partials
    ncnt = _HBINS + 2 * _NB
    n32 = TOP_K + grid * (_NI + _NF)
    buf = torch.zeros(ncnt + (n32 + 1) // 2, dtype=torch.int64, device=dev)
    cnt = buf[:ncnt]
    w = buf[ncnt:].view(torch.int32)
    sel = w[:TOP_K]
    pi = w[TOP_K:TOP_K + grid * _NI]
    pf = w[TOP_K + grid * _NI:n32].view(torch.float32)
    stats_kernel, combine_kernel = _kernel(interpreting())
    stats_kernel[(grid,)](xf, pi, pf, cnt, n, BLOCK=BLOCK, TOP=TOP_K, NI=_NI, NF=_NF,
                          HBINS=_HBINS, NHIST=HIST_BINS, RBINS=_RBINS, NB=_NB,
                          MIN_EXP=HIST_MIN_EXP, BF16=x.dtype == torch.bfloat16, num_warps=8)
    vec = torch.empty(VECTOR_LEN, dtype=torch.float64, device=dev) if out is None else out
    blk = blocks if blocks is not None else cnt
    combine_kernel[(1,)](pi, pf, cnt, sel, vec, vec.stride(0), blk, blk.stride(0), blk.stride(-1), n, grid,
                         TOP=TOP_K, NI=_NI, NF=_NF, HBINS=_HBINS, NHIST=HIST_BINS, NB=_NB,
                         NSCAL=N_SCALARS, BW=256, ROWS=_ROWS, CH=_CHUNK, BLOCKS=blocks is not None,
                         num_warps=4)
    return vec
