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

from gradstats._version import __version__
from gradstats.layers import module_types
from gradstats.noise.record import Propagation, records_noise, sending_back, weight_grad_terms
from gradstats.run import FORMAT_VERSION, RunWriter, atomic_write_json, last_committed_step, sample_key
from gradstats.run.select import layer_matcher
from gradstats.stats import VectorRows, kernel_applies, tensor_stats_vector, write_stats
from gradstats.stats.blocks import BLOCK_SIZES, RANGE_BINS
from gradstats.wrappers import named_layers, unwrap

log = logging.getLogger(__name__)

KINDS = ("grad", "act", "weight", "wgrad")
#: the tables of the noise records (:mod:`gradstats.noise.record`): not steps of the run by themselves
NOISE_TABLES = ("noise", "noise_graph", "noise_gain")
Schedule = Union[int, Sequence[int], None]
LayerSelect = Union[None, str, Sequence[str], re.Pattern, Callable[[str, nn.Module], bool]]


# --------------------------------------------------------------------------- helpers


def _owns_parameters(name: str, module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def module_selector(layers: LayerSelect) -> Callable[[str, nn.Module], bool]:
    """Turn the ``layers=`` argument into a predicate on ``(name, module)``."""
    if layers is None:
        return _owns_parameters
    if callable(layers) and not isinstance(layers, (str, re.Pattern)):
        return layers
    if isinstance(layers, (str, re.Pattern)) or (
            isinstance(layers, (list, tuple)) and layers and all(isinstance(p, (str, re.Pattern)) for p in layers)):
        match = layer_matcher(layers)
        return lambda name, _m: match(name)
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


def first_grad_tensor(out: Any) -> torch.Tensor | None:
    """The first floating tensor requiring grad in a (nested) module output."""
    if isinstance(out, torch.Tensor):
        return out if (out.requires_grad and out.is_floating_point()) else None
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        for item in out:
            t = first_grad_tensor(item)
            if t is not None:
                return t
    return None


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter or gradient: the local shard of a ``DTensor`` (FSDP2's
    ``fully_shard``, tensor parallelism), the tensor itself otherwise."""
    return t.to_local() if _is_dtensor(t) else t


def sharded_parameters(module: nn.Module) -> bool:
    """Whether ``module``'s own parameters are split across ranks (``DTensor``s with a ``Shard``
    placement, as ``fully_shard`` makes them): its weights and weight gradients are then recorded
    per rank as shards, which ``Run.stats(merge_ranks=True)`` adds up instead of taking one
    rank's replica.

    Example:
        >>> sharded_parameters(torch.nn.Linear(2, 2))          # plain parameters: not sharded
        False
    """
    for p in module.parameters(recurse=False):
        if _is_dtensor(p) and any(type(pl).__name__ in ("Shard", "_StridedShard") for pl in p.placements):
            return True
    return False


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
                 max_bytes: int | None = None, seed: int = 0, flush_secs: float = 1.0,
                 resume: bool = False, start_step: int | None = None, sinks: Iterable[Any] = (),
                 alarms: Any = True, blocks: Sequence[int] | None = None,
                 block_sample: int | None = 512, noise: bool = True) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"trace() needs a torch.nn.Module as model, got {type(model).__name__}")
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"trace() needs the path of a run directory (a str or pathlib.Path) as path, "
                             f"got {type(path).__name__}: trace(model, 'runs/my-run')")
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
        if not isinstance(resume, bool):
            raise ValueError(f"resume must be True or False, got {resume!r}")
        if start_step is not None and (isinstance(start_step, bool) or not isinstance(start_step, int)
                                       or start_step < 0):
            raise ValueError(f"start_step must be a step number >= 0 or None, got {start_step!r}")
        if blocks is not None:
            blocks = (blocks,) if isinstance(blocks, int) and not isinstance(blocks, bool) else tuple(blocks)
            if not blocks or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in blocks):
                raise ValueError(f"blocks must be None or positive block sizes, e.g. (16, 32) for NVFP4 and MX; "
                                 f"got {blocks!r}")
        if block_sample is not None and (isinstance(block_sample, bool) or not isinstance(block_sample, int)
                                         or block_sample < 1):
            raise ValueError(f"block_sample must be a positive number of blocks or None (every block), got "
                             f"{block_sample!r}")
        #: block sizes of the per-block statistics (:mod:`gradstats.stats.blocks`), or None
        self.blocks = blocks
        self.block_sample = block_sample
        sinks = list(sinks)
        bad_sinks = [type(k).__name__ for k in sinks if not callable(getattr(k, "write", None))]
        if bad_sinks:
            raise ValueError(f"sinks must be objects with a write(stats) method (such as "
                             f"gradstats.integrations.tensorboard.TensorBoardSink); got {bad_sinks}")
        from gradstats.alarms import as_alarms

        #: the :class:`gradstats.alarms.Alarms` checked on each commit (None: off)
        self.alarms = as_alarms(alarms)
        if self.alarms is not None:
            self.alarms.bind(lambda rows: self.log_rows("alarms", rows))
            sinks = [*sinks, self.alarms]
        self.sinks = sinks
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
        select = module_selector(layers)
        root = unwrap(model)
        self._default_layers = layers is None
        self.modules: dict[str, nn.Module] = {n: m for n, m in named_layers(model) if select(n, m)}
        if not self.modules:
            names = [n for n, _ in named_layers(model)][:12]
            raise ValueError(f"layers={layers!r} matches no module of {type(root).__name__}; "
                             f"module names look like {names}")
        self.rank, self.world_size = _dist_info()
        self.resume = resume
        self.start_step = start_step
        self.current_step = 0 if start_step is None else start_step
        #: this tracing session (commit records carry it: a later session that starts at an
        #: earlier step supersedes what an earlier one wrote from there on)
        self._session = f"{time.time_ns():x}-{os.getpid()}-{self.rank}"
        self._reported_uncalled = False
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
        #: record the noise terms of :mod:`gradstats.noise.record` on sampled steps
        self.noise = bool(noise)
        # the step whose noise propagation is measured (the first sampled one), and the measurement
        self._graph_step: int | None = None
        # not under torch.distributed: FSDP frees the parameters a backward pass sent back from one layer
        # would need, and every rank would have to take part (the prediction then assumes gain 1)
        self._propagation: Propagation | None = Propagation() if self.noise and self.world_size == 1 else None
        self._noise_prev: tuple[int, dict[str, torch.Tensor]] | None = None
        self._noise_generators: dict[torch.device, torch.Generator] = {}

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
        last = last_committed_step(self.path)
        if last is not None and self.start_step is None:
            if not self.resume:
                raise ValueError(
                    f"{self.path} already holds a run (steps up to {last}); pass resume=True to "
                    f"continue it after step {last} (CLI: --resume), start_step=N to continue from "
                    "a checkpoint taken at step N (what was written from step N on is superseded), "
                    "or a new directory")
            self.current_step = last + 1
        self._previous = self._read_previous_manifest() if last is not None else None
        self._writer = RunWriter(self.path, self.rank, max_bytes=self.max_bytes,
                                 session=self._session, start_step=self.current_step, sinks=self.sinks)
        self._write_manifest()
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_hook(self._make_forward_hook(name)))
        if self.optimizer is not None:
            if "weight" in self.kinds or "wgrad" in self.kinds or self.noise:
                self._handles.append(self.optimizer.register_step_pre_hook(lambda *_: self._before_update()))
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
        if self.sinks:                  # what the sinks (the alarms) log while the last tables commit
            self._writer.wait()
            if self._pending_tables:
                self._flush(self.current_step, force=True)
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
        self._before_update()
        self._advance()

    def _before_update(self) -> None:
        """The step's gradients are complete: the parameters and weight gradients it records."""
        if "weight" in self.kinds or "wgrad" in self.kinds:
            self._capture_parameters()
        if self.noise:
            self._finish_propagation()
            self._capture_noise_pair()

    def _finish_propagation(self) -> None:
        """After the step whose noise propagation was measured: its rows, once per run."""
        prop = self._propagation
        if prop is not None and self.current_step == self._graph_step:
            graph, gains = prop.finish(self.current_step)
            self._propagation = None
            if graph:
                self.log_rows("noise_graph", graph)
            if gains:
                self.log_rows("noise_gain", gains)

    def _capture_noise_pair(self) -> None:
        """SGD's own noise of each recorded layer's weight gradient, from two batches: the weight
        gradients of a sampled step ``s`` and of the next, ``|G_s - G_(s+1)|^2 / 2`` (into the ``"noise"``
        table as ``pair``, at step ``s + 1`` with ``of_step = s``; one update apart, the model's drift is
        small next to the minibatch noise)."""
        step = self.current_step
        prev = self._noise_prev
        if prev is not None and prev[0] == step - 1:
            rows = []
            for name, g0 in prev[1].items():
                w = getattr(self.modules[name], "weight", None)
                g1 = getattr(w, "grad", None)
                if isinstance(g1, torch.Tensor) and g1.shape == g0.shape:
                    d2 = float((_local(g1).detach().float() - g0).square().sum())
                    rows.append({"step": step, "of_step": prev[0], "layer": name, "call": -1, "rank": self.rank,
                                 "pair": d2 / 2.0})
            if rows:
                self.log_rows("noise", rows)
            self._noise_prev = None
        if self._active(step)[1] and "grad" in self.kinds:
            grads = {}
            for name, module in self.modules.items():
                w = getattr(module, "weight", None)
                if records_noise(module) and isinstance(getattr(w, "grad", None), torch.Tensor):
                    grads[name] = _local(w.grad).detach().float().clone()
            self._noise_prev = (step, grads) if grads else None

    def _advance(self) -> None:
        self._flush(self.current_step)
        if not self._reported_uncalled and self._shapes:
            self._report_uncalled()
        self.current_step += 1
        self._calls.clear()

    def _report_uncalled(self) -> None:
        """Say once which selected modules the first traced step never called (an attention
        block's ``out_proj`` used functionally, a branch not taken): they are left out of the
        run's layers until they are called."""
        self._reported_uncalled = True
        missing = [n for n in self.modules if n not in self._shapes]
        if missing:
            level = logging.INFO if self._default_layers else logging.WARNING
            log.log(level, "gradstats: %d selected module(s) produced no gradient in step %d and are "
                    "not traced until they do (not called, or their output needs no grad): %s",
                    len(missing), self.current_step, ", ".join(missing))
            self._write_manifest()

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume this tracer exactly: the step, the sampling
        generators' states and whether the byte budget stopped sampling.

        Save it beside the model and optimizer; restore with :meth:`load_state_dict` on a tracer
        of the same run. Example:
            >>> import tempfile, torch, gradstats
            >>> m, path = torch.nn.Linear(2, 2), tempfile.mkdtemp()
            >>> with gradstats.trace(m, path) as t:
            ...     m(torch.randn(3, 2)).sum().backward(); t.step()
            ...     ckpt = t.state_dict()
            >>> with gradstats.trace(m, path, resume=True) as t2:
            ...     t2.load_state_dict(ckpt)
            ...     m(torch.randn(3, 2)).sum().backward(); t2.step()
            >>> ckpt["step"], gradstats.open_run(path).steps
            (1, [0, 1])
        """
        return {"step": int(self.current_step), "seed": int(self.seed),
                "sampling_stopped": bool(self._sampling_stopped),
                "generators": {str(d): g.get_state() for d, g in self._generators.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next step recorded is ``state["step"]``, and
        sampling draws what the checkpointed tracer would have drawn. Whatever this run holds
        from that step on (written after the checkpoint, by a training that then crashed) is
        superseded by what is recorded now. Call it before the first step of the resumed
        training (on an attached tracer, or before attaching: then no ``resume=`` is needed)."""
        need = {"step", "seed", "sampling_stopped", "generators"}
        if not isinstance(state, dict) or not need <= set(state):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"load_state_dict expects a dict from Tracer.state_dict() with keys "
                             f"{sorted(need)}, got {got}")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"the state's step must be an int >= 0, got {step!r}")
        if int(state["seed"]) != self.seed:
            log.warning("gradstats: the tracer state was saved with seed=%s, this tracer has seed=%s; "
                        "the saved generator states are used", state["seed"], self.seed)
        if self._attached:
            self._flush(self.current_step, force=True)   # what was recorded so far, under the old count
        self.current_step = self.start_step = step
        self._session = f"{time.time_ns():x}-{os.getpid()}-{self.rank}"
        if self._writer is not None:
            self._writer.session, self._writer.start_step = self._session, step
        self._calls.clear()
        self._active_step = None
        self._sampling_stopped = bool(state["sampling_stopped"])
        for dev, gstate in state["generators"].items():
            self._generator(torch.device(dev)).set_state(torch.as_tensor(gstate, dtype=torch.uint8))

    def flush(self) -> None:
        """Commit every closed step now and block until it is on disk."""
        if self._writer is not None:
            self._flush(self.current_step, force=True)
            self._writer.wait()

    def log_rows(self, table: str, rows: Iterable[dict[str, Any]]) -> None:
        """Add rows (plain values) to a further table of the run, written with the current
        step (or the step a row names); ``gradstats.apply(..., log_to=tracer)`` logs what it did
        this way, the alarms (:mod:`gradstats.alarms`) what they found.
        Read back with ``open_run(path).table(table)``."""
        rows = [{"step": self.current_step, **r, "rank": self.rank} for r in rows]   # a row may name its step
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
            out = first_grad_tensor(output)
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
                x = self._noise_input(step, name, call, module, inputs, out) if do_samples else None

                def tensor_hook(grad: torch.Tensor) -> None:
                    if sending_back():                   # noise sent back by a propagation measurement
                        return
                    prop = self._propagation
                    if torch.compiler.is_compiling():    # traced (compiled autograd): kept out
                        self._record(step, name, "grad", call, grad, do_stats, do_samples)
                    else:                                # eager, the common case: no wrapper
                        self._record_now(step, name, "grad", call, grad, do_stats, do_samples)
                        if x is not None:
                            self._record_noise(step, name, call, module, x, grad)
                        if prop is not None and step == self._graph_step and call == 0:
                            prop.on_gradient(name, grad, self._noise_generator(grad.device))
                out.register_hook(tensor_hook)
        return forward_hook

    def _noise_input(self, step: int, name: str, call: int, module: nn.Module, inputs: Any,
                     out: torch.Tensor) -> torch.Tensor | None:
        """On a sampled step: the layer's input, kept for the noise terms of its gradient
        (:mod:`gradstats.noise.record`; autograd holds it already), and the autograd nodes of the
        step's first calls, from which the layers downstream of each are worked out once."""
        if not self.noise or torch.compiler.is_compiling():
            return None
        x = next((t for t in (inputs if isinstance(inputs, tuple) else (inputs,)) if isinstance(t, torch.Tensor)),
                 None)
        if self._propagation is not None and call == 0:
            if self._graph_step is None:
                self._graph_step = step
            if step == self._graph_step:
                self._propagation.keep(name, out, x)
        return x.detach() if x is not None and records_noise(module) else None

    def _record_noise(self, step: int, layer: str, call: int, module: nn.Module, x: torch.Tensor,
                      grad: torch.Tensor) -> None:
        try:
            terms = weight_grad_terms(module, x, grad, self._noise_generator(grad.device))
        except RuntimeError as exc:   # a layer whose input is not what its type says: no noise terms
            log.debug("no noise terms for %s: %s", layer, exc)
            return
        self.log_rows("noise", [{"step": step, "layer": layer, "call": call, "rank": self.rank, **terms}])

    def _noise_generator(self, device: torch.device) -> torch.Generator:
        """The noise records' own random stream (the samples' stream is not touched by them)."""
        gen = self._noise_generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed + 7919 * self.rank + 104729)
            self._noise_generators[device] = gen
        return gen

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
            want_blocks = self.blocks is not None and kind == "grad"
            counts = None
            if kernel_applies(t):     # the common case on the CPU: the kernel writes a row in place
                if want_blocks and set(self.blocks) & set(BLOCK_SIZES):   # and counts every block of those
                    counts = np.empty((len(BLOCK_SIZES), 1 + RANGE_BINS), np.int64)   # write_stats zeroes it
                with self._lock:      # (held while it writes: a flush never takes a half-written row)
                    write_stats(t, self._rows.claim(), blocks=counts)
                    self._row_keys.append((step, layer, kind, call))
            else:
                vec = tensor_stats_vector(t)
            if want_blocks:
                from gradstats.stats.blocks import ORIENTATIONS, kernel_block_stats, oriented_block_stats

                done = [b for b in self.blocks if b in BLOCK_SIZES] if counts is not None else []
                exact = dict(zip(done, kernel_block_stats(counts, t.numel(), done))) if done else {}
                last = int(t.shape[-1]) if t.dim() else 1
                gen = self._generator(t.device)
                rows = []
                for b in self.blocks:
                    for o in ORIENTATIONS:
                        st = oriented_block_stats(t, b, o, sample=self.block_sample, generator=gen)
                        if o == "rows" and b in exact and last % b == 0:   # memory order is row order:
                            st = {**exact[b], "below_hist": st["below_hist"]}   # every block counted
                        rows.append({"step": step, "layer": layer, "kind": kind, "call": call, "block_size": b,
                                     "orientation": o, **st})
                with self._lock:
                    self._pending_tables.setdefault("blocks", []).extend(dict(r, rank=self.rank) for r in rows)
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
                self._pending_samples[sample_key(step, layer, kind, call)] = sample

    def _capture_parameters(self) -> None:
        step = self.current_step
        do_stats, do_samples = self._active(step)
        if not (do_stats or do_samples):
            return
        for name, module in self.modules.items():
            params = list(module.parameters(recurse=False))
            if not params or name not in self._shapes:      # a module not called has no gradient
                continue
            if "weight" in self.kinds:
                w = torch.cat([_local(p.detach()).reshape(-1).float() for p in params])
                self._record(step, name, "weight", 0, w, do_stats, do_samples)
            if "wgrad" in self.kinds:
                grads = [_local(p.grad).reshape(-1).float() for p in params if p.grad is not None]
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
                       | {int(r["step"]) for name, trows in tables.items() if name not in NOISE_TABLES for r in trows})
        if not steps:
            if not force:        # noise records alone make no step: they ride with the next commit
                with self._lock:
                    for name, trows in tables.items():
                        self._pending_tables[name] = trows + self._pending_tables.get(name, [])
                return
            steps = sorted({int(r.get("of_step", r["step"])) for trows in tables.values() for r in trows})
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

    def _read_previous_manifest(self) -> dict[str, Any] | None:
        try:
            m = json.loads((self.path / "manifest.json").read_text())
            return m if isinstance(m, dict) else None
        except (OSError, ValueError):
            return None

    def _write_manifest(self) -> None:
        if self.rank != 0:
            return
        root = unwrap(self.model)
        layers = []
        for name, module in self.modules.items():
            if name not in self._shapes and self._reported_uncalled:
                continue                # selected but not called: nothing of it is in the run
            layers.append({"name": name, "type": type(module).__name__,
                           "bases": list(module_types(module)[1:]),
                           **({"sharded": True} if sharded_parameters(module) else {}),
                           "output_shape": self._shapes.get(name),
                           "params": sum(p.numel() for p in module.parameters(recurse=False))})
        prev = getattr(self, "_previous", None)
        if prev:                        # a resumed run keeps the layers its earlier sessions traced
            ours = {e["name"] for e in layers}
            layers = [e for e in prev.get("layers", []) if e.get("name") not in ours] + layers
        manifest = {
            "format_version": FORMAT_VERSION,
            "gradstats_version": __version__,
            "torch_version": torch.__version__,
            "created": prev.get("created", self._created) if prev else self._created,
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
          max_bytes: int | None = None, seed: int = 0, flush_secs: float = 1.0,
          resume: bool = False, start_step: int | None = None, sinks: Iterable[Any] = (),
          alarms: Any = True, blocks: Sequence[int] | None = None, block_sample: int | None = 512,
          noise: bool = True) -> Tracer:
    """Trace the neural gradients of ``model`` into the run directory ``path``.

    Args:
        model: any ``nn.Module``; DDP, DataParallel, FSDP and ``torch.compile`` wrappers are
            seen through (:func:`gradstats.wrappers.unwrap`): layer names are the user's.
        path: run directory (created). A directory that already holds a run is an error unless
            ``resume=True`` or ``start_step=`` says how to continue it.
        layers: which modules: ``None`` for those that own parameters (Linear, Conv, norms,
            Embedding, ...; modules that are never called, such as an attention block's
            ``out_proj`` used functionally, are left out with one log line), a glob or list of
            globs on module names (``"re:..."`` for a regex), a compiled regex, or a callable
            ``(name, module) -> bool``. The model itself, when it owns parameters, is ``"(root)"``.
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
        resume: continue a run at ``path`` after its last committed step.
        start_step: number the first step recorded (a trainer restored from a checkpoint taken
            at step N passes N; whatever the run holds from step N on is superseded). For an
            exact resume of the sampling too, restore :meth:`Tracer.load_state_dict`.
        sinks: objects with a ``write(stats)`` method (and optionally ``close()``) that receive
            each committed statistics table (a DataFrame as ``Run.stats()`` has it), on the
            writer thread after the commit: live views such as
            :class:`gradstats.integrations.tensorboard.TensorBoardSink`. A sink that raises is
            reported once and left out; the run on disk is complete whatever a sink does.
        alarms: ``True`` (default): warn once per layer, and record in the run's ``"alarms"``
            table, when a layer's gradient is all zero for 3 steps in a row or has non-finite
            values; ``False``: off; or a :class:`gradstats.alarms.Alarms` (other bounds, formats to
            watch: ``Alarms(watch="e4m3fn,e2m1fn", flush_bound=0.5)``). Checked on the writer thread.
        blocks: block sizes (``(16, 32)``: NVFP4 and MX) of per-block statistics of each neural
            gradient on the steps statistics are taken, in each orientation a GEMM consumes it
            (rows, columns, ``B x B`` tiles): the blocks' dynamic ranges and the entries' binades
            below their block's maximum, into the run's ``"blocks"`` table
            (:mod:`gradstats.stats.blocks`; :func:`gradstats.what_if` reads the MX underflow from
            them, :func:`gradstats.stats.blocks.flushed_blocks` the fraction of blocks flushed).
            Opt-in. On the CPU the dynamic ranges of row blocks of 16 and 32 are counted, every one,
            in the statistics kernel's own pass where the last dim is a multiple of the size.
        block_sample: blocks counted per tensor, block size and orientation, a uniform random
            sample (default 512, ``512 / B`` tiles: a cost that does not grow with the tensor,
            fractions of blocks within about 2.2 points, of entries closer); None: every block (a few passes over the tensor).
        noise: on sampled steps, record per Linear and 1-d/2-d convolution call the terms from which
            :func:`gradstats.noise.predicted_noise` predicts the noise a plan adds to the layer's
            weight gradient against SGD's own minibatch noise (one extra weight-gradient product per
            layer on those steps; the ``"noise"`` and ``"noise_graph"`` tables,
            :mod:`gradstats.noise.record`). Default on.

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
                  flush_secs=flush_secs, resume=resume, start_step=start_step, sinks=sinks, alarms=alarms,
                  blocks=blocks, block_sample=block_sample, noise=noise)
