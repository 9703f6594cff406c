"""Chunking and threads of the fitting passes.

The passes issue thousands of small torch ops on cache-sized chunks; torch's intra-op pool
would make each a parallel region, which on a busy machine costs up to a scheduler quantum.
So torch runs single-threaded inside a fit and the fit uses up to two Python worker threads
of its own (torch ops and numpy's sort/partition release the GIL).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

#: values per chunk of the passes (float32: 256 KiB, cache-resident)
CHUNK = 1 << 16


def _chunks(lo: int, hi: int):
    for s in range(lo, hi, CHUNK):
        yield s, min(hi, s + CHUNK)


_LOCK = threading.Lock()
_DEPTH = 0
_SAVED_THREADS = 1


@contextmanager
def torch_single_thread() -> Iterator[None]:
    """Run torch's CPU ops single-threaded inside the block (re-entrant, thread-safe; the
    previous setting is restored when the outermost block exits).

    The chunked passes issue thousands of small ops; torch's intra-op pool turns each into
    a parallel region, which on a busy machine costs up to a scheduler quantum. One torch
    thread per Python worker is faster and steadier (see ``docs/fitting.md``)."""
    global _DEPTH, _SAVED_THREADS
    with _LOCK:
        if _DEPTH == 0:
            _SAVED_THREADS = torch.get_num_threads()
            if _SAVED_THREADS != 1:
                torch.set_num_threads(1)
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0 and _SAVED_THREADS != 1:
                torch.set_num_threads(_SAVED_THREADS)


def default_workers() -> int:
    """Python worker threads for one fit: torch's CPU thread count, at most 2 and the cores."""
    n = torch.get_num_threads() if _DEPTH == 0 else _SAVED_THREADS
    return max(1, min(2, os.cpu_count() or 1, n))


def _split(m: int, workers: int) -> list[tuple[int, int]]:
    """Contiguous ranges of ``[0, m)`` aligned to chunk boundaries, one per worker."""
    nch = -(-m // CHUNK)
    w = max(1, min(workers, nch))
    bounds = [min(m, (nch * i // w) * CHUNK) for i in range(w + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(w) if bounds[i] < bounds[i + 1]]


def _map(fn: Callable[[int, int], dict[str, Any]], m: int, pool: ThreadPoolExecutor | None
         ) -> list[dict[str, Any]]:
    ranges = _split(m, 1 if pool is None else pool._max_workers)  # noqa: SLF001
    if pool is None or len(ranges) == 1:
        return [fn(lo, hi) for lo, hi in ranges]
    return list(pool.map(lambda r: fn(*r), ranges))
