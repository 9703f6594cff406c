"""The one worker pool of the CPU engines (the chunked quantiser and the numpy pruning engine).

Sized to ``torch.get_num_threads()`` (re-made when that changes); a task already running on one of its
threads does its nested work inline, so nested use never waits on itself.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

#: the name prefix of the pool's threads
PREFIX = "gradstats-worker"

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def workers() -> int:
    """Threads the CPU engines use: torch's intra-op thread count."""
    return max(1, torch.get_num_threads())


def pool() -> ThreadPoolExecutor:
    """The shared pool (made on first use).

    Example:
        >>> pool().submit(sum, [1, 2]).result()
        3
    """
    global _pool
    with _lock:
        if _pool is None or _pool._max_workers != workers():  # type: ignore[attr-defined]
            _pool = ThreadPoolExecutor(max_workers=workers(), thread_name_prefix=PREFIX)
        return _pool


def in_worker() -> bool:
    """Whether the calling thread is one of the pool's (then run nested work inline)."""
    return threading.current_thread().name.startswith(PREFIX)
