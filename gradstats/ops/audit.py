"""What a training step costs the device beyond the model's own work, counted on the CPU:
:class:`Audit`.

Inside an ``Audit`` every ATen operation is seen (a ``TorchDispatchMode``) and counted by where it
runs (inside the backward pass or outside it) and by the size of the tensors it touches: an
operation that is not a view and touches a tensor of at least ``big`` elements is a *whole-gradient
operation* (one more pass over a gradient's memory). It also counts

* **host synchronisations**: reads of tensor values by the host (``aten._local_scalar_dense``,
  which ``.item()``, ``int(t)``, ``float(t)`` and ``bool(t)`` make, ``.tolist()``, ``.numpy()``,
  ``.cpu()``) and the operations whose output size depends on the data (``nonzero``,
  ``masked_select``, ``unique``...), which on a GPU wait for the device, plus each
  :meth:`gradstats.ops.host.Outbox.collect` that waited for something (on the CPU all tensors
  live on the host, so every read is counted, which is stricter than a GPU; the tensors an
  outbox hands back are host memory and are not);
* **Triton launches**, each kernel a program grid (under the interpreter the ATen operations it
  makes to copy a kernel's arguments are not counted: a CUDA launch makes none).

Run with ``GRADSTATS_ENGINE=triton`` and ``TRITON_INTERPRET=1`` it audits the GPU code path on the
CPU (``bench/device_audit.py`` prints the table; the tests assert its targets).

Example:
    >>> import torch
    >>> x = torch.ones(1000, requires_grad=True)
    >>> with Audit(big=500) as a:
    ...     y = (x * 2).sum()
    ...     y.backward()
    ...     _ = float(y.detach())
    >>> a.big_ops["forward"] >= 1, a.syncs["forward"], a.syncs["backward"]
    (True, 1, 0)
"""
from __future__ import annotations

import weakref
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

#: ATen operations whose output size depends on the data (a GPU waits for the device to size them)
DATA_DEPENDENT = frozenset({"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
                            "_local_scalar_dense", "is_nonzero", "equal", "repeat_interleave"})
#: ATen operations that touch no data (metadata, aliases), beside those tagged as views
_NO_DATA = frozenset({"detach", "alias", "lift_fresh", "_reshape_alias", "view", "_unsafe_view", "as_strided",
                      "empty_strided", "set_", "resize_", "sym_size", "sym_stride", "sym_numel", "is_same_size"})

#: host tensors an outbox handed back (not device reads), by the address of their storage: a view
#: of one (a slice, another dtype) is host memory too, as long as the tensor lives
HOST_TENSORS: dict[int, "weakref.ref[torch.Tensor]"] = {}


def _mark_host(t: torch.Tensor) -> None:
    HOST_TENSORS[t.untyped_storage().data_ptr()] = weakref.ref(t)


def _phase() -> str:
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


def _on_host(t: torch.Tensor) -> bool:
    ref = HOST_TENSORS.get(t.untyped_storage().data_ptr())
    return ref is not None and ref() is not None


class Audit(TorchDispatchMode):
    """Counts per phase (``"forward"``: everything outside the backward pass; ``"backward"``):

    Attributes:
        ops: every ATen operation that touches data.
        big_ops: those touching a tensor of at least ``big`` elements (whole-gradient operations).
        syncs: host synchronisations (see the module's docstring); ``sync_names`` says which.
        launches: Triton kernel launches.
    """

    def __init__(self, big: int) -> None:
        super().__init__()
        if big < 1:
            raise ValueError(f"big must be a positive number of elements, got {big}")
        self.big = int(big)
        self.ops: Counter[str] = Counter()
        self.big_ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.launches: Counter[str] = Counter()
        self.sync_names: Counter[str] = Counter()
        self.big_names: Counter[str] = Counter()
        self._patched: list[tuple[Any, str, Any]] = []
        self._launching = False

    # -- the dispatch mode
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._launching:         # the interpreter's own copies of a kernel's arguments: no CUDA op
            return out
        name = func.overloadpacket.__name__
        phase = _phase()
        if name in DATA_DEPENDENT:
            self._sync(phase, f"aten.{name}")
        if not (getattr(func, "is_view", False) or name in _NO_DATA):
            self.ops[phase] += 1
            flat, _ = tree_flatten((args, kwargs, out))
            if any(isinstance(t, torch.Tensor) and t.numel() >= self.big for t in flat):
                self.big_ops[phase] += 1
                self.big_names[f"{phase}: aten.{name}"] += 1
        return out

    def _sync(self, phase: str, what: str) -> None:
        self.syncs[phase] += 1
        self.sync_names[f"{phase}: {what}"] += 1

    # -- host reads the dispatcher does not see, and kernel launches
    def _patch(self, owner: Any, attr: str, make: Any) -> None:
        old = getattr(owner, attr)
        setattr(owner, attr, make(old))
        self._patched.append((owner, attr, old))

    def __enter__(self) -> "Audit":
        from gradstats.ops import host

        audit = self

        def reading(what: str):
            def wrap(old):
                def read(t, *a, **k):
                    if not _on_host(t):
                        audit._sync(_phase(), f"Tensor.{what}")
                    return old(t, *a, **k)
                return read
            return wrap

        for what in ("tolist", "numpy", "cpu"):
            self._patch(torch.Tensor, what, reading(what))

        def collecting(old):
            def collect(box):
                before = host.COLLECTS[0]
                items = old(box)
                if host.COLLECTS[0] != before:
                    audit._sync(_phase(), "Outbox.collect")
                for t in items:
                    _mark_host(t)
                return items
            return collect

        self._patch(host.Outbox, "collect", collecting)
        try:
            from triton.runtime import interpreter, jit
        except Exception:      # pragma: no cover - without Triton there is nothing to launch
            pass
        else:
            def launching(old):
                def run(fn, *a, **k):
                    if audit._launching:         # a launcher calling its own run: one launch
                        return old(fn, *a, **k)
                    audit.launches[_phase()] += 1
                    audit._launching = True
                    try:
                        return old(fn, *a, **k)
                    finally:
                        audit._launching = False
                return run
            for cls in (interpreter.InterpretedFunction, jit.JITFunction):
                if hasattr(cls, "run"):
                    self._patch(cls, "run", launching)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for owner, attr, old in reversed(self._patched):
                setattr(owner, attr, old)
            self._patched.clear()

    def to_dict(self) -> dict[str, Any]:
        """The counts per phase, and which operations were big or synchronised."""
        return {"ops": dict(self.ops), "big_ops": dict(self.big_ops), "syncs": dict(self.syncs),
                "launches": dict(self.launches), "sync_names": dict(self.sync_names),
                "big_names": dict(self.big_names)}


__all__ = ["Audit", "DATA_DEPENDENT", "HOST_TENSORS"]
