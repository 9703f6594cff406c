"""The fused C kernel of the statistics (``ops/native/stats.c``) as the statistics stage uses it:
whether it is here, whether a tensor suits it, and rows it writes in place. It writes the scalar
statistics at the offsets of :data:`gradstats.stats.fields.LAYOUT` (its ``GS_F_*`` defines, checked
against the declaration by a test), then the binade counts and the largest magnitudes at the
addresses it is given.

Example:
    >>> import torch
    >>> from gradstats.ops.native import load
    >>> has_native_kernel() == (load("stats") is not None)   # here when a C compiler built ops/native/stats.c
    True
    >>> kernel_applies(torch.ones(3, dtype=torch.float64))   # float32 only: others take tensor_stats_vector
    False
"""
from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

import numpy as np

from gradstats.stats.fields import LAYOUT, VECTOR_LEN

if TYPE_CHECKING:
    import torch


@functools.lru_cache(maxsize=2)
def _native_kernel(portable: bool = False):
    """``gs_stats_f32`` of the C kernel (None without a compiler); ``portable``: the build
    in plain C, without its AVX-512 block loop and its AVX2 loops (CPUs without AVX-512 run the
    same block loop, its sums, logarithms and binade counts in AVX2 where they have AVX2 and FMA)."""
    from gradstats.ops.native import function

    return function("stats", "gs_stats_f32",
                    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                     ctypes.c_int, ctypes.c_int, ctypes.c_void_p], defines=("GS_PORTABLE",) if portable else ())


def has_native_kernel() -> bool:
    """Whether the fused C kernel is available here (a C compiler was found and it compiled)."""
    return _native_kernel() is not None


def kernel_applies(x: torch.Tensor) -> bool:
    """Whether :func:`write_stats` can take ``x`` as it is: a non-empty contiguous float32 CPU tensor that holds
    its memory (:func:`gradstats.ops.native.reads_in_place`), the C kernel available, and the CPU's engine the native one
    (:func:`gradstats.ops.engine.active_engine`). (What a tracer checks before claiming a row.)"""
    from gradstats.ops.engine import use_native
    from gradstats.ops.native import reads_in_place

    return reads_in_place(x) and _native_kernel() is not None and use_native("cpu")


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
    write_stats_raw(x.data_ptr(), x.numel(), address, full=full, blocks=bh)


_HIST_OFFSET = 8 * LAYOUT["hist"].start
_TOP_OFFSET, _TOP_K = 8 * LAYOUT["top_abs"].start, LAYOUT["top_abs"].stop - LAYOUT["top_abs"].start


def write_stats_raw(data: int, n: int, address: int, *, full: bool = True, blocks: int | None = None) -> None:
    """:func:`write_stats` of the ``n`` float32 values at address ``data``, without its checks: for a caller
    that has checked :func:`kernel_applies` on the tensor (a hook on every gradient, where each check costs
    its share of a training step). ``blocks``: the address of the per-block counts, or None.

    Example:
        >>> import torch
        >>> rows, x = VectorRows(), torch.tensor([0.0, 1.0, -2.0])
        >>> if kernel_applies(x):
        ...     write_stats_raw(x.data_ptr(), x.numel(), rows.claim())
        ...     assert rows.take()[0, :3].tolist() == [3.0, 1.0, 0.0]
    """
    import torch

    if full:
        _native_kernel()(data, n, address, address + _HIST_OFFSET, address + _TOP_OFFSET, _TOP_K,
                         torch.get_num_threads(), blocks)
    else:
        _native_kernel()(data, n, address, None, None, 0, torch.get_num_threads(), blocks)


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
