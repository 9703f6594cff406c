"""Device results bound for the host without stalling the device: :class:`Outbox`.

In the backward pass the statistics vectors and the counts of the fused operator stay on the
device; each :meth:`Outbox.put` starts a non-blocking copy of one into page-locked (pinned) host
memory, queued behind the kernel that made it, and returns at once. :meth:`Outbox.collect`, called
outside the backward pass on the reader's schedule (the tracer's commit, apply's settling at the
next forward), waits once for every copy queued so far (one host synchronisation, however many
tensors) and hands back host tensors. Reading a device value any other way (``.item()``,
``int(t)``, ``.tolist()``, ``.cpu()``) stalls the launch queue until the device catches up: once per
layer, where this costs once per step.

CPU tensors (the native engine, or Triton's interpreter standing in for a device) are kept as they
are; :data:`COLLECTS` counts the collections that had something to wait for, on every device, so an
audit on the CPU counts the synchronisations a GPU would make (:mod:`gradstats.ops.audit`).

Example:
    >>> import torch
    >>> box = Outbox()
    >>> _ = box.put(torch.arange(3.0)), box.put(torch.ones(2))
    >>> [t.tolist() for t in box.collect()], len(box)
    ([[0.0, 1.0, 2.0], [1.0, 1.0]], 0)
"""
from __future__ import annotations

import threading

import torch

#: collections that waited for something (one host synchronisation each on a GPU)
COLLECTS = [0]


class Outbox:
    """Device tensors on their way to the host, collected with one synchronisation."""

    def __init__(self) -> None:
        self._items: list[torch.Tensor] = []
        self._events: dict[torch.device, "torch.cuda.Event"] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, t: torch.Tensor) -> torch.Tensor:
        """Queue ``t`` (a small tensor: statistics, counts, a sample) for the host and return the
        host tensor that will hold it, readable after the next :meth:`collect`: on CUDA a
        non-blocking copy into pinned memory, ordered after the kernel that wrote ``t``; elsewhere
        ``t`` itself (the caller does not write it again)."""
        t = t.detach()
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(t.device))
            with self._lock:
                self._items.append(host)
                self._events[t.device] = ev            # the last copy on each device
            return host
        with self._lock:
            self._items.append(t)
        return t

    def collect(self) -> list[torch.Tensor]:
        """Every tensor put since the last collection, on the host, in the order put: one wait
        for the device's copies (none when there were none)."""
        with self._lock:
            items, events = self._items, self._events
            self._items, self._events = [], {}
        if items:
            COLLECTS[0] += 1
        for ev in events.values():
            ev.synchronize()
        return items


__all__ = ["Outbox", "COLLECTS"]
