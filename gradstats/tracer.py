"""Capture neural gradients (dL/d layer output) of any PyTorch model into a run on disk.

A forward hook on each selected module registers a tensor hook on the module's output; the
tensor hook sees the gradient with respect to that output in the backward pass, computes the
streamed statistics of :mod:`gradstats.stats` on the tensor's own device and, on sampled
steps, keeps an unbiased uniform random sample. Nothing is modified: training with the tracer
is bit-identical to training without it.

Example:
    >>> import tempfile, torch
    >>> import gradstats
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with gradstats.trace(model, tempfile.mkdtemp(), optimizer=opt) as tracer:
    ...     for _ in range(3):
    ...         opt.zero_grad()
    ...         model(torch.randn(16, 4)).square().mean().backward()
    ...         opt.step()          # the tracer advances with the optimizer
    >>> gradstats.open_run(tracer.path).steps
    [0, 1, 2]
"""
from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, Union

import numpy as np
import torch
from torch import nn

from ._version import __version__
from .run import FORMAT_VERSION, RunWriter, _sample_key, atomic_write_json
from .stats import VectorRows, kernel_applies, tensor_stats_vector, write_stats

log = logging.getLogger(__name__)

KINDS = ("grad", "act", "weight", "wgrad")
Schedule = Union[int, Sequence[int], None]
LayerSelect = Union[None, str, Sequence[str], re.Pattern, Callable[[str, nn.Module], bool]]


# --------------------------------------------------------------------------- helpers


def _owns_parameters(name: str, module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _selector(layers: LayerSelect) -> Callable[[str, nn.Module], bool]:
    """Turn the ``layers=`` argument into a predicate on ``(name, module)``."""
    if layers is None:
        return _owns_parameters
    if callable(layers) and not isinstance(layers, (str, re.Pattern)):
        return layers
    if isinstance(layers, re.Pattern):
        return lambda name, _m: bool(layers.fullmatch(name))
    if isinstance(layers, str):
        layers = [layers]
    if isinstance(layers, (list, tuple)) and all(isinstance(p, str) for p in layers):
        pats = list(layers)

        def match(name: str, _m: nn.Module) -> bool:
            for p in pats:
                if fnmatch.fnmatchcase(name, p):
                    return True
                if p.startswith("re:") and re.fullmatch(p[3:], name):
                    return True
            return False
        return match
    raise ValueError("layers= must be None (modules that own parameters), a glob or list of globs "
                     "on module names ('re:PATTERN' for a regex), a compiled regex, or a callable "
                     f"(name, module) -> bool; got {type(layers).__name__}")


def _schedule(value: Schedule, what: str) -> Callable[[int], bool]:
    """``every=`` / ``sample_every=``: a positive period, a list of steps, or None (never)."""
    if value is None:
        return lambda step: False
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a positive int period or a list of steps, got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{what} must be a positive int period (1 = every step) or a list of "
                             f"steps, got {value}")
        return lambda step: step % value == 0
    try:
        steps = frozenset(int(s) for s in value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a positive int period or a list of step numbers, "
                         f"got {value!r}") from None
    if any(s < 0 for s in steps):
        raise ValueError(f"{what} lists a negative step: steps count from 0")
    return lambda step: step in steps


def _first_grad_tensor(out: Any) -> torch.Tensor | None:
    """The first floating tensor requiring grad in a (nested) module output."""
    if isinstance(out, torch.Tensor):
        return out if (out.requires_grad and out.is_floating_point()) else None
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        for item in out:
            t = _first_grad_tensor(item)
            if t is not None:
                return t
    return None


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside DistributedDataParallel-style wrappers (names stay the user's)."""
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module) and type(model).__name__ in (
            "DistributedDataParallel", "DataParallel", "FullyShardedDataParallel"):
        return inner
    return model


def _dist_info() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


# --------------------------------------------------------------------------- tracer


def sample_indices(n: int, k: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """``k`` distinct indices of ``range(n)`` drawn uniformly at random, in random order: the same
    law as ``torch.randperm(n)[:k]``, without its O(n) cost when ``k`` is small against ``n``.

    Draws slightly more than ``k`` indices with replacement and keeps the distinct ones: given
    their number, by symmetry they are a uniform subset of that size, so a uniform random ``k`` of
    them, in random order, is a uniform ordered sample without replacement.

    Example:
        >>> idx = sample_indices(10**6, 1000, torch.Generator().manual_seed(0), torch.device("cpu"))
        >>> idx.shape, idx.unique().numel()
        (torch.Size([1000]), 1000)
    """
    # 32-bit indices where they suffice: the sort inside unique() and the permutation take half
    # the time of 64-bit ones (a capture's sample of 65536 from 1.6M values: 2.95 -> 1.3 ms)
    dtype = torch.int32 if n < 2**31 else torch.int64
    if 4 * k >= n:
        return torch.randperm(n, generator=generator, device=device, dtype=dtype)[:k]
    m = k + (k * k) // n + 64            # about k distinct among m draws, with room to spare
    drawn = torch.randint(0, n, (m,), generator=generator, device=device, dtype=dtype).unique()
    while drawn.numel() < k:
        more = torch.randint(0, n, (m,), generator=generator, device=device, dtype=dtype)
        drawn = torch.cat([drawn, more]).unique()
    return drawn[torch.randperm(drawn.numel(), generator=generator, device=device, dtype=dtype)[:k]]


class Tracer:
    """Captures neural gradients (and optionally activations, weights and weight gradients)
    of selected modules into a run directory. See :func:`trace` for the arguments.

    Use as a context manager, or call :meth:`attach` / :meth:`detach`. Advance the step
    with :meth:`step` (or pass ``optimizer=`` to advance on each ``optimizer.step()``).

    Example:
        >>> import tempfile, torch, gradstats
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 3))
        >>> tracer = gradstats.Tracer(model, tempfile.mkdtemp()).attach()
        >>> model(torch.randn(2, 3)).sum().backward(); tracer.step()
        >>> tracer.detach(); gradstats.open_run(tracer.path).layers
        ['0']
    """

    def __init__(self, model: nn.Module, path: str | os.PathLike[str], *,
                 layers: LayerSelect = None, every: Schedule = 1, sample_every: Schedule = 100,
                 samples: int | None = 65536, kinds: Iterable[str] = ("grad",),
                 optimizer: torch.optim.Optimizer | None = None,
                 max_bytes: int | None = None, seed: int = 0, flush_secs: float = 1.0) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"trace() needs a torch.nn.Module as model, got {type(model).__name__}")
        self.kinds = tuple(kinds)
        bad = [k for k in self.kinds if k not in KINDS]
        if bad or not self.kinds:
            raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {self.kinds}")
        if samples is not None and (not isinstance(samples, int) or samples <= 0):
            raise ValueError(f"samples must be a positive int (values kept per capture) or None "
                             f"(keep whole tensors), got {samples!r}")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive number of bytes or None, got {max_bytes}")
        if isinstance(flush_secs, bool) or not isinstance(flush_secs, (int, float)) or not flush_secs >= 0:
            raise ValueError(f"flush_secs must be a number of seconds >= 0 (0 = commit every step), "
                             f"got {flush_secs!r}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.model = model
        self.path = Path(path)
        self._take_stats = _schedule(every, "every")
        self._take_samples = _schedule(sample_every, "sample_every")
        self.config = {"every": every if isinstance(every, (int, type(None))) else list(every),
                       "sample_every": sample_every if isinstance(sample_every, (int, type(None)))
                       else list(sample_every),
                       "samples": samples, "kinds": list(self.kinds), "max_bytes": max_bytes,
                       "flush_secs": flush_secs}
        self.samples_per_capture = samples
        self.max_bytes = max_bytes
        self.optimizer = optimizer
        self.seed = seed
        self.flush_secs = float(flush_secs)
        self._last_commit = time.monotonic()
        select = _selector(layers)
        root = _unwrap(model)
        self.modules: dict[str, nn.Module] = {n: m for n, m in root.named_modules() if select(n, m)}
        if not self.modules:
            names = [n for n, _ in root.named_modules()][:12]
            raise ValueError(f"layers={layers!r} matches no module of {type(root).__name__}; "
                             f"module names look like {names}")
        self.rank, self.world_size = _dist_info()
        self.current_step = 0
        self._handles: list[Any] = []
        self._lock = threading.Lock()
        # statistics of the step(s) not yet committed: CPU float32 tensors are written by the C
        # kernel straight into rows (no allocation per capture), others kept as device vectors
        self._rows = VectorRows()
        self._row_keys: list[tuple[int, str, str, int]] = []
        self._pending: list[tuple[int, str, str, int, torch.Tensor]] = []
        self._active_step: int | None = None
        self._active_now = (False, False)
        self._pending_samples: dict[str, tuple[torch.Tensor, int]] = {}
        self._pending_tables: dict[str, list[dict[str, Any]]] = {}
        self._calls: dict[str, int] = {}
        self._shapes: dict[str, list[int]] = {}
        self._sampling_stopped = False
        self._generators: dict[torch.device, torch.Generator] = {}
        self._writer: RunWriter | None = None
        self._written_shapes: dict[str, list[int]] = {}
        self._created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._attached = False

    # -- lifecycle
    def attach(self) -> "Tracer":
        """Create the run directory and register the hooks. Returns ``self``."""
        if self._attached:
            return self
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ValueError(f"cannot write a run to {self.path}: {exc.strerror or exc}; "
                             "pass a writable directory") from None
        self._writer = RunWriter(self.path, self.rank, max_bytes=self.max_bytes)
        self._write_manifest()
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_hook(self._make_forward_hook(name)))
        if self.optimizer is not None:
            if "weight" in self.kinds or "wgrad" in self.kinds:
                self._handles.append(self.optimizer.register_step_pre_hook(
                    lambda *_: self._capture_parameters()))
            self._handles.append(self.optimizer.register_step_post_hook(lambda *_: self._advance()))
        self._attached = True
        return self

    def detach(self) -> None:
        """Remove the hooks, flush what is pending and wait until it is on disk."""
        if not self._attached:
            return
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._flush(self.current_step, force=True)
        assert self._writer is not None
        self._writer.close()
        self._write_manifest()
        self._attached = False

    def __enter__(self) -> "Tracer":
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    # -- steps
    def step(self) -> None:
        """Close the current step: write its statistics and samples, advance the counter.

        Call it once per optimizer step (not needed when the tracer was given ``optimizer=``).
        """
        if self.optimizer is not None:
            raise ValueError("this tracer advances on optimizer.step() (optimizer= was given); "
                             "do not call tracer.step() as well")
        if ("weight" in self.kinds or "wgrad" in self.kinds):
            self._capture_parameters()
        self._advance()

    def _advance(self) -> None:
        self._flush(self.current_step)
        self.current_step += 1
        self._calls.clear()

    def flush(self) -> None:
        """Commit every closed step now and block until it is on disk."""
        if self._writer is not None:
            self._flush(self.current_step, force=True)
            self._writer.wait()

    def log_rows(self, table: str, rows: Iterable[dict[str, Any]]) -> None:
        """Add rows (plain values) to a further table of the run, written with the current
        step; ``gradstats.apply(..., log_to=tracer)`` logs what it did this way.
        Read back with ``open_run(path).table(table)``."""
        rows = [dict(r, step=self.current_step, rank=self.rank) for r in rows]
        with self._lock:
            self._pending_tables.setdefault(table, []).extend(rows)

    # -- hooks
    def _active(self, step: int) -> tuple[bool, bool]:
        """(statistics, samples) taken on ``step``: worked out once per step (every module's
        forward hook asks)."""
        if step != self._active_step:
            self._active_now = (self._take_stats(step),
                                self._take_samples(step) and not self._sampling_stopped)
            self._active_step = step
        return self._active_now

    def _make_forward_hook(self, name: str) -> Callable[..., None]:
        def forward_hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            step = self.current_step
            do_stats, do_samples = self._active(step)
            if not (do_stats or do_samples) and name in self._shapes:
                return              # nothing taken on this step (calls are counted on taken steps)
            out = _first_grad_tensor(output)
            if out is None:
                return
            call = self._calls.get(name, 0)
            self._calls[name] = call + 1
            if name not in self._shapes:
                self._shapes[name] = list(out.shape)
            if not (do_stats or do_samples):
                return
            if "act" in self.kinds:
                self._record(step, name, "act", call, out.detach(), do_stats, do_samples)
            if "grad" in self.kinds:
                def tensor_hook(grad: torch.Tensor) -> None:
                    if torch.compiler.is_compiling():    # traced (compiled autograd): kept out
                        self._record(step, name, "grad", call, grad, do_stats, do_samples)
                    else:                                # eager, the common case: no wrapper
                        self._record_now(step, name, "grad", call, grad, do_stats, do_samples)
                out.register_hook(tensor_hook)
        return forward_hook

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed + 7919 * self.rank)
            self._generators[device] = gen
        return gen

    @torch.compiler.disable
    def _record(self, step: int, layer: str, kind: str, call: int, t: torch.Tensor,
                do_stats: bool, do_samples: bool) -> None:
        """:meth:`_record_now`, never traced by the compiler (a hook inside a compiled region
        runs it eagerly)."""
        self._record_now(step, layer, kind, call, t, do_stats, do_samples)

    def _record_now(self, step: int, layer: str, kind: str, call: int, t: torch.Tensor,
                    do_stats: bool, do_samples: bool) -> None:
        # every tensor read here is detached first (or only its memory is): no graph is recorded,
        # with or without grad mode
        vec = None
        if do_stats:
            if kernel_applies(t):     # the common case on the CPU: the kernel writes a row in place
                with self._lock:      # (held while it writes: a flush never takes a half-written row)
                    write_stats(t, self._rows.claim())
                    self._row_keys.append((step, layer, kind, call))
            else:
                vec = tensor_stats_vector(t)
        sample = None
        if do_samples:
            flat = t.detach().reshape(-1)
            k = self.samples_per_capture
            if k is not None and flat.numel() > k:
                flat = flat[sample_indices(flat.numel(), k, self._generator(flat.device), flat.device)]
            sample = (flat.to(torch.float32).clone(), t.numel())
        if vec is None and sample is None:
            return
        with self._lock:
            if vec is not None:
                self._pending.append((step, layer, kind, call, vec))
            if sample is not None:
                self._pending_samples[_sample_key(step, layer, kind, call)] = sample

    def _capture_parameters(self) -> None:
        step = self.current_step
        do_stats, do_samples = self._active(step)
        if not (do_stats or do_samples):
            return
        for name, module in self.modules.items():
            params = list(module.parameters(recurse=False))
            if not params:
                continue
            if "weight" in self.kinds:
                w = torch.cat([p.detach().reshape(-1).float() for p in params])
                self._record(step, name, "weight", 0, w, do_stats, do_samples)
            if "wgrad" in self.kinds:
                grads = [p.grad.reshape(-1).float() for p in params if p.grad is not None]
                if grads:
                    self._record(step, name, "wgrad", 0, torch.cat(grads), do_stats, do_samples)

    # -- writing
    #: pending statistics rows beyond which a step commits whatever the time
    MAX_PENDING_ROWS = 4096

    def _flush(self, step: int, *, force: bool = False) -> None:
        if not (force or self._pending_samples
                or len(self._pending) + len(self._rows) >= self.MAX_PENDING_ROWS
                or time.monotonic() - self._last_commit >= self.flush_secs):
            return              # batch closed steps into one commit (see flush_secs)
        self._last_commit = time.monotonic()
        with self._lock:
            rows, row_keys, self._row_keys = self._rows.take(), self._row_keys, []
            pending, self._pending = self._pending, []
            samples, self._pending_samples = self._pending_samples, {}
            tables, self._pending_tables = self._pending_tables, {}
        new_shapes = bool(set(self._shapes) - set(self._written_shapes))
        if not row_keys and not pending and not samples and not tables:
            if new_shapes:
                self._write_manifest()
            return
        assert self._writer is not None
        keys = row_keys + [p[:4] for p in pending]
        steps = sorted({k[0] for k in keys} | {int(k.split("|", 1)[0]) for k in samples}
                       | {int(r["step"]) for trows in tables.values() for r in trows})
        fl = self._writer.new_flush(steps)
        fl.tables = tables
        if keys:   # the table is built on the writer thread (Flush.vectors)
            fl.keys = [(s, self.rank, layer, kind, call) for s, layer, kind, call in keys]
            if pending:
                on_device = torch.stack([p[4].to("cpu", non_blocking=False) for p in pending])
                rows = np.concatenate([rows, on_device.numpy()])
            fl.vectors = rows
        if samples:
            total = RunWriter.sample_bytes(v for v, _ in samples.values())
            if self.max_bytes is not None and self._writer.bytes_committed_or_queued + total > self.max_bytes:
                self._sampling_stopped = True
                self._active_step = None
                msg = (f"gradstats: the run at {self.path} reached its byte budget max_bytes="
                       f"{self.max_bytes}; sampling stops here (statistics go on)")
                log.warning(msg)
                warnings.warn(msg, stacklevel=3)
            else:
                for key, (v, n_total) in samples.items():
                    fl.samples[key] = v.cpu()
                    fl.sample_totals[key] = [int(v.numel()), int(n_total)]
        if not fl.keys and not fl.samples and not fl.tables:
            return
        self._writer.submit(fl)
        if new_shapes:
            self._write_manifest()

    def _write_manifest(self) -> None:
        if self.rank != 0:
            return
        root = _unwrap(self.model)
        layers = []
        for name, module in self.modules.items():
            layers.append({"name": name, "type": type(module).__name__,
                           "output_shape": self._shapes.get(name),
                           "params": sum(p.numel() for p in module.parameters(recurse=False))})
        manifest = {
            "format_version": FORMAT_VERSION,
            "gradstats_version": __version__,
            "torch_version": torch.__version__,
            "created": self._created,
            "model_class": type(root).__name__,
            "model_params": sum(p.numel() for p in root.parameters()),
            "world_size": self.world_size,
            "capture": self.config,
            "layers": layers,
        }
        atomic_write_json(self.path / "manifest.json", manifest)
        self._written_shapes = dict(self._shapes)

    def __repr__(self) -> str:
        return (f"Tracer({str(self.path)!r}, layers={len(self.modules)}, kinds={self.kinds}, "
                f"step={self.current_step})")


def trace(model: nn.Module, path: str | os.PathLike[str], *, layers: LayerSelect = None,
          every: Schedule = 1, sample_every: Schedule = 100, samples: int | None = 65536,
          kinds: Iterable[str] = ("grad",), optimizer: torch.optim.Optimizer | None = None,
          max_bytes: int | None = None, seed: int = 0, flush_secs: float = 1.0) -> Tracer:
    """Trace the neural gradients of ``model`` into the run directory ``path``.

    Args:
        model: any ``nn.Module`` (a DDP-wrapped model is traced through its ``.module``).
        path: run directory (created; a run there is appended to).
        layers: which modules: ``None`` for those that own parameters (Linear, Conv, norms,
            Embedding, ...), a glob or list of globs on module names (``"re:..."`` for a
            regex), a compiled regex, or a callable ``(name, module) -> bool``.
        every: steps on which statistics are taken: a period (1 = every step) or a list.
        sample_every: steps on which raw samples are kept: a period, a list, or ``None``.
        samples: values kept per capture (an unbiased uniform sample without replacement),
            or ``None`` to keep whole flattened tensors in order.
        kinds: any of ``"grad"`` (dL/d output), ``"act"`` (outputs), ``"weight"`` and
            ``"wgrad"`` (the module's own parameters and their gradients, taken when the step
            closes; with ``optimizer=`` just before the optimizer updates them).
        optimizer: advance the step on each ``optimizer.step()`` instead of ``tracer.step()``.
        max_bytes: byte budget of the run's files; sampling stops with a warning beyond it.
        seed: seed of the tracer's own random generator (the global RNG is never touched).
        flush_secs: closed steps are committed to disk together once this many seconds have
            passed since the last commit (and at once on sampled steps, on :meth:`Tracer.flush`
            and when the tracer detaches); 0 commits every step. A run read while training goes
            on, or after the process is killed, shows every step committed until then: at most
            ``flush_secs`` of training behind. Fewer, larger files and less work per step.

    Returns a :class:`Tracer`; use it as a context manager (or ``.attach()``/``.detach()``).

    Example:
        >>> import tempfile, torch, gradstats
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(2))
        >>> _ = model(torch.randn(1, 1, 8, 8))
        >>> with gradstats.trace(model, tempfile.mkdtemp(), layers="0") as t:
        ...     model(torch.randn(2, 1, 8, 8)).sum().backward(); t.step()
        >>> list(gradstats.open_run(t.path).stats()["layer"])
        ['0']
    """
    return Tracer(model, path, layers=layers, every=every, sample_every=sample_every,
                  samples=samples, kinds=kinds, optimizer=optimizer, max_bytes=max_bytes, seed=seed,
                  flush_secs=flush_secs)
